"""Runs in a rank the fork server forked: its whole life, from its own output files to its report, and for a rank of
a reusable world the loop on its link (``protocol.NextTest``, ``protocol.RankFinished``) between two tests.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import marshal
import os
import pickle
import signal
import sys
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from types import CodeType

from ...core.outcome import Status
from ...inrank.context import RankContext
from ..protocol import Meeting, NextTest, RankFinished, RankJob, RankReport, write_report
from ..workdir import group_port_file, output_file, record_buffers, stack_file
from . import body, rendezvous
from .leftovers import ProcessState
from .reuse_reset import Baseline

#: The signal on which a rank dumps every thread's Python stack (the fork server sends it, asked by pytest).
STACK_SIGNAL = signal.SIGUSR1


def _into(workdir: Path, rank: int) -> None:
    """The rank's output and stack files are this world's: fds 1 and 2, and faulthandler's file."""
    sys.stdout.flush()
    sys.stderr.flush()
    out = os.open(output_file(workdir, rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    for stream in (sys.stdout, sys.stderr):  # keep Python's prints in order with C-level writes to the same file
        stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    stack = open(stack_file(workdir, rank), "w")  # noqa: SIM115 - must stay open for faulthandler
    faulthandler.register(STACK_SIGNAL, file=stack, all_threads=True)
    faulthandler.enable(file=stack, all_threads=True)  # a segfault or abort leaves the Python stack too


def rank_life(
    job: RankJob,
    rank: int,
    size: int,
    workdir: Path,
    meeting: Meeting,
    code: CodeType | None,
    link: Connection | None = None,
    forked: Baseline | None = None,
) -> None:
    """One forked rank: its test, reported. A rank of a reusable world (``link``, and ``forked``: what the server
    saved of it before the fork) whose body passed (in a gloo world, or failed, or skipped: ``RankReport.goes_on``)
    puts back what it had when it was forked (``reuse_reset``), says it finished, and waits on its link for the next
    test of its scope. It exits after any other ending (a setup that failed, a crash), when the test left what it
    cannot put back (``leftovers``: its report says what, ``RankReport.not_kept``), when its body did not pass while
    a peer's still ran (``run_rank``), or when the server closes its link."""
    baseline = forked.settled() if forked is not None and link is not None else None
    state = ProcessState.take() if baseline is not None else None
    while True:
        _into(workdir, rank)
        kept_group = link is not None and job.backend == "nccl"
        kept = link is not None and job.backend == "gloo"  # a kept NCCL rank goes on only after a pass
        report = run_rank(job, rank, size, meeting, code, keep_group=kept_group, workdir=workdir, kept=kept)
        record_buffers(workdir, rank)
        if link is None or baseline is None or state is None or not report.goes_on(job.backend) or report.not_kept:
            write_report(workdir, rank, report)
            return
        _drop_group(report)
        left = _put_back(baseline, state)
        write_report(workdir, rank, dataclasses.replace(report, not_kept="; ".join(left)))
        if left:
            return
        link.send(RankFinished(time.monotonic()))
        try:
            following = link.recv()
        except (EOFError, OSError):
            return
        assert isinstance(following, NextTest)
        job, workdir, meeting = following.job, Path(following.workdir), following.meeting
        code = None if following.code is None else marshal.loads(following.code)


def _put_back(baseline: Baseline, state: ProcessState) -> list[str]:
    """After a test on a kept rank: what it left that cannot be put back (then nothing is: the rank exits), else
    everything put back as forked (``reuse_reset``) and nothing."""
    rebound = baseline.namespaces.rebound()
    left = state.leftovers() + baseline.leftovers(rebound)
    if not left:
        try:
            baseline.restore(rebound)
        except Exception as exc:  # noqa: BLE001 - never expected: what could not be put back is a leftover
            left.append(f"putting it back failed: {type(exc).__name__}: {exc}")
    return left


def _drop_group(report: RankReport) -> None:
    """A gloo rank whose body did not pass goes on with its group still made (``run_rank`` drops a passed one's):
    dropping it is local, and the next test makes a new one."""
    import torch.distributed as dist

    if report.status is not Status.PASSED and dist.is_initialized():
        dist.destroy_process_group()


def run_rank(
    job: RankJob,
    rank: int,
    world_size: int,
    meeting: Meeting,
    code: CodeType | None = None,
    *,
    keep_group: bool = False,
    workdir: Path | None = None,
    kept: bool = False,
) -> RankReport:
    """A spawned rank's test, from its rendezvous to its report, except process plumbing (``rank_life``); ``code``:
    the test module's code, compiled by the fork server for every rank of the world (None: compiled here). Its
    report's ``marks`` say when it got through each phase of the world (``core.outcome.PHASES``). ``keep_group``: a
    rank of a reusable NCCL world keeps its process group for the next test (a new NCCL communicator is the cost of
    such a world); a gloo rank makes a new one per test, which costs milliseconds. ``workdir``: where rank 0 notes the
    port of the group a body makes itself, which names DeepSpeed's buffers (``workdir.group_port_file``). ``kept``:
    a rank of a reusable gloo world, which says on the world's store that its body ended; one whose body did not pass
    while a peer's runs on (``rendezvous.PEERS_WAIT``) is not kept (``RankReport.not_kept``): that peer may be
    waiting on it, and learns only when its connections close, which a fresh rank's exit does at once (dropping the
    group does not while the failed body's objects hold it)."""
    marks = [time.monotonic()]

    def mark() -> None:
        marks.append(time.monotonic())

    job.environ.apply(os.environ)
    try:
        stores = _meet(job, rank, world_size, meeting)
        if workdir is not None and rank == 0 and stores[1] is not None:
            group_port_file(workdir).write_text(str(stores[1][0]))
    except BaseException as exc:  # noqa: BLE001
        return body.failed_report(exc, "world setup failed:\n", traceback.format_exc())
    mark()
    ctx = RankContext(rank=rank, world_size=world_size, local_rank=rank, backend=job.backend)
    try:
        fn = body.resolve_test(job.test, code)
        kwargs, fixes, setup = pickle.loads(job.payload)
    except BaseException as exc:  # noqa: BLE001
        return body.failed_report(exc, "loading the test failed:\n", traceback.format_exc())
    mark()
    report = body.run_body(fn, kwargs, fixes, ctx, deepspeed=job.deepspeed, setup=setup, mark=mark, undo_patches=True)
    report = _after_body(report, stores[0], rank, world_size, keep_group=keep_group, kept=kept)
    del stores  # kept until the body was over
    return dataclasses.replace(report, marks=(*marks, report.at or time.monotonic()))


def _after_body(report: RankReport, store: object, rank: int, world_size: int, *, keep_group: bool, kept: bool
                ) -> RankReport:  # fmt: skip
    """A clean rank's teardown (``run_rank``'s ``keep_group``), and a kept rank's word that its body ended; a kept
    rank whose body did not pass while a peer's ran on is not kept (``run_rank``'s ``kept``)."""
    import torch.distributed as dist

    if kept:  # before a passed rank's teardown, which may wait on its peers
        rendezvous.body_ended(store, rank)
    if dist.is_initialized() and report.status is Status.PASSED and not keep_group:
        # Only a clean rank tears down collectively; a failed one must not wait on peers that may be gone.
        dist.destroy_process_group()
    if kept and report.status is not Status.PASSED and not rendezvous.peers_ended(store, world_size):
        return dataclasses.replace(report, not_kept=f"its body ended {report.status.value} while a peer's ran on")
    return report


def _meet(job: RankJob, rank: int, world_size: int, meeting: Meeting) -> tuple[object, tuple[int, object] | None]:
    """The world's rendezvous: the server's store, torchrun's variables, the default process group, every rank
    connected. Returns what must live as long as the body: the store, and in a world without the plugin's process
    group the master port and rank 0's own store on it."""
    master = None
    store = rendezvous.rendezvous(meeting.port, meeting.world, job.timeout)
    if job.launcher_env:
        if not job.process_group:  # the body makes the group, on a MASTER_PORT nobody else serves
            master = rendezvous.own_master_port(store, rank, job.timeout)
        rendezvous.set_rank_environment(rank, world_size, master[0] if master else meeting.port)
    if job.process_group:
        rendezvous.init_default_group(job.backend, store, rank, world_size, job.timeout)
    rendezvous.agree_connected(store, rank, world_size, job.timeout)
    return store, master
