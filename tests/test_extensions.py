"""DeepSpeed's comm op is built once per distinct source, and a build killed midway cannot wedge later runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock

from conftest import REAL_CACHE, RunPytest, comm_op_directory, deepspeed_version, named, wait_for_builds_apart
from pytest_dsrepro.core import versions
from pytest_dsrepro.core.options import CACHE_ENV
from pytest_dsrepro.worlds.server.builds import (
    BUILD_LOCK_TIMEOUT,
    BUILDER_NAME,
    build_key,
    extensions_dir,
    remove_stale_locks,
)
from pytest_dsrepro.worlds.server.comm_op import shared_library

USES_OP = """
import pytest

@pytest.mark.ds_world
def test_uses_op(ds_rank):
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
"""

TWICE = (
    USES_OP
    + """
@pytest.mark.ds_world
def test_uses_op_again(ds_rank):
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
"""
)


def test_one_directory_per_distinct_source(tmp_path: Path) -> None:
    """Keyed by content, not place: two installs of one op's sources share a build; any byte, flag or torch
    difference does not."""
    for env in ("env1", "env2"):
        (tmp_path / env).mkdir()
        (tmp_path / env / "shm.cpp").write_text("int f() { return 1; }\n")
    flags = ["-O2", "-fopenmp"]
    key = build_key([tmp_path / "env1" / "shm.cpp"], flags, "2.13.0")
    assert build_key([tmp_path / "env2" / "shm.cpp"], flags, "2.13.0") == key
    assert build_key([tmp_path / "env1" / "shm.cpp"], ["-O3", "-fopenmp"], "2.13.0") != key
    assert build_key([tmp_path / "env1" / "shm.cpp"], flags, "2.14.0") != key
    (tmp_path / "env2" / "shm.cpp").write_text("int f() { return 2; }\n")
    assert build_key([tmp_path / "env2" / "shm.cpp"], flags, "2.13.0") != key
    assert (
        extensions_dir(tmp_path, "deepspeed_shm_comm", key)
        == tmp_path / "torch_extensions" / f"deepspeed_shm_comm-{key}"
    )


def test_stale_torch_locks_are_found_and_removed(tmp_path: Path) -> None:
    """The baton of the op being built goes (its builds run under our lock); another op's goes only once no build is
    that old: in a user's TORCH_EXTENSIONS_DIR, torch's JIT may be building FusedAdam there meanwhile, without it."""
    batons = {}
    for op in ("deepspeed_shm_comm", "fused_adam", "cpu_adam"):
        (tmp_path / op).mkdir()
        batons[op] = tmp_path / op / "lock"
        batons[op].touch()
    long_ago = time.time() - BUILD_LOCK_TIMEOUT - 60
    os.utime(batons["cpu_adam"], (long_ago, long_ago))
    assert sorted(remove_stale_locks(tmp_path, "deepspeed_shm_comm")) == [
        batons["cpu_adam"],
        batons["deepspeed_shm_comm"],
    ]
    assert [p for p in batons.values() if p.exists()] == [batons["fused_adam"]]


def _built_op(pytester: pytest.Pytester, run: RunPytest) -> Path:
    """This environment's op directory in the real cache, built first if the cache is cold."""
    source = comm_op_directory()
    assert source is not None
    if not (source / "deepspeed_shm_comm").is_dir():
        run(timeout=1800).assert_outcomes(passed=1)  # a cold cache: build the op once, in the real cache
        assert wait_for_builds_apart() == []
    return source


def test_a_killed_build_does_not_hang_the_next_run(
    pytester: pytest.Pytester, run: RunPytest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache whose build directory holds torch's lock file (as a killed build leaves it) still runs at once."""
    pytester.makepyfile(USES_OP)
    source = _built_op(pytester, run)
    cache = pytester.path / "cache"
    target = cache / "torch_extensions" / source.name
    shutil.copytree(source, target)
    (target / "deepspeed_shm_comm" / "lock").write_text("")
    monkeypatch.setenv("DSREPRO_CACHE_DIR", str(cache))
    run(timeout=120).assert_outcomes(passed=1)
    assert not (target / "deepspeed_shm_comm" / "lock").exists()


def test_another_install_of_the_same_release_loads_the_op_built_by_the_first(
    pytester: pytest.Pytester, run: RunPytest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second copy of DeepSpeed at another place (a new tox env, clone or bisect probe) builds nothing."""
    test_file = pytester.makepyfile(USES_OP)
    source = _built_op(pytester, run)
    elsewhere = pytester.path / "elsewhere"
    installed = versions.location("deepspeed")
    assert installed is not None
    shutil.copytree(installed, elsewhere / "deepspeed", ignore=shutil.ignore_patterns("*.pyc"))
    monkeypatch.setenv("PYTHONPATH", str(elsewhere))
    result = run("-v", str(test_file), timeout=120)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [f"worlds ran on: DeepSpeed * from {elsewhere / 'deepspeed'}*comm op loaded from {source}*"]
    )


# ---- a damaged or read-only cache (issue 27) ----------------------------------------------------------------------


def _damage_of(library: Path) -> str:
    """``builds.damage`` as the fork server calls it: in a process that has torch, which the op links against."""
    code = (
        "import sys, torch; from pathlib import Path; from pytest_dsrepro.worlds.server.builds import damage; "
        "print(damage(Path(sys.argv[1]), 'deepspeed_shm_comm'))"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(library)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def _private_copy(pytester: pytest.Pytester, run: RunPytest) -> tuple[Path, Path]:
    """A cache of this test's own holding this environment's built op: ``(cache, the op's shared object)``."""
    source = _built_op(pytester, run)
    cache = pytester.path / "cache"
    target = cache / "torch_extensions" / source.name
    shutil.copytree(source, target)
    return cache, target / "deepspeed_shm_comm" / "deepspeed_shm_comm.so"


def test_a_damaged_build_is_told_apart_without_loading_it_here(pytester: pytest.Pytester, run: RunPytest) -> None:
    """A shared object cut short kills whatever maps it (SIGBUS), an empty one does not import: both are found in a
    throwaway child, and the process that asked is still there to say so."""
    pytester.makepyfile(USES_OP)
    _, library = _private_copy(pytester, run)
    assert _damage_of(library) == "None"
    truncated = library.with_name("truncated.so")
    truncated.write_bytes(library.read_bytes()[: library.stat().st_size // 3])
    assert _damage_of(truncated) == "loading it in a throwaway child: it failed (killed by signal SIGBUS)"
    empty = library.with_name("empty.so")
    empty.touch()
    assert _damage_of(empty) == "it is empty: 0 bytes, a build or a copy cut short"
    garbage = library.with_name("garbage.so")
    garbage.write_bytes(b"not an ELF file")
    assert _damage_of(garbage).startswith("loading it in a throwaway child: ImportError: ")


def test_a_damaged_build_in_the_cache_is_discarded_and_built_again(
    pytester: pytest.Pytester, run: RunPytest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 1: a truncated build (a full disk, a copy cut short) made the fork server die by SIGBUS in every later
    session. It is found, said, discarded with ninja's state and built again, beside the worlds as a first build is
    (issue 38: it held up the first world for two minutes); the run passes."""
    pytester.makepyfile(USES_OP)
    cache, library = _private_copy(pytester, run)
    whole = library.stat().st_size
    library.write_bytes(library.read_bytes()[: whole // 3])
    monkeypatch.setenv("DSREPRO_CACHE_DIR", str(cache))
    result = run(timeout=1800)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [
            "pytest-dsrepro: the cached build of DeepSpeed's CPU comm op for * does not load (loading it in a "
            f"throwaway child: it failed (killed by signal SIGBUS)): discarded, building it again ({library})",
            "pytest-dsrepro: building DeepSpeed's CPU comm op for *, beside the worlds: *",
        ]
    )
    assert wait_for_builds_apart() == []  # the run's test did not need the op: its build went on after the run
    assert library.stat().st_size > whole // 3
    assert _damage_of(library) == "None"


def _in_user_extensions_dir(pytester: pytest.Pytester, run: RunPytest, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This environment's built op in a ``TORCH_EXTENSIONS_DIR`` of the user's (torch's JIT layout, another op's
    build beside it); the op's shared object."""
    extensions = pytester.path / "extensions"
    shutil.copytree(_built_op(pytester, run) / "deepspeed_shm_comm", extensions / "deepspeed_shm_comm")
    (extensions / "cpu_adam").mkdir()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions))
    return extensions / "deepspeed_shm_comm" / "deepspeed_shm_comm.so"


def test_a_damaged_build_in_the_users_extensions_dir_is_discarded_and_built_again(
    pytester: pytest.Pytester, run: RunPytest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 38, item 4: a truncated op in a ``TORCH_EXTENSIONS_DIR`` the user set killed the fork server by SIGBUS
    in every world of every session. It is found and said as in the plugin's cache, and torch's JIT builds it again
    there; the other builds of that directory are left alone."""
    pytester.makepyfile(USES_OP)
    library = _in_user_extensions_dir(pytester, run, monkeypatch)
    whole = library.stat().st_size
    library.write_bytes(library.read_bytes()[: whole // 3])
    result = run(timeout=1800)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [
            "pytest-dsrepro: the cached build of DeepSpeed's CPU comm op for * does not load (loading it in a "
            f"throwaway child: it failed (killed by signal SIGBUS)): discarded, building it again ({library})",
        ]
    )
    assert "SIGBUS" not in result.stdout.str().split("discarded, building it again")[1]
    assert _damage_of(library) == "None"
    assert (library.parent.parent / "cpu_adam").is_dir()


def test_a_build_that_fails_again_names_the_directory_and_how_to_clear_it(
    pytester: pytest.Pytester, run: RunPytest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rebuilt once: when that fails too (here no compiler works) in a ``TORCH_EXTENSIONS_DIR`` the user set, the
    run stops at its first world in one line that names the directory and the command that clears the op's build
    there (not the directory: the user's other builds are in it), instead of a server crash in every test. An empty
    shared object is said as such."""
    pytester.makepyfile(TWICE)
    library = _in_user_extensions_dir(pytester, run, monkeypatch)
    library.write_bytes(b"")
    monkeypatch.setenv("CXX", "false")
    result = run(timeout=600)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    directory = library.parent.parent
    result.stdout.fnmatch_lines(
        [
            "pytest-dsrepro: the cached build of DeepSpeed's CPU comm op for * does not load (it is empty: 0 bytes, "
            f"a build or a copy cut short): discarded, building it again ({library})",
            f"*pytest-dsrepro: DeepSpeed's CPU comm op for * could not be built in {directory} (*); remove its "
            f"build (rm -rf {library.parent}) and run again, or unset TORCH_EXTENSIONS_DIR*",
        ]
    )
    assert "test_uses_op_again" not in result.stdout.str(), "the run went on to fail the next world test"


def test_a_read_only_cache_serves_the_builds_it_holds(
    pytester: pytest.Pytester, run: RunPytest, monkeypatch: pytest.MonkeyPatch, read_only: Callable[[Path], None]
) -> None:
    """Item 4: a read-only cache used to fail every world test (the build lock could not be made), even with the op
    built. It is said once, and its build is used."""
    pytester.makepyfile(TWICE)
    cache, _ = _private_copy(pytester, run)
    read_only(cache)
    monkeypatch.setenv("DSREPRO_CACHE_DIR", str(cache))
    result = run("-v", timeout=300)
    result.assert_outcomes(passed=2)
    out = result.stdout.str()
    assert out.count("cannot be written") == 1, out
    result.stdout.fnmatch_lines(
        [
            f"pytest-dsrepro: the cache directory {cache} cannot be written (*): worlds use the builds it holds",
            f"worlds ran on: *comm op loaded from {cache}* (a read-only cache)*",
        ]
    )


def test_a_read_only_cache_without_builds_stops_the_run_before_the_first_world(
    pytester: pytest.Pytester, run: RunPytest, monkeypatch: pytest.MonkeyPatch, read_only: Callable[[Path], None]
) -> None:
    """Item 4: found before anything is spawned (a torch that cannot be imported proves no fork server started) and
    said in one line with what to do; a run with no world test is left alone."""
    cache = pytester.mkdir("empty-cache")
    read_only(cache)
    monkeypatch.setenv("DSREPRO_CACHE_DIR", str(cache))
    sentinel = pytester.mkdir("no-torch")
    (sentinel / "torch.py").write_text("raise ImportError('sentinel: the fork server was started')\n")
    monkeypatch.setenv("PYTHONPATH", str(sentinel))
    pytester.makepyfile(test_world=USES_OP, test_plain="def test_plain():\n    pass\n")
    result = run("test_world.py")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            f"ERROR: pytest-dsrepro: the cache directory {cache} cannot be written (*) and holds no build of "
            "DeepSpeed's comm op for worlds to use: point --ds-cache-dir (or DSREPRO_CACHE_DIR) at a writable directory"
        ]
    )
    assert "sentinel" not in result.stdout.str()
    assert "Exit" not in result.stdout.str() + result.stderr.str(), "issue 38 item 5: a startup error, not an exit"
    run("test_plain.py").assert_outcomes(passed=1)


BESIDE_THE_BUILD = """
import os
import pytest
import torch

MARK = {mark!r}


@pytest.mark.ds_world
def test_a_before_the_build(ds_rank):
    import deepspeed.comm

    assert deepspeed.comm.is_initialized()
    assert deepspeed.comm.comm.cdb.shm_comm_op is None  # as DeepSpeed runs where it cannot build the op
    if ds_rank == 0:
        open(MARK, "w").close()


@pytest.mark.ds_world
def test_b_needs_the_op(ds_rank):
    import deepspeed.comm

    t = torch.ones(4) * (ds_rank + 1)
    deepspeed.comm.inference_all_reduce(t)  # waits for the build, loads the op, and goes on with it
    assert t.tolist() == [3.0] * 4
    assert deepspeed.comm.comm.cdb.shm_comm_op is not None
"""


def test_a_first_build_holds_up_no_world(
    pytester: pytest.Pytester, run: RunPytest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 22: a never-built comm op builds beside the worlds. Another process's build (the lock held here until
    the first world has run) makes that deterministic: the first world runs without the op, the next waits for it
    in the one collective that needs it, the run ends with the op built, and the next run builds nothing."""
    source = comm_op_directory()
    assert source is not None
    cache = pytester.path / "cold-cache"
    target = cache / "torch_extensions" / source.name
    target.mkdir(parents=True)
    shutil.copytree(Path(REAL_CACHE) / "preload", cache / "preload")  # only the build is new: no search goes on apart
    mark = pytester.path / "first-world-ran"
    pytester.makepyfile(BESIDE_THE_BUILD.format(mark=str(mark)))
    monkeypatch.setenv(CACHE_ENV, str(cache))
    held = FileLock(target / ".dsrepro-build.lock", thread_local=False)  # released by another thread
    held.acquire()

    def release_once_the_first_world_ran() -> None:
        deadline = time.monotonic() + 600
        while not mark.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        held.release()

    releaser = threading.Thread(target=release_once_the_first_world_ran)
    releaser.start()
    try:
        result = run("-v", timeout=1800)
    finally:
        mark.touch()
        releaser.join()
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        [
            f"pytest-dsrepro: building DeepSpeed's CPU comm op for {deepspeed_version()}, first time only (*), beside "
            "the worlds: until it is built they run without it*",
            "*::test_b_needs_the_op ",
            f"pytest-dsrepro: DeepSpeed's CPU comm op for {deepspeed_version()} built beside the worlds in *s; worlds "
            "from now on use it, later runs load it",  # while test_b waited for it: the run's end has none to wait for
            "PASSED*",
            "worlds ran on: *; comm op building beside the worlds; *",
            "*= 2 passed in *",
        ]
    )
    assert shared_library(target).exists()
    again = run("-v", "-k", "needs_the_op")
    again.assert_outcomes(passed=1)
    assert "building DeepSpeed's CPU comm op" not in again.stdout.str()


def test_a_first_run_whose_tests_do_not_need_the_op_ends_without_waiting_for_its_build(
    pytester: pytest.Pytester, run: RunPytest, monkeypatch: pytest.MonkeyPatch, private_tmp: Path, process_tag: str
) -> None:
    """Issue 35: a release's first run waited 70-106 s at its end for the comm op, which none of its tests called.
    The run now ends with its tests; the build goes on apart, still under the cache's lock, and ends complete: the
    next run loads it. A second session meanwhile waits for nothing either. Nothing of it is left once it is done
    (its compilers' files included)."""
    source = comm_op_directory()
    assert source is not None
    cache = pytester.path / "cold-cache"
    target = cache / "torch_extensions" / source.name
    monkeypatch.setenv(CACHE_ENV, str(cache))
    pytester.makepyfile(USES_OP)
    result = run("-v", timeout=1800)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [
            f"pytest-dsrepro: building DeepSpeed's CPU comm op for {deepspeed_version()}, first time only (*), beside "
            "the worlds: *",
            "*= 1 passed in *",
            f"pytest-dsrepro: DeepSpeed's CPU comm op for {deepspeed_version()} goes on building apart (process *, for "
            "at most *s): later runs load it; a run started before it is built builds beside it",
        ]
    )
    out = result.stdout.str()
    assert "the tests are over" not in out, "the run's end waited for the build"
    assert "still building" not in out, "the run's end waited for the build"
    assert named(process_tag, BUILDER_NAME), "the build ended with the run"
    beside = run("-v", timeout=600)  # a second session while the first one's build goes on (it holds the lock)
    beside.assert_outcomes(passed=1)
    assert "the tests are over" not in beside.stdout.str()
    assert wait_for_builds_apart() == []
    assert _damage_of(shared_library(target)) == "None"
    assert list(target.rglob("lock")) == []
    assert [p.name for p in private_tmp.iterdir() if p.name.startswith("dsrepro-")] == []
    again = run("-v")
    again.assert_outcomes(passed=1)
    again.stdout.fnmatch_lines([f"worlds ran on: *comm op loaded from {target}*"])
    assert "building DeepSpeed's CPU comm op" not in again.stdout.str()


def test_a_build_beside_the_worlds_that_failed_is_said_by_the_next_run(
    pytester: pytest.Pytester, run: RunPytest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 35: a build that goes on apart may fail once nobody reads the fork server's log. Why is kept in its op's
    directory, and the next run says it as it builds again (here no compiler works, so it fails again)."""
    source = comm_op_directory()
    assert source is not None
    cache = pytester.path / "cold-cache"
    monkeypatch.setenv(CACHE_ENV, str(cache))
    monkeypatch.setenv("CXX", "false")
    pytester.makepyfile(USES_OP)
    run(timeout=600).assert_outcomes(passed=1)
    assert wait_for_builds_apart() == []
    again = run(timeout=600)
    again.assert_outcomes(passed=1)
    again.stdout.fnmatch_lines(
        [
            f"pytest-dsrepro: the last build of DeepSpeed's CPU comm op for {deepspeed_version()} failed (*DeepSpeed's "
            f"CPU comm op for {deepspeed_version()} could not be built in {cache / 'torch_extensions' / source.name} "
            "(*): building it again",
        ]
    )
    assert wait_for_builds_apart() == []
