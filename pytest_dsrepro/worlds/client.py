"""The pytest side of a world: start the fork server, run one world, and turn what its ranks did into an outcome.

A world always ends within its timeout, leaves no process and no /dev/shm buffer behind, and tells the story of
every rank: its exception, its exit code or signal, its Python stack if it hung, and the tail of its own output.

This module talks to the fork server only in ``protocol`` messages and never signals a rank itself: the server forked
the ranks and reaps them, so only it knows a pid still names that rank. To stop ranks it asks the server
(``DumpStacks``, then ``Kill``), and ``Reap`` when the world's directory has been read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import pickle
import signal
import site
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

from ..core import versions
from ..core.errors import HarnessError
from ..core.options import CACHE_ENV
from ..core.outcome import PHASES, RankResult, Status, WorldOutcome, describe_exit, phases, rank_ranges
from ..core.world_spec import accelerator_for
from . import comm_op, devices, leases, nccl
from . import workdir as layout
from .devices import Gpu
from .protocol import (
    SCOUT_ARGUMENT,
    SERVER_MESSAGES,
    BuildEnded,
    Building,
    ClientMessage,
    DumpStacks,
    EnvironChanges,
    Exited,
    FinishBuild,
    Finished,
    Hello,
    Kill,
    RankJob,
    RankReport,
    Reap,
    Reaped,
    ServerFacts,
    ServerMessage,
    Spawn,
    Spawned,
)

#: After one rank fails, how long the others get to finish (or fail) on their own before they are stopped.
FAILURE_GRACE = 5.0
#: How long ranks get to write their Python stacks before they are killed.
STACK_DUMP_WAIT = 1.0
#: How long the server may take to kill what is left of a world and answer ``Reaped`` (it takes milliseconds; this
#: only bounds a wedged server).
REAP_WAIT = 15.0
#: The same for a world whose ranks were never announced (Ctrl-C while the server prepared them).
UNANNOUNCED_REAP_WAIT = 1.0
#: After pytest asks the fork server to stop (SIGTERM), how long it gets to clean up before its whole process group
#: is killed.
STOP_WAIT = 10.0
#: How long a server whose socket closed gets to finish dying, so that its exit status can be told.
EXIT_WAIT = 5.0
#: The fork server's module, run as ``python -m``.
SERVER_MODULE = "pytest_dsrepro.worlds.server"


class RunStops(HarnessError):
    """No world of this run can be judged, whichever test asks: the run stops, saying why in one line."""


class WrongRelease(RunStops):
    """The fork server imported another DeepSpeed than this pytest process resolves: every verdict would be about a
    release the ranks did not run."""


class CacheUnusable(RunStops):
    """The cache directory can serve no world: DeepSpeed's comm op can be neither loaded from it nor built in it."""


class ServerGone(HarnessError):
    """The fork server's socket closed: it died (or was never running). ``ending`` says how, when it is known."""

    def __init__(self, ending: str, log: str) -> None:
        super().__init__(f"the pytest-dsrepro fork server is gone ({ending}); {told_log(log)}")
        self.ending = ending
        self.log = log


def told_log(log: str) -> str:
    """The server's log in a message: its tail, or that it is empty (never a colon with nothing after it)."""
    return f"its log:\n{log}" if log.strip() else "its log is empty"


#: The report header's note (``ServerFacts.preloaded``) for a run of one world that uses DeepSpeed (``plan``).
NOT_WARMED = "nothing: one world of this run uses DeepSpeed, and its ranks import what they need themselves"
#: While DeepSpeed's comm op builds, how often the user is told it still does.
PROGRESS_EVERY = 30.0

Progress = Callable[[str], None]


def _silent(text: str) -> None:
    pass


def server_pythonpath(package_root: str, pythonpath: str | None, site_dirs: list[str]) -> str | None:
    """The fork server's ``PYTHONPATH``: this plugin must import there, and nothing may shadow what pytest imports.

    A source checkout's root is added *after* the caller's entries; an installed plugin's root is a site directory,
    already on the server's path: adding it would put the whole environment ahead of ``PYTHONPATH=<release dir>``.
    """
    entries = [p for p in (pythonpath or "").split(os.pathsep) if p]
    real = {os.path.realpath(p) for p in (*entries, *site_dirs)}
    if os.path.realpath(package_root) not in real:
        entries.append(package_root)
    return os.pathsep.join(entries) or None


class ForkServer:
    """One preloaded interpreter (``worlds.server``) per pytest process and DeepSpeed accelerator, started on first
    use.

    ``progress`` is told, in words, what a slow start is doing (a first comm-op build takes minutes). ``accelerator``:
    DeepSpeed's in its ranks (``DS_ACCELERATOR``, unless the user set it); ``gpus``: the machine's, as the pytest
    process found them (the server never asks: see ``devices``).
    """

    def __init__(
        self,
        cache_dir: Path,
        startup_timeout: float,
        progress: Progress = _silent,
        *,
        accelerator: str = "cpu",
        gpus: tuple[Gpu, ...] = (),
    ) -> None:
        self.cache_dir = cache_dir
        self.startup_timeout = startup_timeout
        self.progress = progress
        self.accelerator = accelerator
        self.gpus = gpus
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._log: Path | None = None
        self.facts: ServerFacts | None = None
        self.refused: str | None = None  # why it could not get ready, when it said so: it is not started again
        self.environ: dict[str, str] = {}  # the pytest process's environment when the server started: its baseline
        self._launched = 0.0  # when ``launch`` started it (monotonic)

    def _environment(self) -> dict[str, str]:
        env = dict(os.environ)
        package_root = str(Path(__file__).resolve().parents[2])  # the directory holding pytest_dsrepro/
        path = server_pythonpath(package_root, env.get("PYTHONPATH"), site.getsitepackages())
        if path:
            env["PYTHONPATH"] = path
        env[CACHE_ENV] = str(self.cache_dir)
        return devices.server_environment(env, self.accelerator, self.gpus)

    def launch(self, deepspeed: bool = False) -> None:
        """Start the server without waiting for it (``start`` waits); ``deepspeed``: its first world uses DeepSpeed,
        so that what its ranks need first is prepared beside the comm-op build (``worlds.preload.scout``)."""
        if self._proc is not None:
            return
        ours, theirs = socket.socketpair()
        fd, log = tempfile.mkstemp(prefix="dsrepro-server-", suffix=".log")
        self._log = Path(log)
        self.environ = dict(os.environ)
        try:
            command = [sys.executable, "-P", "-m", SERVER_MODULE, str(theirs.fileno()), str(os.getpid()), log]
            self._proc = subprocess.Popen(
                [*command, *([SCOUT_ARGUMENT] if deepspeed else [])],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=fd,
                stderr=subprocess.STDOUT,
                env=self._environment(),
                start_new_session=True,  # out of the terminal's process group: Ctrl-C is pytest's to handle
            )
        finally:
            os.close(fd)
            theirs.close()
        self._conn = Connection(ours.detach())
        self._launched = time.monotonic()

    def start(self, deepspeed: bool = False) -> ServerFacts:
        """Start the server (``launch``), if it was not, and wait until it is ready."""
        if self.facts is not None:
            return self.facts
        if self.refused is not None:  # not started again, only to fail the same way minutes later
            raise HarnessError(f"the pytest-dsrepro fork server {self.refused}, when this run's first world started it")
        self.launch(deepspeed)
        try:
            message = self._hello()
            failure = f"did not start: no answer within {self.startup_timeout:g}s"
        except ServerGone as exc:
            message = None
            after = time.monotonic() - self._launched
            failure = f"ended ({exc.ending}) {after:.1f}s after it was started, before it was ready"
        if not isinstance(message, Hello) or message.facts.fatal is not None:
            self._stop()
            log = self.log_tail()
            self.close()
            if isinstance(message, Hello):
                if message.facts.stops_run:
                    raise CacheUnusable(message.facts.fatal)
                self.refused = f"could not get ready ({message.facts.fatal})"  # the same for every later world
                failure = self.refused
            raise HarnessError(f"the pytest-dsrepro fork server {failure}; {told_log(log)}")
        expected = versions.resolved("deepspeed", "deepspeed")
        seen = versions.Release(message.facts.deepspeed, message.facts.deepspeed_path)
        if not versions.same_release(expected, seen):
            self._stop()
            self.close()
            raise WrongRelease(
                f"this pytest resolves deepspeed {expected}, but the ranks import deepspeed {seen}; every verdict "
                "would be about a release the ranks did not run (a sys.path entry only one of them has: PYTHONPATH, "
                "a test directory pytest inserted, a .pth file?)"
            )
        gpus = tuple(g.name for g in self.gpus)
        self.facts = dataclasses.replace(message.facts, cuda_devices=len(gpus), gpus=gpus)
        return self.facts

    def _hello(self) -> ServerMessage | None:
        """Wait for ``Hello``, telling ``progress`` what a comm-op build is doing meanwhile, and when it is done."""
        started = time.monotonic()
        deadline = started + self.startup_timeout
        building: float | None = None
        while (left := deadline - time.monotonic()) > 0:
            message = self.receive(left if building is None else min(left, PROGRESS_EVERY))
            if isinstance(message, Building):
                building = time.monotonic()
                self.progress(message.what)
            elif message is None and building is not None:
                self.progress(f"... still building ({time.monotonic() - building:.0f}s)")
            else:
                facts = message.facts if isinstance(message, Hello) else None
                if facts and facts.fatal is None and facts.comm_op != comm_op.BESIDE and building is not None:
                    self.progress(
                        f"DeepSpeed's CPU comm op ready after {time.monotonic() - building:.0f}s; "
                        "later runs load it from the cache"
                    )
                return message
        return None

    def noted_preload(self, preloaded: str | None, fork_hazard: str | None = None) -> None:
        """Keep with its facts what the server imported ahead of its ranks, once it has (``Spawned.preloaded``), and
        what made a fork of it unsafe, if anything ever did (``Spawned.fork_hazard``)."""
        if self.facts is None:
            return
        if preloaded is not None and self.facts.preloaded != preloaded:
            self.facts = dataclasses.replace(self.facts, preloaded=preloaded)
        if fork_hazard is not None and self.facts.fork_hazard is None:
            self.facts = dataclasses.replace(self.facts, fork_hazard=fork_hazard)

    def log_tail(self, lines: int = 30) -> str:
        if self._log is None or not self._log.exists():
            return ""
        return "\n".join(self._log.read_text(errors="replace").splitlines()[-lines:])

    def send(self, message: ClientMessage) -> None:
        """``ServerGone`` when the server is not running or died."""
        if self._conn is None:
            raise ServerGone("not running", self.log_tail())
        try:
            self._conn.send(message)
        except OSError:
            raise self._lost() from None

    def receive(self, timeout: float) -> ServerMessage | None:
        """The next message, or None when none came within ``timeout``; ``ServerGone`` as soon as the server is gone
        (end of file on its socket), never a busy wait on a closed socket."""
        if self._conn is None:
            raise ServerGone("not running", self.log_tail())
        try:
            if not self._conn.poll(max(timeout, 0.0)):
                return None
            message = self._conn.recv()
        except (EOFError, OSError):
            raise self._lost() from None
        if not isinstance(message, SERVER_MESSAGES):
            raise HarnessError(f"the pytest-dsrepro fork server sent an unknown message: {message!r}")
        return message

    def _lost(self) -> ServerGone:
        """The socket closed under us: give the server a moment to finish dying, then say how it ended."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        ending = "its socket closed"
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                ending = describe_exit(self._proc.wait(timeout=EXIT_WAIT))
        return ServerGone(ending, self.log_tail())

    @property
    def alive(self) -> bool:
        return self._conn is not None and self._proc is not None and self._proc.poll() is None

    def finish_build(self) -> None:
        """Wait, saying so, for a comm-op build that runs beside the worlds to end: later runs then load the op, where
        stopping the server now would throw the build away. Ctrl-C cuts the wait short (``close`` then stops it)."""
        if self._conn is None or self.facts is None or self.facts.comm_op != comm_op.BESIDE:
            return
        self._conn.send(FinishBuild())
        started: float | None = None  # when the server said it still builds
        while True:
            try:
                message = self.receive(PROGRESS_EVERY)
            except ServerGone as gone:  # nothing left to wait for; ``close`` cleans up after it
                return self.progress(f"the fork server ended before the build did ({gone.ending})")
            except KeyboardInterrupt:  # the run's outcome stands; ``close`` stops the build, leaving nothing of it
                return self.progress("Ctrl-C: the build is stopped; the next run builds it again")
            if isinstance(message, BuildEnded):
                return self.progress(message.what) if message.what else None
            if isinstance(message, Building):
                started = time.monotonic()
                self.progress(message.what)
            elif message is None and started is not None:
                self.progress(f"... still building ({time.monotonic() - started:.0f}s)")

    def close(self) -> None:
        """Stop the server (it kills whatever it started and exits) and remove its log, even when a second Ctrl-C
        cuts the wait for the server short: the server, already told to stop, finishes on its own."""
        try:
            self._stop()
        finally:
            if self._log is not None:
                self._log.unlink(missing_ok=True)
            self.facts = None

    def _stop(self) -> None:
        """End of file and SIGTERM: the server kills its worlds (or a comm-op build in progress: the compilers, and
        torch's build lock goes with the unwound build), discards their directories and exits. Only a server that
        is still there after ``STOP_WAIT`` is killed, with its whole process group (it leads its own session)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.terminate()
                try:
                    self._proc.wait(timeout=STOP_WAIT)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self._proc.pid, signal.SIGKILL)  # unreaped, so the group id is still its own
                    self._proc.wait()
            self._proc = None


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


@dataclass
class WorldRun:
    """One world in flight: its ranks, its private directory, and how it ends."""

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
    reaped: bool = False  # the server answered Reap: nothing of the world is left

    def _failed(self, r: _Rank) -> bool:
        return r.returncode is not None and (r.returncode != 0 or r.report is None or r.report.status is Status.FAILED)

    def _live(self) -> list[_Rank]:
        return [r for r in self.ranks if r.returncode is None]

    def _dispatch(self, message: ServerMessage | None) -> None:
        # A world interrupted before its Spawned arrived knows no ranks yet: their ends only matter to the server.
        if not isinstance(message, (Exited, Finished)) or message.world != self.world_id:
            return
        if message.rank < len(self.ranks):
            r = self.ranks[message.rank]
            r.finished = isinstance(message, Finished)  # it counts as a clean exit; a later Exited overrides it
            r.returncode = message.returncode if isinstance(message, Exited) else 0
            r.exited_at = message.at if message.at is not None else time.monotonic()
            r.report = layout.read_report(self.workdir, r.rank)

    def _force_end(self, ranks: list[_Rank], status: Status, detail: str) -> None:
        """Have the server dump the Python stacks of ``ranks`` (and an NCCL world's ranks their flight recorder), then
        kill them."""
        for r in ranks:
            r.forced, r.forced_detail = status, detail
        which = tuple(r.rank for r in ranks)
        if self.flight_recorder is not None:
            nccl.request_dumps(self.workdir)
        self.server.send(DumpStacks(self.world_id, which))
        deadline = time.monotonic() + self.stack_dump_wait
        while time.monotonic() < deadline and not all(self._stack(r.rank) for r in ranks):
            time.sleep(0.02)
        if self.flight_recorder is not None:
            nccl.wait_for_dumps(self.workdir, list(which))
            for rank, told in nccl.keep_dumps(self.workdir, list(which), self.flight_recorder).items():
                self.ranks[rank].forced_detail += f"; {told}"
        self.server.send(Kill(self.world_id, which))

    def _stack(self, rank: int) -> str:
        return _user_frames(nccl.without_recorder_thread(layout.read_text(layout.stack_file(self.workdir, rank))))

    def run(self, job: RankJob) -> WorldOutcome:
        started = time.monotonic()
        try:
            self.server.send(Spawn(self.world_id, pickle.dumps(job), self.size, str(self.workdir), self.reuse))
            while not self.ranks:
                message = self.server.receive(self.timeout)
                if message is None:
                    raise HarnessError(
                        f"the pytest-dsrepro fork server did not start the ranks; {told_log(self.server.log_tail())}"
                    )
                if isinstance(message, Building):  # a first preload of a release: what it does, and how long
                    self.server.progress(message.what)
                if isinstance(message, Spawned) and message.world == self.world_id:
                    self.ranks = [_Rank(rank, pid) for rank, pid in enumerate(message.pids)]
                    self.preloaded, self.fork_hazard = message.preloaded, message.fork_hazard
                    self.reused = message.reused
            self._wait(started + self.timeout)
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

    def _wait(self, deadline: float) -> None:
        first_failure: float | None = None
        while live := self._live():
            now = time.monotonic()
            if first_failure is None and any(self._failed(r) for r in self.ranks):
                first_failure = now
            if first_failure is not None and now > first_failure + self.failure_grace:
                failed = [r.rank for r in self.ranks if self._failed(r)]
                self._force_end(
                    live,
                    Status.STOPPED,
                    f"still running {self.failure_grace:g}s after {rank_ranges(failed)} failed",
                )
            elif now > deadline:
                self._force_end(live, Status.HUNG, f"still running when the {self.timeout:g}s world timeout expired")
            else:
                wake = deadline if first_failure is None else min(deadline, first_failure + self.failure_grace)
                self._dispatch(self.server.receive(min(max(wake - now, 0.0), 0.5)))
                continue
            self._collect_exits(live)

    def _collect_exits(self, ranks: list[_Rank]) -> None:
        """The ``Exited`` of ranks the server was asked to kill (it answers at once; ``REAP_WAIT`` bounds a wedged
        server, and a dead one raises ``ServerGone`` at once)."""
        deadline = time.monotonic() + REAP_WAIT
        while any(r.returncode is None for r in ranks) and (left := deadline - time.monotonic()) > 0:
            self._dispatch(self.server.receive(left))
        for r in ranks:  # the server is wedged: never report a rank as still alive
            if r.returncode is None:
                r.returncode = -signal.SIGKILL

    def _outcome(self, started: float) -> WorldOutcome:
        results = []
        for r in self.ranks:
            output = layout.read_output(self.workdir, r.rank)
            if r.forced is not None:
                stack = self._stack(r.rank)
                results.append(RankResult(r.rank, r.forced, detail=r.forced_detail, output=output, stack=stack))
            else:
                results.append(_judged(r, output, started, self._stack(r.rank)))
        duration = time.monotonic() - started
        return WorldOutcome(self.size, self.backend, tuple(results), duration, self._phases(started), self.reused)

    def _phases(self, started: float) -> tuple[tuple[str, float], ...]:
        """Where the world's time went, when every rank got through every phase on its own."""
        marks = [r.report.marks for r in self.ranks if r.report is not None and r.forced is None]
        ends = [r.exited_at for r in self.ranks if r.exited_at is not None]
        if not self.ranks or len(marks) < len(self.ranks) or len(ends) < len(self.ranks):
            return ()
        if any(len(m) != len(PHASES) - 1 for m in marks):
            return ()
        return phases(started, marks, max(ends))

    def _keep(self) -> bool:
        """May the server keep the ranks for the next test of the scope? Only when every one of them passed and lives
        on: after any failure, hang or crash the next test gets a new world."""
        return self.reuse is not None and all(
            r.finished and r.forced is None and r.report is not None and r.report.status is Status.PASSED
            for r in self.ranks
        )

    def _cleanup(self) -> None:
        """Have the server reap the world and wait for its ``Reaped``; the directory is discarded here too.

        Runs on every ending, an interrupted one included (Ctrl-C, pytest-timeout): the server kills what is left
        and answers within milliseconds, so nothing waits for ``Exited`` messages that a reaped world never sends. A
        world whose ranks were never announced is waited for only briefly: the server may be busy preparing them (a
        first preload, seconds); it reaps the world once it gets there, or, stopped, kills it with everything else.
        A dead server's ranks died with it: then only the directory (and its ``/dev/shm`` buffers) is left to remove.
        """
        try:
            if self.server.alive:
                self.server.send(Reap(self.world_id, keep=self._keep()))
                deadline = time.monotonic() + (REAP_WAIT if self.ranks else UNANNOUNCED_REAP_WAIT)
                while (left := deadline - time.monotonic()) > 0:
                    message = self.server.receive(left)
                    if isinstance(message, Reaped) and message.world == self.world_id:
                        self.reaped = True
                        break
                    self._dispatch(message)
        except ServerGone:
            pass
        finally:
            layout.discard(self.workdir)


def _judged(r: _Rank, output: str, started: float, stack: str) -> RankResult:
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
    harness = (here + "rank.py", here + "server.py", "<frozen runpy>")
    return "\n".join(
        line
        for line in dump.splitlines()
        if not any(h in line for h in harness) and not line.startswith("Extension modules:")  # a fatal error's list
    )


class WorldRunner:
    """Runs worlds for one pytest process; owns its fork servers, one per DeepSpeed accelerator its worlds use (on a
    CPU machine, one), and leases the GPUs of its NCCL worlds (``leases``).

    ``failure_grace``: after one rank fails, how long the others get before they are stopped; ``stack_dump_wait``:
    how long ranks get to write their Python stacks before they are killed; ``progress``: told what a slow fork
    server start is doing; ``gpu_wait``: how long an NCCL world waits for its GPUs before ``leases.Busy``.
    """

    def __init__(
        self,
        cache_dir: Path,
        startup_timeout: float,
        *,
        failure_grace: float = FAILURE_GRACE,
        stack_dump_wait: float = STACK_DUMP_WAIT,
        progress: Progress = _silent,
        gpu_wait: float = leases.WAIT,
    ) -> None:
        self.cache_dir = cache_dir
        self.startup_timeout = startup_timeout
        self.progress = progress
        self.failure_grace = failure_grace
        self.stack_dump_wait = stack_dump_wait
        self.gpu_wait = gpu_wait
        self.servers: dict[str, ForkServer] = {}  # accelerator -> its fork server
        self.warm_ahead = True  # ``plan``
        self._gpus: tuple[Gpu, ...] | None = None
        self._ids = itertools.count(1)

    def gpus(self) -> tuple[Gpu, ...]:
        """The machine's CUDA devices, found once (``devices.find``: nothing to find, and no probe, without a GPU
        device node), before any fork server starts: the backend, hence the server, depends on them."""
        if self._gpus is None:
            self._gpus = devices.find()
        return self._gpus

    def cuda_devices(self) -> int:
        return len(self.gpus())

    def server_for(self, backend: str) -> ForkServer:
        """The fork server of worlds with this backend: DeepSpeed's accelerator follows it (``accelerator_for``)."""
        accelerator = accelerator_for(backend, os.environ)
        if accelerator not in self.servers:
            self.servers[accelerator] = ForkServer(
                self.cache_dir, self.startup_timeout, self.progress, accelerator=accelerator, gpus=self.gpus()
            )
        return self.servers[accelerator]

    @property
    def server(self) -> ForkServer:
        """The fork server of gloo worlds (on a CPU machine, the only one)."""
        return self.server_for("gloo")

    def started(self) -> list[ServerFacts]:
        """The facts of every fork server that started, in the order they did."""
        return [s.facts for s in self.servers.values() if s.facts is not None]

    def facts(self) -> ServerFacts:
        return self.server.start()

    def launch(self) -> None:
        """Start the gloo worlds' fork server now, for DeepSpeed's worlds, without waiting for it: the run's first
        world then finds it ready, or nearly."""
        self.server.launch(deepspeed=True)

    def plan(self, worlds: int, deepspeed_worlds: int) -> None:
        """How many worlds the run has, and how many use DeepSpeed (counted up to 2). The fork server warms up ahead
        of its ranks (``RankJob.warm``, ``worlds.preload``) only for more than one: warming there costs about what
        one cold world's ranks spend on the same work side by side, and more where a test skips or fails before it
        needs all of it. A run of one such world (one repro, one upstream test) gets its verdict that much sooner.
        A run of no world stops a server started early (``launch``), which would only take CPU from the tests."""
        self.warm_ahead = deepspeed_worlds > 1
        if not worlds:
            self.close()

    def run(self, job: RankJob, size: int, reuse: str | None = None) -> WorldOutcome:
        """Run one world of ``size`` ranks (a test that uses DeepSpeed, ``job.warm``, starts warm); ``reuse``: the
        test's reuse scope (``Spawn.reuse``): ranks kept from its previous test may run it. An NCCL world
        runs on GPUs leased for it alone; ``leases.Busy`` when none came free within ``gpu_wait``."""
        server = self.server_for(job.backend)
        lease = self._lease(job, size) if job.backend == "nccl" else None
        cold = job.warm and not self.warm_ahead
        job = dataclasses.replace(job, warm=job.warm and self.warm_ahead)
        try:
            server.start(job.warm)
            if not server.alive:
                server.close()
                server.start(job.warm)
            world = WorldRun(
                server,
                next(self._ids),
                size,
                job.backend,
                job.timeout,
                failure_grace=self.failure_grace,
                stack_dump_wait=self.stack_dump_wait,
                reuse=reuse if job.backend != "nccl" else None,  # an NCCL world's GPUs are leased for it alone
                flight_recorder=self._flight_recorder() if job.backend == "nccl" else None,
            )
            seen = {**os.environ, **(lease.environ() if lease else {})}
            if job.backend == "nccl":
                seen.update(nccl.environment(world.workdir, os.environ))
            job = dataclasses.replace(job, environ=EnvironChanges.between(server.environ, seen))
            try:
                return world.run(job)
            finally:
                server.noted_preload(world.preloaded or (NOT_WARMED if cold else None), world.fork_hazard)
        finally:
            if lease is not None:
                lease.release()

    def _flight_recorder(self) -> Path:
        """Where a stopped NCCL world's flight recorder dumps are kept (its own directory is discarded)."""
        return self.cache_dir / "nccl-flight-recorder" / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"

    def _lease(self, job: RankJob, size: int) -> leases.Lease:
        worker = os.environ.get("PYTEST_XDIST_WORKER")
        holder = f"{Path(job.test.module_file).name}::{job.test.qualname}" + (f", xdist {worker}" if worker else "")
        return leases.acquire(self.gpus(), size, leases.lease_dir(self.cache_dir), self.gpu_wait, holder)

    def close(self, finish_builds: bool = False) -> None:
        """Stop every fork server; ``finish_builds``: the run was not interrupted, so comm-op builds still running
        beside its worlds end first (``ForkServer.finish_build``)."""
        try:
            if finish_builds:
                for server in self.servers.values():
                    server.finish_build()
        finally:
            for server in self.servers.values():
                server.close()
