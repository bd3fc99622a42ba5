"""dsrepro matrix: the model and its renderers, pure functions over results files written here through
``core.results`` (no torch, no worlds). The page's width, the image and the command's faults: test_matrix_page.py,
test_matrix_command.py."""

from __future__ import annotations

import html.parser
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from matrix_records import EPI, EPILOGUE, FIXED, MODULE_ID, RELEASES, STOCK, rec, write

from pytest_dsrepro.core import results
from pytest_dsrepro.core.gates import Rate, Reason, Verdict
from pytest_dsrepro.core.outcome import Measurement
from pytest_dsrepro.core.results import Origin
from pytest_dsrepro.tools import matrix, matrix_command
from pytest_dsrepro.tools.matrix import MatrixError, load, merge, render_html, render_markdown, render_terminal, symbols

ERROR_0163 = "AssertionError: ids [7, 7] | [0, 1]"


@pytest.fixture
def catalogue(tmp_path: Path) -> Path:
    """Four releases (given out of order), one of them unavailable, one UNEXPECTED run."""
    d = tmp_path / "results"
    write(d, "0.16.4", [rec(STOCK, "FIXED"), rec(FIXED, "PASSES-WITH-FIX", variant="fixed"),
                        rec(EPI, "REPRODUCED", repro=EPILOGUE, outcome="xfailed", error="REPRODUCED on 0.16.4: x",
                            raised="AttributeError: 'DeepSpeedZeRoOffload' object has no attribute 'backward'")])  # fmt: skip
    write(d, "0.16.3", [rec(STOCK, "REPRODUCED", outcome="xfailed", error=f"REPRODUCED: {ERROR_0163}",
                            raised=ERROR_0163),
                        rec(FIXED, "PASSES-WITH-FIX", variant="fixed"),
                        rec(EPI, "REPRODUCED", repro=EPILOGUE, outcome="xfailed", error="REPRODUCED on 0.16.3: x",
                            raised="AttributeError: 'DeepSpeedZeRoOffload' object has no attribute 'backward'")])  # fmt: skip
    write(d, "0.14.1", [], unavailable="import failed: AttributeError: module 'torch' has no attribute '_six'")
    write(d, "0.18.3", [rec(STOCK, "FIXED"), rec(FIXED, "UNEXPECTED", variant="fixed", outcome="failed",
                                                   error="RuntimeError: patch no longer applies")])  # fmt: skip
    return d


def build(paths: list[Path]) -> matrix.Matrix:
    return merge(*load(paths))


def verdicts(m: matrix.Matrix, row: matrix.Row) -> list[tuple[str | None, str | None]]:
    """Each column's (stock, fixed) verdicts of ``row``."""
    found = []
    for c in m.columns:
        cell = m.cell(row, c)
        found.append(tuple(r.verdict.value if r else None for r in (cell.stock, cell.fixed)) if cell else (None, None))
    return found  # type: ignore[return-value]


# --- the model ---------------------------------------------------------------------------------------------------


def test_columns_sorted_by_version_not_by_string(tmp_path: Path) -> None:
    for v in ["0.9.0", "0.16.10", "0.16.3", "0.14.4"]:
        write(tmp_path, v, [rec(STOCK, "FIXED")])
    m = build([tmp_path])
    assert [c.version for c in m.columns] == ["0.9.0", "0.14.4", "0.16.3", "0.16.10"]


def test_one_row_per_bug_and_config_with_stock_and_fixed_in_one_cell(catalogue: Path) -> None:
    m = build([catalogue])
    assert [c.version for c in m.columns] == ["0.14.1", "0.16.3", "0.16.4", "0.18.3"]
    assert [(r.repro, r.label, r.stock, r.fixed) for r in m.rows] == [
        (EPILOGUE, "zero3", EPI, None),  # a test without a fix: its row has the stock test only
        (MODULE_ID, "zero3", STOCK, FIXED),
    ]
    epilogue, module_id = m.rows
    assert verdicts(m, module_id) == [(None, None), ("REPRODUCED", "PASSES-WITH-FIX"), ("FIXED", "PASSES-WITH-FIX"),
                                      ("FIXED", "UNEXPECTED")]  # fmt: skip
    assert m.cell(epilogue, m.columns[3]) is None  # EPILOGUE did not run on 0.18.3: "not run", not invented
    assert epilogue.upstream == f"https://x.invalid/{EPILOGUE}"
    assert module_id.declared == ("<0.16.4",)
    assert [(name, [r.label for r in rows]) for name, rows in m.groups()] == [(EPILOGUE, ["zero3"]),
                                                                               (MODULE_ID, ["zero3"])]  # fmt: skip


def test_rows_of_a_repro_with_several_tests_say_what_tells_them_apart(tmp_path: Path) -> None:
    base = "repros/test_a.py::test_"
    write(tmp_path, "0.16.3", [
        rec(f"{base}one[zero2-stock]", "FIXED"), rec(f"{base}one[zero2-fixed]", "PASSES-WITH-FIX", variant="fixed"),
        rec(f"{base}two[zero2-stock]", "FIXED"), rec(f"{base}two", "FIXED", variant=None),
    ])  # fmt: skip
    m = build([tmp_path])
    assert [(r.label, r.stock is not None, r.fixed is not None) for r in m.rows] == [
        ("test_one[zero2]", True, True), ("test_two", True, False), ("test_two[zero2]", True, False)]  # fmt: skip


def test_unavailable_release_is_a_column_with_its_reason(catalogue: Path) -> None:
    m = build([catalogue])
    col = m.columns[0]
    assert col.unavailable_line == (
        "cannot run with torch 2.13.0+cpu: import failed: AttributeError: module 'torch' has no attribute '_six'"
    )
    assert "0.14.1: cannot run with torch 2.13.0+cpu" in render_terminal(m)
    assert "cannot run with torch 2.13.0+cpu" in render_markdown(m)
    assert "cannot run with torch 2.13.0+cpu" in render_html(m)
    # the UNEXPECTED run, not the unavailable release
    assert matrix_command.exit_code(m) == matrix_command.Exit.UNEXPECTED


def test_only_unavailable_releases_still_render(tmp_path: Path) -> None:
    write(tmp_path, "0.14.0", [], unavailable="import failed: CPU_Accelerator requires intel_extension_for_pytorch")
    m = build([tmp_path])
    assert m.rows == ()
    assert len(m.columns) == 1
    for rendered in (render_html(m), render_markdown(m), render_terminal(m), matrix.render_svg(m)):
        assert "intel_extension_for_pytorch" in rendered or "0.14" in rendered
    assert "intel_extension_for_pytorch" in render_html(m) + render_markdown(m) + render_terminal(m)
    assert matrix_command.exit_code(m) == 0
    assert matrix_command.exit_code(m, fail_on_unavailable=True) == 1


def test_the_newest_file_that_ran_a_test_gives_its_run(tmp_path: Path) -> None:
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
    assert cell.stock is not None
    assert cell.stock.verdict is Verdict.REPRODUCED
    assert cell.stock.source == new
    assert matrix_command.exit_code(m) == 0
    assert "0.16.3: 2 results files (per test, the newest file that ran it)" in render_terminal(m)


def test_shards_make_one_column_and_disagreeing_files_are_named(tmp_path: Path) -> None:
    """``--ds-shard`` slices run on two machines: one column, every run from the file that ran it, and nothing to
    say while they agree. A file that contradicts another about a test is named with every verdict, newest first."""
    one = write(tmp_path, "0.16.3", [rec(STOCK, "REPRODUCED", outcome="xfailed")], name="shard1.json")
    two = write(tmp_path, "0.16.3", [rec(FIXED, "PASSES-WITH-FIX", variant="fixed")], name="shard2.json")
    m = build([tmp_path])
    (row,), (col,) = m.rows, m.columns
    cell = m.cell(row, col)
    assert cell is not None
    assert cell.stock is not None
    assert cell.fixed is not None
    assert (cell.stock.verdict, cell.stock.source, cell.fixed.verdict, cell.fixed.source) == (
        Verdict.REPRODUCED, one, Verdict.PASSES_WITH_FIX, two)  # fmt: skip
    assert m.disagreements == ()
    assert "disagree" not in render_terminal(m) + render_markdown(m)
    later = write(tmp_path, "0.16.3", [rec(STOCK, "UNEXPECTED", outcome="failed", error="x")], name="again.json",
                  created="2026-11-22T11:00:00+00:00")  # fmt: skip
    m = build([tmp_path])
    assert m.disagreements == (matrix.Disagreement(STOCK, "0.16.3", (("UNEXPECTED", later), ("REPRODUCED", one))),)
    told = f"0.16.3  {MODULE_ID} [zero3]: UNEXPECTED (again.json); REPRODUCED (shard1.json)"
    assert "Files that disagree (the newest gives the cell):" in render_terminal(m)
    assert told in render_terminal(m)
    assert f"- {' '.join(told.split('  '))}" in render_markdown(m)


def test_a_partial_rerun_never_empties_cells(tmp_path: Path) -> None:
    """``tox -e ds0163 -- -k module_id`` after a full run: its tests change, the others keep their runs."""
    full = write(tmp_path, "0.16.3", [rec(STOCK, "UNEXPECTED", outcome="failed", error="flaky gloo"),
                                      rec(FIXED, "PASSES-WITH-FIX", variant="fixed"),
                                      rec(EPI, "REPRODUCED", repro=EPILOGUE, outcome="xfailed")],
                 created="2026-11-22T09:00:00+00:00")  # fmt: skip
    partial = write(tmp_path, "0.16.3", [rec(STOCK, "REPRODUCED", outcome="xfailed")],
                    created="2026-11-22T10:00:00+00:00")  # fmt: skip
    m = build([tmp_path])
    sources = {(run.nodeid, run.verdict.value, run.source) for _, _, run in m.placed()}
    assert sources == {(EPI, "REPRODUCED", full), (STOCK, "REPRODUCED", partial), (FIXED, "PASSES-WITH-FIX", full)}
    assert matrix_command.exit_code(m) == 0  # the UNEXPECTED of the full run is history: the re-run replaced it
    assert "not run" not in render_terminal(m)


def test_latest_file_wins_even_when_it_says_unavailable(tmp_path: Path) -> None:
    write(tmp_path, "0.16.3", [rec(STOCK, "REPRODUCED")], created="2026-11-22T09:00:00+00:00")
    write(tmp_path, "0.16.3", [], unavailable="pip failed", created="2026-11-22T11:00:00+00:00")
    m = build([tmp_path])
    (col,) = m.columns
    assert col.unavailable == "pip failed"
    assert list(m.placed()) == []  # what it said before is history, not a cell


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
    assert matrix_command.exit_code(build([tmp_path])) == 0


def test_failing_test_without_verdict_is_unexpected(tmp_path: Path) -> None:
    """A gated test whose world crashed in setup, or a plain test failing, must not vanish from the table."""
    write(tmp_path, "0.16.3", [
        rec(STOCK, None, outcome="error", error="world did not start"),
        rec("repros/test_plain.py::test_ok", None, repro=None, outcome="passed"),
        rec("repros/test_plain.py::test_bad", None, repro=None, outcome="failed", error="boom"),
    ])  # fmt: skip
    m = build([tmp_path])
    assert [r.name for r in m.rows] == ["(not a repro) [test_bad]", f"{MODULE_ID} [zero3]"]  # test_ok is no row
    assert {run.verdict for _, _, run in m.placed()} == {Verdict.UNEXPECTED}
    assert "no verdict, pytest outcome error: world did not start" in " ".join(render_terminal(m).split())
    assert matrix_command.exit_code(m) == 1


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
    _, unreadable = load([tmp_path])
    assert [(u.path, u.kind, u.release) for u in unreadable] == [(flat, "invalid", "0.16.3")]
    assert unreadable[0].problem.startswith(
        f"not a valid schema-{results.SCHEMA} results file: tests[0] ({STOCK}): 'repro' must be an object or null, "
        "not a string; edited or damaged: run its tests again, or delete it"
    )


def test_every_verdict_has_a_symbol_a_colour_and_words() -> None:
    """A verdict the gates add is drawn by every form once it has its ``Kind``: this fails until it has one."""
    for v in Verdict:
        kind = symbols.KINDS[v.value]
        assert kind.glyph
        assert kind.ascii
        assert kind.words
        assert kind.fill.startswith("#")
    glyphs = [k.glyph for k in symbols.KINDS.values()]
    assert len(set(glyphs)) == len(glyphs)
    assert len({k.ascii for k in symbols.KINDS.values()}) == len(glyphs)


# --- the terminal ------------------------------------------------------------------------------------------------


def table_lines(text: str) -> list[str]:
    """The table's lines, from its first header line to the blank line after it."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("bug / config")) - 1
    end = next(i for i in range(start, len(lines)) if not lines[i].strip() and i > start)
    return lines[start:end]


def test_terminal_table(catalogue: Path) -> None:
    text = render_terminal(build([catalogue]))
    lines = text.splitlines()
    assert lines[0].startswith("DeepSpeed repro matrix: 2 bugs in 2 rows x 4 DeepSpeed releases: ")
    assert "torch 2.13.0+cpu, gloo, every test in a world of 2 ranks" in text  # the unavailable one included
    table = table_lines(text)
    assert table == [
        "            0.14 0.16   0.18",
        "bug / config  .1   .3 .4  .3",
        f"{EPILOGUE} (affected <0.18.3)",
        "  zero3      [//   ●  ● ] ·",  # no fixed twin; not run on 0.18.3; unavailable on 0.14.1
        f"{MODULE_ID} (affected <0.16.4)",
        "  zero3      [//   ●✓]○✓  ○✗",
    ]
    assert "\033[" not in text
    assert f"0.18.3  {FIXED}: RuntimeError: patch no longer applies" in text
    coloured = render_terminal(build([catalogue]), color=True)
    assert "\033[1;31m✗\033[0m" in coloured
    legend = " ".join(text.split("Legend: ")[1].split("\n\n")[0].split())
    assert legend == (
        "each cell: the stock run, then the run with the fix; [ ] the declared affected range; ● reproduced as "
        "declared; ○ fixed: the stock code passes, newer than the bug; ✓ passes with the repro's fix; ✗ UNEXPECTED: "
        "look at it; · not run on this release; / the release cannot run here"
    )


def test_terminal_prints_letters_where_it_has_no_symbols(catalogue: Path) -> None:
    text = render_terminal(build([catalogue]), ascii_only=True)
    assert "  zero3      [//   RW]FW  FU" in text
    assert text.isascii()
    code = "import sys; from pytest_dsrepro.tools.cli import main; sys.exit(main(sys.argv[1:]))"
    run = subprocess.run([sys.executable, "-c", code, "matrix", str(catalogue), "--no-write"], capture_output=True,
                         env={**os.environ, "PYTHONIOENCODING": "ascii"}, text=True, encoding="ascii")  # fmt: skip
    assert run.returncode == 1, run.stderr
    assert "[//   RW]FW  FU" in run.stdout


def test_environments_that_differ_are_each_said_with_their_releases(tmp_path: Path) -> None:
    write(tmp_path, "0.16.3", [rec(STOCK, "REPRODUCED")], torch="2.12.0+cpu")
    write(tmp_path, "0.16.4", [rec(STOCK, "FIXED")])
    write(tmp_path, "0.17.0", [rec(STOCK, "FIXED")])
    write(tmp_path, "0.14.1", [], unavailable="import failed")
    lines = render_terminal(build([tmp_path])).splitlines()
    assert lines[1:3] == ["torch 2.12.0+cpu, gloo, 2 ranks: 0.16.3", "torch 2.13.0+cpu, gloo, 2 ranks: 0.16.4-0.17.0"]


def test_the_header_says_the_world_sizes_the_tests_really_used(tmp_path: Path) -> None:
    """The run's --ds-world-size is 2, but one test ran in worlds of 4 (its ds_world marker)."""
    write(tmp_path, "0.16.3", [rec(STOCK, "REPRODUCED"), rec(EPI, "REPRODUCED", repro=EPILOGUE, world_size=4)])
    write(tmp_path, "0.16.4", [rec(STOCK, "FIXED"), rec(EPI, "REPRODUCED", repro=EPILOGUE, world_size=4)])
    m = build([tmp_path])
    assert "torch 2.13.0+cpu, gloo, worlds of 2 ranks (2 runs), 4 ranks (2 runs)" in render_terminal(m)
    assert m.columns[0].environment_line == "torch 2.13.0+cpu, gloo, 2, 4 ranks"
    assert "worlds of 2 ranks (2 runs), 4 ranks (2 runs)" in render_markdown(m) + render_html(m)


def test_the_terminal_table_fits_its_width_and_never_cuts_a_name(tmp_path: Path) -> None:
    """Today's catalogue shape on 24 releases: one table within 120 columns, every bug id and config whole on a
    line; narrower terminals get several tables (each with its labels), never a name cut in two."""
    long_config = "seed_workaround_offload_optimizer_none_with_a_longer_name"
    for v in RELEASES:
        write(tmp_path, v, [
            rec(f"repros/test_c.py::test_c[{long_config}-stock]", "REPRODUCED" if v < "0.18" else "FIXED",
                repro="bf16-zero0-checkpoint-loses-optimizer", affected=("<0.18",)),
            rec(f"repros/test_c.py::test_c[{long_config}-fixed]", "PASSES-WITH-FIX", variant="fixed",
                repro="bf16-zero0-checkpoint-loses-optimizer", affected=("<0.18",)),
            rec("repros/test_c.py::test_c[zero3-stock]", "REPRODUCED" if v < "0.18" else "FIXED",
                repro="bf16-zero0-checkpoint-loses-optimizer", affected=("<0.18",)),
        ])  # fmt: skip
    m = build([tmp_path])
    for width in (120, 100, 80, 60):
        text = render_terminal(m, width=width)
        table = [ln for ln in text.split("Legend:")[0].splitlines()]
        assert max(len(line) for line in table) <= width, (width, text)
        words = {w for line in text.splitlines() for w in line.split()}
        assert {"bf16-zero0-checkpoint-loses-optimizer", long_config, "zero3"} <= words, (width, text)
        tables = sum(1 for line in table if line.startswith("bug / config"))
        assert tables == 1 if width == 120 else tables > 1, (width, text)
        assert all(v.rsplit(".", 1)[1] in text for v in RELEASES)


def test_every_test_without_a_verdict_says_why(tmp_path: Path) -> None:
    for v in RELEASES[:8]:
        tests = [rec(STOCK, "REPRODUCED" if v < "0.16.4" else "FIXED")] if v != "0.17.5" else []
        tests.append(rec(EPI, "REPRODUCED", repro=EPILOGUE))
        write(tmp_path, v, tests)
    write(tmp_path, "0.19.8", [rec(STOCK, "FIXED"), rec(FIXED, "SKIPPED", variant="fixed", outcome="skipped",
                                                        error="no fix needed past 0.16.4")])  # fmt: skip
    m = build([tmp_path])
    notes = " ".join(render_terminal(m).split("Without a judged run:")[1].split())
    assert f"{MODULE_ID} [zero3]: not run: no results file of the release ran this test (on 0.17.5)" in notes
    assert (f"{MODULE_ID} [zero3] with the fix: not run: no results file of the release ran this test (on "
            "0.14.4-0.18.0)") in notes  # fmt: skip
    assert f"{MODULE_ID} [zero3] with the fix: SKIPPED: no fix needed past 0.16.4 (on 0.19.8)" in notes
    assert f"{EPILOGUE} [zero3]: not run: no results file of the release ran this test (on 0.19.8)" in notes
    md = render_markdown(m)
    assert "no fix needed past 0.16.4" in md
    assert "not run: no results file of the release ran this test (on 0.17.5)" in md


def test_runs_against_the_declared_range_are_marked(tmp_path: Path) -> None:
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
    (row,) = m.rows
    assert row.declared == ("<0.16.4",)
    marked = {c.version: cell.stock.contradicts for c in m.columns if (cell := m.cell(row, c)) and cell.stock}
    assert marked == {"0.16.3": True, "0.16.4": False, "0.16.9": True, "0.18.3": True}
    fixed = [cell.fixed for c in m.columns if (cell := m.cell(row, c)) and cell.fixed]
    assert fixed
    assert not any(run.contradicts for run in fixed)
    text = render_terminal(m)
    assert "  zero3      [✗·!]○✗ ●·!  ✗·!" in table_lines(text)
    against = " ".join(text.split("Against the declared range (!):")[1].split())
    assert f"0.16.3 {MODULE_ID} [zero3]: the body passed inside the declared range (<0.16.4)" in against
    assert f"0.16.9 {MODULE_ID} [zero3]: the body failed outside the declared range" in against
    assert "3 against the declared range" in " ".join(text.split("\n\n")[0].split())
    md = render_markdown(m)
    assert "| [✗·!] | ○✗ | ●·! | ✗·! |" in md
    assert "the body failed outside the declared range (<0.16.4): REPRODUCED, reproduced" in " ".join(md.split())
    assert 'class="cell contradicts"' in render_html(m)


def test_since_marks_the_runs_that_changed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    write(old, "0.16.3", [rec(STOCK, "FIXED"), rec(EPI, "REPRODUCED", repro=EPILOGUE, outcome="xfailed")])
    write(old, "0.16.4", [rec(STOCK, "FIXED")])
    write(new, "0.16.3", [rec(STOCK, "REPRODUCED", outcome="xfailed"), rec(FIXED, "PASSES-WITH-FIX", variant="fixed")])
    write(new, "0.16.4", [rec(STOCK, "FIXED")])
    m = matrix.since(build([new]), build([old]), [old])
    assert [(r.name, c.version, run.nodeid, before) for r, c, run, before in m.changes()] == [
        (f"{MODULE_ID} [zero3]", "0.16.3", STOCK, "FIXED"),
        (f"{MODULE_ID} [zero3]", "0.16.3", FIXED, "not run"),
    ]
    assert m.gone == ((f"{EPILOGUE} [zero3]", "0.16.3", "REPRODUCED"),)
    text = render_terminal(m)
    assert "  zero3      [●✓~]○·" in table_lines(text)
    assert f"Changed since {old} (~): 2" in text
    assert f"0.16.3  {MODULE_ID} [zero3]: FIXED -> REPRODUCED" in text
    assert f"0.16.3  {EPILOGUE} [zero3]: REPRODUCED -> no longer in the results" in text
    assert "~ changed since the older results" in " ".join(text.split())
    assert "| [●✓~] | ○· |" in render_markdown(m)
    assert "was FIXED" in render_html(m)
    # the command: --since DIR
    assert matrix_command.run(_args(str(new), "--since", str(old), "--no-write", "--color", "never")) == 0
    assert "●✓~" in capsys.readouterr().out
    assert matrix_command.run(_args(str(new), "--since", str(tmp_path / "nope"), "--no-write")) == 2
    assert "--since: no such file or directory" in capsys.readouterr().err


def test_not_applicable_and_prerequisite_runs_say_why_in_every_form(tmp_path: Path) -> None:
    """A release the repro declares out of reach is its own verdict with its reason; a run that had another bug's
    fix applied first is marked, and the fix is named, in the terminal, Markdown and HTML tables alike."""
    masked = "masking bug (PR #7948) breaks every ZeRO-1/2 step on CPU"
    why = "not applicable on deepspeed 0.14.4: deepspeed<0.15: the API it needs is missing"
    write(tmp_path, "0.14.4", [rec(STOCK, "NOT-APPLICABLE", outcome="skipped", error=why)])
    write(tmp_path, "0.18.8", [rec(STOCK, "FIXED", prerequisites=(f"deepspeed>=0.18.7: {masked}",))])
    m = build([tmp_path])
    terminal = render_terminal(m)
    assert "  zero3      [\u2013 ]  \u25cb +" in table_lines(terminal)  # not applicable, then fixed
    assert "+ another bug's fix applied first" in terminal
    notes = " ".join(terminal.split())
    assert f"{MODULE_ID} [zero3]: NOT-APPLICABLE: {why} (on 0.14.4)" in notes
    assert f"With a prerequisite fix (+): deepspeed>=0.18.7: {masked}: on 0.18.8: {MODULE_ID} [zero3]" in notes
    assert not m.contradictions()  # no body ran on 0.14.4: nothing to hold against the range
    markdown = render_markdown(m)
    assert f"- deepspeed>=0.18.7: {masked}: on 0.18.8: {MODULE_ID} [zero3]" in markdown
    assert "| [\u2013] | \u25cb+ |" in markdown
    page = render_html(m)
    assert "prerequisite: deepspeed&gt;=0.18.7: " in page
    assert "<i>+</i>" in page


def test_series_and_timings_show_their_rate_and_margin(tmp_path: Path) -> None:
    """A race judged by its rate and a slowdown judged by a timing with a margin: the cell says which kind, the
    notes and the hover say the numbers."""
    race, slow = Rate(20, 20, 9, 1, 31.5), Measurement("backward of 256 tensors", "8 backwards of 32", 0.79, 0.1, 3, 5)
    write(tmp_path, "0.18.5", [rec(STOCK, "REPRODUCED", outcome="xfailed", rate=race),
                               rec(EPI, "REPRODUCED", repro=EPILOGUE, outcome="xfailed", measurements=(slow,))])  # fmt: skip
    write(tmp_path, "0.18.7", [rec(STOCK, "FIXED", affected=("<0.18.6",), rate=Rate(20, 20, 0, 1, 30.0))])
    m = build([tmp_path])
    text = render_terminal(m)
    assert "◐ reproduced in some runs of a series (the rate on hover)" in text
    series = " ".join(text.split("Series and timings:")[1].split())
    assert f"{MODULE_ID} [zero3]: 0.18.5 REPRODUCED 9/20 in 31.5 s; 0.18.7 FIXED 0/20 in 30.0 s" in series
    assert f"{EPILOGUE} [zero3]: 0.18.5 REPRODUCED, timed 7.90x its reference (limit 3x, margin 2.6x)" in series
    page = render_html(m)
    assert "stock: REPRODUCED 9/20 (reproduced), 2 ranks" in page
    assert "timed 7.90x its reference (limit 3x, margin 2.6x)" in page


def test_deepspeeds_own_tests_are_rows_of_their_own_beside_the_catalogue(tmp_path: Path) -> None:
    """Tests of DeepSpeed's own suite (``ds_origin``: DeepSpeed at a revision) declare no range: their cells say what
    pytest said, they are grouped by revision and file after the catalogue's bugs, one test of two revisions is two
    rows, and a failure is shown and told, never UNEXPECTED."""
    head = Origin("DeepSpeed", "edaa722" + "0" * 33, "v0.19.5-46-gedaa722")
    old = Origin("DeepSpeed", "1234567" + "0" * 33, "v0.18.0")
    zero = "unit/runtime/zero/test_zero.py::TestZero3ParamPartitioningBase::test[True-False]"
    ckpt = "unit/checkpoint/test_zero_optimizer.py::TestZeROCheckpoint::test_load_optimizer_state[1]"
    na = "not applicable on deepspeed 0.16.3: deepspeed<0.17: imports deepspeed.runtime.zenflow"
    write(tmp_path, "0.16.3", [rec(STOCK, "REPRODUCED", outcome="xfailed"),
                               rec(zero, None, repro=None, variant=None, origin=head),
                               rec(ckpt, "NOT-APPLICABLE", repro=None, variant=None, outcome="skipped", error=na,
                                   origin=head),
                               rec(zero, None, repro=None, variant=None, origin=old, outcome="failed",
                                   error="AssertionError: partitions differ", raised="AssertionError: partitions differ")])  # fmt: skip
    write(tmp_path, "0.16.4", [rec(STOCK, "FIXED"), rec(zero, None, repro=None, variant=None, origin=head),
                               rec(ckpt, None, repro=None, variant=None, origin=head, outcome="xfailed")])  # fmt: skip
    m = build([tmp_path])
    assert [(name, [r.label for r in rows]) for name, rows in m.groups()] == [
        (MODULE_ID, ["zero3"]),
        (f"{old.short} unit/runtime/zero/test_zero.py", ["TestZero3ParamPartitioningBase::test[True-False]"]),
        (f"{head.short} unit/checkpoint/test_zero_optimizer.py", ["TestZeROCheckpoint::test_load_optimizer_state[1]"]),
        (f"{head.short} unit/runtime/zero/test_zero.py", ["TestZero3ParamPartitioningBase::test[True-False]"]),
    ]
    assert m.rows[-1].title == "DeepSpeed's own tests at v0.19.5-46-gedaa722"
    assert matrix_command.exit_code(m) == 0  # a test that declares nothing is never UNEXPECTED
    assert m.counts() == {"REPRODUCED": 1, "FIXED": 1, "NOT-APPLICABLE": 1, "PASSED": 2, "FAILED": 1, "XFAILED": 1}
    text = render_terminal(m)
    assert text.startswith("DeepSpeed repro matrix: 1 bug in 1 row, 3 of DeepSpeed's own tests x 2 DeepSpeed releases")
    assert table_lines(text)[4:] == [
        f"{old.short} unit/runtime/zero/test_zero.py",
        "  TestZero3ParamPartitioningBase::test[True-False]",
        "                                          \u25a0  \u00b7",  # failed; not run on 0.16.4
        f"{head.short} unit/checkpoint/test_zero_optimizer.py",
        "  TestZeROCheckpoint::test_load_optimizer_state[1]",
        "                                          \u2013  x",  # not applicable; xfailed
        f"{head.short} unit/runtime/zero/test_zero.py",
        "  TestZero3ParamPartitioningBase::test[True-False]",
        "                                          \u25a1  \u25a1",  # passed, passed
    ]
    said = " ".join(text.split())
    assert (f"Failed (tests that declare no range): 0.16.3 {old.short} {zero}: AssertionError: partitions differ"
            in said)  # fmt: skip
    assert f"{head.short} unit/checkpoint/test_zero_optimizer.py [TestZeROCheckpoint::test_load_optimizer_state[1]]: "\
           f"NOT-APPLICABLE: {na} (on 0.16.3)" in said  # fmt: skip
    assert "\u25a1 passed (a test that declares no range)" in said
    assert "2 PASSED, 1 FAILED, 1 XFAILED" in said
    md = render_markdown(m)
    assert (
        f"| {old.short} unit/runtime/zero/test_zero.py | TestZero3ParamPartitioningBase::test[True-False] | \u25a0 | \u00b7 |"
        in md
    )
    assert "with the fix" not in render_html(m).split("<h2>Evidence</h2>")[1]  # they have no twin


# --- Markdown and HTML -------------------------------------------------------------------------------------------


def test_markdown_table_bugs_and_what_each_test_raised(catalogue: Path) -> None:
    md = render_markdown(build([catalogue]), image="matrix.svg")
    lines = md.splitlines()
    assert "![the matrix as an image](matrix.svg)" in lines
    header = next(ln for ln in lines if ln.startswith("| bug"))
    assert header == "| bug | config | 0.14<br>.1 | 0.16<br>.3 | .4 | 0.18<br>.3 |"
    assert f"| [{EPILOGUE}][1] | zero3 | [// | ● | ●] | · |" in lines
    assert f"| [{MODULE_ID}][2] | zero3 | [// | ●✓] | ○✓ | ○✗ |" in lines
    assert f"[2]: https://x.invalid/{MODULE_ID}" in lines
    table = [ln for ln in lines if ln.startswith("|")]
    assert len({ln.count(" | ") - ln.count("\\|") for ln in table if not ln.startswith("|:")}) == 1, table
    assert f"- **{MODULE_ID}** (affected `<0.16.4`): title of {MODULE_ID} (https://x.invalid/{MODULE_ID})" in lines
    raised = md.split("## What each test raised")[1]
    # one line per distinct failure, with its releases; a pipe in an error breaks nothing outside a table
    assert f"- {EPILOGUE} [zero3] on 0.16.3-0.16.4: `ranks 0-1: AttributeError: 'DeepSpeedZeRoOffload'" in raised
    assert f"- {MODULE_ID} [zero3] on 0.16.3: `ranks 0-1: {ERROR_0163}`" in raised
    assert f"`0.18.3 {FIXED}`: RuntimeError: patch no longer applies" in md


class _Page(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))

    def all(self, tag: str) -> list[dict[str, str | None]]:
        return [attrs for t, attrs in self.tags if t == tag]


def test_html_cells_say_each_run_on_hover_and_link_to_their_evidence(catalogue: Path) -> None:
    page = render_html(build([catalogue]), links=catalogue)
    parsed = _Page()
    parsed.feed(page)
    tags = {t for t, _ in parsed.tags}
    assert not tags & {"script", "link", "img", "iframe"}  # self-contained
    ids = {a["id"] for _, a in parsed.tags if a.get("id")}
    cells = [a for a in parsed.all("a") if (a.get("href") or "").startswith("#e")]
    assert len(cells) == 2 * 4  # every cell of every row links to its evidence
    assert all(a["href"][1:] in ids for a in cells)  # type: ignore[index]
    tips = [a["title"] or "" for a in cells]
    assert f"{MODULE_ID} [zero3] on 0.18.3\nstock: FIXED (not-affected), 2 ranks\nwith the fix: UNEXPECTED " \
           "(failed-differently), 2 ranks: RuntimeError: patch no longer applies\noutside the declared range <0.16.4" \
           in tips  # fmt: skip
    assert any(t.startswith(f"{MODULE_ID} [zero3] on 0.14.1\ncannot run with torch") for t in tips)
    evidence = [a["href"] for a in parsed.all("a") if (a.get("href") or "").endswith(".json")]
    assert evidence
    assert all((catalogue / str(href)).is_file() for href in evidence)
    assert 'class="cell in"' in page  # the declared range
    assert ".k-UNEXPECTED { background: #d7263d" in page


def test_html_escapes_everything(tmp_path: Path) -> None:
    write(tmp_path, "0.16.3", [rec(STOCK, "UNEXPECTED", outcome="failed", error='<script>alert("x")</script>')])
    page = render_html(build([tmp_path]))
    assert "<script>" not in page
    assert "&lt;script&gt;" in page


# --- reading ------------------------------------------------------------------------------------------------------


def test_each_unreadable_file_says_what_it_is_and_what_to_do(tmp_path: Path) -> None:
    good = write(tmp_path, "0.16.3", [rec(STOCK, "REPRODUCED")])
    (tmp_path / "package.json").write_text('{"name": "x"}')
    (tmp_path / "results-deepspeed-0.16.4-0123abcd.json").write_text('{"schema": 5, "crea')
    future = {"schema": results.SCHEMA + 1, "environment": {"deepspeed": "0.17.0", "plugin": "9.0"}, "tests": []}
    (tmp_path / "future.json").write_text(json.dumps(future))
    (tmp_path / "old.json").write_text('{"schema": 1, "environment": {"platform": "Linux"}, "tests": []}')
    files, unreadable = load([tmp_path, good])  # a file reached twice is read once
    assert [f.path for f in files] == [good]
    found = {u.path.name: (u.kind, u.release) for u in unreadable}
    assert found == {"package.json": ("foreign", None), "results-deepspeed-0.16.4-0123abcd.json": ("truncated", "0.16.4"),
                     "future.json": ("newer", "0.17.0"), "old.json": ("older", None)}  # fmt: skip
    said = {u.path.name: u.problem for u in unreadable}
    assert said["future.json"] == (f"schema {results.SCHEMA + 1}: written by a newer pytest-dsrepro (9.0); this one "
                                   f"reads results files of schema 5 to {results.SCHEMA}: upgrade pytest-dsrepro to "
                                   "read it")  # fmt: skip
    assert said["old.json"].endswith(f"schema 5 to {results.SCHEMA}: run those tests again to write it anew")
    assert (
        "cut short by an interrupted run, a full disk or a partial copy? Run its tests again, or delete it"
        in (said["results-deepspeed-0.16.4-0123abcd.json"])
    )
    m = merge(files, unreadable)
    assert [c.version for c in m.columns] == ["0.16.3", "0.16.4", "0.17.0"]  # their releases do not vanish
    assert [c.blank_line for c in m.columns[1:]] == [f"unreadable: {said[n]}" for n in
                                                     ("results-deepspeed-0.16.4-0123abcd.json", "future.json")]  # fmt: skip
    assert [u.path.name for u in m.damaged] == sorted(n for n in said if n != "package.json")
    assert matrix_command.exit_code(m) == matrix_command.Exit.UNREADABLE
    text = render_terminal(m)
    assert "  zero3      [● ]??  ??" in table_lines(text)
    assert "Results files that could not be read (the matrix lacks them):" in text
    assert "Left out:" in text
    assert "package.json: not a pytest-dsrepro results file (no 'schema')" in " ".join(text.split())


def test_no_files_is_a_usage_error_naming_the_directory(tmp_path: Path) -> None:
    with pytest.raises(MatrixError, match=f"no pytest-dsrepro results files in {tmp_path}"):
        load([tmp_path])
    with pytest.raises(MatrixError, match="no such file or directory"):
        load([tmp_path / "missing"])
    (tmp_path / "package.json").write_text("{}")
    with pytest.raises(MatrixError, match=r"\(1 other JSON files\)"):
        load([tmp_path])


# --- the command ---------------------------------------------------------------------------------------------------


def _args(*argv: str) -> object:
    import argparse

    parser = argparse.ArgumentParser()
    matrix_command.add_arguments(parser)
    return parser.parse_args(argv)


def test_run_writes_outputs_and_exits_1_on_unexpected(catalogue: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert matrix_command.run(_args(str(catalogue), "--color", "never")) == 1  # type: ignore[arg-type]
    out = capsys.readouterr().out
    assert "UNEXPECTED" in out
    assert (catalogue / "matrix.md").read_text().startswith("# DeepSpeed repro matrix")
    assert (catalogue / "matrix.html").read_text().startswith("<!DOCTYPE html>")
    assert (catalogue / "matrix.svg").read_text().startswith("<svg ")
    assert oct((catalogue / "matrix.md").stat().st_mode & 0o777) == oct(0o666 & ~_umask())
    # the outputs are not results files: a second run reads the same four releases and nothing else
    assert matrix_command.run(_args(str(catalogue), "--no-write")) == 1  # type: ignore[arg-type]
    assert "Left out" not in capsys.readouterr().out


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_importing_matrix_needs_no_torch() -> None:
    code = "import sys, pytest_dsrepro.tools.matrix, pytest_dsrepro.tools.install; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_markdown_and_terminal_lines_stay_short_at_24_releases(tmp_path: Path) -> None:
    """The sizes the rework is for: a table line per row, not a word per cell."""
    for v in RELEASES:
        write(tmp_path, v, [rec(STOCK, "REPRODUCED" if v < "0.16.4" else "FIXED"),
                            rec(FIXED, "PASSES-WITH-FIX", variant="fixed")])  # fmt: skip
    m = build([tmp_path])
    table = [ln for ln in render_markdown(m).splitlines() if ln.startswith("|")]
    assert max(map(len, table)) <= 250, max(table, key=len)
    assert max(map(len, table_lines(render_terminal(m)))) <= 120
    assert re.search(r"\[●✓ \| ●✓ \| ●✓\] \| ○✓", table[-1])


def test_a_result_of_each_kind_is_drawn_alike_in_every_form(tmp_path: Path) -> None:
    """Every kind's symbol appears in the terminal, the Markdown, the page and the image."""
    write(tmp_path, "0.14.0", [], unavailable="import failed")
    write(tmp_path, "0.16.3", [
        rec(STOCK, "NOT-YET-AFFECTED", affected=(">=0.16.4",)), rec(FIXED, "UNEXPECTED", variant="fixed"),
        rec(EPI, "SKIPPED", repro=EPILOGUE, outcome="skipped", error="why"),
        rec("repros/test_x.py::test_x[zero1-stock]", "REPRODUCED", repro="x", rate=Rate(20, 20, 9, 1, 1.0)),
        rec("repros/test_x.py::test_x[zero1-fixed]", "NOT-APPLICABLE", repro="x", variant="fixed",
            outcome="skipped", error="n/a"),
    ])  # fmt: skip
    write(tmp_path, "0.16.4", [rec(STOCK, "REPRODUCED", affected=(">=0.16.4",)),
                               rec(FIXED, "PASSES-WITH-FIX", variant="fixed")])  # fmt: skip
    theirs = Origin("DeepSpeed", "0" * 40)
    write(tmp_path, "0.16.5", [rec(STOCK, "FIXED", affected=(">=0.16.4,<0.16.5",)), *(
        rec(f"unit/test_{outcome}.py::test", None, repro=None, variant=None, outcome=outcome, origin=theirs)
        for outcome in ("passed", "failed", "error", "xfailed", "xpassed"))])  # fmt: skip
    (tmp_path / "results-deepspeed-0.17.0-0000abcd.json").write_text("{")
    m = build([tmp_path])
    forms = {"terminal": render_terminal(m), "markdown": render_markdown(m), "html": render_html(m),
             "svg": matrix.render_svg(m)}  # fmt: skip
    for kind in symbols.KINDS.values():
        for form, text in forms.items():
            assert kind.glyph in text, (kind.name, form)
