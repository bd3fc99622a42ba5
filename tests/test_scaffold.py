"""dsrepro new: names, validation, never overwriting, and a scaffold that runs and passes in a real 2-rank world."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conftest import ROOT, RunPytest
from pytest_dsrepro.core.configs import PRESETS
from pytest_dsrepro.tools import catalogue, cli
from pytest_dsrepro.tools.scaffold import Names, ScaffoldError, create, names


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("zero3-module-id", Names("zero3-module-id", "zero3_module_id")),
        ("ZeRO3 module.id", Names("zero3-module-id", "zero3_module_id")),
        ("test_offload_hang.py", Names("offload-hang", "offload_hang")),
        ("6772", Names("6772", "6772")),
    ],
)
def test_names(name: str, expected: Names) -> None:
    assert names(name) == expected


@pytest.mark.parametrize("name", ["", "  ", "../etc/passwd", "a/b", "-x", "naïve", "x;rm"])
def test_bad_names(name: str) -> None:
    with pytest.raises(ScaffoldError, match=r"invalid NAME .*e\.g\. zero3-module-id"):
        names(name)


def test_new_writes_a_file_with_the_markers_and_todos(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    monkeypatch.chdir(tmp_path)
    url = "https://github.com/deepspeedai/DeepSpeed/issues/6772"
    assert cli.main(["new", "zero3 module id", "--issue", url, "--config", "zero2"]) == 0
    path = tmp_path / "repros" / "test_zero3_module_id.py"
    out = capsys.readouterr().out
    assert out.startswith("wrote repros/test_zero3_module_id.py\n")
    assert "pytest repros/test_zero3_module_id.py -v" in out
    assert "dsrepro bisect repros/test_zero3_module_id.py::test_zero3_module_id --good X --bad Y" in out
    text = path.read_text()
    compile(text, str(path), "exec")
    assert 'id="zero3-module-id"' in text
    assert f'upstream="{url}"' in text
    assert '@pytest.mark.ds_config("zero2")' in text
    assert "def test_zero3_module_id(" in text
    assert "pytest.mark.ds_world(size=2)" in text
    assert "@pytest.mark.ds_version(affected=" in text
    assert text.count("TODO") >= 5


def test_new_goes_into_the_folder_of_its_subsystem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """In a catalogue laid out by subsystem a new repro goes into the folder its name begins with, one not made yet
    too; a name that begins with none needs --dir, and a file name a repro of another folder has is refused, naming
    both."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "repros" / "zero3").mkdir(parents=True)
    assert cli.main(["new", "zero3-late-attach"]) == 0
    assert capsys.readouterr().out.startswith("wrote repros/zero3/test_zero3_late_attach.py\n")
    assert cli.main(["new", "moe gate"]) == 0
    assert "pytest repros/moe/test_moe_gate.py -v" in capsys.readouterr().out
    assert cli.main(["new", "odd-one"]) == 1
    assert capsys.readouterr().err.startswith(
        "dsrepro: 'odd-one' begins with no subsystem's name (zero3-..., checkpoint-...: core/areas.py lists them): "
        "give --dir repros/FOLDER, the folder of the DeepSpeed subsystem the bug is in (zero3, moe)"
    )
    assert cli.main(["new", "odd-one", "--dir", "repros/engine"]) == 0
    assert cli.main(["new", "moe-gate", "--dir", str(tmp_path / "repros" / "engine")]) == 1
    assert "repros/engine/test_moe_gate.py and repros/moe/test_moe_gate.py have the same file name" in (
        capsys.readouterr().err
    )
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.py")) == [
        "repros/engine/test_odd_one.py", "repros/moe/test_moe_gate.py", "repros/zero3/test_zero3_late_attach.py"]  # fmt: skip


def test_new_never_overwrites(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["new", "hang", "--dir", str(tmp_path)]
    assert cli.main(args) == 0
    path = tmp_path / "test_hang.py"
    path.write_text("# my work in progress\n")
    assert cli.main(args) == 1
    assert capsys.readouterr().err == (
        f"dsrepro: {path} already exists; not overwriting it (choose another NAME or remove it)\n"
    )
    assert path.read_text() == "# my work in progress\n"
    with pytest.raises(ScaffoldError, match="already exists"):
        create("test_hang.py", tmp_path)


def test_new_validates_preset_issue_and_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["new", "x", "--dir", str(tmp_path), "--config", "zero4"]) == 1
    assert capsys.readouterr().err == f"dsrepro: unknown preset 'zero4'; presets: {', '.join(PRESETS)}\n"
    assert cli.main(["new", "x", "--dir", str(tmp_path), "--issue", "issue 12"]) == 1
    assert "--issue 'issue 12' is not a URL" in capsys.readouterr().err
    assert cli.main(["new", "a/b", "--dir", str(tmp_path)]) == 1
    assert "invalid NAME 'a/b'" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_every_preset_renders() -> None:
    for preset in PRESETS:
        from pytest_dsrepro.tools.scaffold import render

        compile(render("n", Path("repros/test_n.py"), None, preset), "<scaffold>", "exec")


def test_scaffold_is_catalogued_and_passes_at_once_in_two_ranks_under_the_catalogues_check(
    pytester: pytest.Pytester, run: RunPytest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 49, item 6: fresh ``dsrepro new`` output, beside the catalogue's own ``conftest.py`` (its device check
    on every body), passes as written; a body beside it that makes a tensor without ``device=`` is refused, so the
    check was there to refuse it."""
    monkeypatch.chdir(pytester.path)
    assert cli.main(["new", "my first repro", "--issue", "https://example.invalid/1"]) == 0
    shutil.copy(ROOT / "repros" / "conftest.py", pytester.path / "repros" / "conftest.py")
    (pytester.path / "repros" / "test_unplaced.py").write_text(
        "def test_unplaced():\n    import torch\n\n    torch.randn(2)\n"
    )
    (entry,) = catalogue.collect(["repros/test_my_first_repro.py"])
    assert (entry.id, entry.upstream, entry.affected, entry.fixed_in) == (
        "my-first-repro", "https://example.invalid/1", ("<0.0.1",), None,
    )  # fmt: skip
    result = run("repros", "-v")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*test_my_first_repro?zero3? PASSED*", "*test_unplaced FAILED*"])
    result.stdout.fnmatch_lines(["*MisplacedTensor: torch.randn() without device= at *test_unplaced.py:4*"])
