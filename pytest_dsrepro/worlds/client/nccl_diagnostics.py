"""Runs in the pytest process: NCCL worlds that fail loudly. The harness, not NCCL, ends a hang, and says where each
rank was.

- The process group's timeout is longer than the world's deadline (``rank.nccl_recorder.process_group_timeout``): at
  the deadline the harness dumps every rank's Python stack and NCCL's flight recorder, then kills the world. An NCCL
  timeout first would abort the ranks with nothing but "Watchdog caught collective operation timeout".
- Each rank gets NCCL's diagnostics (``environment``, a user's own values win): async error handling (a failed or
  aborted communicator ends the rank instead of leaving it waiting), the flight recorder (the last collectives of
  every process group, with their state), its dump on an NCCL timeout into the world's directory, NCCL's warnings.
- At the deadline the harness asks for the flight recorder (``request_dumps``): a thread of each rank
  (``rank.nccl_recorder.serve_dump_request``) writes it where NCCL would on a timeout; the pytest process keeps the
  files (``keep_dumps``) before the world's directory is discarded and summarises each rank's unfinished collectives
  in its story. A torch build without the flight recorder (a CPU build) says so instead.
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

from ..workdir import NCCL_TRACE_FILE, NCCL_TRACE_PREFIX, nccl_dump_file, nccl_request_file

#: How long the pytest process waits for the ranks' dumps once asked.
DUMP_WAIT = 5.0
#: Entries of the flight recorder's ring buffer (0 turns it off; torch 2.13's name, once TORCH_NCCL_TRACE_BUFFER_SIZE).
TRACE_BUFFER = ("TORCH_FR_BUFFER_SIZE", "2000")


def environment(workdir: Path, environ: Mapping[str, str]) -> dict[str, str]:
    """What an NCCL world's ranks get on top of ``environ``, which keeps what it sets itself."""
    wanted = {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        TRACE_BUFFER[0]: TRACE_BUFFER[1],
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
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
    nccl_request_file(workdir).touch()


def wait_for_dumps(workdir: Path, ranks: list[int], timeout: float = DUMP_WAIT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(nccl_dump_file(workdir, r).exists() for r in ranks):
        time.sleep(0.05)


class _Builtins(pickle.Unpickler):
    """The flight recorder is builtins only: anything else in a dump is refused, never imported."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{module}.{name} is not a builtin")


def summary(data: bytes) -> str:
    """One line about a rank's flight recorder: its collectives that had not completed, oldest first."""
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
        f"{e.get('profiling_name', '?')} #{e.get('collective_seq_id', '?')} {e.get('state', '?')}"
        f" (sizes {e.get('input_sizes', '?')})"
        for e in pending[:3]
    )
    more = f" and {len(pending) - 3} more" if len(pending) > 3 else ""
    return f"{len(entries)} collectives recorded; not completed: {shown}{more}"


def keep_dumps(workdir: Path, ranks: list[int], keep: Path) -> dict[int, str]:
    """Copy the ranks' dumps out of the world's directory (discarded when it is reaped) into ``keep``; for each rank,
    a line for its story: where its dump is and what it says, or that it wrote none."""
    told = {}
    for rank in ranks:
        source = nccl_dump_file(workdir, rank)
        if not source.exists():
            told[rank] = "NCCL flight recorder: no dump (the rank did not answer)"
            continue
        keep.mkdir(parents=True, exist_ok=True)
        kept = keep / source.name
        shutil.copyfile(source, kept)
        told[rank] = f"NCCL flight recorder: {summary(kept.read_bytes())}; dump {kept}"
    return told
