"""``--ds-report``: a run record rendered as Markdown that can be pasted into a GitHub issue as it is.

``render_markdown`` is a pure function of a ``core.results.RunRecord`` (the record ``--ds-results`` writes, or
its JSON), so it is tested on hand-built records. Long parts (configs, tracebacks, rank output) are
folded in ``<details>`` so the issue reads top-down: environment, a summary table, then one section per test.
"""

from __future__ import annotations

import dataclasses
import html
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from .gates import oldest_first
from .outcome import rank_ranges
from .results import Environment, RankStory, ReproMeta, RunRecord, TestRecord

#: GitHub refuses issue bodies over 65536 characters; one folded block never takes more than this.
BLOCK_LIMIT = 12_000

_ENV_ROWS = (
    ("DeepSpeed", "deepspeed"),
    ("torch", "torch"),
    ("Python", "python"),
    ("Backend", "backend"),
    ("World size", "world_size"),
    ("OS", "os"),
)


def _fence(text: str, lang: str = "") -> str:
    """A fenced code block that survives backticks inside ``text``."""
    longest = max((len(m) for m in re.findall(r"`{3,}", text)), default=2)
    fence = "`" * (longest + 1)
    return f"{fence}{lang}\n{text.rstrip()}\n{fence}"


def _clip(text: str, limit: int = BLOCK_LIMIT) -> str:
    """Keep the end of ``text`` (where a traceback's exception and a log's last words are)."""
    if len(text) <= limit:
        return text
    cut = len(text) - limit
    return f"[... {cut} characters cut ...]\n" + text[cut:]


def _details(summary: str, body: str) -> str:
    return f"<details><summary>{html.escape(summary)}</summary>\n\n{body}\n\n</details>"


def _cell(value: object) -> str:
    """A Markdown table cell: one line, pipes escaped."""
    text = " ".join(str(value).split())
    return text.replace("|", "\\|") if text else "-"


def _code(value: object) -> str:
    text = " ".join(str(value).split())
    ticks = "``" if "`" in text else "`"
    pad = " " if ticks == "``" else ""
    return f"{ticks}{pad}{text}{pad}{ticks}"


# --- ranks -----------------------------------------------------------------------------------------------------


def _rank_numbers(label: str) -> list[int] | None:
    """``"ranks 0-1,3"``, ``"rank 2"`` or ``"0-1"`` -> ``[0, 1, 3]``; None when the label is not a rank list."""
    body = re.sub(r"^\s*ranks?\s*", "", label).strip()
    if not re.fullmatch(r"\d+(-\d+)?(\s*,\s*\d+(-\d+)?)*", body):
        return None
    numbers: list[int] = []
    for part in body.split(","):
        lo, _, hi = part.strip().partition("-")
        numbers.extend(range(int(lo), int(hi or lo) + 1))
    return numbers


def dedupe_ranks(stories: Sequence[RankStory]) -> list[RankStory]:
    """Merge rank stories that ended the same way (same error and traceback) into one, labels joined.

    The plugin already groups identical ranks; this also merges records written one rank at a time, and keeps
    the order in which each distinct ending first appears. Labels are written by ``core.outcome.rank_ranges``.
    """
    merged: dict[tuple[str, str], list[RankStory]] = {}
    for story in stories:
        merged.setdefault((story.error, story.traceback), []).append(story)
    out = []
    for same in merged.values():
        labels = [s.ranks for s in same]
        numbers = [_rank_numbers(label) for label in labels]
        if all(n is not None for n in numbers):
            label = rank_ranges({n for ns in numbers if ns is not None for n in ns})
        else:
            label = ", ".join(labels)
        out.append(dataclasses.replace(same[0], ranks=label))
    return out


# --- sections --------------------------------------------------------------------------------------------------


def _environment(env: Environment) -> list[str]:
    lines = ["### Environment", "", "| | |", "|---|---|"]
    for title, key in _ENV_ROWS:
        value = getattr(env, key)
        lines.append(f"| {title} | {_cell(value if value is not None else 'not installed')} |")
    cpu = env.cpu or "unknown"
    if env.cpu_count:
        cpu = f"{cpu} ({env.cpu_count} cores)"
    lines.append(f"| CPU | {_cell(cpu)} |")
    gpu = f"{env.gpu_count} x {env.gpu}" if env.gpu_count else "none"
    lines.append(f"| GPU | {_cell(gpu)} |")
    return lines


def _label(test: TestRecord) -> str:
    return test.verdict.value if test.verdict else test.outcome.upper()


def _summary(tests: Sequence[TestRecord]) -> list[str]:
    lines = ["### Summary", "", "| Test | Verdict | Outcome | Duration |", "|---|---|---|---|"]
    for t in tests:
        lines.append(f"| {_code(t.nodeid)} | {_cell(_label(t))} | {_cell(t.outcome)} | {t.duration:.1f} s |")
    return lines


def _repro(repro: ReproMeta | None) -> list[str]:
    if repro is None:
        return ["Not a catalogued repro (no `ds_repro` marker)."]
    lines = [f"- **Repro:** `{repro.id}` - {repro.title or '(no title)'}"]
    if repro.upstream:
        lines.append(f"- **Upstream:** {repro.upstream}")
    affected = oldest_first(a for a in repro.affected if a)
    if affected:
        lines.append("- **Affected:** " + " or ".join(f"`deepspeed{a}`" for a in affected))
    fixed_text = repro.fixed_in or "no release yet"
    lines.append(f"- **Fixed in:** {fixed_text}" + (f" ({repro.fix_ref})" if repro.fix_ref else ""))
    if repro.root_cause:
        lines.append(f"- **Root cause:** {' '.join(repro.root_cause.split())}")
    return lines


def _config(test: TestRecord) -> list[str]:
    lines: list[str] = []
    if test.config_notes:
        lines.append("- **Config adapted to this world:** " + "; ".join(test.config_notes))
    if test.config is not None:
        body = _fence(json.dumps(test.config, indent=2, sort_keys=True, default=str), "json")
        lines += ["", _details("Resolved DeepSpeed config", body)]
    return lines


def _failures(test: TestRecord) -> list[str]:
    stories = dedupe_ranks(test.ranks)
    lines: list[str] = []
    if len(stories) > 1:
        lines += ["", f"The ranks ended in {len(stories)} different ways:"]
    for story in stories:
        label = story.ranks or "ranks"
        lines += ["", f"**{label}:** {_code(story.error or 'no error recorded')}"]
        if story.traceback:
            lines += ["", _details(f"Traceback ({label})", _fence(_clip(story.traceback), "pytb"))]
        if story.output:
            lines += ["", _details(f"Output of {label} (tail)", _fence(_clip(story.output)))]
    if not stories and test.longrepr:
        lines += ["", _details("Failure", _fence(_clip(test.longrepr)))]
    return lines


def _test(test: TestRecord) -> list[str]:
    lines = [f"### {_label(test)}: {_code(test.nodeid)}", "", *_repro(test.repro)]
    outcome = f"- **Outcome:** {test.outcome} in {test.duration:.1f} s"
    if test.variant:
        outcome += f" ({test.variant} variant)"
    lines.append(outcome)
    if test.error:
        lines.append(f"- **Result:** {_code(test.error)}")
    lines += _config(test)
    lines += _failures(test)
    return lines


def _counts(tests: Sequence[TestRecord]) -> str:
    counts: dict[str, int] = {}
    for t in tests:
        counts[_label(t)] = counts.get(_label(t), 0) + 1
    return ", ".join(f"{n} {label.lower()}" for label, n in counts.items()) or "no tests"


def render_markdown(run: RunRecord | Mapping[str, Any]) -> str:
    """The whole report of a run record (or of its JSON, validated: ``ValueError``); paste it into an issue as it is."""
    if not isinstance(run, RunRecord):
        run = RunRecord.from_json(run)
    env, tests = run.environment, run.tests
    world = f"{env.world_size or '?'} ranks, {env.backend or '?'}"
    created = f" Run at {run.created.isoformat(timespec='seconds')}." if run.created else ""
    lines = [
        "## pytest-dsrepro report",
        "",
        f"DeepSpeed {env.deepspeed or 'not installed'}, torch {env.torch or 'not installed'}, "
        f"{world}: {_counts(tests)}.{created}",
    ]
    if run.unavailable:
        lines += ["", f"> **DeepSpeed was not available for this run:** {' '.join(run.unavailable.split())}"]
    lines += ["", *_environment(env)]
    if tests:
        lines += ["", *_summary(tests)]
    for test in tests:
        lines += ["", *_test(test)]
    lines += ["", "<sub>Generated by pytest-dsrepro (`pytest --ds-report`).</sub>", ""]
    return "\n".join(lines)
