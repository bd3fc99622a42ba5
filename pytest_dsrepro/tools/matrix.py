"""``dsrepro matrix``: the results files of many runs (one or more per DeepSpeed release) as one table.

Rows are repros (one row per test id where a repro has several: variant, config, other parameters), each with the
range of releases its ``ds_version`` markers declare affected; columns are DeepSpeed releases in version order
(``packaging.version``); cells are verdicts: REPRODUCED, FIXED, PASSES-WITH-FIX, UNEXPECTED, NOT-APPLICABLE,
SKIPPED.

- **Several files of one release merge**: per test, the newest file that ran it gives its cell (``created``, then
  the file's time), so a partial re-run (``-k``) updates its cells and leaves the others as they were, and the files
  of ``--ds-shard`` slices run on several machines make one column. Files of one release that disagree about a test
  are listed (every verdict, with its file): never a silent choice.
- **Every cell that is not a verdict says why**: NOT-APPLICABLE cells the reason their repro declares, SKIPPED
  cells their skip reason, ``not run`` cells that no file of
  the release ran the test, ``n/a`` columns why the release could not run (``unavailable`` in its results file,
  written by ``dsrepro install``); such a release is a column of its own, never dropped.
- **Declared against observed**: a stock cell whose outcome contradicts the row's declared range (the body passed
  inside it, or failed outside it, as the gates' ``Reason`` says) is marked ``!``.
- **Prerequisites in the open**: a cell whose run had another bug's fix applied first (``ds_prerequisite``) is
  marked ``+``, and the notes say which fix, for which releases.
- **What changed**: with ``--since OLD_DIR``, cells that differ from the matrix of those older files are marked ``~``.
- **120 columns**: the terminal table uses the verdicts' names when they fit, else short names (with a legend), and
  splits the releases into several tables when even those do not fit; long labels wrap.

Everything here is a pure function of the files' contents (:func:`load`, :func:`merge`, :func:`since`, the
``render_*`` functions), so the whole of it is tested without torch; :func:`run` is the command. The files are
read, and checked, by ``core.results``; verdicts and reasons are the gates' own ``Verdict`` and ``Reason``.
"""

from __future__ import annotations

import argparse
import dataclasses
import html
import os
import shutil
import sys
import textwrap
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from ..core import results
from ..core.gates import Reason, Verdict, oldest_first
from ..core.results import ResultsFile, TestRecord

__all__ = [
    "Cell",
    "Column",
    "Disagreement",
    "Matrix",
    "MatrixError",
    "Row",
    "add_arguments",
    "exit_code",
    "load",
    "merge",
    "render_html",
    "render_markdown",
    "render_terminal",
    "run",
    "since",
]

NOT_RUN = "not run"
UNAVAILABLE = "n/a"
CONTRADICTS = "!"  # the cell contradicts the row's declared range
CHANGED = "~"  # the cell differs from the --since matrix
PREREQUISITE = "+"  # the run had another bug's fix applied first (ds_prerequisite)
#: The width the terminal table keeps within (or the terminal's, when narrower).
WIDTH = 120
#: A row label longer than this wraps.
LABEL_WIDTH = 36
#: Short names, used when the full ones would not fit (a legend says so).
SHORT = {
    Verdict.REPRODUCED.value: "REPRO",
    Verdict.FIXED.value: "FIXED",
    Verdict.NOT_YET_AFFECTED.value: "N/YET",
    Verdict.PASSES_WITH_FIX.value: "W/FIX",
    Verdict.UNEXPECTED.value: "UNEXP",
    Verdict.NOT_APPLICABLE.value: "N/APP",
    Verdict.SKIPPED.value: "SKIP",
    NOT_RUN: "-",
    UNAVAILABLE: "n/a",
}


class MatrixError(Exception):
    """A usage problem: nothing to read, or nothing readable. ``dsrepro matrix`` exits 2 with this one line."""


@dataclass(frozen=True)
class Column:
    version: str
    torch: str | None
    backend: str | None
    world_size: int | None
    unavailable: str | None
    source: Path  # the newest file of the release
    sources: tuple[Path, ...] = ()  # every file of the release, newest first

    @property
    def environment_line(self) -> str:
        parts = [f"torch {self.torch or '?'}"]
        if self.backend:
            parts.append(self.backend)
        if self.world_size:
            parts.append(f"{self.world_size} ranks")
        return ", ".join(parts)

    @property
    def unavailable_line(self) -> str | None:
        if self.unavailable is None:
            return None
        return f"cannot run with torch {self.torch or '?'}: {self.unavailable}"


@dataclass(frozen=True)
class Row:
    repro: str
    nodeid: str
    label: str  # the repro id, plus what tells this row from the repro's other rows
    title: str | None = None
    upstream: str | None = None
    variant: str | None = None
    declared: tuple[str, ...] = ()  # the affected ranges its ds_version markers declare (the newest record's)

    @property
    def judged_by_range(self) -> bool:
        """A stock (or fix-less) row: its cells say whether the bug shows, which the declared range predicts."""
        return self.variant in (None, "stock") and bool(self.declared)

    def declares_affected(self, version: str) -> bool | None:
        """Does the declared range include ``version``? None when that cannot be said."""
        try:
            v = Version(version)
            return any(SpecifierSet(d).contains(v, prereleases=True) for d in self.declared)
        except (InvalidVersion, InvalidSpecifier):
            return None


@dataclass(frozen=True)
class Cell:
    verdict: Verdict
    outcome: str | None = None
    error: str | None = None
    reason: Reason | None = None
    source: Path | None = None  # the results file it comes from
    contradicts: bool = False  # the outcome contradicts the row's declared range
    before: str | None = None  # with --since: what the cell was (a verdict, "not run"), when it changed
    prerequisites: tuple[str, ...] = ()  # the other bugs' fixes applied first (ds_prerequisite), with their reasons

    @property
    def note(self) -> str | None:
        """The line worth a footnote or a tooltip: the failure seen, or why there was no verdict."""
        return self.error or None

    @property
    def marks(self) -> str:
        marks = PREREQUISITE if self.prerequisites else ""
        return marks + (CONTRADICTS if self.contradicts else "") + (CHANGED if self.before is not None else "")


@dataclass(frozen=True)
class Disagreement:
    """Files of one release that gave one test different verdicts; the newest one's is the cell."""

    nodeid: str
    version: str
    seen: tuple[tuple[str, Path], ...]  # (verdict, file), newest first


@dataclass(frozen=True)
class Matrix:
    columns: tuple[Column, ...]
    rows: tuple[Row, ...]
    cells: Mapping[tuple[str, str], Cell]  # (row nodeid, column version) -> cell
    sources: tuple[Path, ...] = ()
    warnings: tuple[str, ...] = field(default=())
    since: tuple[Path, ...] | None = None  # the older files compared with (--since), if any
    gone: tuple[tuple[str, str, str], ...] = ()  # (label, version, verdict) cells of the older matrix missing here
    disagreements: tuple[Disagreement, ...] = ()

    def cell(self, row: Row, column: Column) -> Cell | None:
        return self.cells.get((row.nodeid, column.version))

    def count(self, verdict: Verdict) -> int:
        return sum(1 for c in self.cells.values() if c.verdict == verdict)

    def unexpected(self) -> list[tuple[Row, Column, Cell]]:
        return self._where(lambda cell: cell.verdict is Verdict.UNEXPECTED)

    def contradictions(self) -> list[tuple[Row, Column, Cell]]:
        return self._where(lambda cell: cell.contradicts)

    def changes(self) -> list[tuple[Row, Column, str, str]]:
        """``(row, column, before, now)`` for every cell that differs from the ``--since`` matrix."""
        found = []
        for c in self.columns:
            for r in self.rows:
                cell = self.cell(r, c)
                if cell is not None and cell.before is not None:
                    found.append((r, c, cell.before, cell.verdict.value))
        return found

    def _where(self, keep: object) -> list[tuple[Row, Column, Cell]]:
        assert callable(keep)
        return [
            (r, c, cell)
            for c in self.columns
            for r in self.rows
            if not c.unavailable and (cell := self.cell(r, c)) is not None and keep(cell)
        ]

    def text(self, row: Row, column: Column) -> str:
        """What a cell says: a verdict, ``not run`` or ``n/a``."""
        if column.unavailable:
            return UNAVAILABLE
        cell = self.cell(row, column)
        return cell.verdict.value if cell else NOT_RUN

    def not_verdicts(self) -> list[tuple[str, Row, list[str]]]:
        """Why each cell without a judged run (NOT-APPLICABLE, SKIPPED, not run) is what it is: ``(why, row,
        releases)``, one entry per row and reason. Unavailable releases say why in their own notes."""

        def why(cell: Cell | None) -> str | None:
            if cell is None:
                return "not run: no results file of the release ran this test"
            if cell.verdict in (Verdict.NOT_APPLICABLE, Verdict.SKIPPED):
                return f"{cell.verdict.value}: {_one_line(cell.error or 'no reason recorded')}"
            return None

        return self._grouped(why)

    def with_prerequisites(self) -> list[tuple[str, Row, list[str]]]:
        """``(prerequisite, row, releases)`` for the cells whose runs had another bug's fix applied first."""
        return self._grouped(lambda cell: "; ".join(cell.prerequisites) if cell and cell.prerequisites else None)

    def _grouped(self, why: Callable[[Cell | None], str | None]) -> list[tuple[str, Row, list[str]]]:
        grouped: dict[tuple[str, str], list[str]] = {}
        rows = {r.nodeid: r for r in self.rows}
        for r in self.rows:
            for c in self.columns:
                text = None if c.unavailable else why(self.cell(r, c))
                if text is not None:
                    grouped.setdefault((r.nodeid, text), []).append(c.version)
        return [(text, rows[nodeid], versions) for (nodeid, text), versions in grouped.items()]


# ----------------------------------------------------------------------------------------------------- loading


def load(paths: Sequence[Path]) -> tuple[list[ResultsFile], list[str]]:
    """Every results file under ``paths`` (files, or directories searched for ``*.json``), and warnings for the
    JSON files that are not results files. Raises :class:`MatrixError` when nothing usable is found."""
    try:
        files, warnings = results.read_all(paths)
    except FileNotFoundError as exc:
        raise MatrixError(str(exc)) from None
    if not files:
        where = ", ".join(str(p) for p in paths)
        detail = f" ({len(warnings)} unreadable JSON files)" if warnings else ""
        raise MatrixError(f"no pytest-dsrepro results files in {where}{detail}; write them with --ds-results DIR")
    return files, warnings


# ----------------------------------------------------------------------------------------------------- merging


def version_key(version: str) -> tuple[int, Version | str]:
    try:
        return (0, Version(version))
    except InvalidVersion:
        return (1, version)


def _cell_of(record: TestRecord, source: Path) -> Cell | None:
    """A record's cell, or None for a test outside the catalogue's business (ungated and not failing)."""
    if record.verdict is not None:
        return Cell(record.verdict, record.outcome, record.error, record.reason, source,
                    prerequisites=record.prerequisites)  # fmt: skip
    if record.outcome in ("failed", "error", "xpassed"):
        why = f"no verdict, pytest outcome {record.outcome}: {record.error or 'no error recorded'}"
        return Cell(Verdict.UNEXPECTED, record.outcome, why, None, source)
    if record.outcome == "skipped":
        return Cell(Verdict.SKIPPED, record.outcome, record.error, None, source)
    return None


def _test_part(nodeid: str) -> str:
    return nodeid.split("::", 1)[1] if "::" in nodeid else nodeid


def _labels(repro: str, nodeids: Iterable[str]) -> dict[str, str]:
    """Row labels for one repro's test ids: the repro id alone when it has one row, else what tells them apart."""
    ids = sorted(set(nodeids))
    if len(ids) == 1:
        return {ids[0]: repro}
    files = {n.split("::", 1)[0] for n in ids}
    if len(files) > 1:
        return {n: f"{repro} {n}" for n in ids}
    functions = {_test_part(n).split("[", 1)[0] for n in ids}
    if len(functions) == 1:
        return {n: f"{repro} [{_test_part(n).partition('[')[2].rstrip(']')}]" for n in ids}
    return {n: f"{repro} {_test_part(n)}" for n in ids}


def _row_order(row: Row) -> tuple[str, str, int]:
    params = _test_part(row.nodeid).partition("[")[2].rstrip("]")
    variant = row.variant
    rest = "-".join(p for p in params.split("-") if p != variant) if variant else params
    base = _test_part(row.nodeid).split("[", 1)[0]
    return (row.repro, f"{base}[{rest}]", 0 if variant in (None, "stock") else 1)


def _age(f: ResultsFile) -> tuple[object, float, str]:
    return (f.created, f.path.stat().st_mtime, str(f.path))


def _column(version: str, files: Sequence[ResultsFile]) -> Column:
    """A release's column from its files (oldest first): the newest file's environment; unavailable only when the
    newest file says so (a later run that worked makes an older unavailability history)."""
    newest = files[-1]
    runs = [f for f in files if not f.run.unavailable]
    env = (runs[-1] if runs and not newest.run.unavailable else newest).run.environment
    return Column(
        version=version,
        torch=env.torch,
        backend=env.backend,
        world_size=env.world_size,
        unavailable=newest.run.unavailable,
        source=newest.path,
        sources=tuple(f.path for f in reversed(files)),
    )


@dataclass(frozen=True)
class _About:
    """What a test's newest record says about it (older records fill what a newer one leaves empty)."""

    repro: str
    title: str | None
    upstream: str | None
    variant: str | None
    declared: tuple[str, ...]

    def updated(self, record: TestRecord) -> _About:
        about = record.repro
        return _About(
            repro=(about.id if about else None) or self.repro,
            title=(about.title if about else None) or self.title,
            upstream=(about.upstream if about else None) or self.upstream,
            variant=record.variant or self.variant,
            declared=tuple(oldest_first(about.affected)) if about and about.affected else self.declared,
        )


_NOBODY = _About("(not a repro)", None, None, None, ())


def _collect(
    files: Sequence[ResultsFile],
) -> tuple[dict[tuple[str, str], Cell], dict[str, _About], tuple[Disagreement, ...]]:
    """Every cell, the newest file that ran its test on its release giving it; what each test is; and the tests that
    files of one release disagree about."""
    cells: dict[tuple[str, str], Cell] = {}
    about: dict[str, _About] = {}
    seen: dict[tuple[str, str], list[tuple[str, Path]]] = {}
    for f in sorted(files, key=_age):  # oldest first: newer records overwrite
        if f.run.unavailable:
            continue
        for record in f.run.tests:
            cell = _cell_of(record, f.path)
            if record.nodeid and cell is not None:
                about[record.nodeid] = about.get(record.nodeid, _NOBODY).updated(record)
                cells[(record.nodeid, f.run.version)] = cell
                seen.setdefault((record.nodeid, f.run.version), []).insert(0, (cell.verdict.value, f.path))
    disagreements = tuple(
        Disagreement(nodeid, version, tuple(verdicts))
        for (nodeid, version), verdicts in seen.items()
        if len({verdict for verdict, _ in verdicts}) > 1
    )
    return cells, about, disagreements


def _rows(about: Mapping[str, _About]) -> tuple[Row, ...]:
    per_repro: dict[str, list[str]] = {}
    for nodeid, a in about.items():
        per_repro.setdefault(a.repro, []).append(nodeid)
    rows = [
        Row(repro, nodeid, label, about[nodeid].title, about[nodeid].upstream, about[nodeid].variant,
            about[nodeid].declared)
        for repro, nodeids in per_repro.items()
        for nodeid, label in _labels(repro, nodeids).items()
    ]  # fmt: skip
    return tuple(sorted(rows, key=lambda r: (_row_order(r), r.nodeid)))


def merge(files: Sequence[ResultsFile], warnings: Sequence[str] = ()) -> Matrix:
    """One column per DeepSpeed release, one row per test of a repro; per test and release the newest file that ran
    it gives the cell, so several files of one release (a partial re-run among them) merge."""
    by_version: dict[str, list[ResultsFile]] = {}
    for f in sorted(files, key=_age):
        by_version.setdefault(f.run.version, []).append(f)
    columns = tuple(_column(v, by_version[v]) for v in sorted(by_version, key=version_key))
    cells, about, disagreements = _collect(files)
    unavailable = {c.version for c in columns if c.unavailable}
    # What older runs of a release that cannot run now said is history, not a cell.
    cells = {k: cell for k, cell in cells.items() if k[1] not in unavailable}
    disagreements = tuple(d for d in disagreements if d.version not in unavailable)
    rows = _rows(about)
    return Matrix(
        columns, rows, _judge_ranges(rows, cells), tuple(f.path for f in files), tuple(warnings),
        disagreements=disagreements,
    )  # fmt: skip


def _opt(value: object) -> str | None:
    return None if value is None else str(value)


def _judge_ranges(rows: Sequence[Row], cells: Mapping[tuple[str, str], Cell]) -> dict[tuple[str, str], Cell]:
    """Mark the cells whose outcome contradicts their row's declared range (``Reason.body_failed`` against it)."""
    by_id = {r.nodeid: r for r in rows}
    judged: dict[tuple[str, str], Cell] = {}
    for (nodeid, version), cell in cells.items():
        row = by_id[nodeid]
        failed = cell.reason.body_failed if cell.reason is not None else None
        affected = row.declares_affected(version) if row.judged_by_range else None
        contradicts = failed is not None and affected is not None and failed != affected
        judged[(nodeid, version)] = dataclasses.replace(cell, contradicts=contradicts)
    return judged


def since(matrix: Matrix, old: Matrix, paths: Sequence[Path] = ()) -> Matrix:
    """``matrix`` with each cell that differs from ``old`` marked (its ``before``), and the cells ``old`` had that
    ``matrix`` has not listed (``gone``)."""
    old_rows = {r.nodeid: r for r in old.rows}
    old_columns = {c.version: c for c in old.columns}

    def before(nodeid: str, version: str) -> str:
        column, row = old_columns.get(version), old_rows.get(nodeid)
        if column is None or row is None:
            return NOT_RUN
        return old.text(row, column)

    cells = dict(matrix.cells)
    columns = {c.version: c for c in matrix.columns}
    for (nodeid, version), cell in matrix.cells.items():
        was = before(nodeid, version)
        if was != cell.verdict.value and not columns[version].unavailable:
            cells[(nodeid, version)] = dataclasses.replace(cell, before=was)
    new_rows = {r.nodeid for r in matrix.rows}
    gone = tuple(
        (r.label, c.version, cell.verdict.value)
        for (nodeid, version), cell in old.cells.items()
        if (r := old_rows[nodeid]) and (c := old_columns[version])
        and (nodeid not in new_rows or (nodeid, version) not in matrix.cells)
    )  # fmt: skip
    return dataclasses.replace(matrix, cells=cells, since=tuple(paths), gone=gone)


def exit_code(matrix: Matrix, *, fail_on_unavailable: bool = False) -> int:
    """1 when any cell is UNEXPECTED (or, if asked, any release could not run), else 0."""
    if matrix.unexpected():
        return 1
    if fail_on_unavailable and any(c.unavailable for c in matrix.columns):
        return 1
    return 0


# --------------------------------------------------------------------------------------------------- rendering


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _summary(matrix: Matrix) -> str:
    counts = [f"{matrix.count(v)} {v.value}" for v in Verdict if matrix.count(v)]
    unavailable = sum(1 for c in matrix.columns if c.unavailable)
    if unavailable:
        counts.append(f"{unavailable} release{'s' * (unavailable != 1)} unavailable")
    contradictions = len(matrix.contradictions())
    if contradictions:
        counts.append(f"{contradictions} against the declared range")
    if matrix.since is not None:
        counts.append(f"{len(matrix.changes())} changed")
    return ", ".join(counts) or "no verdicts"


_ANSI = {
    Verdict.REPRODUCED.value: "\033[33m",
    Verdict.FIXED.value: "\033[32m",
    Verdict.NOT_YET_AFFECTED.value: "\033[2;32m",
    Verdict.PASSES_WITH_FIX.value: "\033[36m",
    Verdict.UNEXPECTED.value: "\033[1;31m",
    Verdict.NOT_APPLICABLE.value: "\033[2m",
    Verdict.SKIPPED.value: "\033[2m",
    UNAVAILABLE: "\033[2m",
    NOT_RUN: "\033[2m",
}


def _column_heads(matrix: Matrix) -> tuple[str | None, list[list[str]]]:
    """The environment all columns share (None when they differ), and each column's heading lines."""
    # The same torch/backend/world size everywhere (the usual case): said once above the table, columns stay narrow.
    envs = {c.environment_line for c in matrix.columns if not c.unavailable}
    common: str | None = None
    if matrix.columns and len(envs) <= 1 and len({c.torch for c in matrix.columns}) == 1:
        common = envs.pop() if envs else f"torch {matrix.columns[0].torch or '?'}"
    head: list[list[str]] = []
    for c in matrix.columns:
        setup = f"{c.backend or '?'}, {c.world_size or '?'} ranks"
        lines = [c.version] if common else [c.version, f"torch {c.torch or '?'}", setup]
        if c.unavailable:
            lines[1 if common else 2 :] = ["UNAVAILABLE"]
        head.append(lines)
    return common, head


def _declared_lines(row: Row) -> list[str]:
    if row.variant not in (None, "stock"):
        return ["(with fix)"]
    return list(row.declared) or ["-"]


@dataclass(frozen=True)
class _Layout:
    short: bool
    label_width: int
    declared_width: int
    blocks: tuple[tuple[int, ...], ...]  # column indexes of each table


def _layout(matrix: Matrix, head: Sequence[Sequence[str]], width: int) -> _Layout:
    """The first that fits: full names and labels, wrapped labels, short names, then short names in several tables."""
    longest = max([len("repro"), *(len(r.label) for r in matrix.rows)])
    declared = max([len("declared"), *(len(d) for r in matrix.rows for d in _declared_lines(r))])
    widths: list[int] = []
    for short, label in ((False, longest), (False, min(longest, LABEL_WIDTH)), (True, longest),
                         (True, min(longest, LABEL_WIDTH))):  # fmt: skip
        widths = [_column_width(matrix, i, h, short) for i, h in enumerate(head)]
        if label + 2 + declared + sum(w + 2 for w in widths) <= width:
            return _Layout(short, label, declared, (tuple(range(len(widths))),))
    label = min(longest, LABEL_WIDTH)
    blocks: list[list[int]] = [[]]
    used = label + 2 + declared
    for i, w in enumerate(widths):  # the short names, split into tables that fit
        if blocks[-1] and used + w + 2 > width:
            blocks.append([])
            used = label + 2 + declared
        blocks[-1].append(i)
        used += w + 2
    return _Layout(True, label, declared, tuple(tuple(b) for b in blocks))


def _shown(matrix: Matrix, row: Row, column: Column, short: bool) -> str:
    text = matrix.text(row, column)
    cell = matrix.cell(row, column)
    return (SHORT[text] if short else text) + (cell.marks if cell and not column.unavailable else "")


def _column_width(matrix: Matrix, index: int, head: Sequence[str], short: bool) -> int:
    column = matrix.columns[index]
    return max([*(len(h) for h in head), *(len(_shown(matrix, r, column, short)) for r in matrix.rows)])


def _table(
    matrix: Matrix, head: Sequence[Sequence[str]], layout: _Layout, block: Sequence[int], color: bool
) -> list[str]:
    columns = [matrix.columns[i] for i in block]
    heads = [head[i] for i in block]
    widths = [_column_width(matrix, i, head[i], layout.short) for i in block]
    lw, dw = layout.label_width, layout.declared_width
    depth = max((len(h) for h in heads), default=1)

    def paint(row: Row, column: Column, w: int) -> str:
        shown = _shown(matrix, row, column, layout.short)
        padded = f"{shown:<{w}}"
        key = matrix.text(row, column)
        return f"{_ANSI[key]}{padded}\033[0m" if color and key in _ANSI else padded

    lines = []
    for i in range(depth):
        cells = [f"{(h[i] if i < len(h) else ''):<{w}}" for h, w in zip(heads, widths, strict=True)]
        first = ("repro", "declared") if i == 0 else ("", "")
        lines.append("  ".join([f"{first[0]:<{lw}}", f"{first[1]:<{dw}}", *cells]).rstrip())
    lines.append("  ".join(["-" * lw, "-" * dw, *("-" * w for w in widths)]))
    for r in matrix.rows:
        labels = textwrap.wrap(r.label, lw, break_on_hyphens=False) or [""]
        declared = _declared_lines(r)
        for i in range(max(len(labels), len(declared))):
            label = labels[i] if i < len(labels) else ""
            ranges = declared[i] if i < len(declared) else ""
            cells = [paint(r, c, w) if i == 0 else " " * w for c, w in zip(columns, widths, strict=True)]
            lines.append("  ".join([f"{label:<{lw}}", f"{ranges:<{dw}}", *cells]).rstrip())
    return lines


def _wrapped(prefix: str, text: str, width: int) -> list[str]:
    """``prefix`` then ``text``, wrapped within ``width`` (under the prefix; on lines of its own when the prefix leaves
    it less than 30 columns). Only a word longer than the width (a node id, a path) can pass it."""
    text = _one_line(text)
    if len(prefix) > width - 30:
        rest = textwrap.wrap(text, width, initial_indent=" " * 6, subsequent_indent=" " * 6,
                             break_on_hyphens=False, break_long_words=False)  # fmt: skip
        return [prefix.rstrip(), *rest]
    return textwrap.wrap(text, width, initial_indent=prefix, subsequent_indent=" " * (len(prefix) + 2),
                         break_on_hyphens=False, break_long_words=False) or [prefix]  # fmt: skip


def _legend(matrix: Matrix, layout: _Layout, width: int) -> list[str]:
    legend = []
    if layout.short:
        legend.append(", ".join(f"{short} {full}" for full, short in SHORT.items() if short != full))
    if matrix.with_prerequisites():
        legend.append(f"{PREREQUISITE} with another bug's fix applied first")
    if matrix.contradictions():
        legend.append(f"{CONTRADICTS} against the declared range")
    if matrix.since is not None:
        legend.append(f"{CHANGED} changed since {', '.join(str(p) for p in matrix.since) or 'the older results'}")
    return ["", *_wrapped("Legend: ", "; ".join(legend), width)] if legend else []


def _against(matrix: Matrix, width: int) -> list[str]:
    found = matrix.contradictions()
    lines = ["", f"Against the declared range ({CONTRADICTS}):"] if found else []
    for r, c, cell in found:
        side = "inside" if r.declares_affected(c.version) else "outside"
        what = "passed" if cell.reason is not None and cell.reason.body_failed is False else "failed"
        reason = cell.reason.value if cell.reason else ""
        why = f"the body {what} {side} the declared range ({' or '.join(r.declared)}): {cell.verdict.value}, {reason}"
        lines += _wrapped(f"  {c.version}  {r.label}: ", why, width)
    return lines


def _changes(matrix: Matrix, width: int) -> list[str]:
    if matrix.since is None:
        return []
    changes = matrix.changes()
    lines = ["", f"Changed since the older results: {len(changes)} cell{'s' * (len(changes) != 1)}"]
    for r, c, before, now in changes:
        lines += _wrapped(f"  {c.version}  {r.label}: ", f"{before} -> {now}", width)
    for label, version, was in matrix.gone:
        lines += _wrapped(f"  {version}  {label}: ", f"{was} -> no longer in the results", width)
    return lines


def _terminal_notes(matrix: Matrix, layout: _Layout, width: int) -> list[str]:
    """Below the tables: the legend, the cells against the declared range, the unexpected cells with their errors,
    why each cell without a verdict has none, the unavailable releases, the changes since --since, the merges."""
    lines = _legend(matrix, layout, width) + _against(matrix, width)
    unexpected = matrix.unexpected()
    lines += ["", "UNEXPECTED:"] if unexpected else []
    for r, c, cell in unexpected:  # the node id: what to run again
        lines += _wrapped(f"  {c.version}  {r.nodeid}: ", cell.error or cell.outcome or "?", width)
    not_verdicts = matrix.not_verdicts()
    lines += ["", "Cells with no judged run:"] if not_verdicts else []
    for why, r, versions in not_verdicts:
        lines += _wrapped(f"  {r.label}: ", f"{why} (on {', '.join(versions)})", width)
    prerequisites = matrix.with_prerequisites()
    lines += ["", f"With a prerequisite fix ({PREREQUISITE}):"] if prerequisites else []
    for fix, r, versions in prerequisites:
        lines += _wrapped(f"  {r.label}: ", f"{fix} (on {', '.join(versions)})", width)
    unavailable = [c for c in matrix.columns if c.unavailable_line]
    lines += ["", "Unavailable releases:"] if unavailable else []
    for c in unavailable:
        lines += _wrapped(f"  {c.version}: ", c.unavailable_line or "", width)
    lines += _changes(matrix, width)
    merged = "; ".join(f"{c.version} from {len(c.sources)} results files" for c in matrix.columns if len(c.sources) > 1)
    if merged:
        lines += ["", *_wrapped("Merged: ", f"{merged} (per test, the newest file that ran it)", width)]
    lines += ["", "Files that disagree (the newest gives the cell):"] if matrix.disagreements else []
    for version, label, told in _disagreements(matrix):
        lines += _wrapped(f"  {version}  {label}: ", told, width)
    return lines


def _disagreements(matrix: Matrix) -> list[tuple[str, str, str]]:
    """``(version, row label, what each file said)`` for each test that files of one release disagree about."""
    labels = {r.nodeid: r.label for r in matrix.rows}
    return [
        (d.version, labels.get(d.nodeid, d.nodeid), "; ".join(f"{verdict} ({path.name})" for verdict, path in d.seen))
        for d in matrix.disagreements
    ]


def render_terminal(matrix: Matrix, *, color: bool = False, width: int = WIDTH) -> str:
    """Fixed-width tables within ``width``; below them what the marks, short names and verdict-less cells mean, the
    unexpected cells with their errors and the unavailable releases. Only an upstream-free text line that cannot be
    broken (a long path or error word) can pass the width."""
    common, head = _column_heads(matrix)
    layout = _layout(matrix, head, width)
    lines = [f"DeepSpeed repro matrix: {len(matrix.rows)} rows x {len(matrix.columns)} releases ({_summary(matrix)})"]
    lines = _wrapped("", lines[0], width)
    if common:
        lines.append(f"all releases: {common}")
    for block in layout.blocks:
        lines.append("")
        lines += _table(matrix, head, layout, block, color)
    lines += _terminal_notes(matrix, layout, width)
    return "\n".join(lines) + "\n"


def _md(text: str) -> str:
    return _one_line(text).replace("|", "\\|")


class _Notes:
    """Footnote numbers, one per distinct text."""

    def __init__(self) -> None:
        self.texts: dict[str, int] = {}

    def ref(self, text: str) -> str:
        number = self.texts.setdefault(_one_line(text), len(self.texts) + 1)
        return f"[^{number}]"


def _md_cell(matrix: Matrix, row: Row, column: Column, notes: _Notes) -> str:
    if column.unavailable:
        return UNAVAILABLE
    cell = matrix.cell(row, column)
    if cell is None:
        return f"_{NOT_RUN}_" + notes.ref(f"not run: no results file of {column.version} ran this test")
    text = f"**{cell.verdict.value}**" if cell.verdict is Verdict.UNEXPECTED else cell.verdict.value
    refs = []
    if cell.note:
        refs.append(notes.ref(cell.note))
    elif cell.verdict is Verdict.SKIPPED:
        refs.append(notes.ref("skipped: no reason recorded"))
    if cell.contradicts:
        refs.append(
            notes.ref(
                f"against the declared range ({' or '.join(row.declared)}): {cell.reason.value if cell.reason else ''}"
            )
        )
    refs += [notes.ref(f"with the prerequisite fix for {p}") for p in cell.prerequisites]
    if cell.before is not None:
        text += f" (was {cell.before})"
    marks = (PREREQUISITE if cell.prerequisites else "") + (CONTRADICTS if cell.contradicts else "")
    return f"{text} {''.join(refs)}".rstrip() + (f" {marks}" if marks else "")


def render_markdown(matrix: Matrix) -> str:
    """A GitHub-flavoured Markdown table; error lines, skip reasons, not-run cells, unavailability reasons and
    contradictions of the declared range as footnotes."""
    notes = _Notes()
    out = [
        "# DeepSpeed repro matrix",
        "",
        f"{len(matrix.rows)} rows x {len(matrix.columns)} DeepSpeed releases: {_summary(matrix)}.",
        "",
    ]
    header = ["repro", "declared affected", *(c.version for c in matrix.columns)]
    out.append("| " + " | ".join(header) + " |")
    out.append("|" + "---|" * len(header))
    env_cells = [
        f"_{_md(c.environment_line)}_"
        + (f" **unavailable**{notes.ref(c.unavailable_line)}" if c.unavailable_line else "")
        for c in matrix.columns
    ]
    out.append("| _environment_ | - | " + " | ".join(env_cells) + " |")
    for r in matrix.rows:
        label = f"[{_md(r.label)}]({r.upstream})" if r.upstream else _md(r.label)
        declared = " or ".join(f"`{d}`" for d in r.declared) if r.variant in (None, "stock") else "_with fix_"
        cells = [_md_cell(matrix, r, c, notes) for c in matrix.columns]
        out.append(f"| {label} | {declared or '-'} | " + " | ".join(cells) + " |")
    if matrix.contradictions() or matrix.since is not None:
        out += [""]
        if matrix.contradictions():
            out.append(f"{CONTRADICTS}: the outcome contradicts the declared range.")
        if matrix.since is not None:
            out.append(f"(was ...): changed since {', '.join(f'`{p}`' for p in matrix.since)}.")
    titled = [r for r in matrix.rows if r.title]
    seen: set[str] = set()
    if titled:
        out += ["", "## Repros", ""]
        for r in titled:
            if r.repro not in seen:
                seen.add(r.repro)
                out.append(f"- **{_md(r.repro)}**: {_md(r.title or '')}" + (f" ({r.upstream})" if r.upstream else ""))
    if matrix.disagreements:
        out += ["", "## Files that disagree", "", "The newest file gives the cell; every verdict, newest first:", ""]
        out += [f"- {version} {_md(label)}: {_md(told)}" for version, label, told in _disagreements(matrix)]
    if notes.texts:
        out.append("")
        out += [f"[^{n}]: {text}" for text, n in notes.texts.items()]
    out += ["", "Sources: " + ", ".join(f"`{p.name}`" for c in matrix.columns for p in c.sources or (c.source,)), ""]
    return "\n".join(out)


_CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: center; vertical-align: middle; }
th.row, td.row { text-align: left; }
th small { display: block; font-weight: normal; color: #555; }
td.REPRODUCED { background: #fde2a7; }
td.FIXED { background: #bfe8c0; }
td.NOT-YET-AFFECTED { background: #e6f4e6; }
td.PASSES-WITH-FIX { background: #b9e3ee; }
td.UNEXPECTED { background: #f4a3a3; font-weight: bold; }
td.SKIPPED, td.NOT-APPLICABLE, td.not-run { background: #eee; color: #777; }
td.unavailable { background: repeating-linear-gradient(45deg, #eee, #eee 6px, #ddd 6px, #ddd 12px);
  color: #555; font-size: 12px; max-width: 14em; }
td[title] { cursor: help; text-decoration: underline dotted; }
td.prerequisite { border-bottom: 3px double #36c; }
td.contradicts { outline: 3px solid #c00; outline-offset: -3px; }
td.changed { box-shadow: inset 0 0 0 3px #36c; }
"""

_LEGEND = {
    Verdict.REPRODUCED: "the bug shows on this release as declared",
    Verdict.FIXED: "stock code passes on a release after the affected range",
    Verdict.NOT_YET_AFFECTED: "stock code passes on a release older than the affected range",
    Verdict.PASSES_WITH_FIX: "the repro's fix makes it pass",
    Verdict.UNEXPECTED: "anything else: look at it",
    Verdict.NOT_APPLICABLE: "the repro declares this release out of its reach (reason on hover)",
    Verdict.SKIPPED: "skipped (reason on hover)",
}
_MARKS = {
    "prerequisite": f"{PREREQUISITE} another bug's fix was applied first (which, on hover)",
    "contradicts": f"{CONTRADICTS} the outcome contradicts the declared range",
    "changed": f"{CHANGED} changed since the older results (--since)",
}


def _html_cell(matrix: Matrix, row: Row, column: Column) -> str:
    e = html.escape
    cell = matrix.cell(row, column)
    if cell is None:
        return f'<td class="not-run" title="no results file of {e(column.version)} ran this test">{NOT_RUN}</td>'
    tips = [_one_line(cell.note)] if cell.note else []
    classes = [cell.verdict.value]
    if cell.prerequisites:
        classes.append("prerequisite")
        tips += [f"with the prerequisite fix for {p}" for p in cell.prerequisites]
    if cell.contradicts:
        classes.append("contradicts")
        tips.append(f"against the declared range ({' or '.join(row.declared)})")
    if cell.before is not None:
        classes.append("changed")
        tips.append(f"was {cell.before}")
    tip = f' title="{e("; ".join(tips))}"' if tips else ""
    return f'<td class="{e(" ".join(classes))}"{tip}>{e(cell.verdict.value)}{e(cell.marks)}</td>'


def render_html(matrix: Matrix) -> str:
    """A self-contained page (inline CSS, no scripts); errors on hover (``title``) and listed below the table."""
    e = html.escape
    head = "".join(
        f"<th>{e(c.version)}<small>{e(c.environment_line)}</small></th>" for c in matrix.columns
    )  # fmt: skip
    body = []
    for i, r in enumerate(matrix.rows):
        label = f'<a href="{e(r.upstream)}">{e(r.label)}</a>' if r.upstream else e(r.label)
        title = f' title="{e(r.title)}"' if r.title else ""
        declared = "<br>".join(f"<code>{e(d)}</code>" for d in r.declared) if r.variant in (None, "stock") else (
            "<i>with fix</i>")  # fmt: skip
        tds = [f'<td class="row"{title}>{label}</td>', f'<td class="row">{declared or "-"}</td>']
        for c in matrix.columns:
            if c.unavailable:
                if i == 0:
                    tds.append(
                        f'<td class="unavailable" rowspan="{len(matrix.rows)}">{e(c.unavailable_line or "")}</td>'
                    )
                continue
            tds.append(_html_cell(matrix, r, c))
        body.append("<tr>" + "".join(tds) + "</tr>")
    if not matrix.rows:
        body.append(
            '<tr><td class="row">(no tests)</td><td class="row"></td>'
            + "".join(
                f'<td class="unavailable">{e(c.unavailable_line or "")}</td>' if c.unavailable else "<td></td>"
                for c in matrix.columns
            )
            + "</tr>"
        )
    details = [
        f"<li><b>{e(c.version)}</b> <code>{e(r.nodeid)}</code>: {e(_one_line(cell.note or cell.outcome or ''))}</li>"
        for r, c, cell in matrix.unexpected()
    ]
    unavailable_items = [
        f"<li><b>{e(c.version)}</b>: {e(c.unavailable_line or '')}</li>" for c in matrix.columns if c.unavailable
    ]
    against = [
        f"<li><b>{e(c.version)}</b> <code>{e(r.nodeid)}</code>: {e(cell.verdict.value)} "
        f"({e(cell.reason.value if cell.reason else '')}) against the declared range {e(' or '.join(r.declared))}</li>"
        for r, c, cell in matrix.contradictions()
    ]
    changes = [
        f"<li><b>{e(c.version)}</b> <code>{e(r.nodeid)}</code>: {e(before)} &rarr; {e(now)}</li>"
        for r, c, before, now in matrix.changes()
    ]
    sections = []
    if details:
        sections.append(f"<h2>UNEXPECTED</h2><ul>{''.join(details)}</ul>")
    if against:
        sections.append(f"<h2>Against the declared range</h2><ul>{''.join(against)}</ul>")
    if matrix.since is not None:
        sections.append(f"<h2>Changed since the older results</h2><ul>{''.join(changes) or '<li>nothing</li>'}</ul>")
    if unavailable_items:
        sections.append(f"<h2>Unavailable releases</h2><ul>{''.join(unavailable_items)}</ul>")
    sources = "".join(f"<li><code>{e(str(p))}</code></li>" for c in matrix.columns for p in c.sources or (c.source,))
    legend_cells = "".join(
        f'<td class="{v.value}">{v.value}</td><td class="row">{e(t)}</td>' for v, t in _LEGEND.items()
    ) + "".join(f'<td class="{k}"></td><td class="row">{e(t)}</td>' for k, t in _MARKS.items())
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>DeepSpeed repro matrix</title>
<style>{_CSS}</style></head>
<body>
<h1>DeepSpeed repro matrix</h1>
<p>{len(matrix.rows)} rows x {len(matrix.columns)} DeepSpeed releases: {e(_summary(matrix))}.</p>
<table>
<thead><tr><th class="row">repro</th><th class="row">declared affected</th>{head}</tr></thead>
<tbody>
{chr(10).join(body)}
</tbody></table>
{"".join(sections)}
<h2>Legend</h2><table><tr>{legend_cells}</tr></table>
<h2>Sources</h2><ul>{sources}</ul>
</body></html>
"""


# ----------------------------------------------------------------------------------------------------- command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Merge pytest-dsrepro results files (--ds-results, dsrepro install --results) into one repro x DeepSpeed "
        "release table: printed, and written as Markdown and HTML. Exit 1 on any UNEXPECTED cell, 2 on usage errors."
    )
    parser.add_argument("paths", nargs="*", type=Path, default=[Path("results")], help="results files or directories")
    parser.add_argument("--markdown", type=Path, default=None, help="Markdown output (default: DIR/matrix.md)")
    parser.add_argument("--html", type=Path, default=None, help="HTML output (default: DIR/matrix.html)")
    parser.add_argument("--no-write", action="store_true", help="print only; write no Markdown or HTML")
    parser.add_argument("--color", choices=("auto", "always", "never"), default="auto", help="terminal colours")
    parser.add_argument(
        "--fail-on-unavailable", action="store_true", help="exit 1 also when a release could not run at all"
    )
    parser.add_argument(
        "--since", type=Path, action="append", default=None, metavar="OLD",
        help="older results files or directories (repeatable): mark the cells that changed since them",
    )  # fmt: skip


def _use_color(choice: str) -> bool:
    if choice != "auto":
        return choice == "always"
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR")


def run(args: argparse.Namespace) -> int:
    paths: list[Path] = list(args.paths) or [Path("results")]
    try:
        files, warnings = load(paths)
    except MatrixError as exc:
        print(f"dsrepro matrix: {exc}", file=sys.stderr)
        return 2
    for warning in warnings:
        print(f"dsrepro matrix: warning: {warning}", file=sys.stderr)
    matrix = merge(files, warnings)
    if args.since:
        try:
            old, old_warnings = load(args.since)
        except MatrixError as exc:
            print(f"dsrepro matrix: --since: {exc}", file=sys.stderr)
            return 2
        for warning in old_warnings:
            print(f"dsrepro matrix: warning: --since: {warning}", file=sys.stderr)
        matrix = since(matrix, merge(old), args.since)
    width = min(WIDTH, shutil.get_terminal_size((WIDTH, 24)).columns)
    sys.stdout.write(render_terminal(matrix, color=_use_color(args.color), width=width))
    if not args.no_write:
        base = paths[0] if paths[0].is_dir() else paths[0].parent
        for path, text in ((args.markdown or base / "matrix.md", render_markdown(matrix)),
                           (args.html or base / "matrix.html", render_html(matrix))):  # fmt: skip
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
    return exit_code(matrix, fail_on_unavailable=args.fail_on_unavailable)
