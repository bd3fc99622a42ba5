"""The matrix's page and image fit where they are read: the HTML page on a 1400-pixel screen, computed from the page
itself (its fixed layout's pixel widths and its CSS), without a browser; the SVG image a well-formed drawing with one
cell per row and release. (Looked at in a real browser: ``python benchmarks/matrix.py --browser chromium``.)"""

from __future__ import annotations

import html.parser
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from matrix_records import RELEASES, big_catalogue, rec, write

from pytest_dsrepro.tools.matrix import html as page_layout
from pytest_dsrepro.tools.matrix import load, merge, render_html, render_svg

SCREEN = 1400
#: What a browser may take for its vertical scroll bar (none takes more).
SCROLLBAR = 17


class _Map(html.parser.HTMLParser):
    """The widths the page fixes: its heat map's ``<col>`` widths, and every inline width anywhere."""

    def __init__(self) -> None:
        super().__init__()
        self.in_map = False
        self.cols: list[int] = []
        self.inline: list[int] = []
        self.rows = 0
        self.cells: list[dict[str, str | None]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "table":
            self.in_map = a.get("class") == "map"
        style = a.get("style") or ""
        widths = [int(w) for w in re.findall(r"width:\s*(\d+)px", style)]
        self.inline += widths
        if self.in_map and tag == "col":
            self.cols += widths
        if self.in_map and tag == "tr" and a.get("class") not in ("minor", "patch"):
            self.rows += 1
        if self.in_map and tag == "td" and "cell" in (a.get("class") or ""):
            self.cells.append(a)

    def handle_endtag(self, tag: str) -> None:
        if tag == "table":
            self.in_map = False


def _css(page: str) -> dict[str, str]:
    """Each CSS rule of the page's style sheet: selector -> declarations."""
    style = page.split("<style>", 1)[1].split("</style>", 1)[0]
    return {sel.strip(): body.strip() for sel, body in re.findall(r"([^{}]+)\{([^{}]*)\}", style)}


def _px(declarations: str, prop: str) -> int:
    found = re.search(rf"(?:^|;)\s*{prop}:\s*(\d+)px", declarations)
    assert found, (prop, declarations)
    return int(found.group(1))


def page_width(page: str) -> int:
    """The width the page needs, from what it fixes: the heat map's columns and the spacing between them, within
    the body's margins, beside a scroll bar. Everything else on the page wraps within the body (checked here too)."""
    css = _css(page)
    table = css["table.map"]
    assert "table-layout: fixed" in table
    assert "border-collapse: separate" in table
    spacing = _px(table, "border-spacing")
    parsed = _Map()
    parsed.feed(page)
    columns = sum(parsed.cols) + spacing * (len(parsed.cols) + 1)
    assert _px(table, "width") == columns  # the table is as wide as its columns: no browser widens it
    cells = css["table.map th, table.map td"]
    assert "padding: 0" in cells  # a cell's padding would add to its column
    assert "overflow: hidden" in cells
    assert "text-overflow: ellipsis" in cells
    assert "overflow-wrap: anywhere" in css["body"]  # long node ids and errors below it wrap
    assert max(parsed.inline) <= _px(table, "width")  # nothing else is given a width of its own beyond the table
    assert [sel for sel, body in css.items() if "nowrap" in body and not sel.startswith("table.map")] == []
    return columns + 2 * _px(css["body"], "margin") + SCROLLBAR


@pytest.mark.parametrize("releases", [RELEASES, [f"0.{minor}.{patch}" for minor in (17, 18, 19) for patch in
                                                  range(12)]])  # fmt: skip
def test_30_bugs_fit_a_1400_pixel_screen(tmp_path: Path, releases: list[str]) -> None:
    """30 bugs with long names, two configs each, on 24 releases (and on 36): every release column on one screen."""
    big_catalogue(tmp_path, bugs=30, releases=releases)
    m = merge(*load([tmp_path]))
    assert (len(m.rows), len(m.columns)) == (60, len(releases))
    page = render_html(m)
    width = page_width(page)
    assert width <= SCREEN, width
    assert width == page_layout.layout(m).page  # what the renderer planned is what the page says
    parsed = _Map()
    parsed.feed(page)
    assert parsed.rows == 60
    assert len(parsed.cells) == 60 * len(releases)
    assert all(cell.get("class") in ("cell", "cell in") for cell in parsed.cells)
    assert min(parsed.cols[2:]) >= page_layout.MIN_CELL  # two symbols still fit a cell
    # long names are cut by the browser, never by us: whole in the page, on hover too
    long_repro = next(r.repro for r in m.rows)
    assert f'title="{long_repro}: title of {long_repro}' in page


def test_the_widest_page_is_said_by_the_layout(tmp_path: Path) -> None:
    """Beyond what fits (60 releases), cells keep their least width: the layout says how wide the page then is."""
    releases = [f"0.{minor}.{patch}" for minor in range(14, 20) for patch in range(10)]
    write(tmp_path, releases[0], [rec("repros/test_a.py::test_a[zero3-stock]", "FIXED")])
    for v in releases[1:]:
        write(tmp_path, v, [rec("repros/test_a.py::test_a[zero3-stock]", "FIXED")])
    m = merge(*load([tmp_path]))
    lay = page_layout.layout(m)
    assert lay.cell == page_layout.MIN_CELL
    assert page_width(render_html(m)) == lay.page > SCREEN


def test_the_image_draws_every_cell(tmp_path: Path) -> None:
    big_catalogue(tmp_path, bugs=12)
    m = merge(*load([tmp_path]))
    svg = render_svg(m)
    root = ET.fromstring(svg)
    ns = "{http://www.w3.org/2000/svg}"
    assert root.tag == f"{ns}svg"
    width = float(root.attrib["width"])
    assert root.attrib["viewBox"] == f"0 0 {root.attrib['width']} {root.attrib['height']}"
    cells = [g for g in root.iter(f"{ns}g")]
    assert len(cells) == len(m.rows) * len(m.columns)
    for g in cells:
        title = g.find(f"{ns}title")
        assert title is not None
        assert " on 0." in (title.text or "")
        rects = g.findall(f"{ns}rect")
        assert rects, ET.tostring(g)
        assert all(float(r.attrib["x"]) + float(r.attrib["width"]) <= width for r in rects)
    assert width < 1400  # pastes into an issue as it is
