"""DeepSpeed's CPU shared-memory allreduce leaves one ~66 MiB file per rank in /dev/shm and never deletes it.

Names are ``deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>`` (csrc/cpu/comm/shm.cpp, the same
from 0.14 to 0.19). A world's MASTER_PORT is the port of its fork server's store, held by that server while it
lives, whose worlds run one at a time: the files carrying that address and port are the running world's, and
removing them cannot touch a world of another server.
"""

from __future__ import annotations

import os
from pathlib import Path

SHM_DIR = Path("/dev/shm")


def world_buffers(addr: str, port: int, shm_dir: Path = SHM_DIR) -> list[Path]:
    if not shm_dir.is_dir():
        return []
    return sorted(shm_dir.glob(f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_*"))


def remove_world_buffers(addr: str, port: int, shm_dir: Path = SHM_DIR) -> list[Path]:
    found = world_buffers(addr, port, shm_dir)
    for path in found:
        path.unlink(missing_ok=True)
    return found
