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
