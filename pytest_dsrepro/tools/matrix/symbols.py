"""What every form draws for a run: one table of symbols, colours and legend words per kind of result.

A cell is two symbols, the stock run then the run with the repro's fix, and the marks of both runs; a release that
holds no run draws one symbol in both places. Adding a verdict to the gates means adding its :class:`Kind` here (a
test checks that every ``Verdict`` has one). What the forms say in words is ``notes``.
"""

from __future__ import annotations

from dataclasses import dataclass

from packaging.version import Version

from ...core.gates import Verdict
from .model import (
    CHANGED,
    CONTRADICTS,
    NOT_RUN,
    PREREQUISITE,
    UNAVAILABLE,
    UNREADABLE,
    Column,
    Matrix,
    Row,
    Run,
)


@dataclass(frozen=True)
class Kind:
    name: str  # the verdict's name, or what a cell without a verdict is; also the HTML class
    glyph: str
    ascii: str  # for a terminal that cannot print the glyph
    words: str  # the legend's
    ansi: str  # the terminal's colour
    fill: str  # the heat map's colour (HTML, SVG)
    ink: str  # the symbol's colour on that fill


SOME_RUNS = "REPRODUCED in some runs"
KINDS: dict[str, Kind] = {
    k.name: k
    for k in (
        Kind(Verdict.REPRODUCED.value, "●", "R", "reproduced as declared", "\033[33m", "#f0a23b", "#222"),
        Kind(
            Verdict.FIXED.value,
            "○",
            "F",
            "fixed: the stock code passes, newer than the bug",
            "\033[32m",
            "#6cc070",
            "#123",
        ),
        Kind(
            SOME_RUNS,
            "◐",
            "r",
            "reproduced in some runs of a series (the rate on hover)",
            "\033[33m",
            "#f6c47f",
            "#222",
        ),
        Kind(
            Verdict.NOT_YET_AFFECTED.value,
            "◦",
            "o",
            "not yet affected: passes, older than the bug",
            "\033[2;32m",
            "#d8eed8",
            "#476",
        ),
        Kind(Verdict.PASSES_WITH_FIX.value, "✓", "W", "passes with the repro's fix", "\033[36m", "#8ccbe0", "#123"),
        Kind(Verdict.UNEXPECTED.value, "✗", "U", "UNEXPECTED: look at it", "\033[1;31m", "#d7263d", "#fff"),
        Kind(
            Verdict.NOT_APPLICABLE.value,
            "\u2013",
            "N",
            "not applicable here (the repro says why)",
            "\033[2m",
            "#e4e4e4",
            "#666",
        ),
        Kind(Verdict.SKIPPED.value, "s", "s", "skipped", "\033[2m", "#e4e4e4", "#666"),
        Kind("PASSED", "□", "p", "passed (a test that declares no range)", "\033[32m", "#b7e4c7", "#123"),
        Kind("FAILED", "■", "f", "failed (a test that declares no range)", "\033[31m", "#8d0801", "#fff"),
        Kind(
            "ERROR",
            "▲",
            "e",
            "error in setup or teardown (a test that declares no range)",
            "\033[35m",
            "#6a4c93",
            "#fff",
        ),
        Kind("XFAILED", "x", "x", "xfailed (a test that declares no range)", "\033[2;33m", "#f6e58d", "#444"),
        Kind("XPASSED", "X", "X", "xpassed (a test that declares no range)", "\033[33m", "#ffb4a2", "#222"),
        Kind(NOT_RUN, "·", ".", "not run on this release", "\033[2m", "#ffffff", "#999"),
        Kind(UNAVAILABLE, "/", "/", "the release cannot run here", "\033[2m", "#cfcfcf", "#777"),
        Kind(UNREADABLE, "?", "?", "its results file could not be read", "\033[1;35m", "#c9a0dc", "#222"),
    )
}
MARKS = {
    PREREQUISITE: "another bug's fix applied first",
    CONTRADICTS: "against the declared range",
    CHANGED: "changed since the older results",
}
#: The shape of a cell, said once above or below every table.
SHAPE = "each cell: the stock run, then the run with the fix"
RANGE = "[ ] the declared affected range"


def kind(run: Run | None) -> Kind:
    if run is None:
        return KINDS[NOT_RUN]
    partly = run.verdict is Verdict.REPRODUCED and run.rate is not None and run.rate.failed < run.rate.runs
    return KINDS[SOME_RUNS if partly else run.word]


def blank_kind(column: Column) -> Kind:
    """What a column without runs draws in every cell."""
    return KINDS[UNAVAILABLE if column.unavailable is not None else UNREADABLE]


def pair(matrix: Matrix, row: Row, column: Column) -> tuple[Kind | None, Kind | None]:
    """What a cell draws: the stock run's kind and the fixed run's (None where the row has no such test); a column
    without runs draws its own kind in both places."""
    if column.blank:
        return blank_kind(column), blank_kind(column)
    cell = matrix.cell(row, column)
    stock = kind(cell.stock if cell else None) if row.stock else None
    fixed = kind(cell.fixed if cell else None) if row.fixed else None
    return stock, fixed


def affected(matrix: Matrix, row: Row) -> list[bool]:
    """For each column: does the row declare the release affected (what the brackets enclose)?"""
    return [row.declares_affected(c.version) is True for c in matrix.columns]


def head(version: str) -> tuple[str, str]:
    """``("0.18", ".3")``: the minor release that heads a group of columns, and what heads the column itself."""
    try:
        v = Version(version)
    except ValueError:  # InvalidVersion, or a part of 4300 digits or more (int())
        return version, ""
    prefix = ".".join(str(n) for n in (*v.release, 0)[:2])
    return (prefix, version[len(prefix) :]) if version.startswith(prefix) else (version, "")


def used(matrix: Matrix) -> list[Kind]:
    """The kinds the matrix draws, in legend order; and the marks it uses."""
    names = {kind(run).name for _, _, run in matrix.placed()}
    names |= {blank_kind(c).name for c in matrix.columns if c.blank}
    if any(_missing(matrix, r, c) for r in matrix.rows for c in matrix.columns if not c.blank):
        names.add(NOT_RUN)
    return [k for k in KINDS.values() if k.name in names]


def _missing(matrix: Matrix, row: Row, column: Column) -> bool:
    return any(matrix.run_of(row, column, n) is None for n in row.nodeids)


def marks_used(matrix: Matrix) -> list[str]:
    found = "".join(run.marks for _, _, run in matrix.placed())
    return [m for m in MARKS if m in found]


def legend(matrix: Matrix, ascii_only: bool = False) -> list[tuple[str, str]]:
    """``(symbol, meaning)`` for each kind and mark the matrix draws."""
    shown = [(k.ascii if ascii_only else k.glyph, k.words) for k in used(matrix)]
    return shown + [(m, MARKS[m]) for m in marks_used(matrix)]
