"""Runs in a rank of an NCCL world: the process group's timeout past the harness's deadline, and the thread that dumps
NCCL's flight recorder when the pytest process asks (``client.nccl_diagnostics`` says why, and reads the dumps).

The thread needs the GIL: a rank stuck in a call that holds it (rare: torch releases it while waiting on NCCL)
writes no dump, and its story says so.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..workdir import NCCL_REQUEST, NCCL_TRACE_FILE

#: How much longer than the world's timeout a collective may wait, at least: the harness's deadline comes first.
MARGIN = 60.0


def process_group_timeout(world_timeout: float) -> float:
    """A collective's timeout in an NCCL world: twice the world's, and at least ``MARGIN`` seconds longer."""
    return max(2 * world_timeout, world_timeout + MARGIN)


def _dump_from_torch() -> bytes:
    """NCCL's flight recorder of this process, as torch dumps it on a timeout (a pickle of builtins)."""
    import torch

    c10d: Any = torch._C._distributed_c10d
    dump = getattr(c10d, "_dump_nccl_trace", None)
    if dump is None:
        raise RuntimeError("this torch build has no NCCL flight recorder")
    return bytes(dump())


def serve_dump_request(rank: int, dump: Callable[[], bytes] = _dump_from_torch, poll: float = 0.1) -> None:
    """In a rank of an NCCL world: a daemon thread that writes the flight recorder when the harness asks
    (``request_dumps``), where torch itself would (``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``). Nothing without it."""
    prefix = os.environ.get(NCCL_TRACE_FILE)
    if not prefix:
        return
    request = Path(prefix).parent / NCCL_REQUEST
    target = Path(f"{prefix}{rank}")

    def serve() -> None:
        while not request.exists():
            time.sleep(poll)
        try:
            data = dump()
        except Exception as exc:  # noqa: BLE001 - said in the rank's story instead of a dump
            data = pickle.dumps({"dsrepro_error": f"{type(exc).__name__}: {exc}"})
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_bytes(data)
        tmp.rename(target)

    threading.Thread(target=serve, name="dsrepro-nccl-flight-recorder", daemon=True).start()
