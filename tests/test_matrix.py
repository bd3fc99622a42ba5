"""dsrepro matrix: pure functions over results files written here through ``core.results`` (no torch, no worlds)."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import html.parser
import json
import os
import re
from pathlib import Path

import pytest

from pytest_dsrepro.core import results
from pytest_dsrepro.core.gates import Reason, Verdict
from pytest_dsrepro.core.results import Environment, ReproMeta, RunRecord, TestRecord
from pytest_dsrepro.tools import matrix
from pytest_dsrepro.tools.matrix import MatrixError, load, merge, render_html, render_markdown, render_terminal

EPILOGUE = "zero3-backward-without-optimizer"
MODULE_ID = "zero3-module-id-clobbered"


#: The reason a record of each verdict gives (any reason of that verdict would do for the matrix).
REASONS = {Verdict.REPRODUCED: Reason.REPRODUCED, Verdict.FIXED: Reason.NOT_AFFECTED,
           Verdict.PASSES_WITH_FIX: Reason.FIX_HOLDS, Verdict.UNEXPECTED: Reason.FAILED_DIFFERENTLY}  # fmt: skip


#: The affected ranges each repro declares (its ds_version markers).
DECLARED = {MODULE_ID: ("<0.16.4",), EPILOGUE: ("<0.18.3",)}


def rec(
    nodeid: str, verdict: str | None, *, repro: str | None = MODULE_ID, variant: str | None = "stock",
    outcome: str = "passed", error: str | None = None, reason: Reason | None = None,
    affected: tuple[str, ...] | None = None,
) -> TestRecord:  # fmt: skip
    """A test record as the plugin writes it."""
    declared = DECLARED.get(repro or "", ()) if affected is None else affected
    meta = None if repro is None else ReproMeta(repro, f"title of {repro}", f"https://x.invalid/{repro}",
                                                affected=declared)  # fmt: skip
    judged = Verdict(verdict) if verdict else None
    reason = reason or (REASONS.get(judged) if judged else None)
    return TestRecord(nodeid=nodeid, repro=meta, variant=variant, verdict=judged, reason=reason, outcome=outcome,
                      error=error, duration=1.0, config=None)  # fmt: skip


def write(
    directory: Path, version: str, tests: list[TestRecord], *, created: str = "2026-11-22T10:00:00+00:00",
    unavailable: str | None = None, name: str | None = None, torch: str = "2.13.0+cpu",
) -> Path:  # fmt: skip
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / (name or f"results-deepspeed-{version}-{len(list(directory.iterdir()))}.json")
    env = Environment(deepspeed=version, torch=torch, python="3.11.7", backend=None if unavailable else "gloo",
                      world_size=None if unavailable else 2, os="Linux", cpu=None, cpu_count=None, gpu=None,
                      gpu_count=None)  # fmt: skip
    run = RunRecord(created=datetime.datetime.fromisoformat(created), environment=env, unavailable=unavailable,
                    tests=tuple(tests))  # fmt: skip
    path.write_text(json.dumps(run.to_json()))
    return path


STOCK = "repros/test_module_id.py::test_user_id_survives[zero3-stock]"
FIXED = "repros/test_module_id.py::test_user_id_survives[zero3-fixed]"
EPI = "repros/test_epilogue.py::test_backward[zero3-stock]"


@pytest.fixture
def catalogue(tmp_path: Path) -> Path:
    """Four releases (given out of order), one of them unavailable, one UNEXPECTED cell."""
    d = tmp_path / "results"
    write(d, "0.16.4", [rec(STOCK, "FIXED"), rec(FIXED, "PASSES-WITH-FIX", variant="fixed"),
                        rec(EPI, "REPRODUCED", repro=EPILOGUE, outcome="xfailed", error="AttributeError: 'DeepSpeedZeRoOffload' object has no attribute 'backward'")])  # fmt: skip
    write(d, "0.16.3", [rec(STOCK, "REPRODUCED", outcome="xfailed", error="AssertionError: ids [7, 7] | [0, 1]"),
                        rec(FIXED, "PASSES-WITH-FIX", variant="fixed"),
                        rec(EPI, "REPRODUCED", repro=EPILOGUE, outcome="xfailed", error="AttributeError: 'DeepSpeedZeRoOffload' object has no attribute 'backward'")])  # fmt: skip
    write(d, "0.14.1", [], unavailable="import failed: AttributeError: module 'torch' has no attribute '_six'")
    write(d, "0.18.3", [rec(STOCK, "FIXED"), rec(FIXED, "UNEXPECTED", variant="fixed", outcome="failed",
                                                   error="RuntimeError: patch no longer applies")])  # fmt: skip
    return d


def build(paths: list[Path]) -> matrix.Matrix:
    files, warnings = load(paths)
    return merge(files, warnings)


def test_columns_sorted_by_version_not_by_string(tmp_path: Path) -> None:
    for v in ["0.9.0", "0.16.10", "0.16.3", "0.14.4"]:
        write(tmp_path, v, [rec(STOCK, "FIXED")])
    m = build([tmp_path])
    assert [c.version for c in m.columns] == ["0.9.0", "0.14.4", "0.16.3", "0.16.10"]


def test_rows_cells_and_labels(catalogue: Path) -> None:
    m = build([catalogue])
    assert [c.version for c in m.columns] == ["0.14.1", "0.16.3", "0.16.4", "0.18.3"]
    # one test for EPILOGUE: the row is the repro id; two for MODULE_ID: the parameters tell them apart, stock first
    assert [r.label for r in m.rows] == [EPILOGUE, f"{MODULE_ID} [zero3-stock]", f"{MODULE_ID} [zero3-fixed]"]
    stock = m.rows[1]
    assert [cell.verdict if (cell := m.cell(stock, c)) else None for c in m.columns] == [
        None, Verdict.REPRODUCED, Verdict.FIXED, Verdict.FIXED]  # fmt: skip
    assert m.cell(m.rows[0], m.columns[3]) is None  # EPILOGUE did not run on 0.18.3: "not run", not invented
    assert m.rows[0].upstream == f"https://x.invalid/{EPILOGUE}"


def test_unavailable_release_is_a_column_with_its_reason(catalogue: Path) -> None:
    m = build([catalogue])
    col = m.columns[0]
    assert col.unavailable_line == (
        "cannot run with torch 2.13.0+cpu: import failed: AttributeError: module 'torch' has no attribute '_six'"
    )
    assert "0.14.1: cannot run with torch 2.13.0+cpu" in render_terminal(m)
    assert "cannot run with torch 2.13.0+cpu" in render_markdown(m)
    assert "cannot run with torch 2.13.0+cpu" in render_html(m)
    assert matrix.exit_code(m) == 1  # because of the UNEXPECTED cell, not the unavailable release


def test_only_unavailable_releases_still_render(tmp_path: Path) -> None:
    write(tmp_path, "0.14.0", [], unavailable="import failed: CPU_Accelerator requires intel_extension_for_pytorch")
    m = build([tmp_path])
    assert m.rows == ()
    assert len(m.columns) == 1
    assert "intel_extension_for_pytorch" in render_html(m)
    assert "intel_extension_for_pytorch" in render_markdown(m)
    assert matrix.exit_code(m) == 0
    assert matrix.exit_code(m, fail_on_unavailable=True) == 1


def test_the_newest_file_that_ran_a_test_gives_its_cell(tmp_path: Path) -> None:
    old = write(tmp_path, "0.16.3", [rec(STOCK, "UNEXPECTED", outcome="failed", error="old")],
                created="2026-11-22T09:00:00+00:00", name="b-old.json")  # fmt: skip
    new = write(tmp_path, "0.16.3", [rec(STOCK, "REPRODUCED", outcome="xfailed")],
                created="2026-11-22T10:00:00+00:00", name="a-new.json")  # fmt: skip
    m = build([tmp_path])
    (col,) = m.columns
    assert col.source == new
    assert col.sources == (new, old)
    cell = m.cell(m.rows[0], col)
    assert cell is not None
    assert cell.verdict is Verdict.REPRODUCED
    assert cell.source == new
    assert matrix.exit_code(m) == 0
    assert "Merged: 0.16.3 from 2 results files (per test, the newest file that ran it)" in render_terminal(m)


def test_shards_make_one_column_and_disagreeing_files_are_named(tmp_path: Path) -> None:
    """``--ds-shard`` slices run on two machines: one column, every cell from the file that ran it, and nothing to
    say while they agree. A file that contradicts another about a test is named with every verdict, newest first."""
    one = write(tmp_path, "0.16.3", [rec(STOCK, "REPRODUCED", outcome="xfailed")], name="shard1.json")
    two = write(tmp_path, "0.16.3", [rec(FIXED, "PASSES-WITH-FIX", variant="fixed")], name="shard2.json")
    m = build([tmp_path])
    (col,) = m.columns
    assert {r.nodeid: (c.verdict.value, c.source) for r in m.rows if (c := m.cell(r, col))} == {
        STOCK: ("REPRODUCED", one),
        FIXED: ("PASSES-WITH-FIX", two),
    }
    assert m.disagreements == ()
    assert "disagree" not in render_terminal(m) + render_markdown(m)
    later = write(tmp_path, "0.16.3", [rec(STOCK, "UNEXPECTED", outcome="failed", error="x")], name="again.json",
                  created="2026-11-22T11:00:00+00:00")  # fmt: skip
    m = build([tmp_path])
    assert m.disagreements == (matrix.Disagreement(STOCK, "0.16.3", (("UNEXPECTED", later), ("REPRODUCED", one))),)
    terminal = render_terminal(m)
    assert "Files that disagree (the newest gives the cell):" in terminal
    assert "0.16.3  zero3-module-id-clobbered [zero3-stock]: UNEXPECTED (again.json); REPRODUCED (shard1.json)" in (
        terminal
    )
    assert "- 0.16.3 zero3-module-id-clobbered [zero3-stock]: UNEXPECTED (again.json); REPRODUCED (shard1.json)" in (
        render_markdown(m)
    )


def test_a_partial_rerun_never_empties_cells(tmp_path: Path) -> None:
    """``tox -e ds0163 -- -k module_id`` after a full run: its tests change, the others keep their cells."""
    full = write(tmp_path, "0.16.3", [rec(STOCK, "UNEXPECTED", outcome="failed", error="flaky gloo"),
                                      rec(FIXED, "PASSES-WITH-FIX", variant="fixed"),
                                      rec(EPI, "REPRODUCED", repro=EPILOGUE, outcome="xfailed")],
                 created="2026-11-22T09:00:00+00:00")  # fmt: skip
    partial = write(tmp_path, "0.16.3", [rec(STOCK, "REPRODUCED", outcome="xfailed")],
                    created="2026-11-22T10:00:00+00:00")  # fmt: skip
    m = build([tmp_path])
    (col,) = m.columns
    by_label = {r.label: m.cell(r, col) for r in m.rows}
    assert {label: (c.verdict.value, c.source) for label, c in by_label.items() if c} == {
        EPILOGUE: ("REPRODUCED", full),
        f"{MODULE_ID} [zero3-stock]": ("REPRODUCED", partial),
        f"{MODULE_ID} [zero3-fixed]": ("PASSES-WITH-FIX", full),
    }
    assert matrix.exit_code(m) == 0  # the UNEXPECTED of the full run is history: the re-run replaced it
    assert "not run" not in render_terminal(m)


def test_latest_file_wins_even_when_it_says_unavailable(tmp_path: Path) -> None:
    write(tmp_path, "0.16.3", [rec(STOCK, "REPRODUCED")], created="2026-11-22T09:00:00+00:00")
    write(tmp_path, "0.16.3", [], unavailable="pip failed", created="2026-11-22T11:00:00+00:00")
    (col,) = build([tmp_path]).columns
    assert col.unavailable == "pip failed"


def test_same_created_time_falls_back_to_file_time(tmp_path: Path) -> None:
    a = write(tmp_path, "0.16.3", [rec(STOCK, "FIXED")], name="z.json")
    b = write(tmp_path, "0.16.3", [rec(STOCK, "REPRODUCED")], name="a.json")
    os.utime(a, (1_000_000, 1_000_000))
    os.utime(b, (2_000_000, 2_000_000))
    (col,) = build([tmp_path]).columns
    assert col.source == b


def test_exit_code_zero_without_unexpected(tmp_path: Path) -> None:
    write(tmp_path, "0.16.3", [rec(STOCK, "REPRODUCED"), rec(FIXED, "PASSES-WITH-FIX", variant="fixed")])
    write(tmp_path, "0.16.4", [rec(STOCK, "FIXED"), rec(FIXED, "SKIPPED", variant="fixed", outcome="skipped",
                                                        error="no fix needed")])  # fmt: skip
    assert matrix.exit_code(build([tmp_path])) == 0


def test_failing_test_without_verdict_is_unexpected(tmp_path: Path) -> None:
    """A gated test whose world crashed in setup, or a plain test failing, must not vanish from the table."""
    write(tmp_path, "0.16.3", [
        rec(STOCK, None, outcome="error", error="world did not start"),
        rec("repros/test_plain.py::test_ok", None, repro=None, outcome="passed"),
        rec("repros/test_plain.py::test_bad", None, repro=None, outcome="failed", error="boom"),
    ])  # fmt: skip
    m = build([tmp_path])
    assert [r.label for r in m.rows] == ["(not a repro)", MODULE_ID]  # the passing plain test is not a row
    assert {c.verdict for c in m.cells.values()} == {Verdict.UNEXPECTED}
    assert "no verdict, pytest outcome error: world did not start" in " ".join(render_terminal(m).split())
    assert matrix.exit_code(m) == 1


def test_repro_id_title_and_upstream_come_from_the_record(tmp_path: Path) -> None:
    """``repro`` has one form, an object; a plain id (schema 1's contract example) is named as what is wrong."""
    write(tmp_path, "0.16.4", [rec(STOCK, "FIXED")])
    (row,) = build([tmp_path]).rows
    assert (row.repro, row.title, row.upstream) == (
        MODULE_ID,
        f"title of {MODULE_ID}",
        f"https://x.invalid/{MODULE_ID}",
    )
    flat = write(tmp_path, "0.16.3", [rec(STOCK, "FIXED")])
    data = json.loads(flat.read_text())
    data["tests"][0]["repro"] = MODULE_ID
    flat.write_text(json.dumps(data))
    _, warnings = load([tmp_path])
    assert warnings == [f"{flat}: ignored: tests[0] ({STOCK}): 'repro' must be an object or null, not a string"]


def test_markdown_table_and_footnotes(catalogue: Path) -> None:
    md = render_markdown(build([catalogue]))
    lines = md.splitlines()
    header = next(ln for ln in lines if ln.startswith("| repro"))
    assert header == "| repro | declared affected | 0.14.1 | 0.16.3 | 0.16.4 | 0.18.3 |"
    stock = next(ln for ln in lines if ln.startswith(f"| [{MODULE_ID} [zero3-stock]]"))
    assert "| `<0.16.4` | n/a | REPRODUCED [^" in stock
    fixed = next(ln for ln in lines if ln.startswith(f"| [{MODULE_ID} [zero3-fixed]]"))
    assert "| _with fix_ |" in fixed
    epilogue = next(ln for ln in lines if ln.startswith(f"| [{EPILOGUE}]"))
    note = epilogue.rsplit("_not run_", 1)[1].split(" |")[0]  # every cell without a verdict has its footnote
    assert f"{note}: not run: no results file of 0.18.3 ran this test" in lines
    table = [ln for ln in lines if ln.startswith("|")]
    assert len({ln.count(" | ") - ln.count("\\|") for ln in table if not ln.startswith("|---")}) == 1, table
    assert "_torch 2.13.0+cpu, gloo, 2 ranks_" in md
    # same error on two releases: one footnote; a pipe inside an error cannot break the table
    assert md.count("object has no attribute 'backward'") == 1
    assert "**UNEXPECTED**" in md
    notes = [ln for ln in lines if ln.startswith("[^")]
    assert any("RuntimeError: patch no longer applies" in n for n in notes)
    assert any("ids [7, 7] | [0, 1]" in n for n in notes)
    assert f"[{MODULE_ID} \\[zero3-stock\\]]" not in md  # labels are link text, brackets kept readable
    assert f"https://x.invalid/{MODULE_ID}" in md


class _Cells(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.cells: list[dict[str, str | None]] = []
        self.tags: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        if tag == "td":
            self.cells.append(dict(attrs))


def test_html_is_self_contained_with_colours_and_tooltips(catalogue: Path) -> None:
    page = render_html(build([catalogue]))
    parser = _Cells()
    parser.feed(page)
    assert "script" not in parser.tags
    assert "link" not in parser.tags
    assert "img" not in parser.tags
    assert "<style>" in page
    assert "td.UNEXPECTED { background:" in page
    unexpected = [c for c in parser.cells if c.get("class") == "UNEXPECTED" and c.get("title")]
    assert unexpected
    assert unexpected[0]["title"] == "RuntimeError: patch no longer applies"
    reproduced = [c for c in parser.cells if c.get("class") == "REPRODUCED"]
    assert any(c.get("title") == "AssertionError: ids [7, 7] | [0, 1]" for c in reproduced)
    (unavailable,) = [c for c in parser.cells if c.get("class") == "unavailable"]
    assert unavailable["rowspan"] == "3"
    assert "torch 2.13.0+cpu, gloo, 2 ranks" in page


def test_html_escapes_everything(tmp_path: Path) -> None:
    write(tmp_path, "0.16.3", [rec(STOCK, "UNEXPECTED", outcome="failed", error='<script>alert("x")</script>')])
    page = render_html(build([tmp_path]))
    assert "<script>" not in page
    assert "&lt;script&gt;" in page


def test_terminal_table(catalogue: Path) -> None:
    text = render_terminal(build([catalogue]))
    lines = text.splitlines()
    assert lines[0].startswith("DeepSpeed repro matrix: 3 rows x 4 releases (")
    assert "all releases: torch 2.13.0+cpu, gloo, 2 ranks" in text  # the unavailable column has the same torch
    assert lines[4].split() == ["repro", "declared", "0.14.1", "0.16.3", "0.16.4", "0.18.3"]
    assert lines[5].split() == ["UNAVAILABLE"]
    row = next(ln for ln in lines if ln.startswith(f"{MODULE_ID} [zero3-fixed]"))
    assert row.split()[2:] == ["(with", "fix)", "n/a", "PASSES-WITH-FIX", "PASSES-WITH-FIX", "UNEXPECTED"]
    stock = next(ln for ln in lines if ln.startswith(f"{MODULE_ID} [zero3-stock]"))
    assert stock.split()[2:] == ["<0.16.4", "n/a", "REPRODUCED", "FIXED", "FIXED"]
    assert "\033[" not in text
    assert "0.18.3  " + FIXED + ": RuntimeError: patch no longer applies" in text
    coloured = render_terminal(build([catalogue]), color=True)
    assert "\033[1;31mUNEXPECTED" in coloured


def test_terminal_says_common_environment_once(tmp_path: Path) -> None:
    write(tmp_path, "0.16.3", [rec(STOCK, "REPRODUCED")])
    write(tmp_path, "0.16.4", [rec(STOCK, "FIXED")])
    text = render_terminal(build([tmp_path]))
    assert "all releases: torch 2.13.0+cpu, gloo, 2 ranks" in text


def test_terminal_heads_each_column_when_environments_differ(tmp_path: Path) -> None:
    write(tmp_path, "0.16.3", [rec(STOCK, "REPRODUCED")], torch="2.12.0+cpu")
    write(tmp_path, "0.16.4", [rec(STOCK, "FIXED")])
    write(tmp_path, "0.14.1", [], unavailable="import failed")
    lines = render_terminal(build([tmp_path])).splitlines()
    assert "all releases" not in "\n".join(lines)
    assert lines[2].split() == ["repro", "declared", "0.14.1", "0.16.3", "0.16.4"]
    assert lines[3].split() == ["torch", "2.13.0+cpu", "torch", "2.12.0+cpu", "torch", "2.13.0+cpu"]
    assert lines[4].split() == ["UNAVAILABLE", "gloo,", "2", "ranks", "gloo,", "2", "ranks"]


def test_load_warns_about_foreign_and_broken_json(tmp_path: Path) -> None:
    write(tmp_path, "0.16.3", [rec(STOCK, "FIXED")])
    (tmp_path / "package.json").write_text('{"name": "x"}')
    (tmp_path / "half.json").write_text('{"schema": 2, "crea')
    (tmp_path / "future.json").write_text(json.dumps({"schema": results.SCHEMA + 1, "environment": {}, "tests": []}))
    (tmp_path / "old.json").write_text('{"schema": 1, "environment": {"platform": "Linux"}, "tests": []}')
    files, warnings = load([tmp_path])
    assert len(files) == 1
    assert sorted(Path(w.split(":")[0]).name for w in warnings) == ["future.json", "half.json", "old.json",
                                                                   "package.json"]  # fmt: skip
    only = f"this pytest-dsrepro reads results files of schema {results.SCHEMA} only"
    assert any(f"schema {results.SCHEMA + 1}: {only}" in w for w in warnings)
    assert any(f"schema 1: {only}" in w for w in warnings)


def test_no_files_is_a_usage_error_naming_the_directory(tmp_path: Path) -> None:
    with pytest.raises(MatrixError, match=f"no pytest-dsrepro results files in {tmp_path}"):
        load([tmp_path])
    with pytest.raises(MatrixError, match="no such file or directory"):
        load([tmp_path / "missing"])


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    matrix.add_arguments(parser)
    return parser.parse_args(argv)


def test_run_writes_outputs_and_exits_1_on_unexpected(catalogue: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert matrix.run(_args(str(catalogue), "--color", "never")) == 1
    out = capsys.readouterr().out
    assert "UNEXPECTED" in out
    assert (catalogue / "matrix.md").read_text().startswith("# DeepSpeed repro matrix")
    assert (catalogue / "matrix.html").read_text().startswith("<!DOCTYPE html>")
    # the outputs are not results files: a second run reads the same four releases and nothing else
    assert matrix.run(_args(str(catalogue), "--no-write")) == 1
    assert "dsrepro matrix: warning" not in capsys.readouterr().err


def test_run_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert matrix.run(_args(str(tmp_path / "nothing"))) == 2
    assert capsys.readouterr().err.strip() == f"dsrepro matrix: no such file or directory: {tmp_path / 'nothing'}"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert matrix.run(_args(str(empty))) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert str(empty) in err
    write(tmp_path / "ok", "0.16.3", [rec(STOCK, "REPRODUCED")])
    out_md = tmp_path / "out" / "m.md"
    assert matrix.run(_args(str(tmp_path / "ok"), "--markdown", str(out_md), "--html", str(tmp_path / "m.html"))) == 0
    assert out_md.exists()
    assert (tmp_path / "m.html").exists()


def test_importing_matrix_needs_no_torch() -> None:
    import subprocess
    import sys

    code = "import sys, pytest_dsrepro.tools.matrix, pytest_dsrepro.tools.install; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


# --- a matrix that tells the truth at a glance ------------------------------------------------------------------------

RELEASES = ["0.14.4", "0.15.4", "0.16.3", "0.16.4", "0.17.6", "0.18.3", "0.18.9", "0.19.8"]
LONG = "repros/test_zero3_backward_without_optimizer.py::test_backward_on_zero3_engine_without_optimizer"


def _eight_releases(d: Path) -> None:
    """The catalogue's shape on tox's eight releases: long labels, stock and fixed rows, a skip, a hole."""
    for v in RELEASES:
        tests = [
            rec(f"{LONG}[zero3-stock]", "REPRODUCED", repro=EPILOGUE, outcome="xfailed", affected=("<99",)),
            rec(f"{LONG}[zero3-fixed]", "PASSES-WITH-FIX", repro=EPILOGUE, variant="fixed", affected=("<99",)),
        ]
        if v != "0.17.6":
            tests.append(rec(STOCK, "REPRODUCED" if v < "0.16.4" else "FIXED"))
        if v == "0.19.8":
            tests.append(rec(FIXED, "SKIPPED", variant="fixed", outcome="skipped", error="no fix needed past 0.16.4"))
        write(d, v, tests)  # fmt: skip


def test_the_terminal_table_fits_120_columns(tmp_path: Path) -> None:
    _eight_releases(tmp_path)
    m = build([tmp_path])
    text = render_terminal(m)
    assert max(len(line) for line in text.splitlines()) <= 120, text
    assert "REPRO" in text
    legend = " ".join(text.split("Legend: ")[1].split("\n\n")[0].split())
    assert legend == (
        "REPRO REPRODUCED, N/YET NOT-YET-AFFECTED, W/FIX PASSES-WITH-FIX, UNEXP UNEXPECTED, N/APP NOT-APPLICABLE, "
        "SKIP SKIPPED, - not run"
    )
    assert all(v in text for v in RELEASES)  # every release, in one table or several
    narrow = render_terminal(m, width=80)
    assert max(len(line) for line in narrow.splitlines()) <= 80, narrow
    assert [line.split()[:2] for line in narrow.splitlines() if line.startswith("repro ")] == [
        ["repro", "declared"]
    ] * 2
    roomy = render_terminal(m, width=400)
    assert "PASSES-WITH-FIX" in roomy  # full names when they fit
    assert "Legend" not in roomy


def test_every_cell_without_a_verdict_says_why(tmp_path: Path) -> None:
    _eight_releases(tmp_path)
    text = render_terminal(build([tmp_path]), width=400)
    notes = text.split("Cells with no judged run:")[1]
    assert f"{MODULE_ID} [zero3-stock]: not run: no results file of the release ran this test (on 0.17.6)" in notes
    assert (f"{MODULE_ID} [zero3-fixed]: not run: no results file of the release ran this test (on 0.14.4, 0.15.4, "
            "0.16.3, 0.16.4, 0.17.6, 0.18.3, 0.18.9)") in notes  # fmt: skip
    assert f"{MODULE_ID} [zero3-fixed]: SKIPPED: no fix needed past 0.16.4 (on 0.19.8)" in notes
    md = render_markdown(build([tmp_path]))
    assert "no fix needed past 0.16.4" in md
    assert "not run: no results file of 0.17.6 ran this test" in md


def test_cells_against_the_declared_range_are_marked(tmp_path: Path) -> None:
    write(tmp_path, "0.16.3", [rec(STOCK, "UNEXPECTED", outcome="failed", error="did not reproduce: passed",
                                   reason=Reason.DID_NOT_REPRODUCE)])  # fmt: skip
    write(tmp_path, "0.18.3", [rec(STOCK, "UNEXPECTED", outcome="failed", error="regression",
                                   reason=Reason.REGRESSION)])  # fmt: skip
    # judged under an older declaration (affected <0.17): the newest record now declares <0.16.4
    write(tmp_path, "0.16.9", [rec(STOCK, "REPRODUCED", outcome="xfailed", affected=("<0.17",))],
          created="2026-11-21T10:00:00+00:00")  # fmt: skip
    write(tmp_path, "0.16.4", [rec(STOCK, "FIXED"), rec(FIXED, "UNEXPECTED", variant="fixed", outcome="failed",
                                                        reason=Reason.FIX_DOES_NOT_HOLD)])  # fmt: skip
    m = build([tmp_path])
    stock, fixed = m.rows
    assert stock.declared == ("<0.16.4",)
    marked = {c.version: cell.contradicts for c in m.columns if (cell := m.cell(stock, c))}
    assert marked == {"0.16.3": True, "0.16.4": False, "0.16.9": True, "0.18.3": True}
    fix_cells = [m.cell(fixed, c) for c in m.columns]
    assert not any(cell.contradicts for cell in fix_cells if cell)  # a fix row says nothing of the range
    text = render_terminal(m)
    row = next(ln for ln in text.splitlines() if ln.startswith(f"{MODULE_ID} [zero3-stock]"))
    assert row.split()[2:] == ["<0.16.4", "UNEXPECTED!", "FIXED", "REPRODUCED!", "UNEXPECTED!"]
    against = text.split("Against the declared range (!):")[1]
    assert (
        "0.16.3  zero3-module-id-clobbered [zero3-stock]: the body passed inside the declared range (<0.16.4)"
        in against
    )
    assert "0.16.9  zero3-module-id-clobbered [zero3-stock]: the body failed outside the declared range" in against
    assert "3 against the declared range" in text.splitlines()[0] + text.splitlines()[1]
    md = render_markdown(m)
    assert "REPRODUCED [^" in md
    assert "against the declared range (<0.16.4): reproduced" in md
    assert 'class="REPRODUCED contradicts"' in render_html(m)


def test_since_marks_the_cells_that_changed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    write(old, "0.16.3", [rec(STOCK, "FIXED"), rec(EPI, "REPRODUCED", repro=EPILOGUE, outcome="xfailed")])
    write(old, "0.16.4", [rec(STOCK, "FIXED")])
    write(new, "0.16.3", [rec(STOCK, "REPRODUCED", outcome="xfailed"), rec(FIXED, "PASSES-WITH-FIX", variant="fixed")])
    write(new, "0.16.4", [rec(STOCK, "FIXED")])
    m = matrix.since(build([new]), build([old]), [old])
    assert [(r.label, c.version, before, now) for r, c, before, now in m.changes()] == [
        (f"{MODULE_ID} [zero3-stock]", "0.16.3", "FIXED", "REPRODUCED"),
        (f"{MODULE_ID} [zero3-fixed]", "0.16.3", "not run", "PASSES-WITH-FIX"),
    ]
    assert m.gone == ((EPILOGUE, "0.16.3", "REPRODUCED"),)
    text = render_terminal(m)
    row = next(ln for ln in text.splitlines() if ln.startswith(f"{MODULE_ID} [zero3-stock]"))
    assert row.split()[2:] == ["<0.16.4", "REPRODUCED~", "FIXED"]
    assert "Changed since the older results: 2 cells" in text
    assert f"0.16.3  {EPILOGUE}: REPRODUCED -> no longer in the results" in text
    assert f"~ changed since {old}" in text
    assert "REPRODUCED (was FIXED)" in render_markdown(m)
    assert 'class="REPRODUCED changed" title="was FIXED"' in render_html(m)
    # the command: --since DIR
    assert matrix.run(_args(str(new), "--since", str(old), "--no-write", "--color", "never")) == 0
    assert "REPRODUCED~" in capsys.readouterr().out
    assert matrix.run(_args(str(new), "--since", str(tmp_path / "nope"), "--no-write")) == 2
    assert "--since: no such file or directory" in capsys.readouterr().err


def test_not_applicable_and_prerequisite_cells_say_why_in_every_rendering(tmp_path: Path) -> None:
    """A release the repro declares out of reach is its own verdict with its reason; a run that had another bug's
    fix applied first is marked, and the fix is named, in the terminal, Markdown and HTML tables alike."""
    masked = "masking bug (PR #7948) breaks every ZeRO-1/2 step on CPU"
    na = rec(STOCK, "NOT-APPLICABLE", outcome="skipped", reason=Reason.NOT_APPLICABLE,
             error="not applicable on deepspeed 0.14.4: deepspeed<0.15: the API it needs is missing")  # fmt: skip
    write(tmp_path, "0.14.4", [na])
    write(
        tmp_path, "0.18.8", [dataclasses.replace(rec(STOCK, "FIXED"), prerequisites=(f"deepspeed>=0.18.7: {masked}",))]
    )
    m = build([tmp_path])
    terminal = render_terminal(m)
    assert re.search(r"NOT-APPLICABLE +FIXED\+", terminal), terminal
    assert "+ with another bug's fix applied first" in terminal
    notes = " ".join(terminal.split())
    assert (
        "NOT-APPLICABLE: not applicable on deepspeed 0.14.4: deepspeed<0.15: the API it needs is missing (on 0.14.4)"
        in notes
    )
    assert f"With a prerequisite fix (+): {MODULE_ID}: deepspeed>=0.18.7: {masked} (on 0.18.8)" in notes
    assert not m.contradictions()  # no body ran on 0.14.4: nothing to hold against the range
    markdown = render_markdown(m)
    assert f"with the prerequisite fix for deepspeed>=0.18.7: {masked}" in markdown
    assert re.search(r"\| NOT-APPLICABLE \[\^\d\] \| FIXED \[\^\d\] \+ \|", markdown), markdown
    page = render_html(m)
    assert 'class="FIXED prerequisite"' in page
    assert 'class="NOT-APPLICABLE"' in page
