"""The matrix as GitHub Markdown: the terminal's compact table (two symbols a cell, brackets around the declared
range, one row per bug and config), the bugs with their titles and ranges, what each test raised, and the notes."""

from __future__ import annotations

import re

from ...core.escape import md_code, md_link, md_text
from ...core.text import markdown_cell
from . import notes, symbols
from .model import Matrix, Row


def _cells(matrix: Matrix, row: Row) -> list[str]:
    affected = symbols.affected(matrix, row)
    out = []
    for i, c in enumerate(matrix.columns):
        cell = None if c.blank else matrix.cell(row, c)
        text = "".join(k.glyph for k in symbols.pair(matrix, row, c) if k) + (cell.marks if cell else "")
        if affected[i] and (i == 0 or not affected[i - 1]):
            text = "[" + text
        if affected[i] and (i + 1 == len(affected) or not affected[i + 1]):
            text += "]"
        out.append(text)
    return out


def _table(matrix: Matrix, links: dict[str, int]) -> list[str]:
    """The compact table; each bug's name links to its upstream issue (``links``: the numbered references)."""
    heads = []  # the minor release over the first of its columns only
    for i, c in enumerate(matrix.columns):
        prefix, suffix = symbols.head(c.version)
        heads.append(f"{prefix}<br>{suffix}" if i == 0 or prefix != symbols.head(matrix.columns[i - 1].version)[0]
                     else suffix)  # fmt: skip
    out = ["| bug | config | " + " | ".join(heads) + " |", "|:--|:--|" + ":-:|" * len(matrix.columns)]
    for repro, rows in matrix.groups():
        upstream = next((r.upstream for r in rows if r.upstream), None)
        name = md_text(repro)
        if upstream and md_link(upstream) == upstream:  # a plain http(s) address: a reference to it
            name = f"[{name}][{links.setdefault(upstream, len(links) + 1)}]"
        for i, r in enumerate(rows):
            cells = [markdown_cell(name) if i == 0 else "", markdown_cell(md_text(r.label)), *_cells(matrix, r)]
            out.append(f"| {' | '.join(cells)} |")
    return out


def _bugs(matrix: Matrix) -> list[str]:
    """Each bug: its id, declared range, title and link."""
    out = []
    for repro, rows in matrix.groups():
        declared = {r.declared for r in rows if r.declared and r.stock}
        ranges = "; ".join(" or ".join(md_code(d) for d in ds) for ds in sorted(declared))
        title = next((r.title for r in rows if r.title), None)
        upstream = next((r.upstream for r in rows if r.upstream), None)
        said = f" (affected {ranges})" if ranges else ""
        said += f": {md_text(title)}" if title else ""
        out.append(f"- **{md_text(repro)}**{said}" + (f" ({md_link(upstream)})" if upstream else ""))
    return out


#: A line of the page's "What each test raised", as ``render_markdown`` writes it.
_RAISED = re.compile(
    r"^- (?P<name>.+?) on (?P<versions>[\d., -]+): (?:`` (?P<spaced>.*) ``|`(?P<text>.*)`)$", re.MULTILINE
)


def read_raised(page: str) -> list[tuple[str, str, str]]:
    """What each test raised, read back from a page ``render_markdown`` wrote: ``(name, text, versions)`` a line (the
    name ``repro [config]``), as ``notes.raised`` gave them. The page is where a repro's recorded failures live: the
    benchmark triages them, the face check matches them."""
    section = page.partition("\n## What each test raised\n")[2].partition("\n## ")[0]
    return [
        (m["name"], m["spaced"] if m["text"] is None else m["text"], m["versions"]) for m in _RAISED.finditer(section)
    ]


def render_markdown(matrix: Matrix, image: str | None = None) -> str:
    """A GitHub-flavoured page: the table, the bugs (id, declared range, title, link), what each test raised on
    which releases, the notes; ``image``: the SVG's path relative to the page, shown above the table."""
    links: dict[str, int] = {}
    out = ["# DeepSpeed repro matrix", "", f"{md_text(notes.headline(matrix))}.", ""]
    out += [f"{md_text(line)}." for line in [*notes.environments(matrix), notes.when(matrix)] if line] + [""]
    if image:
        out += [f"![the matrix as an image]({image})", ""]
    out += [f"Legend ({symbols.SHAPE}; {symbols.RANGE}):", ""]
    out += [f"- {glyph} {words}" for glyph, words in symbols.legend(matrix)] + [""]
    out += [*_table(matrix, links), "", "## Bugs", "", *_bugs(matrix)]
    raised = notes.raised(matrix)
    if raised:
        out += ["", "## What each test raised", ""]
        out += [f"- {md_text(name)} on {md_text(versions)}: {md_code(text)}" for name, text, versions in raised]
    for section in notes.sections(matrix):
        out += ["", f"## {md_text(section.title)}", ""]
        out += [f"- {md_code(subject) if section.code else md_text(subject)}: {md_text(text)}"
                for subject, text in section.items]  # fmt: skip
    out += ["", "## Sources", ""] + [f"- {md_code(p.name)}" for c in matrix.columns for p in c.sources] + [""]
    out += [f"[{n}]: {md_link(url)}" for url, n in links.items()]
    return "\n".join(out) + "\n"
