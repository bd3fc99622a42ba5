"""The matrix in a terminal: within 120 columns (or the terminal's width), two symbols a cell, names never cut.

Each bug is a line of its own (its id and declared range), its configs the rows below it; releases are headed by
their minor release above their patch (``0.18`` over ``.3 .4 .5``), and brackets enclose the releases the row
declares affected. Columns that do not fit go to a further table; a row label too long for its column gets a line
of its own. Below the tables, the legend and the notes every form shares.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass

from ...core.escape import terminal
from . import notes, symbols
from .model import Column, Matrix, Row, one_line

#: The width the table keeps within (or the terminal's, when narrower).
WIDTH = 120
#: The widest the label column gets, and the narrowest before the releases are split into several tables; a
#: longer label takes a line of its own.
LABEL_WIDTH, MIN_LABEL = 40, 24
RESET, BOLD = "\033[0m", "\033[1m"


@dataclass(frozen=True)
class _Layout:
    label: int  # the label column's width
    widths: tuple[int, ...]  # each release column's width (its cell: two symbols and the marks)
    blocks: tuple[tuple[int, ...], ...]  # the column indexes of each table


def _widths(matrix: Matrix) -> list[int]:
    """Each column's width: two symbols and the most marks any of its cells has (or its heading, if wider); the last
    column of a minor release widened where the minor release's heading would not fit above its columns."""
    widths = []
    for c in matrix.columns:
        marks = max((len(cell.marks) for r in matrix.rows if not c.blank and (cell := matrix.cell(r, c))), default=0)
        widths.append(max(2 + marks, len(symbols.head(c.version)[1])))
    for group in _groups(matrix.columns):
        heading = symbols.head(matrix.columns[group[0]].version)[0]
        short = len(heading) - sum(1 + widths[i] for i in group)  # the group also has its space before it, and
        if short > 0:  # the heading needs one after it
            widths[group[-1]] += short
    return widths


def _starts_group(columns: Sequence[Column], block: Sequence[int], at: int) -> bool:
    return at == 0 or symbols.head(columns[block[at]].version)[0] != symbols.head(columns[block[at - 1]].version)[0]


def _span(columns: Sequence[Column], widths: Sequence[int], block: Sequence[int]) -> int:
    """The width of one table's cells: each column, the character before it (space or bracket), a space before
    each minor release, and the closing bracket."""
    return sum(widths[i] + 1 + _starts_group(columns, block, k) for k, i in enumerate(block)) + 1


def _groups(columns: Sequence[Column]) -> list[list[int]]:
    """Column indexes by minor release, in order."""
    groups: list[list[int]] = []
    for i, c in enumerate(columns):
        if not groups or symbols.head(c.version)[0] != symbols.head(columns[groups[-1][-1]].version)[0]:
            groups.append([])
        groups[-1].append(i)
    return groups


def _blocks(matrix: Matrix, widths: Sequence[int], label: int, width: int) -> tuple[tuple[int, ...], ...]:
    """The columns in tables that fit beside a label column ``label`` wide: whole minor releases where they fit."""
    blocks: list[list[int]] = [[]]
    for group in _groups(matrix.columns):
        for unit in [group] if label + _span(matrix.columns, widths, group) <= width else [[i] for i in group]:
            if blocks[-1] and label + _span(matrix.columns, widths, [*blocks[-1], *unit]) > width:
                blocks.append([])
            blocks[-1] += unit
    return tuple(tuple(b) for b in blocks)


def _layout(matrix: Matrix, width: int) -> _Layout:
    """One table when it fits, its label column up to ``LABEL_WIDTH`` wide and at least ``MIN_LABEL`` (longer
    labels on lines of their own); else the fewest tables that fit, the wider label column where that costs none."""
    widths = tuple(_widths(matrix))
    longest = max([len("bug / config"), *(2 + len(terminal(r.label)) for r in matrix.rows)])
    label = min(longest, LABEL_WIDTH, width - _span(matrix.columns, widths, range(len(widths))))
    if label >= min(longest, MIN_LABEL):
        return _Layout(label, widths, (tuple(range(len(widths))),))
    choices = [(min(longest, w), _blocks(matrix, widths, min(longest, w), width)) for w in (LABEL_WIDTH, MIN_LABEL)]
    label, blocks = min(choices, key=lambda choice: (len(choice[1]), -choice[0]))
    return _Layout(label, widths, blocks)


def _cell(matrix: Matrix, row: Row, column: Column, color: bool, ascii_only: bool) -> tuple[str, int]:
    """What a cell shows (its two symbols and its marks), and how many characters of it are visible."""

    def paint(kind: symbols.Kind | None) -> str:
        if kind is None:
            return " "
        glyph = kind.ascii if ascii_only else kind.glyph
        return f"{kind.ansi}{glyph}{RESET}" if color else glyph

    cell = None if column.blank else matrix.cell(row, column)
    marks = cell.marks if cell else ""
    return "".join(map(paint, symbols.pair(matrix, row, column))) + marks, 2 + len(marks)


def _row_cells(matrix: Matrix, row: Row, layout: _Layout, block: Sequence[int], color: bool, ascii_only: bool) -> str:
    """A row's cells; a bracket opens before the first release the row declares affected and closes after the last,
    right after the symbols where the column has room (else in the space before the next column)."""
    every = symbols.affected(matrix, row)
    affected = [every[i] for i in block]
    out: list[str] = []
    room = 0  # the spaces at the end of the previous cell
    for k, i in enumerate(block):
        before = affected[k - 1] if k else False
        closes, opens = before and not affected[k], affected[k] and not before
        if closes and room:
            out[-1] = out[-1][:-room] + "]" + " " * (room - 1)
            closes = False
        edge = "[" if opens else "]" if closes else " "
        out.append((f"{edge} " if closes else f" {edge}") if _starts_group(matrix.columns, block, k) else edge)
        shown, visible = _cell(matrix, row, matrix.columns[i], color, ascii_only)
        room = layout.widths[i] - visible
        out.append(shown + " " * room)
    if affected and affected[-1]:
        out.append("]")
    return "".join(out)


def _header(matrix: Matrix, layout: _Layout, block: Sequence[int]) -> list[str]:
    """Two lines: each minor release over its columns, then each column's own part (``.3``)."""
    size = layout.label + _span(matrix.columns, layout.widths, block) + LABEL_WIDTH
    minor, patch = [" "] * size, [" "] * size
    patch[: len("bug / config")] = "bug / config"
    at = layout.label
    for k, i in enumerate(block):
        prefix, suffix = symbols.head(matrix.columns[i].version)
        if _starts_group(matrix.columns, block, k):
            minor[at : at + len(prefix)] = prefix
            at += 1
        patch[at + 1 : at + 1 + len(suffix)] = suffix
        at += 1 + layout.widths[i]
    return ["".join(minor).rstrip(), "".join(patch).rstrip()]


def _declared(rows: Sequence[Row]) -> str:
    ranges = {r.declared for r in rows if r.declared and r.stock}
    if len(ranges) == 1:
        return f"(affected {' or '.join(ranges.pop())})"
    return "; ".join(f"({r.label}: affected {' or '.join(r.declared)})" for r in rows if r.declared and r.stock)


def _table(
    matrix: Matrix, layout: _Layout, block: Sequence[int], color: bool, ascii_only: bool, width: int
) -> list[str]:
    lines = _header(matrix, layout, block)
    for repro, rows in matrix.groups():
        heading = _wrapped("", f"{repro} {_declared(rows)}".rstrip(), width)
        if color:
            heading[0] = heading[0].replace(terminal(one_line(repro)), f"{BOLD}{terminal(one_line(repro))}{RESET}", 1)
        lines += heading
        for r in rows:
            cells = _row_cells(matrix, r, layout, block, color, ascii_only)
            label = f"  {terminal(r.label)}"
            if len(label) > layout.label:
                lines.append(label)
                label = ""
            lines.append((label.ljust(layout.label) + cells).rstrip())
    return lines


def _wrapped(prefix: str, text: str, width: int) -> list[str]:
    """``prefix`` then ``text``, wrapped within ``width`` at spaces only (under the prefix; below it, indented, when
    the prefix leaves less than 30 columns): a name is never cut, and only a word longer than the width passes it."""
    text, prefix = terminal(one_line(text)), terminal(prefix)
    if len(prefix) > width - 30:
        head = textwrap.wrap(prefix.rstrip(), width, subsequent_indent=" " * 4, break_on_hyphens=False,
                             break_long_words=False)  # fmt: skip
        rest = textwrap.wrap(text, width, initial_indent=" " * 6, subsequent_indent=" " * 6,
                             break_on_hyphens=False, break_long_words=False)  # fmt: skip
        return [*head, *rest]
    return textwrap.wrap(text, width, initial_indent=prefix, subsequent_indent=" " * (len(prefix) + 2),
                         break_on_hyphens=False, break_long_words=False) or [prefix]  # fmt: skip


def render_terminal(matrix: Matrix, *, color: bool = False, width: int = WIDTH, ascii_only: bool = False) -> str:
    """Fixed-width tables within ``width``; below them the legend and the notes. Only a word that cannot be broken
    (a long path or node id in a note) can pass the width."""
    layout = _layout(matrix, width)
    lines = _wrapped("", f"DeepSpeed repro matrix: {notes.headline(matrix)}", width)
    for line in notes.environments(matrix):
        lines += _wrapped("", line, width)
    for block in layout.blocks:
        lines.append("")
        lines += _table(matrix, layout, block, color, ascii_only, width)
    legend = "; ".join(f"{glyph} {words}" for glyph, words in symbols.legend(matrix, ascii_only))
    lines += ["", *_wrapped("Legend: ", f"{symbols.SHAPE}; {symbols.RANGE}; {legend}", width)]
    for section in notes.sections(matrix):
        lines += ["", f"{section.title}:"]
        for subject, text in section.items:
            lines += _wrapped(f"  {subject}: ", text, width)
    return "\n".join(lines) + "\n"
