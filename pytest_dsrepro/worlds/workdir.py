"""Runs in every process of a spawned world: a world's private directory, the one place that knows its layout, and
how to leave nothing of it behind.

Ranks write their reports, output and stacks here, and the ``/dev/shm`` buffers they mapped; the fork server writes
down its store's port, which names the world's buffers when its ranks bind DeepSpeed to the plugin's group, and rank 0
of a world whose body makes its own group that group's port. The
pytest process reads it after the world; whoever outlives the world (the fork server, or pytest if the server died)
discards it. A rank's report file is written and read only through ``protocol.write_report`` and
``protocol.read_report``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..core.outcome import OUTPUT_HEAD_BYTES, OUTPUT_TAIL_BYTES, bounded_output
from . import shm

LOOPBACK = "127.0.0.1"


def port_file(workdir: Path) -> Path:
    return workdir / "store_port"


def write_port(workdir: Path, port: int) -> None:
    port_file(workdir).write_text(str(port))


def group_port_file(workdir: Path) -> Path:
    """Where rank 0 of a world whose body makes its own process group notes that group's ``MASTER_PORT`` (the store
    it hosts: ``rank.rendezvous.own_master_port``), which names the group's buffers, before the body runs."""
    return workdir / "group_port"


def buffers_file(workdir: Path, rank: int) -> Path:
    return workdir / f"buffers-{rank}.txt"


def record_buffers(workdir: Path, rank: int) -> None:
    """Write down the DeepSpeed buffers this rank maps (in the rank, after its test): a body that made its own
    process group named them after its own port, which only the rank knows."""
    found = shm.mapped_buffers()
    if found:
        buffers_file(workdir, rank).write_text("".join(f"{p}\n" for p in found))


def result_file(workdir: Path, rank: int) -> Path:
    return workdir / f"result-{rank}.pkl"


def output_file(workdir: Path, rank: int) -> Path:
    return workdir / f"output-{rank}.txt"


def stack_file(workdir: Path, rank: int) -> Path:
    return workdir / f"stack-{rank}.txt"


#: torch's variable naming where its NCCL flight recorder dumps on a timeout (``<prefix><rank>``; torch 2.13's name,
#: once TORCH_NCCL_DEBUG_INFO_TEMP_FILE): an NCCL world's is a prefix in its directory.
NCCL_TRACE_FILE = "TORCH_FR_DUMP_TEMP_FILE"
NCCL_TRACE_PREFIX = "nccl-trace-rank-"
#: The file whose existence asks an NCCL world's ranks for their flight recorder.
NCCL_REQUEST = "nccl-trace-request"
#: What a rank's own thread writes when asked, beside torch's dump (``<prefix><rank><suffix>``).
NCCL_REQUESTED_SUFFIX = ".requested"


def nccl_request_file(workdir: Path) -> Path:
    return workdir / NCCL_REQUEST


def nccl_dump_file(workdir: Path, rank: int) -> Path:
    """Where torch's watchdog dumps rank ``rank``'s flight recorder on a collective's timeout."""
    return workdir / f"{NCCL_TRACE_PREFIX}{rank}"


def nccl_requested_file(workdir: Path, rank: int) -> Path:
    """Where rank ``rank``'s own thread dumps it when the harness asks (``rank.nccl_recorder``)."""
    return workdir / f"{NCCL_TRACE_PREFIX}{rank}{NCCL_REQUESTED_SUFFIX}"


def read_text(path: Path) -> str:
    """The file's text; "" where there is none (never written, or removed meanwhile)."""
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def read_output(workdir: Path, rank: int) -> str:
    """The rank's own stdout and stderr, bounded: never more than its first ``OUTPUT_HEAD_BYTES`` and its last
    ``OUTPUT_TAIL_BYTES`` are read, however much it wrote (``core.outcome.bounded_output`` says what was cut)."""
    try:
        f = open(output_file(workdir, rank), "rb")  # noqa: SIM115 - closed below; the size is read from the open file
    except FileNotFoundError:
        return ""
    with f:
        total = os.fstat(f.fileno()).st_size
        head = f.read(min(total, OUTPUT_HEAD_BYTES))
        f.seek(max(len(head), total - OUTPUT_TAIL_BYTES))
        tail = f.read(total - f.tell())
    return bounded_output(head, tail, total)


def discard(workdir: Path, buffers: bool = True) -> None:
    """Remove the world's /dev/shm buffers (named after its store's port, or its body's own group's; those its ranks
    listed; ``buffers=False``: its ranks live on, kept for the next test, and still map them) and its directory.
    Whoever else removes it meanwhile (pytest and the fork server both may) makes no error here."""
    if buffers:
        for port in (read_text(port_file(workdir)), read_text(group_port_file(workdir))):
            if port.strip().isdigit():
                shm.remove_world_buffers(LOOPBACK, int(port))
        try:
            lists = list(workdir.glob("buffers-*.txt"))
        except FileNotFoundError:  # removed meanwhile by the other process that outlives the world
            lists = []
        for listed in lists:
            for path in map(Path, read_text(listed).splitlines()):
                if shm.is_buffer(path):
                    path.unlink(missing_ok=True)
    shutil.rmtree(workdir, ignore_errors=True)
