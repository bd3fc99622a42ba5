"""Runs in every process of a spawned world (a rank lists what it maps; the fork server, or pytest if the server died,
removes them): DeepSpeed's CPU shared-memory allreduce leaves one ~66 MiB file per rank in /dev/shm and never
deletes it.

The files named after the port of a fork server's store are its running world's (``world_buffers``); those of a group
a body made on another port are found through what the world's processes map (``mapped_by``, ``mapped_buffers``), and
every rank's buffer of such a group goes (``group_buffers``).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PREFIX = "deepspeed_allreduce_buffer_"


def world_buffers(addr: str, port: int, shm_dir: Path = SHM_DIR) -> list[Path]:
    """The buffers named after ``addr`` and ``port``: ``deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_
    <rank>`` (csrc/cpu/comm/shm.cpp, the same from 0.14 to 0.19), made once per process, by its first process group,
    each rank creating its own and mapping every other rank's. A world's MASTER_PORT is the port of its fork server's
    store, held by that server while it lives, whose worlds run one at a time: the files carrying that address and
    port are the running world's, and removing them cannot touch a world of another server."""
    if not shm_dir.is_dir():
        return []
    return sorted(shm_dir.glob(f"{PREFIX}{os.getuid()}_{addr}_{port}_*"))


def remove_world_buffers(addr: str, port: int, shm_dir: Path = SHM_DIR) -> list[Path]:
    found = world_buffers(addr, port, shm_dir)
    for path in found:
        path.unlink(missing_ok=True)
    return found


def is_buffer(path: Path, shm_dir: Path = SHM_DIR) -> bool:
    return path.parent == shm_dir and path.name.startswith(PREFIX)


def mapped_buffers(maps: Path = Path("/proc/self/maps"), shm_dir: Path = SHM_DIR) -> list[Path]:
    """DeepSpeed's buffers this process maps, whatever port named them (none where ``maps`` cannot be read)."""
    try:
        text = maps.read_text()
    except OSError:
        return []
    if PREFIX not in text:  # a rank maps hundreds of files, and seldom a buffer: no line is split then
        return []
    named = (Path(line.split(maxsplit=5)[-1]) for line in text.splitlines() if PREFIX in line)
    return sorted({p for p in named if is_buffer(p, shm_dir)})


def mapped_by(pids: Iterable[int], shm_dir: Path = SHM_DIR) -> set[Path]:
    """DeepSpeed's buffers these processes map (a process gone maps nothing).

    A body that makes its own process group names its buffers after another port (rank 0's own store, which the
    world's directory notes, or one the body chose): the fork server reads the ``/proc/<pid>/maps`` of the world's
    processes before it kills them (a hung or stopped rank maps its peers' too, a crashed one's among them), a rank
    that ends its test lists its own (``mapped_buffers``), and every buffer of a group one of them names goes
    (``group_buffers``), once no rank of the world can still be waiting to open them."""
    return {p for pid in pids for p in mapped_buffers(Path(f"/proc/{pid}/maps"), shm_dir)}


def group_buffers(buffers: Iterable[Path], shm_dir: Path = SHM_DIR) -> list[Path]:
    """Every rank's buffer of the process groups these buffers belong to (the name without its ``_<rank>``): a rank
    that died before a peer opened its buffer is named by none of the peers' maps."""
    found = set()
    for path in buffers:
        group, _, rank = path.name.rpartition("_")
        if is_buffer(path, shm_dir) and rank.isdigit() and shm_dir.is_dir():
            found |= {p for p in shm_dir.glob(f"{glob.escape(group)}_[0-9]*") if p.name.rpartition("_")[2].isdigit()}
    return sorted(found)


def remove(paths: Iterable[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)
