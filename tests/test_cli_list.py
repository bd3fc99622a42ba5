"""dsrepro list: the catalogue comes from the markers, by pytest collection, without importing torch."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from pytest_dsrepro.core.results import repro_meta
from pytest_dsrepro.tools import catalogue, cli
from pytest_dsrepro.tools.catalogue import CollectedTest, Entry, entries_from_tests, format_table

EPILOGUE = """
import pytest

pytestmark = [
    pytest.mark.ds_repro(id="zero3-no-optimizer-backward", title="ZeRO-3 backward without optimizer",
                         upstream="https://example.invalid/issues/1", root_cause="no epilogue"),
    pytest.mark.ds_premise(stage=3, optimizer=False),
    pytest.mark.ds_world,
]

@pytest.mark.ds_config("zero3")
@pytest.mark.ds_version(affected="<0.18.3", raises=AttributeError, match="backward")
@pytest.mark.ds_version(affected=">=0.18.3,<0.19.5", raises=AttributeError, match="epilogue")
@pytest.mark.ds_version(">=0.19.5", raises=AttributeError, match="set_gradient")
def test_backward(ds_engine):
    import torch  # only in the body: collection never imports it
"""
MODULE_ID = """
import pytest

pytestmark = [
    pytest.mark.ds_repro(id="zero3-module-id", title="ZeRO-3 overwrites module.id",
                         upstream="https://example.invalid/issues/6772", fix_ref="PR 6847", fixed_in="0.16.4"),
    pytest.mark.ds_world,
]

@pytest.mark.ds_config("zero3", "zero3_offload")
@pytest.mark.ds_version(affected="<0.16.4", raises=AssertionError)
def test_ids(ds_engine):
    import deepspeed

def test_ids_again():
    pass
"""
PLAIN = """
def test_not_a_repro():
    pass
"""


@pytest.fixture
def repros(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.mkdir("repros")
    pytester.makepyfile(**{"repros/test_epilogue": EPILOGUE, "repros/test_module_id": MODULE_ID,
                           "repros/test_plain": PLAIN})  # fmt: skip
    pytester.chdir()
    return pytester


def test_table(repros: pytest.Pytester, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["ID", "AFFECTED", "FIXED", "IN", "TITLE"]
    assert lines[1].split() == ["zero3-no-optimizer-backward", "<0.18.3", "unfixed", "ZeRO-3", "backward", "without",
                                "optimizer"]  # fmt: skip
    assert lines[2].split() == [">=0.18.3,<0.19.5"]  # the ranges are alternatives: one a line
    assert lines[3].split() == [">=0.19.5"]
    assert lines[4] == "  https://example.invalid/issues/1"
    assert lines[5] == "  premise: ZeRO stage 3, no optimizer section"
    assert lines[6].split() == ["zero3-module-id", "<0.16.4", "0.16.4", "ZeRO-3", "overwrites", "module.id"]
    assert lines[7] == "  https://example.invalid/issues/6772"
    assert lines[8] == "  premise: not declared (a scan cannot tell whether a config can meet it)"
    # Aligned: every column starts at the same offset on every line.
    assert len({line.index("<0.") for line in (lines[1], lines[6])}) == 1
    assert lines[2].index(">=") == lines[1].index("<0.")
    assert len(lines) == 9


def test_the_catalogue_fits_120_columns(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The real catalogue (titles and upstream links as long as they come), in a wide and a narrow terminal."""
    monkeypatch.chdir(Path(__file__).parents[1])
    for columns, limit in (("300", 120), ("80", 80)):
        monkeypatch.setenv("COLUMNS", columns)
        assert cli.main(["list"]) == 0
        lines = capsys.readouterr().out.splitlines()
        links = ("  https://", "  at https://")  # a link is never broken: only one longer than the width passes it
        too_wide = [line for line in lines if len(line) > limit and not line.startswith(links)]
        assert not too_wide
        assert max(map(len, lines)) <= 120
    assert any(line.startswith("zero3-backward-without-optimizer ") for line in lines)  # ids in full, every one
    files = list(Path("repros").rglob("test_*.py"))  # in every folder
    assert len([line for line in lines if line.startswith("  https://")]) == len(files)
    assert not [line for line in lines if "premise: not declared" in line]
    assert any("DeepSpeedZeRoOffload" in line for line in lines)  # wrapped, not cut
    assert len([line for line in lines if line.startswith("  seen: ")]) >= len(files)
    assert "== ZeRO stage 3 (repros/zero3/) ==" in lines  # every folder of the catalogue, under its heading


def test_repros_are_listed_by_folder_under_its_heading(
    repros: pytest.Pytester, capsys: pytest.CaptureFixture[str]
) -> None:
    """The catalogue's folders in their order (core.areas), a folder of no subsystem after them by name, the repros at
    the top first; in the JSON, each repro's folder. All in one folder: no heading (``test_table``)."""
    for folder in ("zero3", "zero12", "mine"):
        (repros.path / "repros" / folder).mkdir()
    for name, folder in (("test_epilogue", "zero3"), ("test_module_id", "zero12")):
        (repros.path / "repros" / f"{name}.py").rename(repros.path / "repros" / folder / f"{name}.py")
    (repros.path / "repros" / "mine" / "test_mine.py").write_text(MODULE_ID.replace("zero3-module-id", "mine"))
    (repros.path / "repros" / "test_top.py").write_text(MODULE_ID.replace("zero3-module-id", "top"))
    assert cli.main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    headings = [line for line in lines if line.startswith("==")]
    assert headings == ["== At the top (repros/) ==", "== ZeRO stages 1 and 2 (repros/zero12/) ==",
                        "== ZeRO stage 3 (repros/zero3/) ==", "== mine (repros/mine/) =="]  # fmt: skip
    assert lines[lines.index(headings[1]) - 1] == ""
    assert lines[lines.index(headings[1]) + 1].split()[0] == "zero3-module-id"
    assert cli.main(["list", "repros/zero3", "repros/mine"]) == 0  # the folders under what is listed
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("==")] == [
        "== ZeRO stage 3 (repros/zero3/) ==", "== mine (repros/mine/) =="]  # fmt: skip
    assert cli.main(["list", "--format", "json"]) == 0
    assert {e["id"]: e["folder"] for e in json.loads(capsys.readouterr().out)} == {
        "top": "", "mine": "mine", "zero3-module-id": "zero12", "zero3-no-optimizer-backward": "zero3"}  # fmt: skip
    assert cli.main(["list", "--format", "markdown"]) == 0
    markdown = capsys.readouterr().out
    assert "\n## ZeRO stage 3 (`repros/zero3/`)\n\n| ID | TITLE |" in markdown


def test_a_long_title_wraps_under_its_column() -> None:
    entry = Entry("x", "word " * 60, "https://u", None, None, "", ("<1", ">=2"), "p", premise="ZeRO stage 3")
    lines = format_table([entry], width=60).splitlines()
    assert max(map(len, lines)) <= 60
    assert lines[-2:] == ["  https://u", "  premise: ZeRO stage 3"]
    column = lines[0].index("TITLE")
    assert all(line[column - 2 : column] == "  " and line[column] == "w" for line in lines[1:-2])
    assert "".join(line[column:] for line in lines[1:-2]).replace(" ", "") == "word" * 60


def test_json_merges_tests_of_one_repro(repros: pytest.Pytester, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["list", "repros/test_module_id.py", "--format", "json"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)
    assert entry["id"] == "zero3-module-id"
    assert entry["fixed_in"] == "0.16.4"
    assert entry["fix_ref"] == "PR 6847"
    assert entry["affected"] == ["<0.16.4"]
    assert entry["path"] == "repros/test_module_id.py"
    assert entry["tests"] == [
        "repros/test_module_id.py::test_ids[zero3]",
        "repros/test_module_id.py::test_ids[zero3_offload]",
        "repros/test_module_id.py::test_ids_again",
    ]


def test_docs_repros_md_holds_each_folders_table_and_its_repros(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/repros.md is the catalogue walked by folder: each folder's table exactly as ``dsrepro list --format
    markdown`` prints it (the markers are its one source), in that order, then a section for each of its repros,
    headed with its id and file."""
    monkeypatch.chdir(ROOT)
    entries = catalogue.collect(["repros"])  # as dsrepro list collects them
    paths = {e.id: Path(e.path).as_posix() for e in entries}
    blocks = [b.strip("\n") for b in re.split(r"^(?=## )", catalogue.render(entries, "markdown"), flags=re.M) if b]
    doc = (ROOT / "docs" / "repros.md").read_text()
    places = []
    for block in blocks:
        assert block in doc, (f"docs/repros.md has not this folder's table as `dsrepro list --format markdown` "
                              f"prints it; put it in place of the old one:\n\n{block}\n")  # fmt: skip
        places.append(doc.index(block))
    assert places == sorted(places)
    for block, start, end in zip(blocks, places, [*places[1:], len(doc)], strict=True):
        for repro in re.findall(r"^\| `([^`]+)` \|", block, re.MULTILINE):
            heading = f"\n### {repro} — `{paths[repro]}`\n"
            assert heading in doc[start:end], f"docs/repros.md has no section {heading.strip()} under its folder"


def test_markdown(repros: pytest.Pytester, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["list", "--format", "markdown"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "| ID | TITLE | UPSTREAM | AFFECTED | FIXED IN | PREMISE | SEEN AS |"
    assert out[2] == ("| `zero3-no-optimizer-backward` | ZeRO-3 backward without optimizer | "
                      "[https://example.invalid/issues/1](https://example.invalid/issues/1) | "
                      "`<0.18.3` \\| `>=0.18.3,<0.19.5` \\| `>=0.19.5` | unfixed | ZeRO stage 3, no optimizer section | - |")  # fmt: skip


def test_listing_writes_no_results_or_report(
    repros: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = repros.path / "out"
    monkeypatch.setenv("DSREPRO_RESULTS", str(out))
    monkeypatch.setenv("DSREPRO_REPORT", str(out / "report.md"))
    assert cli.main(["list"]) == 0
    assert not out.exists()
    assert os.environ["DSREPRO_RESULTS"] == str(out)  # and the environment is as it was


def test_collection_errors_and_empty(pytester: pytest.Pytester, capsys: pytest.CaptureFixture[str]) -> None:
    pytester.makepyfile(test_broken="import nonexistent_module_xyz\n", test_plain=PLAIN)
    pytester.chdir()
    assert cli.main(["list", "test_broken.py"]) == 1
    err = capsys.readouterr().err
    assert "dsrepro: pytest could not collect test_broken.py" in err
    assert "nonexistent_module_xyz" in err
    assert cli.main(["list", "test_plain.py"]) == 1
    assert capsys.readouterr().err == "dsrepro: no repros (tests with a ds_repro marker) under test_plain.py\n"
    assert cli.main(["list"]) == 2
    assert "no repros/ directory here" in capsys.readouterr().err


def test_list_imports_neither_torch_nor_deepspeed(repros: pytest.Pytester) -> None:
    code = (
        "import sys; from pytest_dsrepro.tools import cli; code = cli.main(['list']); "
        "heavy = sorted(m for m in ('torch', 'deepspeed') if m in sys.modules); "
        "print('HEAVY', heavy); sys.exit(code)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY []" in proc.stdout


def test_rows_merge_without_pytest() -> None:
    def row(nodeid: str, *affected: str) -> CollectedTest:
        meta = repro_meta((), {"title": "A"}, "/w/r/test_a.py", [((spec,), {}) for spec in affected])
        return CollectedTest(nodeid, "/w/r/test_a.py", meta)

    (entry,) = entries_from_tests([row("r/test_a.py::t[x]", "<1"), row("r/test_a.py::t[y]", "<1", ">=2")])
    assert entry.id == "a"
    assert entry.affected == ("<1", ">=2")
    assert entry.affected_text == "<1 | >=2"
    assert entry.fixed_text == "unfixed"
    assert len(entry.tests) == 2
    empty = Entry("x", "", None, None, None, "", (), "p")
    assert format_table([empty]).splitlines()[1:] == [
        "x   -         unfixed   -",
        "  upstream: -",
        "  premise: not declared (a scan cannot tell whether a config can meet it)",
    ]
