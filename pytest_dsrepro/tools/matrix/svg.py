"""The matrix as an SVG image to paste into an issue: the heat map alone, with its legend.

The page's cells at a smaller size (two coloured halves with their symbols, a bar under the declared range, the
marks in a corner), the names cut to fit with an ellipsis (the whole name and each run on hover where the image is
opened in a browser), then the legend. Fixed geometry, so the image's size follows from the matrix alone.
"""

from __future__ import annotations

from ...core.escape import html_text as escape
from . import notes, symbols
from .model import Column, Matrix, Row

CELL_W, CELL_H, GAP = 22, 16, 1
GROUP = 5  # more space before each minor release
CHAR = 6.6  # pixels a character of 11 px sans-serif, for the name columns
NAME = 38  # characters a name keeps before its ellipsis
HEAD = 34  # the two header lines
PAD = 8
MIN_WIDTH = 600  # room for the legend
RANGE = "#4a2a00"  # the bar under the declared range


def _cut(text: str) -> str:
    return text if len(text) <= NAME else text[: NAME - 1] + "…"


def _columns(matrix: Matrix, left: float) -> tuple[list[float], list[str]]:
    """Each column's left edge (a little more space before each minor release), and the two header lines."""
    e = escape
    xs: list[float] = []
    out: list[str] = []
    x: float = left
    previous = None
    for c in matrix.columns:
        prefix, suffix = symbols.head(c.version)
        if prefix != previous:
            x += GROUP if previous is not None else 0
            out.append(f'<text x="{x}" y="{PAD + 11}" class="h">{e(prefix)}</text>')
            previous = prefix
        xs.append(x)
        out.append(f'<text x="{x + CELL_W / 2}" y="{PAD + 25}" class="h" text-anchor="middle">{e(suffix)}</text>')
        x += CELL_W + GAP
    return xs, out


def _cell(matrix: Matrix, row: Row, column: Column, x: float, y: float, inside: bool) -> str:
    e = escape
    kinds = symbols.pair(matrix, row, column)
    drawn = [kinds[0]] if column.blank else [kind for kind in kinds if kind]
    width = CELL_W / max(len(drawn), 1)
    parts = [f"<title>{e(notes.tip(matrix, row, column, errors=False))}</title>"]
    for j, kind in enumerate(k for k in drawn if k):
        hx = x + j * width
        parts.append(f'<rect x="{hx}" y="{y}" width="{width}" height="{CELL_H}" fill="{kind.fill}"/>'
                     f'<text x="{hx + width / 2}" y="{y + 12}" fill="{kind.ink}" text-anchor="middle">'
                     f"{e(kind.glyph)}</text>")  # fmt: skip
    cell = None if column.blank else matrix.cell(row, column)
    if cell is not None and cell.marks:
        parts.append(f'<text x="{x + CELL_W - 1}" y="{y + 6}" class="m" text-anchor="end">{e(cell.marks)}</text>')
    if inside:
        parts.append(f'<rect x="{x}" y="{y + CELL_H}" width="{CELL_W + GAP}" height="2" fill="{RANGE}"/>')
    return f"<g>{''.join(parts)}</g>"


def _legend(matrix: Matrix, y: float, right: float) -> tuple[list[str], float]:
    """The legend's swatches, in lines within ``right``; and where it ends."""
    e = escape
    items = [(k.fill, k.ink, k.glyph, k.words) for k in symbols.used(matrix)]
    items += [("#ffffff", "#000", m, symbols.MARKS[m]) for m in symbols.marks_used(matrix)]
    items.append((RANGE, "#fff", "", "the declared affected range"))
    out = []
    x: float = PAD
    for fill, ink, glyph, words in items:
        size = 28 + len(words) * CHAR
        if x + size > right:
            x, y = PAD, y + 18
        out.append(f'<rect x="{x}" y="{y}" width="14" height="14" fill="{fill}" stroke="#999" stroke-width="0.5"/>'
                   f'<text x="{x + 7}" y="{y + 11}" fill="{ink}" text-anchor="middle">{e(glyph)}</text>'
                   f'<text x="{x + 18}" y="{y + 11}">{e(words)}</text>')  # fmt: skip
        x += size
    return out, y + 18


def render_svg(matrix: Matrix) -> str:
    e = escape
    bug_w = int(max([3, *(len(_cut(r.repro)) for r in matrix.rows)]) * CHAR) + PAD
    config_w = int(max([6, *(len(_cut(r.label)) for r in matrix.rows)]) * CHAR) + PAD
    xs, out = _columns(matrix, PAD + bug_w + config_w)
    right = max((xs[-1] + CELL_W if xs else 0), MIN_WIDTH)
    y: float = PAD + HEAD
    for repro, rows in matrix.groups():
        out.append(f'<line x1="{PAD}" x2="{right}" y1="{y - 0.5}" y2="{y - 0.5}" class="g"/>')
        out.append(f'<text x="{PAD}" y="{y + 12}"><title>{e(repro)}</title>{e(_cut(repro))}</text>')
        for r in rows:
            out.append(f'<text x="{PAD + bug_w}" y="{y + 12}"><title>{e(r.label)}</title>{e(_cut(r.label))}</text>')
            inside = symbols.affected(matrix, r)
            out += [_cell(matrix, r, c, xs[k], y, inside[k]) for k, c in enumerate(matrix.columns)]
            y += CELL_H + 3
    legend, y = _legend(matrix, y + PAD, right)
    out += legend
    out.append(f'<text x="{PAD}" y="{y + 12}">{e(symbols.SHAPE)}. {e(notes.headline(matrix))}</text>')
    width, height = right + PAD, y + 12 + PAD
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="DejaVu Sans, Verdana, sans-serif" font-size="11">\n'
        "<style>.h{fill:#444;font-size:10px}.m{font-size:9px;font-weight:bold}.g{stroke:#bbb;stroke-width:1}</style>\n"
        '<rect width="100%" height="100%" fill="#fff"/>\n' + "\n".join(out) + "\n</svg>\n"
    )
