"""The matrix as one self-contained page: a heat map of fixed width that fits a 1400-pixel screen.

Every width is decided here, in pixels, and written into the page (``table-layout: fixed``, one ``<col>`` per
column; names that do not fit end in an ellipsis and are whole on hover), so :func:`layout` says what the browser
will draw and a test can check it without one. Each cell is two halves, the stock run and the run with the fix,
coloured by kind; a bar under the cells marks the declared range; a cell's details are on hover, and it links to
its line in the evidence below the table (and that to the results file). No scripts, no external resources.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ...core.escape import html_link, html_text, path_link
from . import notes, symbols
from .model import Column, Matrix, Row

#: The window the page must fit, the vertical scroll bar it may have, and the page's margin.
SCREEN = 1400
SCROLLBAR = 17
MARGIN = 16
#: Between cells (``border-spacing``).
SPACING = 1
#: A release column's width: what reads well, and the least that still shows two symbols.
CELL, MIN_CELL = 30, 24
#: The least the two name columns get together; their share of the rest follows their longest names.
MIN_LABELS = 300
#: A name's width is estimated at this many pixels a character (12 px sans-serif) plus padding.
CHAR, PAD = 7, 10


@dataclass(frozen=True)
class Layout:
    """The table's columns in pixels: the bug, the config, and each release."""

    bug: int
    config: int
    cell: int
    releases: int

    @property
    def table(self) -> int:
        """The table's width: its columns and the spacing around each."""
        return self.bug + self.config + self.cell * self.releases + SPACING * (self.releases + 3)

    @property
    def page(self) -> int:
        """The page's width: the table within the margins, beside a scroll bar."""
        return self.table + 2 * MARGIN + SCROLLBAR


def layout(matrix: Matrix) -> Layout:
    budget = SCREEN - 2 * MARGIN - SCROLLBAR - SPACING * (len(matrix.columns) + 3)
    n = len(matrix.columns)
    cell = CELL if n * CELL + MIN_LABELS <= budget else max(MIN_CELL, (budget - MIN_LABELS) // max(n, 1))
    rest = max(MIN_LABELS, budget - n * cell)
    want_bug = max([len("bug"), *(len(r.repro) for r in matrix.rows)]) * CHAR + PAD
    want_config = max([len("config"), *(len(r.label) for r in matrix.rows)]) * CHAR + PAD
    if want_bug + want_config <= rest:
        return Layout(want_bug, want_config, cell, n)
    bug = max(MIN_LABELS // 2, min(want_bug, rest * want_bug // (want_bug + want_config)))
    return Layout(bug, rest - bug, cell, n)


CSS = """
body { font: 13px/1.4 system-ui, sans-serif; margin: %(margin)dpx; color: #222; overflow-wrap: anywhere; }
h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 20px 0 6px; } h3 { font-size: 13px; }
p { margin: 4px 0; }
table.map { table-layout: fixed; width: %(table)dpx; border-collapse: separate; border-spacing: %(spacing)dpx;
  font-size: 12px; }
table.map th, table.map td { padding: 0; overflow: hidden; white-space: nowrap; text-overflow: ellipsis; }
table.map thead th { position: sticky; background: #fff; font-weight: normal; color: #444; z-index: 1; }
table.map thead tr.minor th { top: 0; font-size: 11px; text-align: left; }
table.map thead th.group { box-shadow: inset 1px 0 #999; padding-left: 2px; }
table.map thead tr.patch th { top: 16px; font-size: 11px; border-bottom: 1px solid #999; }
table.map th.name, table.map td.name { text-align: left; padding: 0 4px; }
table.map tr.first td { border-top: 1px solid #999; }
table.map tbody tr:hover td.name { background: #eef; }
table.map td.cell a { display: flex; height: 18px; position: relative; text-decoration: none; }
table.map td.cell a span { flex: 1; text-align: center; line-height: 18px; font-size: 11px; }
table.map td.cell { border-bottom: 3px solid transparent; }
table.map td.in { border-bottom-color: #4a2a00; }
table.map td.contradicts a { outline: 2px solid #b00020; outline-offset: -2px; }
table.map td.changed a { box-shadow: inset 0 0 0 2px #2b59c3; }
table.map a i { position: absolute; right: 1px; top: -3px; font-style: normal; font-size: 10px; color: #000; }
td.blank { background: repeating-linear-gradient(45deg, #e4e4e4, #e4e4e4 4px, #d0d0d0 4px, #d0d0d0 8px); }
.legend span.key { display: inline-block; min-width: 18px; text-align: center; margin-right: 3px; }
.legend li { display: inline-block; margin-right: 14px; }
ul { padding-left: 18px; } code { font-size: 12px; }
table.evidence { width: 100%%; table-layout: fixed; border-collapse: collapse; font-size: 12px; }
table.evidence td, table.evidence th { border-top: 1px solid #ddd; padding: 2px 4px; vertical-align: top;
  text-align: left; }
table.evidence tr:target { background: #ffef9e; }
table.evidence col.release { width: 70px; } table.evidence col.file { width: 220px; }
"""


def _kind_css() -> str:
    return "\n".join(
        f".k-{_css_name(k.name)} {{ background: {k.fill}; color: {k.ink}; }}" for k in symbols.KINDS.values()
    )


def _css_name(name: str) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in name)


def _cell(matrix: Matrix, row: Row, column: Column, index: int, inside: bool) -> str:
    e = html_text
    classes = ["cell"] + (["in"] if inside else [])
    if column.blank:
        kind = symbols.blank_kind(column)
        return (f'<td class="cell blank{" in" * inside}"><a href="#e{index}-{e(column.version)}" '
                f'title="{e(notes.tip(matrix, row, column))}"><span>{kind.glyph}</span></a></td>')  # fmt: skip
    cell = matrix.cell(row, column)
    if cell is not None and any(r.contradicts for r in cell.runs):
        classes.append("contradicts")
    if cell is not None and any(r.before is not None for r in cell.runs):
        classes.append("changed")
    halves = "".join(
        f'<span class="k-{_css_name(k.name)}">{e(k.glyph)}</span>' for k in symbols.pair(matrix, row, column) if k
    )
    marks = f"<i>{e(cell.marks)}</i>" if cell is not None and cell.marks else ""
    return (f'<td class="{" ".join(classes)}"><a href="#e{index}-{e(column.version)}" '
            f'title="{e(notes.tip(matrix, row, column))}">{halves}{marks}</a></td>')  # fmt: skip


def _head(matrix: Matrix, lay: Layout) -> str:
    e = html_text
    cols = [f'<col style="width:{lay.bug}px">', f'<col style="width:{lay.config}px">']
    cols += [f'<col style="width:{lay.cell}px">'] * len(matrix.columns)
    minor: list[tuple[str, int]] = []
    for c in matrix.columns:
        prefix = symbols.head(c.version)[0]
        if minor and minor[-1][0] == prefix:
            minor[-1] = (prefix, minor[-1][1] + 1)
        else:
            minor.append((prefix, 1))
    top = "".join(f'<th colspan="{n}" class="group" title="{e(p)}">{e(p)}</th>' for p, n in minor)
    patch = "".join(
        f'<th title="{e(c.version)}: {e(c.blank_line or c.environment_line)}">{e(symbols.head(c.version)[1])}</th>'
        for c in matrix.columns
    )
    return (
        f"<colgroup>{''.join(cols)}</colgroup>\n<thead>"
        f'<tr class="minor"><th class="name"></th><th class="name"></th>{top}</tr>\n'
        f'<tr class="patch"><th class="name">bug</th><th class="name">config</th>{patch}</tr></thead>'
    )


def _body(matrix: Matrix) -> str:
    e = html_text
    rows = []
    index = 0
    for repro, group in matrix.groups():
        for i, r in enumerate(group):
            affected = symbols.affected(matrix, r)
            bug = e(repro) if i == 0 else ""
            link = html_link(r.upstream) if i == 0 and r.upstream else None
            if link:
                bug = f'<a href="{link}">{bug}</a>'
            about = " ".join(filter(None, [repro + ":", r.title, f"(affected {' or '.join(r.declared)})" if r.declared
                                           else None]))  # fmt: skip
            cells = "".join(_cell(matrix, r, c, index, affected[k]) for k, c in enumerate(matrix.columns))
            rows.append(
                f'<tr{" class=first" if i == 0 else ""}><td class="name" title="{e(about)}">{bug}</td>'
                f'<td class="name" title="{e(r.label)}"><a href="#r{index}">{e(r.label)}</a></td>{cells}</tr>'
            )
            index += 1
    return "\n".join(rows)


@functools.lru_cache(maxsize=1024)
def _file_link(path: Path | None, links: Path | None) -> str:
    """A results file, linked from the page's directory (the same few files on every line: kept)."""
    if path is None:
        return ""
    e = html_text
    if links is None:
        return f"<code>{e(path.name)}</code>"
    href = path_link(os.path.relpath(path.absolute(), links.absolute()))
    return f'<a href="{href}"><code>{e(path.name)}</code></a>' if href else f"<code>{e(path.name)}</code>"


def _evidence(matrix: Matrix, links: Path | None) -> str:
    """Per row, one line per release: each run's verdict, reason and error, and the file it comes from."""
    e = html_text
    parts = []
    index = 0
    for repro, group in matrix.groups():
        for r in group:
            lines = []
            for c in matrix.columns:
                cell = None if c.blank else matrix.cell(r, c)
                said = [f"{slot}: {e(notes.run_line(matrix.run_of(r, c, n)))}" for slot, n in
                        (("stock", r.stock), ("with the fix", r.fixed)) if n is not None]  # fmt: skip
                what = e(c.blank_line or "") if c.blank else "<br>".join(said)
                files = sorted({run.source for run in (cell.runs if cell else ()) if run.source})
                lines.append(f'<tr id="e{index}-{e(c.version)}"><td>{e(c.version)}</td><td>{what}</td>'
                             f'<td>{" ".join(_file_link(f, links) for f in files)}</td></tr>')  # fmt: skip
            ids = ", ".join(f"<code>{e(n)}</code>" for n in r.nodeids)
            parts.append(f'<h3 id="r{index}">{e(repro)} [{e(r.label)}]</h3><p>{ids}</p>'
                         '<table class="evidence"><colgroup><col class="release"><col><col class="file"></colgroup>'
                         f'{"".join(lines)}</table>')  # fmt: skip
            index += 1
    return "\n".join(parts)


def _sections(sections: Sequence[notes.Section]) -> str:
    e = html_text
    out = []
    for s in sections:
        items = "".join(
            f"<li>{f'<code>{e(subject)}</code>' if s.code else f'<b>{e(subject)}</b>'}: {e(text)}</li>"
            for subject, text in s.items
        )
        out.append(f"<h2>{e(s.title)}</h2><ul>{items}</ul>")
    return "\n".join(out)


def render_html(matrix: Matrix, links: Path | None = None) -> str:
    """The page; ``links``: the directory the page is written to, so that evidence links reach the results files
    (None: files named, not linked)."""
    e = html_text
    lay = layout(matrix)
    css = CSS % {"margin": MARGIN, "table": lay.table, "spacing": SPACING} + _kind_css()
    legend = "".join(
        f'<li><span class="key k-{_css_name(k.name)}">{e(k.glyph)}</span>{e(k.words)}</li>'
        for k in symbols.used(matrix)
    ) + "".join(f'<li><span class="key">{e(m)}</span>{e(symbols.MARKS[m])}</li>' for m in symbols.marks_used(matrix))
    raised = "".join(f"<li><b>{e(name)}</b> on {e(versions)}: <code>{e(text)}</code></li>"
                     for name, text, versions in notes.raised(matrix))  # fmt: skip
    environments = "".join(f"<p>{e(line)}</p>" for line in [*notes.environments(matrix), notes.when(matrix)] if line)
    sources = "".join(f"<li>{_file_link(p, links)}</li>" for c in matrix.columns for p in c.sources)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>DeepSpeed repro matrix</title>
<style>{css}</style></head>
<body>
<h1>DeepSpeed repro matrix</h1>
<p>{e(notes.headline(matrix))}.</p>
{environments}
<ul class="legend"><li>{e(symbols.SHAPE)}; a dark bar under the cells marks the declared affected range; hover for
details, click for the evidence</li>{legend}</ul>
<table class="map">
{_head(matrix, lay)}
<tbody>
{_body(matrix)}
</tbody></table>
{_sections(notes.sections(matrix))}
{f"<h2>What each test raised</h2><ul>{raised}</ul>" if raised else ""}
<h2>Evidence</h2>
{_evidence(matrix, links)}
<h2>Sources</h2><ul>{sources}</ul>
</body></html>
"""
