"""What a user of the project sees around their tests: the repros directory's shared rule, and tracebacks."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conftest import RunPytest

ROOT = Path(__file__).resolve().parent.parent


def test_every_repro_runs_in_a_world(pytester: pytest.Pytester, run: RunPytest) -> None:
    """repros/conftest.py puts each test under repros/ into a world; elsewhere nothing changes."""
    body = """
        def test_where():
            import torch.distributed as dist
            assert dist.is_initialized()
            assert dist.get_world_size() == 2
        """
    pytester.mkdir("repros")
    shutil.copy(ROOT / "repros" / "conftest.py", pytester.path / "repros" / "conftest.py")
    pytester.makepyfile(**{"repros/test_in_repros": body, "test_elsewhere": body})
    result = run("-v", "--ds-world-size", "2")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines_random(
        ["*repros/test_in_repros.py::test_where PASSED*", "*test_elsewhere.py::test_where FAILED*"]
    )


def test_a_repro_in_a_folder_imports_the_helpers_at_the_top(pytester: pytest.Pytester, run: RunPytest) -> None:
    """The catalogue's layout: a repro in a subsystem's folder imports the helpers at the top of repros/ by plain
    name, in the pytest process and in its ranks, and the device check covers those helpers too; two repros with one
    file name, in two folders, are refused, naming both, before either is imported."""
    repros = pytester.mkdir("repros")
    shutil.copy(ROOT / "repros" / "conftest.py", repros / "conftest.py")
    (repros / "_shared.py").write_text("ANSWER = 42\n\n\ndef made_without_device():\n    import torch\n\n"
                                       "    return torch.ones(2)\n")  # fmt: skip
    pytester.mkdir("repros/zero3")
    pytester.makepyfile(**{"repros/zero3/test_deep": """
        from _shared import ANSWER

        def test_imports_its_helper():
            import torch.distributed as dist
            from _shared import ANSWER as in_the_rank

            assert dist.is_initialized()
            assert ANSWER == in_the_rank == 42

        def test_the_helper_is_checked():
            from _shared import made_without_device

            made_without_device()
        """})  # fmt: skip
    result = run("repros", "-v", "--ds-world-size", "2")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines_random(["*test_imports_its_helper PASSED*", "*test_the_helper_is_checked FAILED*",
                                        "*MisplacedTensor: torch.ones() without device= at */repros/_shared.py:7*"])  # fmt: skip
    pytester.mkdir("repros/zero12")
    shutil.copy(repros / "zero3" / "test_deep.py", repros / "zero12" / "test_deep.py")
    result = run("repros", "--collect-only")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(["*repros/zero12/test_deep.py and repros/zero3/test_deep.py have the same file name: "
                                 "pytest imports every repro as a top-level module named after its file*"])  # fmt: skip
    assert "import file mismatch" not in result.stdout.str()


def test_user_tracebacks_show_no_plugin_frames(pytester: pytest.Pytester, run: RunPytest) -> None:
    pytester.makepyfile(
        """
        def helper():
            raise KeyError("the user's own failure")

        def test_plain():
            helper()
        """
    )
    result = run("--tb=long")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*def test_plain():*", "*KeyError*"])
    assert "pytest_dsrepro" not in result.stdout.str()
