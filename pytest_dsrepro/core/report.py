"""``--ds-report``: a run record rendered as Markdown that can be pasted into a GitHub issue as it is.

``render_markdown`` is a pure function of a ``core.results.RunRecord`` (the record ``--ds-results`` writes, or
its JSON), so it is tested on hand-built records. The report stands alone for a maintainer who has never heard of
the plugin: per test the repro's source and its fix, the commands that run it again (every version pinned),
DeepSpeed's own ``ds_report`` and torch's environment summary, the accelerator, and each rank's story. Long parts
are folded in ``<details>`` so the issue reads top-down; DeepSpeed's config and memory dumps are folded away from
the output tails they crowd; local paths are replaced by neutral names (:class:`Neutral`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import sys
import sysconfig
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .escape import html_text, md_code, md_fence, md_link, md_text, one_line
from .gates import oldest_first
from .outcome import rank_ranges
from .results import Environment, RankStory, ReproMeta, RunRecord, Source, TestRecord
from .text import markdown_cell, markdown_table, strip_ansi

#: GitHub refuses issue bodies over 65536 characters; one folded block never takes more than this.
BLOCK_LIMIT = 12_000

_ENV_ROWS = (
    ("DeepSpeed", "deepspeed"),
    ("torch", "torch"),
    ("Python", "python"),
    ("Accelerator", "accelerator"),
    ("Backend", "backend"),
    ("World size", "world_size"),
    ("OS", "os"),
    ("pytest", "pytest"),
    ("pytest-dsrepro", "plugin"),
)


# --- local paths -----------------------------------------------------------------------------------------------

#: What ends a path component: a path is replaced only where it ends there (``/work/main`` not in ``/work/mainline``).
_PATH_END = r"(?![\w.-])"
#: Any environment's packages (a rank's traceback names the same interpreter's; ds_report names torch's and its own).
_SITE_PACKAGES = re.compile(r"(?:/[\w.+@-]+)+/(?:site|dist)-packages" + _PATH_END)
_HOME = re.compile(r"/(?:home|Users)/[\w.-]+" + _PATH_END)


@dataclass(frozen=True)
class Neutral:
    """Local paths and the neutral names a report gives them (``/work/me/proj`` -> ``<rootdir>``, longest first),
    after any ``.../site-packages`` -> ``<site-packages>``; then any home directory -> ``~``."""

    pairs: tuple[tuple[str, str], ...] = ()

    def apply(self, text: str) -> str:
        text = _SITE_PACKAGES.sub("<site-packages>", text)  # first: inside the environment or the run's root
        for local, name in sorted(self.pairs, key=lambda pair: -len(pair[0])):
            if len(local) > 1:
                text = re.sub(re.escape(local) + _PATH_END, name.replace("\\", "\\\\"), text)
        return _HOME.sub("~", text)

    @classmethod
    def here(cls, root: str | os.PathLike[str] | None = None) -> Neutral:
        """This machine's paths: the run's root, this interpreter's packages, standard library and environment, the
        home and temporary directories (each also as its real path, when a link leads there)."""
        paths = sysconfig.get_paths()
        named: list[tuple[str, str]] = [
            (paths["purelib"], "<site-packages>"),
            (paths["platlib"], "<site-packages>"),
            (paths["stdlib"], "<stdlib>"),
            (tempfile.gettempdir(), "<tmp>"),
            (os.path.expanduser("~"), "~"),
        ]
        if sys.prefix != sys.base_prefix:
            named.append((sys.prefix, "<venv>"))
        if root is not None:
            named.append((os.fspath(root), "<rootdir>"))
        pairs = {(p, n) for path, n in named for p in {os.path.abspath(path), os.path.realpath(path)}}
        return cls(tuple(sorted(pairs)))


def _clip(text: str, limit: int = BLOCK_LIMIT) -> str:
    """Keep the end of ``text`` (where a traceback's exception and a log's last words are)."""
    if len(text) <= limit:
        return text
    cut = len(text) - limit
    return f"[... {cut} characters cut ...]\n" + text[cut:]


def _details(summary: str, body: str) -> str:
    return f"<details><summary>{html_text(one_line(summary))}</summary>\n\n{body}\n\n</details>"


# --- DeepSpeed's dumps in output tails ---------------------------------------------------------------------------

#: DeepSpeed's logger format is ``[time] [LEVEL] [file.py:line:function] message``: the config dump comes from
#: ``DeepSpeedConfig.print``/``print_user_config`` (``config.py``) and ``print_configuration`` (``logging.py``).
_CONFIG_DUMP = re.compile(r"\[(?:config|logging)\.py:\d+:(?:print|print_user_config|print_configuration)\]")
#: A dumped value printed as indented JSON (the user's config, sub-configs): from ``{`` to ``}`` at column 0.
_BLOCK_START = re.compile(r"\{\s*$")
#: ``see_memory_usage``: its message, then ``MA .. GB Max_MA .. CA .. Max_CA ..`` and ``CPU Virtual Memory: ...``
#: (printed since 0.15; logged through the logger, with the function's name, before).
_MEMORY_LINE = re.compile(r"^\s*MA [\d.]+ GB\s+Max_MA|^\s*CPU Virtual Memory:\s+used =|:see_memory_usage\]")
_MA_LINE = re.compile(r"^\s*MA [\d.]+ GB\s+Max_MA")


def split_dumps(output: str) -> tuple[str, str]:
    """``(what the rank said, DeepSpeed's config and memory dumps)`` of one output tail, each in its order."""
    lines = output.splitlines()
    dump = [False] * len(lines)
    i = 0
    while i < len(lines):
        line = lines[i]
        if _CONFIG_DUMP.search(line) and _BLOCK_START.search(line):
            end = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip() == "}"), len(lines) - 1)
            dump[i : end + 1] = [True] * (end + 1 - i)
            i = end + 1
            continue
        if _CONFIG_DUMP.search(line) or _MEMORY_LINE.search(line):
            dump[i] = True
        elif i + 1 < len(lines) and _MA_LINE.search(lines[i + 1]):
            dump[i] = True  # see_memory_usage's own message, printed right before its numbers
        i += 1
    kept = "\n".join(line for line, d in zip(lines, dump, strict=True) if not d)
    folded = "\n".join(line for line, d in zip(lines, dump, strict=True) if d)
    return kept, folded


def _output(label: str, output: str) -> list[str]:
    """A rank group's output tail; DeepSpeed's dumps folded apart unless they are all there is."""
    kept, folded = split_dumps(strip_ansi(output))
    if not kept.strip() or not folded:
        return ["", _details(f"Output of {label} (tail)", md_fence(_clip(strip_ansi(output))))]
    n = folded.count("\n") + 1
    body = (
        md_fence(_clip(kept))
        + "\n\n"
        + _details(f"DeepSpeed's config and memory dumps ({n} lines)", md_fence(_clip(folded)))
    )
    return ["", _details(f"Output of {label} (tail, {n} lines of DeepSpeed's config and memory dumps folded)", body)]


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


_UNSET = {"accelerator": "not recorded", "backend": "none (no world ran)", "world_size": "none (no world ran)"}


def _environment(env: Environment) -> list[str]:
    lines = ["### Environment", "", "| | |", "|---|---|"]
    for title, key in _ENV_ROWS:
        value = getattr(env, key)
        shown = value if value is not None else _UNSET.get(key, "not installed")
        lines.append(f"| {title} | {markdown_cell(md_text(shown))} |")
    cpu = env.cpu or "unknown"
    if env.cpu_count:
        cpu = f"{cpu} ({env.cpu_count} cores)"
    lines.append(f"| CPU | {markdown_cell(md_text(cpu))} |")
    gpu = f"{env.gpu_count} x {env.gpu}" if env.gpu_count else "none"
    lines.append(f"| GPU | {markdown_cell(md_text(gpu))} |")
    if env.ds_report:
        lines += [
            "",
            _details("ds_report (DeepSpeed's own environment report)", md_fence(_clip(strip_ansi(env.ds_report)))),
        ]
    if env.torch_env:
        summary = "python -m torch.utils.collect_env (torch's environment summary)"
        lines += ["", _details(summary, md_fence(_clip(strip_ansi(env.torch_env))))]
    return lines


def _summary(tests: Sequence[TestRecord]) -> list[str]:
    rows = [(md_code(t.nodeid), md_text(t.label), md_text(t.outcome), f"{t.duration:.1f} s") for t in tests]
    return ["### Summary", "", *markdown_table(("Test", "Verdict", "Outcome", "Duration"), rows)]


def _repro(repro: ReproMeta | None) -> list[str]:
    if repro is None:
        return ["Not a catalogued repro (no `ds_repro` marker)."]
    lines = [f"- **Repro:** {md_code(repro.id)} - {md_text(repro.title or '(no title)')}"]
    if repro.upstream:
        lines.append(f"- **Upstream:** {md_link(repro.upstream)}")
    affected = oldest_first(a for a in repro.affected if a)
    if affected:
        lines.append("- **Affected:** " + " or ".join(md_code(f"deepspeed{a}") for a in affected))
    fixed_text = md_text(repro.fixed_in or "no release yet")
    lines.append(f"- **Fixed in:** {fixed_text}" + (f" ({md_link(repro.fix_ref)})" if repro.fix_ref else ""))
    if repro.root_cause:
        lines.append(f"- **Root cause:** {md_text(repro.root_cause)}")
    if repro.faces:  # how users meet it elsewhere (GPUs, other optimizers and releases): a reader finds theirs here
        lines.append("- **Also seen as:** " + "; ".join(f"{md_text(f.describe())} ({md_link(f.where, 'seen')})"
                                                     for f in repro.faces))  # fmt: skip
    return lines


def _fix(test: TestRecord) -> list[str]:
    source = test.source
    if source is None or source.fix is None:
        return []
    where = "in the source below" if source.fix_code is None else "its source below"
    applied = "applied in every rank of this `[fixed]` variant" if test.variant == "fixed" else (
        "applied in every rank of the `[fixed]` variant"
    )  # fmt: skip
    return [f"- **Fix:** {md_code(source.fix)} ({applied}; {where})"]


def _rate(test: TestRecord) -> list[str]:
    rate = test.rate
    if rate is None:
        return []
    stopped = f"; the runs stopped at run {rate.runs} of {rate.planned}" if rate.runs < rate.planned else ""
    return [
        f"- **Rate:** {rate.failed} of {rate.runs} runs failed as declared (the bug is nondeterministic: REPRODUCED "
        f"needs {rate.needed} of {rate.planned}, FIXED and PASSES-WITH-FIX need 0){stopped}; each run a fresh world, "
        f"{rate.seconds:.1f} s in all ({rate.seconds / rate.runs:.2f} s a run)"
    ]


def _measured(test: TestRecord) -> list[str]:
    return [
        f"- **Measured:** {md_text(m.what)}: {m.seconds * 1e3:.1f} ms, against {md_text(m.reference)}: "
        f"{m.reference_seconds * 1e3:.1f} ms (the least of {m.repeats} interleaved runs each, the slowest rank's): "
        f"{m.ratio:.2f}x; slow from {m.limit:g}x, so {'slow' if m.slow else 'not slow'} with a margin of "
        f"{m.margin:.1f}x"
        for m in test.measurements
    ]


def _prerequisites(test: TestRecord) -> list[str]:
    return [
        f"- **Prerequisite:** another bug's fix was applied in every rank first, for {md_text(p)}"
        for p in test.prerequisites
    ]


def install_commands(env: Environment) -> list[str]:
    """The pip lines that rebuild this run's environment, every version pinned (torch first: DeepSpeed's build
    imports it, hence ``--no-build-isolation``; ``DS_BUILD_OPS=0``: its ops are JIT-built when first used)."""
    lines = []
    if env.torch:
        version, _, local = env.torch.partition("+")
        index = f" --index-url https://download.pytorch.org/whl/{local}" if local else ""
        lines.append(f"python -m pip install {shlex.quote('torch==' + version)}{index}")
    plugin = f"pytest-dsrepro=={env.plugin}" if env.plugin else "pytest-dsrepro"
    pytest = f" {shlex.quote('pytest==' + env.pytest)}" if env.pytest else ""
    lines.append(f"python -m pip install setuptools wheel {shlex.quote(plugin)}{pytest}")
    if env.deepspeed:
        ds = shlex.quote(f"deepspeed=={env.deepspeed}")
        lines.append(f"DS_BUILD_OPS=0 python -m pip install --no-build-isolation {ds}")
    return lines


def rerun_command(env: Environment, test: TestRecord) -> str:
    """The pytest line that runs ``test`` again in the same world."""
    args = ["python", "-m", "pytest"]
    size = test.world_size or env.world_size
    if size:
        args += ["--ds-world-size", str(size)]
    if env.backend:
        args += ["--ds-backend", env.backend]
    return " ".join([*args, shlex.quote(test.nodeid)])


def _run_again(env: Environment, test: TestRecord) -> list[str]:
    lines = [f"# Python {env.python}" if env.python else "# Python", *install_commands(env)]
    if test.source is not None:
        lines.append(f"# save the repro's source (below) as {test.source.path}, then:")
    lines.append(rerun_command(env, test))
    return ["", "**Run it again:**", "", md_fence("\n".join(lines), "bash")]


def _source(test: TestRecord, shown: dict[Source, str]) -> list[str]:
    source = test.source
    if source is None:
        return []
    if source in shown:
        return ["", f"The repro's source: as for {md_code(shown[source])} above."]
    shown[source] = test.nodeid
    lines = ["", _details(f"Source: {source.path} (the test and what it uses from its file)",
                          md_fence(source.code, "python"))]  # fmt: skip
    if source.fix_code:
        lines += ["", _details(f"The fix: {source.fix}", md_fence(source.fix_code, "python"))]
    if source.world_elsewhere:
        lines += ["", "Its `ds_world` marker comes from a conftest.py (the catalogue's runs every test under `repros/` "
                  "in a world); saved on its own, add `pytest.mark.ds_world` to its `pytestmark`."]  # fmt: skip
    return lines


def _config(test: TestRecord) -> list[str]:
    lines: list[str] = []
    if test.config_notes:
        lines.append("- **Config adapted to this world:** " + "; ".join(map(md_text, test.config_notes)))
    if test.config is not None:
        body = md_fence(json.dumps(test.config, indent=2, sort_keys=True, default=str), "json")
        lines += ["", _details("Resolved DeepSpeed config", body)]
    return lines


def _failures(test: TestRecord) -> list[str]:
    stories = dedupe_ranks(test.ranks)
    lines: list[str] = []
    if len(stories) > 1:
        lines += ["", f"The ranks ended in {len(stories)} different ways:"]
    for story in stories:
        label = story.ranks or "ranks"
        lines += ["", f"**{md_text(label)}:** {md_code(story.error or 'no error recorded')}"]
        if story.traceback:
            lines += ["", _details(f"Traceback ({label})", md_fence(_clip(strip_ansi(story.traceback)), "pytb"))]
        if story.output.strip():
            lines += _output(label, story.output)
    if not stories and test.longrepr:
        lines += ["", _details("Failure", md_fence(_clip(test.longrepr)))]
    return lines


def _test(env: Environment, test: TestRecord, shown: dict[Source, str]) -> list[str]:
    lines = [
        f"### {md_text(test.label)}: {md_code(test.nodeid)}",
        "",
        *_repro(test.repro),
        *_fix(test),
        *_prerequisites(test),
    ]
    lines += [*_rate(test), *_measured(test)]
    outcome = f"- **Outcome:** {md_text(test.outcome)} in {test.duration:.1f} s"
    if test.variant:
        outcome += f" ({md_text(test.variant)} variant)"
    if test.world_size:
        outcome += f", {test.world_size} ranks"
    if test.attempts > 1:
        outcome += f"; attempt {test.attempts} of {test.attempts} (the earlier ones were run again)"
    lines.append(outcome)
    if test.error:
        lines.append(f"- **Result:** {md_code(test.error)}")
    lines += _run_again(env, test)
    lines += _source(test, shown)
    lines += _config(test)
    lines += _failures(test)
    return lines


def _counts(tests: Sequence[TestRecord]) -> str:
    counts: dict[str, int] = {}
    for t in tests:
        word = t.verdict.value if t.verdict else t.outcome.upper()  # a rate is the test's, not the count's
        counts[word] = counts.get(word, 0) + 1
    return ", ".join(f"{n} {label.lower()}" for label, n in counts.items()) or "no tests"


def render_markdown(run: RunRecord | Mapping[str, Any], *, neutral: Neutral | None = None) -> str:
    """The whole report of a run record (or of its JSON, validated: ``ValueError``); paste it into an issue as it is.

    ``neutral`` replaces local paths (``Neutral.here(rootdir)`` for this machine's); any ``site-packages`` and home
    directory are made neutral in any case.
    """
    if not isinstance(run, RunRecord):
        run = RunRecord.from_json(run)
    env, tests = run.environment, run.tests
    world = f"{env.world_size or '?'} ranks, {md_text(env.backend or '?')}"
    if env.accelerator:
        world += f", DeepSpeed accelerator {md_text(env.accelerator)}"
    created = f" Run at {run.created.isoformat(timespec='seconds')}." if run.created else ""
    lines = [
        "## pytest-dsrepro report",
        "",
        f"DeepSpeed {md_text(env.deepspeed or 'not installed')}, torch {md_text(env.torch or 'not installed')}, "
        f"{world}: {_counts(tests)}.{created}",
    ]
    if run.unavailable:
        lines += ["", f"> **DeepSpeed was not available for this run:** {md_text(run.unavailable)}"]
    lines += ["", *_environment(env)]
    if tests:
        lines += ["", *_summary(tests)]
    shown: dict[Source, str] = {}
    for test in tests:
        lines += ["", *_test(env, test, shown)]
    plugin = f"pytest-dsrepro {env.plugin}" if env.plugin else "pytest-dsrepro"
    lines += ["", f"<sub>Generated by {plugin} (`pytest --ds-report`); `dsrepro export NODEID` writes a test as one "
              "script for `torchrun`.</sub>", ""]  # fmt: skip
    return (neutral or Neutral()).apply("\n".join(lines))
