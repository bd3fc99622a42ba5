"""Runs in the pytest process: GPU leases, so that an NCCL world runs on GPUs no other world of this machine is using.

Every pytest process (each pytest-xdist worker, each concurrent session) runs its own worlds, and NCCL worlds on a
shared GPU fail in ways that look like the bug under test (out of memory, a collective that never meets). So each
NCCL world first leases the GPUs it needs (``acquire``), and sees only those.
"""

from __future__ import annotations

import os
import random
import re
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from filelock import BaseFileLock, FileLock, Timeout

from .gpu_probe import Gpu

#: How long a world waits for its GPUs by default (``--ds-gpu-wait``).
WAIT = 600.0
#: Between two attempts (with jitter, so that waiting workers do not retry in step).
POLL = 0.5


class Busy(Exception):
    """No lease within the bound; the message says which GPUs were busy and who held them."""


def lease_dir(cache_dir: Path) -> Path:
    return cache_dir / "gpu-leases"


def _name(gpu: Gpu) -> str:
    """A GPU's lock file name: its UUID (the one name of a device that does not depend on ``CUDA_VISIBLE_DEVICES`` or
    the enumeration order), else its index on this host (no UUID from torch: ROCm, old drivers)."""
    key = gpu.uuid or f"{socket.gethostname()}-index-{gpu.index}"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", key)


def lock_file(directory: Path, gpu: Gpu) -> Path:
    return directory / f"{_name(gpu)}.lock"


def holder_file(directory: Path, gpu: Gpu) -> Path:
    """Who holds the lease, in words, for those who wait (written by the holder; read only while its lock is held)."""
    return directory / f"{_name(gpu)}.holder"


@dataclass
class Lease:
    """GPUs held by this process until ``release``: one lock file per GPU under the cache directory, named after the
    GPU (``_name``). The lock is an OS file lock held by the pytest process for the world's life: the lease *is* that
    lock, so the kernel ends it when the process dies, even by SIGKILL, and no stale lease outlives its holder."""

    gpus: tuple[Gpu, ...]
    _locks: list[BaseFileLock] = field(default_factory=list, repr=False)

    def environ(self) -> dict[str, str]:
        """What the world's ranks see: only these GPUs (``CUDA_VISIBLE_DEVICES``, by UUID), in this order (rank r's
        ``cuda:r`` is the r-th of them)."""
        return {"CUDA_VISIBLE_DEVICES": ",".join(g.visible_id for g in self.gpus)}

    def release(self) -> None:
        for lock in self._locks:
            lock.release()
        self._locks.clear()


def try_lease(gpus: Sequence[Gpu], count: int, directory: Path, holder: str) -> Lease | None:
    """``count`` free GPUs (lowest indices first), all or none: no world holds some while waiting for more, so no two
    worlds wait on each other."""
    directory.mkdir(parents=True, exist_ok=True)
    taken: list[tuple[Gpu, BaseFileLock]] = []
    for gpu in gpus:
        if len(taken) == count:
            break
        lock: BaseFileLock = FileLock(str(lock_file(directory, gpu)))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            continue
        taken.append((gpu, lock))
    if len(taken) < count:
        for _, lock in taken:
            lock.release()
        return None
    since = time.strftime("%H:%M:%S")
    for gpu, _ in taken:
        holder_file(directory, gpu).write_text(f"pid {os.getpid()} ({holder}) since {since}")
    return Lease(tuple(g for g, _ in taken), [lock for _, lock in taken])


def busy(gpus: Sequence[Gpu], directory: Path) -> list[str]:
    """The GPUs another process holds right now, each with its holder's words."""
    found = []
    for gpu in gpus:
        lock = FileLock(str(lock_file(directory, gpu)))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            try:
                who = holder_file(directory, gpu).read_text().strip()
            except OSError:
                who = "a holder that has not said who it is"
            found.append(f"{gpu.describe()} leased by {who}")
        else:
            lock.release()
    return found


def acquire(
    gpus: Sequence[Gpu],
    count: int,
    directory: Path,
    wait: float,
    holder: str,
    *,
    poll: float = POLL,
    sleep: Callable[[float], None] = time.sleep,
) -> Lease:
    """Lease ``count`` of ``gpus``, retrying for up to ``wait`` seconds; ``Busy`` after that."""
    if count > len(gpus):
        raise Busy(f"{count} GPUs needed, {len(gpus)} on this machine")
    deadline = time.monotonic() + wait
    while True:
        lease = try_lease(gpus, count, directory, holder)
        if lease is not None:
            return lease
        left = deadline - time.monotonic()
        if left <= 0:
            held = busy(gpus, directory)
            raise Busy(
                f"no {count} free GPUs within {wait:g}s (--ds-gpu-wait); busy: {'; '.join(held) or 'none any more'}"
            )
        sleep(min(left, poll * random.uniform(0.5, 1.5)))


class WorldLeases:
    """The GPUs of one pytest process's NCCL worlds: a lease per world, and the one a kept world holds for its life.

    A kept NCCL world (``reuse=True``) holds its lease for its life: the next test of its scope and size runs on it;
    the next NCCL world of another, on the server that ends the kept world as it starts this one, takes it over when
    it needs as many GPUs, and otherwise leases its own once it is given back (the kept ranks then live unleased for
    the moment it takes the server to end them); a gloo world runs on another server and leaves the kept world, and
    its lease, alone.
    """

    def __init__(self, directory: Path, wait: float) -> None:
        self.directory = directory
        self.wait = wait
        self.kept: Lease | None = None  # the GPUs of the NCCL world its server keeps

    def take(self, gpus: Sequence[Gpu], size: int, holder: str) -> Lease:
        """The GPUs of an NCCL world of ``size`` ranks: the kept world's, else new ones (``acquire``)."""
        kept = self.kept
        if kept is not None and len(kept.gpus) == size:
            self.kept = None
            return kept
        self.release_kept()
        return acquire(gpus, size, self.directory, self.wait, holder)

    def ended(self, lease: Lease, kept: bool) -> None:
        """A world ended: its lease is held on while the server keeps its ranks (``kept``), else given back."""
        if kept:
            self.kept = lease
        else:
            lease.release()

    def release_kept(self) -> None:
        """The kept NCCL world ended (its server closed, or a world needing other GPUs ended it): they are free."""
        kept, self.kept = self.kept, None
        if kept is not None:
            kept.release()
