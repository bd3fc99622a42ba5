"""What every form says in words: the headline, where and when the runs were made, each run on hover, and the
notes below every table (:func:`notes`: sections of subjects and sayings that each renderer only lays out)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ...core.gates import Verdict
from .model import CHANGED, CONTRADICTS, OBSERVED, PREREQUISITE, Column, Matrix, Row, Run, one_line


def summary(matrix: Matrix) -> str:
    """The counts of runs per verdict, then what else the reader must know at once."""
    found = matrix.counts()
    order = [v.value for v in Verdict] + [o.upper() for o in OBSERVED]
    counts = [f"{found[w]} {w}" for w in sorted(found, key=lambda w: order.index(w) if w in order else len(order))]
    blank = sum(1 for c in matrix.columns if c.unavailable)
    if blank:
        counts.append(f"{blank} release{'s' * (blank != 1)} unavailable")
    if matrix.damaged:
        counts.append(f"{len(matrix.damaged)} results file{'s' * (len(matrix.damaged) != 1)} unreadable")
    contradictions = len(matrix.contradictions())
    if contradictions:
        counts.append(f"{contradictions} against the declared range")
    if matrix.since is not None:
        counts.append(f"{len(matrix.changes())} changed")
    return ", ".join(counts) or "no verdicts"


def headline(matrix: Matrix) -> str:
    """``15 bugs in 21 rows, 40 of DeepSpeed's own tests x 24 DeepSpeed releases: 277 REPRODUCED, ...``."""
    ours = [r for r in matrix.rows if r.origin is None]
    bugs = len({r.repro for r in ours})
    parts = [f"{bugs} bug{'s' * (bugs != 1)} in {len(ours)} row{'s' * (len(ours) != 1)}"]
    theirs = [r for r in matrix.rows if r.origin is not None]
    projects = sorted({(r.origin or "").split("@")[0] for r in theirs})
    if theirs:
        whose = f"{projects[0]}'s own" if len(projects) == 1 else "other projects'"
        parts.append(f"{len(theirs)} of {whose} tests")
    releases = len(matrix.columns)
    return f"{', '.join(parts)} x {releases} DeepSpeed release{'s' * (releases != 1)}: {summary(matrix)}"


def environments(matrix: Matrix) -> list[str]:
    """Where the runs happened: one line when every release shares it (with the world sizes the tests really
    used), else one per environment with its releases."""
    shared: dict[tuple[str | None, str | None], list[str]] = {}
    for c in matrix.columns:
        if not c.blank:
            shared.setdefault((c.torch, c.backend), []).append(c.version)
    if len(shared) <= 1:
        torch, backend = next(iter(shared), (matrix.columns[0].torch if matrix.columns else None, None))
        return [", ".join(filter(None, (f"torch {torch or '?'}", backend, worlds(matrix))))]
    by_line: dict[str, list[str]] = {}
    for c in matrix.columns:
        if not c.blank:
            by_line.setdefault(c.environment_line, []).append(c.version)
    return [f"{line}: {spans(matrix.columns, versions)}" for line, versions in by_line.items()]


def when(matrix: Matrix) -> str | None:
    """When and where the runs were made, and how long each release's tests took: what a page of observations
    says of itself."""
    ran = [c for c in matrix.columns if not c.blank]
    if not ran:
        return None
    days = sorted({c.created.date().isoformat() for c in ran if c.created})
    machines = sorted({c.machine for c in ran if c.machine})
    seconds = sorted(c.seconds for c in ran)
    said = f"Run {days[0]}" + (f" to {days[-1]}" if len(days) > 1 else "") if days else "Run"
    said += f" on {'; '.join(machines)}" if machines else ""
    took = f"{seconds[0]:.0f}" + (f"-{seconds[-1]:.0f}" if round(seconds[-1]) != round(seconds[0]) else "")
    return f"{said}; the tests of a release took {took} s (their durations added up)"


def worlds(matrix: Matrix) -> str:
    """``every test in a world of 2 ranks``, or each size with how many runs used it."""
    sizes = matrix.world_sizes()
    if not sizes:
        return ""
    if len(sizes) == 1:
        (size,) = sizes
        return f"every test in a world of {size} rank{'s' * (size != 1)}"
    return "worlds of " + ", ".join(f"{s} ranks ({n} runs)" for s, n in sorted(sizes.items()))


def spans(columns: Sequence[Column], versions: Sequence[str]) -> str:
    """``0.14.4-0.16.3, 0.18.0``: releases as runs of neighbouring columns."""
    index = {c.version: i for i, c in enumerate(columns)}
    found = sorted(index[v] for v in versions if v in index)
    parts: list[str] = []
    start = prev = None
    for i in [*found, None]:
        if i is not None and prev is not None and i == prev + 1:
            prev = i
            continue
        if start is not None and prev is not None:
            a, b = columns[start].version, columns[prev].version
            parts.append(a if start == prev else f"{a}-{b}")
        start = prev = i
    return ", ".join(parts)


@dataclass(frozen=True)
class Section:
    """One list below a table: a heading and its items, each a subject (a release, a test) and what is said."""

    title: str
    items: tuple[tuple[str, str], ...]
    code: bool = False  # the subjects are node ids or paths (set in code)


def _damaged(matrix: Matrix) -> Section:
    items = [(str(u.path), u.problem + (f" (release {u.release})" if u.release else "")) for u in matrix.damaged]
    return Section("Results files that could not be read (the matrix lacks them)", tuple(items), code=True)


def _against(matrix: Matrix) -> Section:
    items = []
    for r, c, run in matrix.contradictions():
        side = "inside" if r.declares_affected(c.version) else "outside"
        what = "passed" if run.reason is not None and run.reason.body_failed is False else "failed"
        reason = run.reason.value if run.reason else ""
        said = f"the body {what} {side} the declared range ({' or '.join(r.declared)}): {run.word}, {reason}"
        items.append((f"{c.version}  {matrix.name(run.nodeid)}", said))
    return Section(f"Against the declared range ({CONTRADICTS})", tuple(items))


def _unexpected(matrix: Matrix) -> Section:
    """The node id, to run it again, and what it said."""
    items = [(f"{c.version}  {run.nodeid}", one_line(run.error or run.outcome or "?")) for _, c, run in
             matrix.unexpected()]  # fmt: skip
    return Section("UNEXPECTED", tuple(items), code=True)


def _failed(matrix: Matrix) -> Section:
    """Another project's tests that failed: what they said (no declared range makes them UNEXPECTED)."""
    items = [(f"{c.version}  {run.nodeid}", one_line(run.error or run.raised or run.word)) for _, c, run in
             matrix.placed() if run.verdict is None and run.outcome in ("failed", "error")]  # fmt: skip
    return Section("Failed (tests that declare no range)", tuple(items), code=True)


def _grouped(matrix: Matrix, why: Callable[[Run | None], str | None]) -> list[tuple[str, str, list[str]]]:
    """What ``why`` says of each test on each release (columns without runs say why in their own notes), with the
    releases it says it of: ``(name, saying, releases)``; a row's twins said once where they say the same of the same
    releases."""
    found = []
    for r in matrix.rows:
        said: dict[str, dict[str, list[str]]] = {n: {} for n in r.nodeids}
        for nodeid in r.nodeids:
            for c in matrix.columns:
                text = None if c.blank else why(matrix.run_of(r, c, nodeid))
                if text is not None:
                    said[nodeid].setdefault(text, []).append(c.version)
        stock, fixed = said.get(r.stock or "", {}), said.get(r.fixed or "", {})
        for text, versions in stock.items():
            both = r.fixed is not None and fixed.get(text) == versions
            found.append((r.name if both else r.test_name(r.stock or ""), text, versions))
        found += [(r.test_name(r.fixed or ""), text, versions) for text, versions in fixed.items()
                  if not (r.stock is not None and stock.get(text) == versions)]  # fmt: skip
    return found


def _not_judged(run: Run | None) -> str | None:
    """Why a test has no judged run on a release (NOT-APPLICABLE, SKIPPED, not run); None when it has one."""
    if run is None:
        return "not run: no results file of the release ran this test"
    if run.verdict in (Verdict.NOT_APPLICABLE, Verdict.SKIPPED):
        return f"{run.word}: {one_line(run.error or 'no reason recorded')}"
    return None


def _without_verdict(matrix: Matrix) -> Section:
    items = [(name, f"{why} (on {spans(matrix.columns, versions)})") for name, why, versions in
             _grouped(matrix, _not_judged)]  # fmt: skip
    return Section("Without a judged run", tuple(items))


def _prerequisites(matrix: Matrix) -> Section:
    """Each prerequisite fix once, with the releases and the rows it was applied to."""
    fixes: dict[tuple[str, str], list[str]] = {}
    applied = _grouped(matrix, lambda run: "; ".join(run.prerequisites) if run and run.prerequisites else None)
    for name, fix, versions in applied:
        fixes.setdefault((fix, spans(matrix.columns, versions)), []).append(name)
    items = [(fix, f"on {where}: {', '.join(names)}") for (fix, where), names in fixes.items()]
    return Section(f"With a prerequisite fix ({PREREQUISITE})", tuple(items))


def _series(matrix: Matrix) -> Section:
    """The rate of each series of runs and the margin of each timing, per test and release."""
    found: dict[str, list[str]] = {}
    for _, c, run in matrix.placed():
        said = [f"{run.word} {run.rate} in {run.rate.seconds:.1f} s"] if run.rate else []
        said += [f"{run.word}, {m.brief}" for m in run.measurements]
        if said:
            found.setdefault(matrix.name(run.nodeid), []).append(f"{c.version} {', '.join(said)}")
    return Section("Series and timings", tuple((name, "; ".join(said)) for name, said in found.items()))


def _changes(matrix: Matrix) -> Section:
    items = [(f"{c.version}  {matrix.name(run.nodeid)}", f"{before} -> {run.word}")
             for _, c, run, before in matrix.changes()]  # fmt: skip
    items += [(f"{version}  {name}", f"{was} -> no longer in the results") for name, version, was in matrix.gone]
    older = ", ".join(str(p) for p in matrix.since or ()) or "the older results"
    return Section(f"Changed since {older} ({CHANGED}): {len(matrix.changes())}", tuple(items))


def _merged(matrix: Matrix) -> Section:
    items = [(c.version, f"{len(c.sources)} results files (per test, the newest file that ran it)")
             for c in matrix.columns if len(c.sources) > 1]  # fmt: skip
    return Section("Merged", tuple(items))


def _disagreements(matrix: Matrix) -> Section:
    items = [
        (f"{d.version}  {matrix.name(d.nodeid)}", "; ".join(f"{verdict} ({path.name})" for verdict, path in d.seen))
        for d in matrix.disagreements
    ]
    return Section("Files that disagree (the newest gives the cell)", tuple(items))


#: How many JSON files that are no results files are named (a directory of other JSON files would bury the table).
LEFT_OUT = 5


def _left_out(matrix: Matrix) -> Section:
    found = [u for u in matrix.unreadable if u not in matrix.damaged]
    items = [(str(u.path), u.problem) for u in found[:LEFT_OUT]]
    if len(found) > LEFT_OUT:
        items.append((f"{len(found) - LEFT_OUT} more JSON files", "no pytest-dsrepro results files either"))
    return Section("Left out", tuple(items), code=True)


def sections(matrix: Matrix) -> list[Section]:
    """What every form says below its table, in this order: unreadable results files, runs against the declared
    range, UNEXPECTED runs, runs without a judged result and why, prerequisite fixes, releases without runs, series
    and timings, changes since --since, merged files, files that disagree, and JSON files that are no results."""
    sections = [
        _damaged(matrix),
        _against(matrix),
        _unexpected(matrix),
        _failed(matrix),
        _without_verdict(matrix),
        _prerequisites(matrix),
        Section("Releases without runs", tuple((c.version, c.blank_line or "") for c in matrix.columns if c.blank)),
        _series(matrix),
        _changes(matrix) if matrix.since is not None else Section("", ()),
        _merged(matrix),
        _disagreements(matrix),
        _left_out(matrix),
    ]
    return [s for s in sections if s.items]


def tip(matrix: Matrix, row: Row, column: Column, errors: bool = True) -> str:
    """What hovering over a cell says: the row and release, each run's verdict, reason (and error), the range, the
    prerequisites, the change."""
    lines = [f"{row.repro} [{row.label}] on {column.version}"]
    if column.blank:
        return "\n".join([*lines, column.blank_line or ""])
    for slot, nodeid in (("stock", row.stock), ("with the fix", row.fixed)):
        if nodeid is not None:
            lines.append(f"{slot}: {run_line(matrix.run_of(row, column, nodeid), errors)}")
    if row.declared and row.stock:
        inside = "inside" if row.declares_affected(column.version) else "outside"
        lines.append(f"{inside} the declared range {' or '.join(row.declared)}")
    cell = matrix.cell(row, column)
    for run in cell.runs if cell else ():
        lines += [f"prerequisite: {p}" for p in run.prerequisites]
        if run.before is not None:
            lines.append(f"was {run.before}")
    return "\n".join(lines)


@functools.lru_cache(maxsize=8192)
def run_line(run: Run | None, errors: bool = True) -> str:
    """A run in a line (said on hover and in the evidence, so kept)."""
    if run is None:
        return "not run: no results file of the release ran this test"
    said = run.word + (f" {run.rate}" if run.rate else "")
    reason = f" ({run.reason.value})" if run.reason else ""
    world = f", {run.world_size} ranks" if run.world_size else ""
    timed = "".join(f", {m.brief}" for m in run.measurements)
    return f"{said}{reason}{world}{timed}" + (f": {one_line(run.error)}" if run.error and errors else "")


def raised(matrix: Matrix) -> list[tuple[str, str, str]]:
    """``(test name, what its failing ranks raised, releases)`` for every distinct failure of every test: what the
    bug looks like on each release (the error line where no rank story was kept)."""
    grouped: dict[tuple[str, str], list[str]] = {}
    for _, c, run in matrix.placed():
        failed = run.reason.body_failed if run.reason is not None else run.outcome in ("failed", "error")
        text = run.raised or (run.error if failed else None)
        if text:
            grouped.setdefault((run.nodeid, one_line(text)), []).append(c.version)
    return [(matrix.name(n), text, spans(matrix.columns, versions)) for (n, text), versions in grouped.items()]
