"""Runs in the pytest process: NCCL worlds that fail loudly. The harness, not NCCL, ends a hang, and says where each
rank was and which collective it had not finished.

Each rank gets NCCL's diagnostics (``environment``, a user's own values win), and a collective times out before the
world's deadline (``rank.nccl_recorder.process_group_timeout``), so that torch's watchdog has dumped the flight recorder
by then; at the deadline the harness also asks each rank's own thread (``request_dumps``), keeps the dumps and
summarises them in each rank's story (``keep_dumps``).
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..workdir import NCCL_TRACE_FILE, NCCL_TRACE_PREFIX, nccl_dump_file, nccl_request_file, nccl_requested_file

#: How long the pytest process waits for the ranks' dumps once asked.
DUMP_WAIT = 5.0
#: Entries of the flight recorder's ring buffer (0 turns it off; torch 2.13's name, once TORCH_NCCL_TRACE_BUFFER_SIZE).
TRACE_BUFFER = ("TORCH_FR_BUFFER_SIZE", "2000")
#: How much longer than the world's timeout torch's monitor thread waits before it ends a rank (after a dump, or
#: when its watchdog stops beating): never before the harness has taken the rank's stack.
MONITOR_MARGIN = 60.0


def environment(workdir: Path, environ: Mapping[str, str], timeout: float) -> dict[str, str]:
    """What the ranks of an NCCL world of ``timeout`` seconds get on top of ``environ``, which keeps what it sets.

    torch 2.13's names (``ProcessGroupNCCL.hpp``, ``FlightRecorder.hpp``): no error handling (0: a timed-out
    collective is logged and dumped, the communicator neither aborted nor the process torn down), the flight
    recorder dumped on a timeout (by the monitor thread, which must be on) without the collectives' Python stacks
    (symbolising them takes the GIL), into the world's directory; the monitor's kill after a dump or a stuck watchdog
    only past the harness's deadline; NCCL's warnings."""
    wanted = {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
        TRACE_BUFFER[0]: TRACE_BUFFER[1],
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_ENABLE_MONITORING": "1",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(int(timeout + MONITOR_MARGIN)),
        "TORCH_INCLUDE_STACK_TRACE": "0",
        NCCL_TRACE_FILE: str(workdir / NCCL_TRACE_PREFIX),
        "NCCL_DEBUG": "WARN",
    }
    return {k: v for k, v in wanted.items() if k not in environ}


#: How faulthandler names the file of the recorder thread's frames (``rank.nccl_recorder``, in every NCCL rank).
HERE = os.sep + os.path.join("worlds", "rank", "nccl_recorder.py")


def without_recorder_thread(stacks: str) -> str:
    """faulthandler's dump of a rank without the thread that waits to dump the flight recorder: the harness's."""
    blocks = stacks.split("\n\n")
    return "\n\n".join(b for b in blocks if not (b.startswith("Thread ") and HERE in "".join(b.splitlines()[1:2])))


def request_dumps(workdir: Path) -> None:
    """At the deadline, ask each rank's own thread for its flight recorder (``rank.nccl_recorder.serve_dump_request``,
    the second source, which needs the GIL), beside the dump torch's watchdog wrote on a collective's timeout (without
    the rank's Python, a main thread stuck in a CUDA call included): a hang that started early enough is past that
    timeout before the deadline. The harness then waits a little for either dump (``wait_for_dumps``)."""
    nccl_request_file(workdir).touch()


def watchdog_dumped(workdir: Path) -> bool:
    """Did torch's watchdog dump a rank's flight recorder: one of its collectives timed out."""
    return any(workdir.glob(f"{NCCL_TRACE_PREFIX}*[0-9]"))


def _dump_of(workdir: Path, rank: int) -> tuple[Path, str] | None:
    """A rank's dump and its source: torch's watchdog's first, else its own thread's."""
    watchdog, requested = nccl_dump_file(workdir, rank), nccl_requested_file(workdir, rank)
    if watchdog.exists():
        return watchdog, "dumped by torch's watchdog at the collective's timeout"
    if requested.exists():
        return requested, "dumped on request by the rank's Python thread"
    return None


def wait_for_dumps(workdir: Path, ranks: list[int], timeout: float = DUMP_WAIT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(_dump_of(workdir, r) for r in ranks):
        time.sleep(0.05)


class _Builtins(pickle.Unpickler):
    """The flight recorder is builtins only: anything else in a dump is refused, never imported."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{module}.{name} is not a builtin")


def summary(data: bytes) -> str:
    """One line about a rank's flight recorder (torch's format: ``entries``, each with its ``profiling_name``, sequence
    number, ``input_sizes`` and ``state``): its collectives that had not completed, oldest first."""
    try:
        dump = _Builtins(io.BytesIO(data)).load()
    except Exception as exc:  # noqa: BLE001 - a dump we cannot read is still kept as a file
        return f"unreadable ({type(exc).__name__}: {exc})"
    if not isinstance(dump, dict):
        return "unreadable (not a dictionary)"
    if "dsrepro_error" in dump:
        return f"not dumped: {dump['dsrepro_error']}"
    entries = [e for e in dump.get("entries", []) if isinstance(e, dict)]
    pending = [e for e in entries if e.get("state") != "completed"]
    if not pending:
        return f"{len(entries)} collectives recorded, all completed"
    shown = ", ".join(
        f"{e.get('profiling_name', '?')} #{e.get('p2p_seq_id' if e.get('is_p2p') else 'collective_seq_id', '?')}"
        f" {e.get('state', '?')} (sizes {e.get('input_sizes', '?')})"
        for e in pending[:3]
    )
    more = f" and {len(pending) - 3} more" if len(pending) > 3 else ""
    return f"{len(entries)} collectives recorded; not completed: {shown}{more}"


def keep_dumps(workdir: Path, ranks: list[int], keep: Path) -> dict[int, str]:
    """Copy the ranks' dumps out of the world's directory (discarded when it is reaped) into ``keep``; for each rank,
    a line for its story: where its dump is, which source wrote it and what it says (its unfinished collectives:
    ``summary``), or that there is none. A torch build without the flight recorder (a CPU build) says so instead."""
    told = {}
    for rank in ranks:
        found = _dump_of(workdir, rank)
        if found is None:
            told[rank] = (
                "NCCL flight recorder: no dump (no collective of the rank had reached torch's timeout, and its Python "
                "thread did not answer)"
            )
            continue
        source, how = found
        keep.mkdir(parents=True, exist_ok=True)
        kept = keep / source.name
        shutil.copyfile(source, kept)
        told[rank] = f"NCCL flight recorder: {summary(kept.read_bytes())}; dump {kept} ({how})"
    return told
