"""DeepSpeed's comm op is built once per release, and a build killed midway cannot wedge later runs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conftest import REAL_CACHE, RunPytest, deepspeed_version
from pytest_dsrepro.worlds.comm_op import extensions_dir, remove_stale_locks


def test_one_directory_per_install(tmp_path: Path) -> None:
    a = extensions_dir(tmp_path, "0.16.3", "2.13.0", tmp_path / "env1")
    b = extensions_dir(tmp_path, "0.16.4", "2.13.0", tmp_path / "env1")
    c = extensions_dir(tmp_path, "0.16.3", "2.13.0", tmp_path / "env2")
    assert len({a, b, c}) == 3
    assert a.parent == b.parent == c.parent
    assert a == extensions_dir(tmp_path, "0.16.3", "2.13.0", tmp_path / "env1")


def test_stale_torch_locks_are_found_and_removed(tmp_path: Path) -> None:
    (tmp_path / "deepspeed_shm_comm").mkdir()
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.touch()
    assert remove_stale_locks(tmp_path) == [lock]
    assert not lock.exists()


def test_a_killed_build_does_not_hang_the_next_run(
    pytester: pytest.Pytester, run: RunPytest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache whose build directory holds torch's lock file (as a killed build leaves it) still runs at once."""
    import deepspeed
    import torch

    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ds_world
        def test_uses_op(ds_rank):
            import deepspeed
            deepspeed.init_distributed(dist_backend="gloo")
        """
    )
    installed = Path(deepspeed.__file__).parent
    source = extensions_dir(Path(REAL_CACHE), deepspeed_version(), torch.__version__, installed)
    if not (source / "deepspeed_shm_comm").is_dir():
        run(timeout=1800).assert_outcomes(passed=1)  # a cold cache: build the op once, in the real cache
    cache = pytester.path / "cache"
    target = extensions_dir(cache, deepspeed_version(), torch.__version__, installed)
    shutil.copytree(source, target)
    (target / "deepspeed_shm_comm" / "lock").write_text("")
    monkeypatch.setenv("DSREPRO_CACHE_DIR", str(cache))
    run(timeout=120).assert_outcomes(passed=1)
    assert not (target / "deepspeed_shm_comm" / "lock").exists()
