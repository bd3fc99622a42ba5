"""Text for terminals and Markdown, written once: colours taken out, lines cut to a width, columns aligned, Markdown
table cells kept on one line."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from .escape import one_line

#: Escape sequences (CSI, OSC, two-byte), and the colour codes a paste leaves once the escape character is gone.
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]|\[(?:\d{1,3};)*\d{1,3}m")


def strip_ansi(text: str) -> str:
    """``text`` without terminal colours and control sequences (a pasted log's leftovers of them too)."""
    return _ANSI.sub("", text)


def cut(text: str, width: int | None) -> str:
    """``text`` within ``width`` characters, ``...`` where it was cut (None: whole, for output that wraps)."""
    return text if width is None or len(text) <= width else text[: max(width - 3, 0)] + "..."


def aligned(rows: Iterable[Sequence[str]], gap: str = "  ", width: int | None = None) -> list[str]:
    """Rows as lines whose columns line up: every column but the last padded to its widest cell, trailing blanks
    dropped, each line cut to ``width``."""
    table = [list(row) for row in rows]
    widths: dict[int, int] = {}
    for row in table:
        for i, cell in enumerate(row[:-1]):
            widths[i] = max(widths.get(i, 0), len(cell))
    return [
        cut(gap.join([cell.ljust(widths[i]) for i, cell in enumerate(row[:-1])] + row[-1:]).rstrip(), width)
        for row in table
    ]


def markdown_cell(value: object) -> str:
    """A Markdown table cell: one line, its pipes escaped (but those already escaped), ``-`` for nothing. What goes
    in is Markdown: texts from outside through ``core.escape``'s ``md_text`` or ``md_code`` first."""
    text = one_line(str(value))
    return re.sub(r"(?<!\\)((?:\\\\)*)\|", r"\1\\|", text) if text else "-"


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """A GitHub Markdown table; cells that are already Markdown (code, links) go in as they are, but on one line."""
    return [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(" --- " for _ in header) + "|",
        *("| " + " | ".join(markdown_cell(cell) for cell in row) + " |" for row in rows),
    ]
