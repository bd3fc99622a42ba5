"""A scan: a user's DeepSpeed config run through the catalogue, and its verdict per bug.

The words a user reads are four: AFFECTED (the repro failed as its ``ds_version`` declares, with this config),
NOT AFFECTED (the body passed with it), NOT APPLICABLE (the config cannot meet the bug's premise, or the repro does
not run on this release: no world started) and CANNOT TELL (it failed otherwise, or could not run). Each is derived
here, once, from the gates' ``Judgement`` of the run (``finding``); the results file records it per test
(``core.results``) and the renderers below read it back, for one release or several.

Pure: no pytest, no torch.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from packaging.version import Version

from . import configs
from .escape import md_code, md_fence, md_link, md_text
from .escape import terminal as terminal_text
from .gates import Rate, Reason
from .premises import lookup
from .results import Finding, ReproMeta, RunRecord, ScanVerdict, TestRecord
from .text import aligned, cut, markdown_table
from .userconfig import _autos  # the one reading of where a config says "auto"

#: How ``ds_engine`` words a config that DeepSpeed itself refuses (``inrank.engine.ConfigRejected``).
REFUSED = "DeepSpeed rejected ds_config"
_REFUSAL = re.compile(re.escape(REFUSED) + r" \[[^\]]*\]: (.*)", re.DOTALL)
#: A bug's row where DeepSpeed refused the config: its message is said once, above the table (``refusals``).
REFUSED_ROW = "DeepSpeed refuses this config (above)"
_PYDANTIC_LINK = "For further information visit"

#: A bug's verdict over its tests is the first of these that any test earned.
SEVERITY = (ScanVerdict.AFFECTED, ScanVerdict.CANNOT_TELL, ScanVerdict.NOT_AFFECTED, ScanVerdict.NOT_APPLICABLE)


def _fixed(fixed_in: str | None) -> str:
    return f"fixed in {fixed_in}" if fixed_in else "unfixed upstream"


def finding(
    reason: Reason,
    message: str,
    *,
    fixed_in: str | None,
    rate: Rate | None = None,
    notes: tuple[str, ...] = (),
    mend: str | None = None,
) -> Finding:
    """The scan's verdict on one test, from the gates' judgement of its stock run with the user's config.

    On a release outside the bug's declared range the body still runs (the honest answer is what happened); a pass
    there is NOT AFFECTED saying the release is fixed or not yet affected, the declared error there is AFFECTED
    saying the bug reaches further than catalogued. A race is AFFECTED as soon as one run failed as declared. A bug
    of refusals names its fix on the config's side (``mend``) where it hit.
    """
    said = message
    fixed = _fixed(fixed_in) + (f"; the fix on the config's side: {mend}" if mend else "")
    if reason is Reason.REPRODUCED or (reason is Reason.DID_NOT_REPRODUCE and rate is not None and rate.failed):
        word, said = ScanVerdict.AFFECTED, f"{message.removeprefix('REPRODUCED ')} ({fixed})"
    elif reason in (Reason.REGRESSION, Reason.BEFORE_AFFECTED):
        word, said = ScanVerdict.AFFECTED, f"{message} ({fixed}; outside the catalogued range)"
    elif reason is Reason.DID_NOT_REPRODUCE:
        word, said = ScanVerdict.NOT_AFFECTED, "passed with this config, on a release the bug affects"
    elif reason in (Reason.NOT_AFFECTED, Reason.NOT_YET_AFFECTED):
        word = ScanVerdict.NOT_AFFECTED
    elif reason is Reason.NOT_APPLICABLE:
        word = ScanVerdict.NOT_APPLICABLE
    else:  # failed differently, outside the range otherwise, a prerequisite fix that raised, no world
        word = ScanVerdict.CANNOT_TELL
    return Finding(word, said, notes)


def not_applicable(unmet: Sequence[str]) -> Finding:
    """A config that cannot meet the bug's premise (``Premise.unmet``'s phrases): no world is started."""
    return Finding(ScanVerdict.NOT_APPLICABLE, "; ".join(unmet))


# --- one bug, one release ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BugRow:
    """A bug's verdict on one release, over its tests (``SEVERITY``), with the test that decided it."""

    id: str
    title: str
    upstream: str | None
    fixed_in: str | None
    verdict: ScanVerdict
    detail: str
    workaround: str | None  # the repro's fix, by name, where the bug hit
    notes: tuple[str, ...]


def refusal(finding: Finding) -> str | None:
    """DeepSpeed's own words where the test could not tell because DeepSpeed refused the config, else None: on one
    line, whole (pydantic names the refused key on the second), less pydantic's pointer to its own docs."""
    found = _REFUSAL.search(finding.detail) if finding.verdict is ScanVerdict.CANNOT_TELL else None
    return refusal_line(found[1]) if found else None


def refusal_line(message: str) -> str:
    """DeepSpeed's refusal on one line, whole (pydantic names the refused key on the second), less pydantic's
    pointer to its own docs."""
    return " ".join(line.strip() for line in message.splitlines() if not line.strip().startswith(_PYDANTIC_LINK))


def rows(run: RunRecord) -> list[BugRow]:
    """One row per catalogued bug the run scanned, in the order its tests ran. A bug that could not be told because
    DeepSpeed refused the config points at ``refusals``, said once above the table."""
    by_bug: dict[str, list[tuple[Finding, ReproMeta, TestRecord]]] = {}
    for test in run.tests:
        if test.scan is not None and test.repro is not None:
            by_bug.setdefault(test.repro.id, []).append((test.scan, test.repro, test))
    found = []
    for bug, tests in by_bug.items():
        said, meta, test = min(tests, key=lambda t: SEVERITY.index(t[0].verdict))
        fix = f"{test.source.fix} ({test.source.path})" if test.source and test.source.fix else None
        workaround = fix if said.verdict is ScanVerdict.AFFECTED else None
        detail = REFUSED_ROW if refusal(said) else said.detail
        found.append(BugRow(bug, meta.title, meta.upstream, meta.fixed_in, said.verdict, detail, workaround,
                            said.notes))  # fmt: skip
    return found


def refusals(run: RunRecord) -> list[str]:
    """Each distinct reason DeepSpeed gave for refusing the scanned config, once, in words: the release, DeepSpeed's
    message, and where an ``"auto"`` of the config names the refused key, what Hugging Face's Trainer filled in."""
    said: list[str] = []
    written = run.scan.config if run.scan is not None else {}
    autos = _autos(written)
    every_world: dict[str, Any] | None = None  # refused before any world: as every world resolves it, once
    for test in run.tests:
        message = refusal(test.scan) if test.scan is not None else None
        if message is None:
            continue
        line = f"DeepSpeed {run.version} refuses this config: {message}"
        filled_in = test.config  # as the test's world had it
        if not filled_in:
            if every_world is None:
                every_world = configs.resolve(written, "scan", run.environment.world_size or 1, "gloo").written
            filled_in = every_world
        for key in autos:
            if re.search(rf"\b{re.escape(key.rsplit('.', 1)[-1])}\b", message):  # the key itself, not "eps" in "steps"
                filled = lookup(filled_in, key)
                line += (f' (your "auto" at {key} is {filled!r} as Hugging Face\'s Trainer fills it by default: '
                         "give the Trainer a value that DeepSpeed accepts, or write one in the config)")  # fmt: skip
        said.append(line)
    return list(dict.fromkeys(said))


def counts(found: Sequence[BugRow]) -> str:
    """``2 AFFECTED, 9 NOT AFFECTED, 12 NOT APPLICABLE``."""
    return ", ".join(f"{n} {v.value}" for v in SEVERITY if (n := sum(r.verdict is v for r in found)))


def notes(run: RunRecord) -> list[str]:
    """What was done to the user's config, each once: reading it (comments, ``"auto"``), then what the worlds
    adapted (fp16 -> fp32 on CPU, ...)."""
    said = list(run.scan.notes) if run.scan else []
    return list(dict.fromkeys(said + [note for t in run.tests if t.scan is not None for note in t.config_notes]))


def terminal(run: RunRecord, width: int | None = None) -> list[str]:
    """The scan's table as the terminal shows it: the notes on the config, then a line per bug, under it the
    settings its premise put on the config and, where the bug hit, the repro's fix to apply."""
    found = rows(run)
    lines = refusals(run)  # whole: DeepSpeed's message names what to change
    lines += [cut(f"note: {note}", width) for note in notes(run)]
    if not found:
        return [*map(terminal_text, lines), "no catalogued bug was scanned"]
    name = max(len(r.id) for r in found)
    word = max(len(r.verdict.value) for r in found)
    indent = " " * (word + name + 4)
    for r in found:
        lines.append(cut(f"{r.verdict.value:<{word}}  {r.id:<{name}}  {r.detail}", width))
        lines += [cut(f"{indent}with {note}", width) for note in r.notes]
        if r.workaround:
            lines.append(cut(f"{indent}workaround: the repro's fix, {r.workaround}", width))
    lines.append(f"{counts(found)} (deepspeed {run.version}, {run.environment.world_size} ranks)")
    return [terminal_text(line) for line in lines]


def markdown(run: RunRecord) -> str:
    """The scan as Markdown to paste into an issue: the config, the release and world, per bug verdict and link."""
    env, scan = run.environment, run.scan
    out = ["# DeepSpeed config scan", ""]
    if scan is not None:
        out += [f"Config {md_code(scan.path)}, scanned against the pytest-dsrepro catalogue on DeepSpeed "
                f"{md_text(run.version)} (torch {md_text(env.torch)}, {env.world_size}-rank {md_text(env.backend)} "
                "worlds).", ""]  # fmt: skip
        out += [md_fence(_json(scan.config), "json"), ""]
    out += [f"**{md_text(line)}**" for line in refusals(run)] + ([""] if refusals(run) else [])
    said = notes(run)
    out += [f"- {md_text(note)}" for note in said] + ([""] if said else [])
    found = rows(run)
    table_rows = []
    for r in found:
        why = md_text(r.detail) + "".join(f"; with {md_text(note)}" for note in r.notes)
        why += f"; workaround: the repro's fix {md_code(r.workaround)}" if r.workaround else ""
        link = md_link(r.upstream, "link") if r.upstream else ""
        table_rows.append((f"{md_code(r.id)} {md_text(r.title)}", f"**{r.verdict.value}**", why, link))
    out += [f"**{counts(found) or 'no catalogued bug scanned'}**", ""]
    out += markdown_table(("bug", "verdict", "why", "upstream"), table_rows)
    return "\n".join(out) + "\n"


def _json(config: object) -> str:
    import json

    return json.dumps(config, indent=2)


# --- across releases -----------------------------------------------------------------------------------------------


def _version(text: str) -> Version:
    try:
        return Version(text)
    except ValueError:  # InvalidVersion, or a part of 4300 digits or more (int())
        return Version("0")


def _untold(run: RunRecord) -> bool:
    """Nothing told about this release: DeepSpeed refused the config there (a body that passed without DeepSpeed's
    config says nothing of it), or some bug CANNOT TELL and none NOT AFFECTED (no body passed there)."""
    verdicts = {row.verdict for row in rows(run)}
    told = ScanVerdict.CANNOT_TELL not in verdicts or ScanVerdict.NOT_AFFECTED in verdicts
    return bool(refusals(run)) or not told


def first_clean(runs: Sequence[RunRecord]) -> str | None:
    """The oldest release from which on every release scanned is hit by no bug (none AFFECTED), and told something
    (a release whose scan told nothing, ``_untold``, is never named clean); None when the newest scanned is not."""
    clean = None
    for run in sorted(runs, key=lambda r: _version(r.version), reverse=True):
        if _untold(run) or any(row.verdict is ScanVerdict.AFFECTED for row in rows(run)):
            break
        clean = run.version
    return clean


def _grid(runs: Sequence[RunRecord]) -> tuple[list[RunRecord], list[list[str]]]:
    """The runs oldest first, and their verdicts as a table: ``bug`` and the releases, then a row per bug (``-``
    where a release did not scan it)."""
    ordered = sorted(runs, key=lambda r: _version(r.version))
    table = {r.version: {row.id: row.verdict.value for row in rows(r)} for r in ordered}
    bugs = list(dict.fromkeys(bug for r in ordered for bug in table[r.version]))
    return ordered, [
        ["bug", *(r.version for r in ordered)],
        *([bug, *(table[r.version].get(bug, "-") for r in ordered)] for bug in bugs),
    ]


def across(runs: Sequence[RunRecord], width: int = 120) -> list[str]:
    """Several releases' scans of one config: a bug per line, a release per column, and the first clean release."""
    ordered, grid = _grid(runs)
    lines = [terminal_text(line) for line in aligned(grid, width=width)]
    clean = first_clean(ordered)
    newest = ordered[-1]
    if clean is None and refusals(newest):
        lines.append(f"no release can be named clean: the newest scanned, deepspeed {newest.version}, refuses this "
                     "config (above)")  # fmt: skip
    elif clean is None and all(row.verdict is not ScanVerdict.AFFECTED for row in rows(newest)):
        lines.append(f"no release can be named clean: on the newest scanned, deepspeed {newest.version}, every "
                     "bug the config meets was CANNOT TELL or NOT APPLICABLE")  # fmt: skip
    elif clean is None:
        lines.append(f"the newest release scanned, deepspeed {newest.version}, has a known bug this config hits")
    else:
        untold = sum(row.verdict is ScanVerdict.CANNOT_TELL for r in ordered if r.version == clean for row in rows(r))
        but = f" (but {untold} could not be told there: CANNOT TELL)" if untold else ""
        lines.append(f"first release where this config hits no known bug: deepspeed {clean}{but}")
    return lines


def markdown_across(runs: Sequence[RunRecord]) -> str:
    """Several releases' scans as Markdown: the table of bugs by release, the first clean release, then each
    release's own scan."""
    ordered, (header, *grid) = _grid(runs)
    cells = ([md_code(bug), *map(md_text, verdicts)] for bug, *verdicts in grid)
    out = ["# DeepSpeed config scan across releases", "", *markdown_table(list(map(md_text, header)), cells)]
    out += ["", md_text(across(ordered)[-1]), ""]
    for run in ordered:
        out += [markdown(run).replace("# DeepSpeed config scan", f"## DeepSpeed {run.version}", 1), ""]
    return "\n".join(out)
