"""Runs in a rank of an NCCL world: the process group's timeout, before the harness's deadline, so that torch's own
watchdog dumps NCCL's flight recorder before the harness stops the rank, and a second source, a thread that dumps it
when the pytest process asks (``client.nccl_diagnostics`` says why, and reads the dumps).

The two sources differ in what they need from the rank. torch's watchdog and its monitor are C++ threads: on a
collective's timeout they write the dump (``TORCH_FR_DUMP_TEMP_FILE``) without the rank's Python, the main thread
stuck in a CUDA call included. The thread here is Python: it needs the GIL, which a main thread stuck in a call that
holds it never gives back; it then writes nothing, and the rank's story says so.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...core.files import write_atomically
from ..workdir import NCCL_TRACE_FILE, nccl_request_file, nccl_requested_file

#: The share of the world's timeout a collective may take: a hang that starts in the world's first quarter is past
#: torch's timeout, and dumped by its watchdog, before the harness's deadline, with the last quarter left for the dump.
TIMEOUT_SHARE = 0.75
#: What torch's watchdog takes from a collective's timeout to its dump: it first waits up to 8 s for the failed
#: collective's traceback (``WorkNCCL::printTraceback``), and only then signals the dump. On an H100 (torch 2.11) a
#: 15 s world's deadline came 3.7 s after the timeout, with neither logged: no dump.
DUMP_TIME = 15.0
#: The least share a collective gets, however short the world (its hang is still dumped by the rank's own thread).
LEAST_SHARE = 0.25


def process_group_timeout(world_timeout: float) -> float:
    """A collective's timeout in an NCCL world: ``TIMEOUT_SHARE`` of the world's, and ``DUMP_TIME`` before its
    deadline at least, as far as ``LEAST_SHARE`` allows. A timeout only dumps and logs
    (``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``, ``client.nccl_diagnostics.environment``): the harness, not NCCL, ends the
    rank, at its deadline, with its Python stack."""
    return max(min(world_timeout * TIMEOUT_SHARE, world_timeout - DUMP_TIME), world_timeout * LEAST_SHARE)


def _dump_from_torch() -> bytes:
    """NCCL's flight recorder of this process, with its collectives and without their Python stacks (symbolising
    those needs the GIL again)."""
    import torch

    c10d: Any = torch._C._distributed_c10d
    dump = getattr(c10d, "_dump_nccl_trace", None)
    if dump is None:
        raise RuntimeError("this torch build has no NCCL flight recorder")
    return bytes(dump(True, False))


_serving: list[threading.Thread] = []  # the one thread of this process (a kept rank makes its group once)


def threads() -> list[threading.Thread]:
    """The harness's own thread in this rank, if it started one: not a test's leftover (``leftovers``)."""
    return list(_serving)


def serve_dump_request(rank: int, dump: Callable[[], bytes] = _dump_from_torch, poll: float = 0.1) -> None:
    """In a rank of an NCCL world: a daemon thread that writes the flight recorder when the harness asks
    (``request_dumps``), next to where torch's watchdog would. It follows ``TORCH_FR_DUMP_TEMP_FILE`` from test to
    test (a kept rank runs each in a new directory). Nothing without it; one thread per process."""
    if not os.environ.get(NCCL_TRACE_FILE) or _serving:
        return

    def serve() -> None:
        answered: set[str] = set()
        while True:
            prefix = os.environ.get(NCCL_TRACE_FILE, "")
            workdir = Path(prefix).parent
            if not prefix or prefix in answered or not nccl_request_file(workdir).exists():
                time.sleep(poll)
                continue
            answered.add(prefix)
            try:
                data = dump()
            except Exception as exc:  # noqa: BLE001 - said in the rank's story instead of a dump
                data = pickle.dumps({"dsrepro_error": f"{type(exc).__name__}: {exc}"})
            write_atomically(nccl_requested_file(workdir, rank), data, durable=False)

    thread = threading.Thread(target=serve, name="dsrepro-nccl-flight-recorder", daemon=True)
    _serving.append(thread)
    thread.start()
