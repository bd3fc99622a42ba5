"""A world's private directory: the one place that knows its layout, and how to leave nothing of it behind.

Ranks write their results, output and stacks here; rank 0 publishes its store port here. The pytest process reads
it after the world; whoever outlives the world (pytest, or the fork server if pytest was killed) discards it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from . import shm

LOOPBACK = "127.0.0.1"


def port_file(workdir: Path) -> Path:
    return workdir / "store_port"


def result_file(workdir: Path, rank: int) -> Path:
    return workdir / f"result-{rank}.pkl"


def output_file(workdir: Path, rank: int) -> Path:
    return workdir / f"output-{rank}.txt"


def stack_file(workdir: Path, rank: int) -> Path:
    return workdir / f"stack-{rank}.txt"


def read_text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def discard(workdir: Path) -> None:
    """Remove the world's /dev/shm buffers (keyed by its store port) and its directory."""
    port = read_text(port_file(workdir))
    if port:
        shm.remove_world_buffers(LOOPBACK, int(port))
    shutil.rmtree(workdir, ignore_errors=True)
