"""Every output the plugin writes, rendered with the hostile corpus (``tests/hostile.py``): Markdown as CommonMark
with HTML on and GitHub's autolinks (markdown-it-py), HTML with the standard library's parser, SVG with an XML parser,
terminal text as written. A test fails on anything that leaves its code: raw HTML, a mention, an image, a link that
is not http(s) or relative or that a text put there, an escape sequence a terminal would run."""

from __future__ import annotations

import datetime
import json
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from hostile import JAVASCRIPT, REPRO_ID, TEXTS
from markdown_it import MarkdownIt
from markdown_it.token import Token
from matrix_records import rec, write

from pytest_dsrepro.core import escape, report, scan_verdicts
from pytest_dsrepro.core.gates import Reason, Verdict
from pytest_dsrepro.core.results import (
    Environment,
    Finding,
    RankStory,
    ReproMeta,
    RunRecord,
    ScanSource,
    ScanVerdict,
    TestRecord,
)
from pytest_dsrepro.tools import catalogue
from pytest_dsrepro.tools.matrix import Matrix, build, render_html, render_markdown, render_svg, render_terminal
from pytest_dsrepro.triage import logread
from pytest_dsrepro.triage import ranking as triage

#: Links our own outputs make: the repros' upstream issues, DeepSpeed's own, the results files beside the page.
SAFE_SCHEMES = ("", "http", "https")
#: The raw HTML our own Markdown writes (a report's folded sections, its footnote).
OWN_HTML = {"details", "summary", "sub", "br"}
#: The tags of the matrix's page.
PAGE_TAGS = {"html", "head", "meta", "title", "style", "body", "h1", "h2", "h3", "p", "ul", "li", "table", "colgroup",
             "col", "thead", "tbody", "tr", "th", "td", "a", "span", "i", "b", "code", "br"}  # fmt: skip
SVG_TAGS = {"svg", "style", "rect", "text", "title", "g", "line"}
_MENTION = re.compile(r"(?<![\w`])@[A-Za-z0-9]")
_TERMINAL_SGR = re.compile(r"\x1b\[[0-9;]*m")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def _leaks_html_fragment(fragment: str) -> list[str]:
    parser = _Page()
    parser.feed(fragment)
    parser.close()
    return [leak for leak in parser.leaks if not leak.startswith("tag ") or leak.split()[1] not in OWN_HTML]


def _inline(tokens: list[Token]) -> Iterator[Token]:
    for token in tokens:
        yield token
        yield from _inline(token.children or [])


def markdown_leaks(text: str) -> list[str]:
    """What gets out of its code in ``text`` rendered as GitHub would: HTML not our own, images, links to anywhere
    but http(s), links a text made (GitHub's autolinks), mentions."""
    md = MarkdownIt("commonmark", {"html": True, "linkify": True}).enable(["table", "linkify", "strikethrough"])
    leaks = []
    for token in _inline(md.parse(text)):
        if token.type in ("html_inline", "html_block"):
            leaks += [f"html {token.content.strip()[:60]!r}" for _ in _leaks_html_fragment(token.content)[:1]]
        elif token.type == "image" and (urlsplit(str(token.attrs.get("src"))).scheme or "evil" in str(token.attrs)):
            leaks.append(f"image {token.attrs.get('src')!r}")
        elif token.type == "link_open":
            href = str(token.attrs.get("href", ""))
            if urlsplit(href).scheme not in SAFE_SCHEMES or "evil" in href or token.markup == "linkify":
                leaks.append(f"link {href!r}")
        elif token.type == "text" and _MENTION.search(token.content):
            leaks.append(f"mention in {token.content[:60]!r}")
    return leaks


class _Page(HTMLParser):
    """The tags, attributes and links of a page, as a browser would read them."""

    def __init__(self, tags: set[str] | None = None) -> None:
        super().__init__(convert_charrefs=True)
        self.tags = tags
        self.leaks: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if self.tags is None or tag not in self.tags:
            self.leaks.append(f"tag {tag}")
        for name, value in attrs:
            if name.startswith("on") or name == "src" or (name == "style" and tag != "col"):
                self.leaks.append(f"attribute {name}={value!r} on {tag}")
            if name == "href" and urlsplit((value or "").strip()).scheme.lower() not in SAFE_SCHEMES:
                self.leaks.append(f"link {value!r}")

    def handle_data(self, data: str) -> None:
        if _CONTROL.search(data):
            self.leaks.append(f"control character in {data[:40]!r}")


def html_leaks(page: str) -> list[str]:
    parser = _Page(PAGE_TAGS)
    parser.feed(page)
    parser.close()
    return parser.leaks


def svg_leaks(image: str) -> list[str]:
    try:
        root = ET.fromstring(image)
    except ET.ParseError as exc:
        return [f"not XML: {exc}"]
    leaks = []
    for element in root.iter():
        tag = element.tag.rpartition("}")[2]
        if tag not in SVG_TAGS:
            leaks.append(f"element {tag}")
        leaks += [f"attribute {name}" for name in element.attrib if name.startswith("on") or "href" in name]
        leaks += [f"control character in {t[:40]!r}" for t in (element.text, element.tail) if t and _CONTROL.search(t)]
    return leaks


def terminal_leaks(text: str, color: bool = False) -> list[str]:
    shown = _TERMINAL_SGR.sub("", text) if color else text
    return [f"control {m[0]!r} at {m.start()}" for m in _CONTROL.finditer(shown)]


# --- the inputs -------------------------------------------------------------------------------------------------


def _meta(text: str, upstream: str = JAVASCRIPT) -> ReproMeta:
    return ReproMeta(REPRO_ID, title=text, upstream=upstream, fixed_in="0.16.4", root_cause=text, affected=("<0.16.4",))


def _record(text: str) -> TestRecord:
    story = RankStory("ranks 0-1", text, f"Traceback (most recent call last):\n{text}", text)
    return TestRecord(nodeid=f"repros/test_x.py::test_x[{text}]", repro=_meta(text), variant="stock",
                      verdict=Verdict.UNEXPECTED, reason=Reason.FAILED_DIFFERENTLY, outcome="failed", error=text,
                      duration=1.0, config={"note": text}, ranks=(story,), world_size=2)  # fmt: skip


def _run(text: str, scan: bool = False) -> RunRecord:
    env = Environment(deepspeed="0.16.3", torch=f"2.13.0 {text}", python="3.11.7", backend="gloo", world_size=2,
                      os=text, cpu=text, cpu_count=2, gpu=None, gpu_count=None)  # fmt: skip
    test = _record(text)
    if scan:
        found = Finding(ScanVerdict.AFFECTED, text, notes=(text,))
        test = TestRecord(**{**test.__dict__, "scan": found})
    source = ScanSource(path=text, config={"k": text}, notes=(text,)) if scan else None
    return RunRecord(created=datetime.datetime(2026, 12, 1, tzinfo=datetime.timezone.utc), environment=env,
                     unavailable=None, tests=(test,), scan=source)  # fmt: skip


def _matrix(tmp_path: Path, text: str) -> Matrix:
    record = rec(f"repros/test_x.py::test_x[{text}]", "UNEXPECTED", repro=None, error=text, raised=text)
    record = TestRecord(**{**record.__dict__, "repro": _meta(text)})
    path = write(tmp_path, "0.16.3", [record], name=f"{JAVASCRIPT}.json", torch=f"2.13.0{text}")
    return build.merge(*build.load([path]))


def _bug(text: str) -> triage.KnownBug:
    from pytest_dsrepro.core.faces import gate_face

    face = gate_face(None, "<0.19.6", "RuntimeError", "pwned")
    return triage.KnownBug(REPRO_ID, text, JAVASCRIPT, "0.19.6", text, "/x/repros/test_x.py", (face,), None,
                           "the_fix", ("<0.19.6",))  # fmt: skip


def _triage(text: str) -> triage.Triage:
    log = f'Traceback (most recent call last):\n  File "x.py", line 1, in f\nRuntimeError: pwned {text}\n'
    return triage.rank([_bug(text)], logread.read(log), triage.Judged())


CASES = sorted(TEXTS.items())


@pytest.mark.parametrize(("name", "text"), CASES, ids=[n for n, _ in CASES])
def test_the_matrix_keeps_every_text_in_its_code(tmp_path: Path, name: str, text: str) -> None:
    matrix = _matrix(tmp_path, text)
    leaks = {
        "matrix.md": markdown_leaks(render_markdown(matrix, image="matrix.svg")),
        "matrix.html": html_leaks(render_html(matrix, links=tmp_path)),
        "matrix.svg": svg_leaks(render_svg(matrix)),
        "terminal": terminal_leaks(render_terminal(matrix, color=False)),
        "terminal in colour": terminal_leaks(render_terminal(matrix, color=True), color=True),
    }
    assert {k: v for k, v in leaks.items() if v} == {}


@pytest.mark.parametrize(("name", "text"), CASES, ids=[n for n, _ in CASES])
def test_the_report_keeps_every_text_in_its_code(name: str, text: str) -> None:
    assert markdown_leaks(report.render_markdown(_run(text))) == []


@pytest.mark.parametrize(("name", "text"), CASES, ids=[n for n, _ in CASES])
def test_the_scan_keeps_every_text_in_its_code(name: str, text: str) -> None:
    run = _run(text, scan=True)
    leaks = {
        "markdown": markdown_leaks(scan_verdicts.markdown(run)),
        "across": markdown_leaks(scan_verdicts.markdown_across([run])),
        "terminal": terminal_leaks("\n".join(scan_verdicts.terminal(run))),
    }
    assert {k: v for k, v in leaks.items() if v} == {}


@pytest.mark.parametrize(("name", "text"), CASES, ids=[n for n, _ in CASES])
def test_the_triage_keeps_every_text_in_its_code(name: str, text: str) -> None:
    t = _triage(text)
    leaks = {
        "ready comment": markdown_leaks(triage.markdown(t, log="crash.log")),
        "terminal": terminal_leaks("\n".join(triage.terminal(t))),
    }
    assert {k: v for k, v in leaks.items() if v} == {}


@pytest.mark.parametrize(("name", "text"), CASES, ids=[n for n, _ in CASES])
def test_the_catalogue_listing_keeps_every_text_in_its_code(name: str, text: str) -> None:
    """``dsrepro list``: a repro's markers (id, title, upstream, ranges, premise, faces) are texts from outside too."""
    from pytest_dsrepro.core.faces import Face

    face = Face(JAVASCRIPT, "RuntimeError", text, frames=(text,), words=(text,))
    entry = catalogue.Entry(REPRO_ID, text, JAVASCRIPT, None, text, text, (f"<0.16.4{text}",), "repros/test_x.py",
                            premise=text, scan_sets=text, faces=(face,))  # fmt: skip
    leaks = {
        "markdown": markdown_leaks(catalogue.render([entry], "markdown")),
        "table": terminal_leaks(catalogue.render([entry], "table")),
    }
    assert {k: v for k, v in leaks.items() if v} == {}


# --- the escapes themselves -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "link"),
    [
        ("https://github.com/deepspeedai/DeepSpeed/issues/1", "https://github.com/deepspeedai/DeepSpeed/issues/1"),
        (JAVASCRIPT, None),
        (" JaVaScRiPt:alert(1)", None),
        ("data:text/html,<script>", None),
        ("//evil.example/x", None),
        ("java\tscript:alert(1)", None),
        ("https://", None),
        ("results/run.json", "results/run.json"),
        ("a b:c", "./a b:c"),
    ],
)
def test_only_http_and_relative_links_survive(url: str, link: str | None) -> None:
    assert escape.safe_link(url) == link


def test_a_files_name_is_a_relative_link_whatever_it_holds() -> None:
    assert escape.path_link("javascript:alert(1).json") == "javascript%3Aalert%281%29.json"
    assert escape.path_link("../results/#1 a.json") == "../results/%231%20a.json"


def test_a_code_span_holds_any_backticks_and_a_fence_any_fence() -> None:
    assert escape.md_code("a ``` b") == "````a ``` b````"
    assert escape.md_code("`x`") == "`` `x` ``"
    assert escape.md_code("") == "`-`"
    assert escape.md_fence("````\nx").startswith("`````\n")


def test_text_reads_as_written_and_links_nothing() -> None:
    assert escape.md_text("deepspeed>=0.18.7 (PR #7948) on 2.13.0+cpu, repros/test_a.py") == (
        "deepspeed>=0.18.7 (PR #7948) on 2.13.0+cpu, repros/test_a.py"
    )
    assert escape.md_text("1. see @octocat") == f"1\\. see @{escape.WORD_JOINER}octocat"
    assert escape.md_link(JAVASCRIPT) == "javascript:alert(document.domain)"
    assert escape.md_link("https://x.example/a b", "a b") == "[a b](<https://x.example/a%20b>)"


def test_a_terminal_is_shown_its_escapes() -> None:
    assert escape.terminal("\x1b]0;t\x07\x1b[2J\r\u202e ok\n\tend") == "\\x1b]0;t\\x07\\x1b[2J\\x0d\\u202e ok\n\tend"


def test_what_the_dsrepro_command_prints_runs_no_escape(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every line ``dsrepro`` prints goes through ``core.escape.terminal`` (``cli``'s streams), whichever command
    printed it: a fix ledger's titles, a clone's commit subjects, a run's failure texts."""
    from pytest_dsrepro.tools import cli

    monkeypatch.setenv("COLUMNS", "300")  # the title whole
    (tmp_path / "a.toml").write_text(
        '[[fix]]\ncommit = "d9e12d3a68d16f87ff1396589be6b0ab5cbf10ff"\npr = 5101\n'
        f'title = {json.dumps(TEXTS["terminal"])}\nfirst = "0.14.1"\nissues = []\n'
        'area = "inference"\ndisposition = "not a fix"\nreason = "docs"\n'
    )
    assert cli.main(["ledger", "--ledger", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "overtype" in out
    assert terminal_leaks(out + err) == []


def test_the_verdicts_pytest_prints_run_no_escape(pytester: pytest.Pytester) -> None:
    """The plugin's terminal summary (``dsrepro verdicts``) says each UNEXPECTED test's error: a rank's exception
    message, which may hold anything. pytest's own traceback and short summary are pytest's (``--tb=no -rN``)."""
    pytester.makepyfile(f"""
        import pytest

        @pytest.mark.ds_version(affected=">=0", raises=ValueError)
        def test_hostile():
            raise RuntimeError({TEXTS["terminal"]!r})
    """)  # fmt: skip
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--tb=no", "-rN", timeout=120)
    out = result.stdout.str()
    assert "UNEXPECTED" in out
    assert "pwned title" in out
    assert terminal_leaks(out) == []
