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


def warm_up() -> str:
    """Build (or load from cache) DeepSpeed's shm comm op in this process, so forked ranks inherit it loaded.

    Runs in the fork server after ``import deepspeed``. Returns a short description for the report header.
    """
    import deepspeed
    import torch
    from filelock import FileLock

    if "TORCH_EXTENSIONS_DIR" not in os.environ:
        cache = default_cache_dir()
        os.environ["TORCH_EXTENSIONS_DIR"] = str(
            extensions_dir(cache, deepspeed.__version__, torch.__version__, Path(deepspeed.__file__).parent)
        )
    directory = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    directory.mkdir(parents=True, exist_ok=True)
    from deepspeed.comm.torch import build_shm_op

    with FileLock(directory / ".dsrepro-build.lock", timeout=BUILD_LOCK_TIMEOUT):
        remove_stale_locks(directory)
        try:
            op = build_shm_op()
        except Exception as exc:  # noqa: BLE001 - ranks build it again and report the error where it matters
            return f"build failed ({type(exc).__name__}: {exc}); ranks will build it themselves"
    return f"loaded from {directory}" if op is not None else "not used by this accelerator"
