"""Issue 49 item 2: every op a body's DeepSpeed JIT-builds (here CPU Adagrad, a real op of DeepSpeed's CPU accelerator
and its smallest: one source file) is built by the fork server beside the worlds, off the test's clock, in a
directory of its own in the cache, and nothing a stopped, killed or damaged build leaves blocks the next one."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import REAL_CACHE, RunPytest, cache_with_comm_op, deepspeed_version, named, wait_for_builds_apart
from pytest_dsrepro.core.options import CACHE_ENV
from pytest_dsrepro.worlds.server import builds

OP = "cpu_adagrad"

ADAGRAD = """
import pytest


def adagrad():
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().create_op_builder("CPUAdagradBuilder").load()
"""

STOPPED_THEN_NEEDED = (
    ADAGRAD
    + """

@pytest.mark.ds_world(size=2)
def test_a_stopped_mid_build(ds_rank):
    if ds_rank == 1:
        raise RuntimeError("rank 1 fails while rank 0 waits for the op")
    adagrad()


@pytest.mark.ds_world(size=2)
def test_b_needs_the_op(ds_rank):
    assert hasattr(adagrad(), "create_adagrad")
"""
)


def _op_builds(cache: Path) -> list[Path]:
    return sorted((cache / "torch_extensions").glob(f"{OP}-*/{OP}/{OP}.so"))


def test_an_op_is_built_beside_the_worlds_off_the_clock_and_a_stopped_world_leaves_it_building(
    pytester: pytest.Pytester, run: RunPytest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A world stopped while its rank waits for the op (its other rank failed) leaves the build going, and no lock:
    the next test waits for that build, its 10 s timeout not counting it (the build takes longer on any machine),
    and passes. The op lands in a directory of its own in the cache, which the next run loads without a build."""
    cache = cache_with_comm_op(pytester.path / "cache")
    monkeypatch.setenv(CACHE_ENV, str(cache))
    pytester.makepyfile(STOPPED_THEN_NEEDED)
    result = run("-v", "--ds-timeout", "10", timeout=1800)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*::test_a_stopped_mid_build ",
            f"pytest-dsrepro: building DeepSpeed's {OP} op, first time only (*), beside the worlds: a test that needs "
            "it waits, its clock stopped",
            "FAILED*",
            "*::test_b_needs_the_op ",
            f"pytest-dsrepro: DeepSpeed's {OP} op built beside the worlds in *s; later runs load it",
            "PASSED*",
            "rank 1: RuntimeError: rank 1 fails while rank 0 waits for the op; rank 0: stopped: still running 5s after "
            "rank 1 failed",
        ],
    )
    assert result.stdout.str().count(f"building DeepSpeed's {OP} op") == 1
    (library,) = _op_builds(cache)
    assert library.parent.parent.name.startswith(f"{OP}-")  # keyed by content, beside the comm op's, not in it
    assert list(cache.rglob("lock")) == [], "torch's baton was left behind: the next build would wait forever"
    again = run("-v", "-k", "needs_the_op", "--ds-timeout", "10")
    again.assert_outcomes(passed=1)
    assert f"building DeepSpeed's {OP} op" not in again.stdout.str()


KILLED_THEN_NEEDED = (
    ADAGRAD
    + """

@pytest.mark.ds_world(size=1)
def test_a_waits_for_a_build_that_is_killed(ds_rank):
    adagrad()


@pytest.mark.ds_world(size=1)
def test_b_gets_it_built_again(ds_rank):
    assert hasattr(adagrad(), "create_adagrad")
"""
)


def test_a_killed_op_build_takes_its_compilers_along_and_blocks_nothing(
    pytester: pytest.Pytester, process_tag: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The process that compiles is SIGKILLed mid-compile: its compilers die with it at once (its warden adopts and
    kills them), the test waiting for it fails saying so, and the next test's build goes through the baton the
    killed one left (removed under the cache's lock) to a complete op."""
    cache = cache_with_comm_op(pytester.path / "cache")
    monkeypatch.setenv(CACHE_ENV, str(cache))
    pytester.makepyfile(KILLED_THEN_NEEDED)
    output = pytester.path / "pytest-output.txt"
    with output.open("wb") as sink:
        args = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", "--ds-timeout", "10"]
        proc = subprocess.Popen(args, cwd=pytester.path, stdout=sink, stderr=subprocess.STDOUT)
    try:
        _wait_until(lambda: named(process_tag, "cc1plus"), "a compiler started")
        (compiling,) = named(process_tag, builds.COMPILER_NAME)
        compiling.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        _wait_until(lambda: not named(process_tag, "cc1plus") and not named(process_tag, "ninja"), "compilers gone", 10)
        gone_after = time.monotonic() - killed
        proc.wait(timeout=1800)
    finally:
        proc.kill()  # only matters when an assertion above failed
    out = output.read_text()
    assert gone_after < 5, out
    said = f"DeepSpeed's {OP} op could not be built (its worker failed (killed by signal SIGKILL)"
    assert "::test_a_waits_for_a_build_that_is_killed - WorldFailed: " in out, out
    assert f"rank 0: RuntimeError: pytest-dsrepro: {said}" in out, out
    assert "= 1 failed, 1 passed in " in out, out  # the other: test_b_gets_it_built_again
    assert len(_op_builds(cache)) == 1
    assert list(cache.rglob("lock")) == []


def _built_in_the_real_cache(pytester: pytest.Pytester, run: RunPytest) -> Path:
    """This environment's CPU Adagrad, built once in the real cache (by a run like the user's) if it is not there."""
    if not _op_builds(Path(REAL_CACHE)):
        it = ADAGRAD + "\n\n@pytest.mark.ds_world(size=1)\ndef test_it(ds_rank):\n    adagrad()\n"
        pytester.makepyfile(test_build_it=it)
        run("test_build_it.py", timeout=1800).assert_outcomes(passed=1)
        assert wait_for_builds_apart() == []
        (pytester.path / "test_build_it.py").unlink()
    (library,) = _op_builds(Path(REAL_CACHE))
    return library.parent.parent


def test_a_damaged_op_build_is_discarded_and_built_again_said_once(
    pytester: pytest.Pytester, run: RunPytest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cached op cut short (a full disk, a copy interrupted) would kill whatever maps it with SIGBUS: it is loaded
    in a throwaway child first, discarded when it does not load, said once, and built again."""
    built = _built_in_the_real_cache(pytester, run)
    cache = cache_with_comm_op(pytester.path / "cache")
    shutil.copytree(built, cache / "torch_extensions" / built.name)
    (library,) = _op_builds(cache)
    library.write_bytes(library.read_bytes()[:4096])  # its headers only: the debug info is its last two thirds
    monkeypatch.setenv(CACHE_ENV, str(cache))
    pytester.makepyfile(
        test_damaged=ADAGRAD + "\n\n@pytest.mark.ds_world(size=2)\n"
        "@pytest.mark.parametrize('n', [1, 2])\ndef test_it(ds_rank, n):\n    assert adagrad()\n"
    )
    result = run("-v", "--ds-timeout", "10", timeout=1800)
    result.assert_outcomes(passed=2)
    said = f"the cached build of DeepSpeed's {OP} op for {deepspeed_version()} does not load (loading it in a throwaway"
    result.stdout.fnmatch_lines([f"pytest-dsrepro: {said} child: *): discarded, building it again ({library})*"])
    assert result.stdout.str().count("does not load") == 1
    check = f"import sys, torch; from pathlib import Path; from {builds.__name__} import damage; "
    check += f"print(damage(Path(sys.argv[1]), {OP!r}))"  # in a process that has torch, which the op links against
    damage = subprocess.run([sys.executable, "-c", check, str(library)], capture_output=True, text=True, check=True)
    assert damage.stdout.strip().splitlines()[-1] == "None"


def _wait_until(condition: Callable[[], object], what: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g}s"
        time.sleep(0.1)
