"""Runs in the pytest process: one world in flight, from ``Spawn`` to ``Reaped``, and what its ranks did, as an outcome.

A world always ends within its timeout, leaves no process and no /dev/shm buffer behind, and tells the story of
every rank: its exception, its exit code or signal, its Python stack if it hung, and the tail of its own output.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import pickle
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ...core.errors import HarnessError
from ...core.outcome import PHASES, RankResult, Status, WorldOutcome, describe_exit, phases, rank_ranges
from ..protocol import (
    FAILURE_GRACE,
    DumpStacks,
    Exited,
    Finished,
    Kill,
    OpWait,
    RankJob,
    RankReport,
    Reap,
    Reaped,
    Spawn,
    Spawned,
    WorldEnded,
    read_report,
)
from ..workdir import discard, read_output, read_text, stack_file
from . import nccl_diagnostics
from .fork_server import ForkServer, WorldMessage
from .server_process import ServerGone, told_log

#: How long ranks get to write their Python stacks before they are killed.
STACK_DUMP_WAIT = 1.0


#: How long the server may take to kill what is left of a world and answer ``Reaped`` (it takes milliseconds; this
#: only bounds a wedged server).
REAP_WAIT = 15.0


#: The same for a world whose ranks were never announced (Ctrl-C while the server prepared them).
UNANNOUNCED_REAP_WAIT = 1.0

#: How long an interruption waits for the server's word of ranks already running (a loaded machine can run a body
#: before pytest has read ``Spawned``), so that their stacks are still taken.
ANNOUNCE_WAIT = 5.0


class WorldInterrupted(BaseException):
    """Something other than Ctrl-C interrupted a running world (pytest-timeout's failure, another plugin's exit):
    ``outcome`` holds every live rank's Python stack, taken before they were killed; ``cause`` is the interruption,
    which the pytest side re-raises as it sees fit."""

    def __init__(self, outcome: WorldOutcome, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.outcome = outcome
        self.cause = cause


@dataclass
class _Rank:
    rank: int
    pid: int  # for diagnostics only: the server signals its ranks, never this process
    returncode: int | None = None
    report: RankReport | None = None  # what the rank wrote before exiting
    forced: Status | None = None  # HUNG or STOPPED when we ended it
    forced_detail: str = ""
    exited_at: float | None = None  # when the server reaped it (time.monotonic()'s clock)
    finished: bool = False  # a reusable world's rank that ended its test cleanly and lives on (``Finished``)

    @property
    def failed(self) -> bool:
        """Ended, and not cleanly: a non-zero exit code, no report, or a failure reported."""
        return self.returncode is not None and (
            self.returncode != 0 or self.report is None or self.report.status is Status.FAILED
        )


@dataclass
class WorldRun:
    """One world in flight: its ranks, its private directory, and how it ends.

    It talks to the fork server only in ``protocol`` messages, which reach it through the server's one loop
    (``ForkServer.wait_for``, into ``take``), and never signals a rank itself: the server forked the ranks and reaps
    them, so only it knows a pid still names that rank. To stop ranks it asks the server (``DumpStacks``, then
    ``Kill``), and ``Reap`` when the world's directory has been read.

    Its clock is its test's only: it starts when the server says the ranks run (``Spawned``), not while the server
    prepares them (a first preload, a found list imported: the server's start-up work, bounded as its start is), and
    it stops while its ranks wait for an op the server builds for them (``OpWait``).
    """

    server: ForkServer
    world_id: int
    size: int
    backend: str
    timeout: float
    failure_grace: float = FAILURE_GRACE
    stack_dump_wait: float = STACK_DUMP_WAIT
    reuse: str | None = None  # the test's reuse scope (``Spawn.reuse``)
    reused: bool = False  # the server ran it on ranks kept from the previous test of the scope
    preloaded: str | None = None  # what the server said it had imported ahead of its ranks
    fork_hazard: str | None = None  # what the server said made its fork of this world unsafe
    flight_recorder: Path | None = None  # an NCCL world's: where its ranks' flight recorder dumps are kept
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="dsrepro-world-")))
    ranks: list[_Rank] = field(default_factory=list)
    reaped: bool = False  # nothing of the world is left but its directory: the server said WorldEnded, or Reaped
    kept: bool = False  # asked the server to keep its ranks for the next test of its scope (``_keep``)
    clock: float = math.inf  # when its clock started: its ranks were said to run (``Spawned``)
    paused: float = 0.0  # how long its ranks waited for ops the server built (``OpWait``), once they got them
    paused_since: float | None = None  # since when they wait, while they do (its timeout cannot expire meanwhile)

    def _live(self) -> list[_Rank]:
        return [r for r in self.ranks if r.returncode is None]

    def take(self, message: WorldMessage) -> None:
        """One of this world's messages, from the server's loop (``ForkServer.dispatch``)."""
        match message:
            case Spawned():
                self.ranks = [_Rank(rank, pid) for rank, pid in enumerate(message.pids)]
                self.preloaded, self.fork_hazard = message.preloaded, message.fork_hazard
                self.reused = message.reused
                self.clock = time.monotonic()
            case OpWait(waiting=True):
                self.paused_since = message.at
            case OpWait():
                if self.paused_since is not None:
                    self.paused += message.at - self.paused_since
                self.paused_since = None
            case Reaped() | WorldEnded():
                self.reaped = True
            case Exited() | Finished():
                # A world interrupted before its Spawned arrived knows no ranks yet: their ends only matter to the
                # server.
                if message.rank < len(self.ranks):
                    r = self.ranks[message.rank]
                    r.finished = isinstance(message, Finished)  # it counts as a clean exit; a later Exited overrides
                    r.returncode = message.returncode if isinstance(message, Exited) else 0
                    r.exited_at = message.at if message.at is not None else time.monotonic()
                    r.report = read_report(self.workdir, r.rank)

    def _force_end(self, ranks: list[_Rank], status: Status, detail: str) -> None:
        """Have the server dump the Python stacks of ``ranks`` (and an NCCL world's ranks their flight recorder), then
        kill them."""
        for r in ranks:
            r.forced, r.forced_detail = status, detail
        which = tuple(r.rank for r in ranks)
        if self.flight_recorder is not None:
            nccl_diagnostics.request_dumps(self.workdir)
        self.server.send(DumpStacks(self.world_id, which))
        deadline = time.monotonic() + self.stack_dump_wait
        while time.monotonic() < deadline and not all(self._stack(r.rank) for r in ranks):
            time.sleep(0.02)
        if self.flight_recorder is not None:
            nccl_diagnostics.wait_for_dumps(self.workdir, list(which))
            for rank, told in nccl_diagnostics.keep_dumps(self.workdir, list(which), self.flight_recorder).items():
                self.ranks[rank].forced_detail += f"; {told}"
        self.server.send(Kill(self.world_id, which))

    def _stack(self, rank: int) -> str:
        return _user_frames(nccl_diagnostics.without_recorder_thread(read_text(stack_file(self.workdir, rank))))

    def run(self, job: RankJob) -> WorldOutcome:
        started = time.monotonic()
        try:
            self.server.send(Spawn(self.world_id, pickle.dumps(job), self.size, str(self.workdir), self.reuse))
            # Preparing the ranks is the server's start-up work (a first preload), bounded as its start is.
            wait = max(self.timeout, self.server.startup_timeout)
            if not self.server.wait_for(lambda: bool(self.ranks), math.inf, self, silence=wait):
                log = self.server.process.log_tail()
                raise HarnessError(
                    f"the pytest-dsrepro fork server did not start the ranks within {wait:g}s; {told_log(log)}"
                )
            self._wait()
            return self._outcome(started)
        except ServerGone as exc:
            raise HarnessError(
                f"the pytest-dsrepro fork server died while this test's world ran ({exc.ending}), "
                f"{time.monotonic() - started:.1f}s in; its ranks died with it; {told_log(exc.log)}"
            ) from None
        except (KeyboardInterrupt, HarnessError):
            raise  # Ctrl-C ends at once: the cleanup below kills the ranks without waiting for their stacks
        except BaseException as exc:
            interrupted = self._interrupted(exc, started)
            if interrupted is None:
                raise
            raise WorldInterrupted(interrupted, exc) from exc
        finally:
            self._cleanup()

    def _interrupted(self, exc: BaseException, started: float) -> WorldOutcome | None:
        """Something else interrupted the wait (pytest-timeout's failure): the live ranks' stacks, then the world."""
        if not self.ranks:
            try:
                self.server.wait_for(lambda: bool(self.ranks), time.monotonic() + ANNOUNCE_WAIT, self)
            except ServerGone:
                return None
        live = self._live()
        if not live:
            return None
        reason = ": ".join(filter(None, [type(exc).__name__, (str(exc).strip().splitlines() or [""])[0]]))
        try:
            self._force_end(live, Status.HUNG, f"still running when the test was interrupted ({reason})")
            self._collect_exits(live)
        except HarnessError:
            return None
        return self._outcome(started)

    def _wait(self) -> None:
        first_failure: float | None = None
        while live := self._live():
            now = time.monotonic()
            deadline = math.inf if self.paused_since is not None else self.clock + self.timeout + self.paused
            if first_failure is None and any(r.failed for r in self.ranks):
                first_failure = now
            if first_failure is not None and now > first_failure + self.failure_grace:
                failed = [r.rank for r in self.ranks if r.failed]
                self._force_end(
                    live,
                    Status.STOPPED,
                    f"still running {self.failure_grace:g}s after {rank_ranges(failed)} failed",
                )
            elif now > deadline:
                self._force_end(live, Status.HUNG, f"still running when the {self.timeout:g}s world timeout expired")
            else:
                wake = deadline if first_failure is None else min(deadline, first_failure + self.failure_grace)
                turned = functools.partial(self._turned, first_failure is not None, self.paused_since is not None)
                self.server.wait_for(turned, wake, self)
                continue
            self._collect_exits(live)

    def _turned(self, failing: bool, paused: bool) -> bool:
        """Has the wait something new to decide: every rank ended, (not ``failing`` yet) a first rank failed, or the
        clock stopped or went on (not ``paused``, or ``paused``: its deadline moved)?"""
        moved = (self.paused_since is not None) != paused
        return not self._live() or moved or (not failing and any(r.failed for r in self.ranks))

    def _collect_exits(self, ranks: list[_Rank]) -> None:
        """The ``Exited`` of ranks the server was asked to kill (it answers at once; ``REAP_WAIT`` bounds a wedged
        server, and a dead one raises ``ServerGone`` at once)."""
        self.server.wait_for(lambda: all(r.returncode is not None for r in ranks), time.monotonic() + REAP_WAIT, self)
        for r in ranks:  # the server is wedged: never report a rank as still alive
            if r.returncode is None:
                r.returncode = -signal.SIGKILL

    def _outcome(self, started: float) -> WorldOutcome:
        results = []
        for r in self.ranks:
            output = read_output(self.workdir, r.rank)
            if r.forced is not None:
                stack = self._stack(r.rank)
                results.append(RankResult(r.rank, r.forced, detail=r.forced_detail, output=output, stack=stack))
            else:
                results.append(_ended_on_its_own(r, output, started, self._stack(r.rank)))
        duration = time.monotonic() - started
        left = [f"rank {r.rank}: {r.report.not_kept}" for r in self.ranks if r.report is not None and r.report.not_kept]
        return WorldOutcome(
            self.size, self.backend, tuple(results), duration, _phases(self.ranks, started), self.reused,
            "; ".join(left),
        )  # fmt: skip

    def _keep(self) -> bool:
        """May the server keep the ranks for the next test of the scope? Only when every one of them ended its body so
        that it goes on (``RankReport.goes_on``: passed; in a gloo world, failed or skipped too) and lives on:
        after a hang, a crash, a stop or a failed setup the next test gets a new world; an NCCL world too after a
        failure, and after a collective that reached torch's timeout (its watchdog dumped), however the test ended."""
        if self.flight_recorder is not None and nccl_diagnostics.watchdog_dumped(self.workdir):
            return False
        return self.reuse is not None and all(
            r.finished and r.forced is None and r.report is not None and r.report.goes_on(self.backend)
            for r in self.ranks
        )

    def _cleanup(self) -> None:
        """Have the server reap the world and wait for its ``Reaped`` (or its ``WorldEnded``, said unasked once every
        rank has ended: then nothing is waited for); the directory is discarded here too (after a
        ``WorldEnded`` before the ``Reap``, which then finds it gone, rather than both removing it at once).

        Runs on every ending, an interrupted one included (Ctrl-C, pytest-timeout): the server kills what is left
        and answers within milliseconds, so nothing waits for ``Exited`` messages that a reaped world never sends. A
        world whose ranks were never announced is waited for only briefly: the server may be busy preparing them (a
        first preload, seconds); it reaps the world once it gets there, or, stopped, kills it with everything else.
        A dead server's ranks died with it: then only the directory (and its ``/dev/shm`` buffers) is left to remove.
        """
        try:
            if self.reaped:  # WorldEnded: nothing of the world is left but this directory
                discard(self.workdir)
            if self.server.alive:
                self.kept = self._keep()
                self.server.send(Reap(self.world_id, keep=self.kept))
                wait = REAP_WAIT if self.ranks else UNANNOUNCED_REAP_WAIT
                self.server.wait_for(lambda: self.reaped, time.monotonic() + wait, self)
        except ServerGone:
            pass
        finally:
            discard(self.workdir)


def _phases(ranks: list[_Rank], started: float) -> tuple[tuple[str, float], ...]:
    """Where the world's time went, when every rank got through every phase on its own."""
    marks = [r.report.marks for r in ranks if r.report is not None and r.forced is None]
    ends = [r.exited_at for r in ranks if r.exited_at is not None]
    if not ranks or len(marks) < len(ranks) or len(ends) < len(ranks):
        return ()
    if any(len(m) != len(PHASES) - 1 for m in marks):
        return ()
    return phases(started, marks, max(ends))


def _ended_on_its_own(r: _Rank, output: str, started: float, stack: str) -> RankResult:
    """A rank that ended on its own: its report counts only when it also exited cleanly.

    A crash is never a pass: a rank that wrote PASSED (or SKIPPED) and then died by a signal or a non-zero exit code
    crashed. A rank that reported a failure keeps it, with how it then ended. A crashed rank's Python stack is what
    faulthandler wrote on the fatal signal; its time is when the server reaped it.
    """
    assert r.returncode is not None
    ending = describe_exit(r.returncode)
    exited = None if r.exited_at is None else max(0.0, r.exited_at - started)
    if r.report is None:
        if r.returncode == 0:
            ending += " without reporting that its body completed"
        return RankResult(r.rank, Status.CRASHED, detail=ending, output=output, stack=stack, at=exited)
    result = r.report.result(r.rank, output, started)
    if r.returncode == 0:
        return result
    if r.report.status is Status.FAILED:
        return dataclasses.replace(result, detail=f"then {ending}", stack=stack)
    detail = f"{ending} after its body {r.report.status.value}"
    return RankResult(r.rank, Status.CRASHED, detail=detail, output=output, stack=stack, at=exited)


def _user_frames(dump: str) -> str:
    """faulthandler's dump without the harness frames under the test body (innermost frames come first)."""
    here = os.sep + "pytest_dsrepro" + os.sep + "worlds" + os.sep
    harness = (here + "rank" + os.sep, here + "server" + os.sep, "<frozen runpy>")
    return "\n".join(
        line
        for line in dump.splitlines()
        if not any(h in line for h in harness) and not line.startswith("Extension modules:")  # a fatal error's list
    )
