"""What a rank would import for a DeepSpeed engine step, imported once in the fork server instead of in every rank.

A first ZeRO step imports ~1,400 modules that ``import torch, deepspeed`` does not (sympy, networkx, torch._dynamo,
inductor, ...): about 2 s in every rank of every test. The fork server imports them once, before it forks. Which
modules is found, not hand-listed: a throwaway child forked from the server runs one training step of each ZeRO
stage in a 1-rank gloo world and reports what it imported, in order; the list is kept per DeepSpeed install (and
torch, and Python) in the cache directory, so only the first run of a release pays for finding it.

Fork safety: the server must hold no thread when it forks. Modules are imported in the order the child imported
them, and preloading stops before the first module after which the server runs more threads than before.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import select
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from . import shm

#: The ZeRO stages whose first step the discovery runs (each imports its own optimizer code).
PRESETS = ("zero1", "zero2", "zero3")
DISCOVERY_TIMEOUT = 300.0


@dataclass(frozen=True)
class Preloaded:
    """What the fork server imported ahead of its ranks, for the report header and the server's facts."""

    modules: int
    seconds: float
    note: str  # where the list came from, or why preloading stopped short

    def describe(self) -> str:
        return f"{self.modules} modules in {self.seconds:.1f}s ({self.note})"


def list_file(cache_dir: Path, deepspeed_version: str, torch_version: str, deepspeed_dir: Path) -> Path:
    """One list per DeepSpeed install (release and location), torch and Python."""
    where = hashlib.sha256(str(deepspeed_dir.resolve()).encode()).hexdigest()[:10]
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    return cache_dir / "preload" / f"deepspeed-{deepspeed_version}-torch-{torch_version}-{where}-{py}.json"


def _threads() -> int:
    """Threads of this process as the kernel counts them (C++ pools too, not only Python's)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _engine_steps() -> None:
    """One step of each ZeRO stage in a 1-rank gloo world (runs in the throwaway child)."""
    import torch
    import torch.distributed as dist

    from ..core import configs
    from ..inrank import context
    from ..inrank.engine import EngineFactory
    from ..inrank.models import make_batch, tiny_mlp

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1", LOCAL_WORLD_SIZE="1")
    # Only a name here (the group's store is in-process): DeepSpeed names its /dev/shm buffer after it, so this
    # child's buffer is its own even when another discovery runs at the same time.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(os.getpid()))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    try:
        with context.running(context.RankContext(rank=0, world_size=1, local_rank=0, backend="gloo")):
            for preset in PRESETS:
                config = configs.resolve(preset, preset, 1, "gloo").config
                engine = EngineFactory(config, preset)(model=tiny_mlp(), optimizer="adam")
                x, y = make_batch(config["train_micro_batch_size_per_gpu"])
                engine.backward(torch.nn.functional.mse_loss(engine(x), y))
                engine.step()
    finally:  # DeepSpeed's CPU allreduce left a 66 MiB buffer for this 1-rank world in /dev/shm
        shm.remove_world_buffers("127.0.0.1", os.getpid())


def discover(timeout: float = DISCOVERY_TIMEOUT) -> list[str]:
    """The modules a throwaway child imports for one step of each ZeRO stage, in import order.

    Raises ``RuntimeError`` with the reason when the child fails or takes longer than ``timeout``.
    """
    before = set(sys.modules)
    sys.stdout.flush()
    sys.stderr.flush()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            os.close(read)
            _engine_steps()
            found = [name for name in sys.modules if name not in before]
            with os.fdopen(write, "w") as out:
                json.dump(found, out)
            code = 0
        except BaseException:  # noqa: BLE001 - told through the exit code; the traceback goes to the server's log
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(write)
    data: bytes | None = None
    try:
        data = _read_all(read, time.monotonic() + timeout)
    finally:
        os.close(read)
        if data is None:
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    if data is None:
        raise RuntimeError(f"finding them took longer than {timeout:g}s")
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"the engine step failed (exit {os.waitstatus_to_exitcode(status)}; see the server log)")
    return [str(name) for name in json.loads(data)]


def _read_all(fd: int, deadline: float) -> bytes | None:
    chunks: list[bytes] = []
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
    return None


def import_ahead(names: list[str]) -> tuple[int, str | None]:
    """Import ``names`` in order until one would leave this process with more threads; ``(imported, stopped_at)``.

    A module that cannot be imported here (one a child generated on the fly, say) is skipped: ranks import it
    themselves, as they would without preloading.
    """
    baseline = _threads()
    imported = 0
    for name in names:
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: BLE001 - preloading is an optimisation; the rank reports real errors
            continue
        if _threads() > baseline:
            return imported, name
        imported += 1
    return imported, None


def warm(cache_dir: Path, deepspeed_version: str, torch_version: str, deepspeed_dir: Path) -> Preloaded:
    """Import, in this (the fork server's) process, what a rank would import for its first engine step."""
    started = time.monotonic()
    listing = list_file(cache_dir, deepspeed_version, torch_version, deepspeed_dir)
    try:
        names = json.loads(listing.read_text())
        note = "list cached"
    except (OSError, ValueError):
        try:
            names = discover()
        except RuntimeError as exc:
            return Preloaded(0, time.monotonic() - started, f"not preloaded: {exc}")
        listing.parent.mkdir(parents=True, exist_ok=True)
        tmp = listing.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(names))
        tmp.rename(listing)
        note = "list found by a throwaway engine step, now cached"
    imported, stopped = import_ahead(names)
    if stopped is not None:
        note = f"stopped before {stopped}, which starts a thread"
    return Preloaded(imported, time.monotonic() - started, note)
