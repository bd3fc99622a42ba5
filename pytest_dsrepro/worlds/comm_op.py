"""DeepSpeed's JIT-built CPU comm op: built once per DeepSpeed release, never inside a test's critical path.

DeepSpeed builds ``deepspeed_shm_comm`` with ninja/g++ the first time a process group is set up on CPU (45-150 s
cold). Torch caches builds under ``TORCH_EXTENSIONS_DIR`` keyed by name only, so releases that share the directory
rebuild each other's op on every switch; and a build killed midway leaves torch's ``lock`` file behind, which makes
every later build of that directory wait forever. Hence: one directory per DeepSpeed install (release, torch,
location), one builder at a time across processes (``filelock``), and stale torch locks removed while we hold ours.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

from ..core.options import default_cache_dir

BUILD_LOCK_TIMEOUT = 1800.0  # a cold build on a loaded 2-core machine takes minutes; never forever


def extensions_dir(cache_dir: Path, deepspeed_version: str, torch_version: str, deepspeed_dir: Path) -> Path:
    """Keyed by where DeepSpeed is installed too: the build files name its sources by absolute path, so two
    installs of one release (a tox env, a bisect probe) sharing a directory would rebuild each other's op."""
    where = hashlib.sha256(str(deepspeed_dir.resolve()).encode()).hexdigest()[:10]
    return cache_dir / "torch_extensions" / f"deepspeed-{deepspeed_version}-torch-{torch_version}-{where}"


def remove_stale_locks(directory: Path) -> list[Path]:
    """Torch's build baton files; call only while holding the build lock (then no live build owns them)."""
    stale = [p for p in directory.rglob("lock") if p.is_file()]
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


#: The op's name (DeepSpeed's ``ShareMemCommBuilder.NAME``, 0.14-0.19): torch builds it into ``<dir>/<name>/<name>.so``.
OP_NAME = "deepspeed_shm_comm"


def built(directory: Path) -> bool:
    return (directory / OP_NAME / f"{OP_NAME}.so").exists()


def warm_up(announce: Callable[[str], None] = lambda _: None) -> str:
    """Build (or load from cache) DeepSpeed's shm comm op in this process, so forked ranks inherit it loaded.

    Runs in the fork server after ``import deepspeed``. ``announce`` is told, in words for the user, before a build
    (minutes, the first time a release is used) or a wait for another process's build. Returns a short description
    for the report header.
    """
    import deepspeed
    import torch
    from filelock import FileLock, Timeout

    if "TORCH_EXTENSIONS_DIR" not in os.environ:
        cache = default_cache_dir()
        os.environ["TORCH_EXTENSIONS_DIR"] = str(
            extensions_dir(cache, deepspeed.__version__, torch.__version__, Path(deepspeed.__file__).parent)
        )
    directory = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    directory.mkdir(parents=True, exist_ok=True)
    from deepspeed.comm.torch import build_shm_op

    release = f"DeepSpeed's CPU comm op for {deepspeed.__version__}"
    lock = FileLock(directory / ".dsrepro-build.lock", timeout=BUILD_LOCK_TIMEOUT)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        announce(f"waiting for another pytest-dsrepro process to build {release} (first time only)")
        lock.acquire()
    try:
        remove_stale_locks(directory)
        if not built(directory):
            announce(f"building {release}, first time only (a minute or more; cached in {directory})")
        try:
            op = build_shm_op()
        except Exception as exc:  # noqa: BLE001 - ranks build it again and report the error where it matters
            return f"build failed ({type(exc).__name__}: {exc}); ranks will build it themselves"
    finally:
        lock.release()
    return f"loaded from {directory}" if op is not None else "not used by this accelerator"
