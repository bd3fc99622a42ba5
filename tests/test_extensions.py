"""DeepSpeed's comm op is built once per distinct source, and a build killed midway cannot wedge later runs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conftest import RunPytest, comm_op_directory
from pytest_dsrepro.core import versions
from pytest_dsrepro.worlds.comm_op import build_key, extensions_dir, remove_stale_locks

USES_OP = """
import pytest

@pytest.mark.ds_world
def test_uses_op(ds_rank):
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
"""


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
    assert extensions_dir(tmp_path, key).parent == tmp_path / "torch_extensions"


def test_stale_torch_locks_are_found_and_removed(tmp_path: Path) -> None:
    (tmp_path / "deepspeed_shm_comm").mkdir()
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.touch()
    assert remove_stale_locks(tmp_path) == [lock]
    assert not lock.exists()


def _built_op(pytester: pytest.Pytester, run: RunPytest) -> Path:
    """This environment's op directory in the real cache, built first if the cache is cold."""
    source = comm_op_directory()
    assert source is not None
    if not (source / "deepspeed_shm_comm").is_dir():
        run(timeout=1800).assert_outcomes(passed=1)  # a cold cache: build the op once, in the real cache
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
