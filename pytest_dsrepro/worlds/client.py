"""The pytest side of a world: start the fork server, run one world, and turn what its ranks did into an outcome.

A world always ends within its timeout, leaves no process and no /dev/shm buffer behind, and tells the story of
every rank: its exception, its exit code or signal, its Python stack if it hung, and the tail of its own output.
"""

from __future__ import annotations

import itertools
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from . import workdir as layout
from ..core.options import CACHE_ENV
from ..core.outcome import RankResult, Status, WorldOutcome, rank_ranges
from .rank import RankJob
from .server import STACK_SIGNAL

#: After one rank fails, how long the others get to finish (or fail) on their own before they are stopped.
FAILURE_GRACE = 5.0
#: How long ranks get to write their Python stacks before they are killed.
STACK_DUMP_WAIT = 1.0


class WorldError(Exception):
    """The harness itself could not run a world (the fork server did not start, a job could not be sent)."""


@dataclass(frozen=True)
class ServerFacts:
    """What the fork server found when it preloaded: versions, devices, the comm-op build."""

    raw: dict[str, Any]

    @property
    def cuda_devices(self) -> int:
        return int(self.raw.get("cuda_devices", 0))

    @property
    def gpus(self) -> list[str]:
        return list(self.raw.get("gpus", []))


class ForkServer:
    """One preloaded interpreter (``pytest_dsrepro.server``) per pytest process, started on first use."""

    def __init__(self, cache_dir: Path, startup_timeout: float) -> None:
        self.cache_dir = cache_dir
        self.startup_timeout = startup_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._log: Path | None = None
        self.facts: ServerFacts | None = None

    def _environment(self) -> dict[str, str]:
        env = dict(os.environ)
        package_root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join([package_root, *filter(None, [env.get("PYTHONPATH")])])
        env[CACHE_ENV] = str(self.cache_dir)
        return env

    def start(self) -> ServerFacts:
        if self.facts is not None:
            return self.facts
        ours, theirs = socket.socketpair()
        fd, log = tempfile.mkstemp(prefix="dsrepro-server-", suffix=".log")
        self._log = Path(log)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "pytest_dsrepro.server", str(theirs.fileno()), str(os.getpid()), log],
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
        message = self._receive(self.startup_timeout)
        if message is None or message[0] != "hello" or "fatal" in message[2]:
            detail = message[2].get("fatal", "") if message else "no answer"
            self.close()
            raise WorldError(
                f"the pytest-dsrepro fork server did not start ({detail or 'it exited'}) within "
                f"{self.startup_timeout:.0f}s; its log:\n{self.log_tail()}"
            )
        self.facts = ServerFacts(message[2])
        return self.facts

    def log_tail(self, lines: int = 30) -> str:
        if self._log is None or not self._log.exists():
            return ""
        return "\n".join(self._log.read_text(errors="replace").splitlines()[-lines:])

    def _receive(self, timeout: float) -> tuple[Any, ...] | None:
        """The next message, or None on timeout or when the server is gone."""
        assert self._conn is not None
        try:
            if self._conn.poll(max(timeout, 0.0)):
                return self._conn.recv()  # type: ignore[no-any-return]
        except (EOFError, OSError):
            pass
        return None

    def send(self, message: tuple[Any, ...]) -> None:
        if self._conn is None:
            raise WorldError("the fork server is not running")
        try:
            self._conn.send(message)
        except OSError as exc:
            raise WorldError(f"the fork server is gone ({exc}); its log:\n{self.log_tail()}") from exc

    def receive(self, timeout: float) -> tuple[Any, ...] | None:
        return self._receive(timeout)

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def close(self) -> None:
        """Closing the socket makes the server kill whatever it started and exit."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        if self._log is not None:
            self._log.unlink(missing_ok=True)
        self.facts = None


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


@dataclass
class _Rank:
    rank: int
    pid: int
    returncode: int | None = None
    result: dict[str, Any] | None = None  # what the rank wrote before exiting
    forced: Status | None = None  # HUNG or STOPPED when we ended it
    forced_detail: str = ""


@dataclass
class WorldRun:
    """One world in flight: its ranks, its private directory, and how it ends."""

    server: ForkServer
    world_id: int
    size: int
    backend: str
    timeout: float
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="dsrepro-world-")))
    ranks: list[_Rank] = field(default_factory=list)

    def _failed(self, r: _Rank) -> bool:
        return r.returncode is not None and (
            r.returncode != 0 or r.result is None or r.result["status"] is Status.FAILED
        )

    def _live(self) -> list[_Rank]:
        return [r for r in self.ranks if r.returncode is None]

    def _dispatch(self, message: tuple[Any, ...] | None) -> None:
        if message is None:
            return
        if message[0] == "exited" and message[1] == self.world_id:
            r = self.ranks[message[2]]
            r.returncode = message[3]
            path = layout.result_file(self.workdir, r.rank)
            r.result = pickle.loads(path.read_bytes()) if path.exists() else None

    def _force_end(self, ranks: list[_Rank], status: Status, detail: str) -> None:
        """Dump the Python stacks of ``ranks``, then kill them."""
        for r in ranks:
            r.forced, r.forced_detail = status, detail
            _signal(r.pid, STACK_SIGNAL)
        deadline = time.monotonic() + STACK_DUMP_WAIT
        while time.monotonic() < deadline and not all(self._stack(r.rank) for r in ranks):
            time.sleep(0.02)
        for r in ranks:
            _signal(r.pid, signal.SIGKILL)

    def _stack(self, rank: int) -> str:
        return _user_frames(layout.read_text(layout.stack_file(self.workdir, rank)))

    def run(self, job: RankJob) -> WorldOutcome:
        started = time.monotonic()
        try:
            self.server.send(("spawn", self.world_id, pickle.dumps(job), self.size, str(self.workdir)))
            while not self.ranks:
                message = self.server.receive(self.timeout)
                if message is None:
                    raise WorldError(f"the fork server did not start the ranks; its log:\n{self.server.log_tail()}")
                if message[0] == "spawned" and message[1] == self.world_id:
                    self.ranks = [_Rank(rank, pid) for rank, pid in enumerate(message[2])]
            self._wait(started + self.timeout)
            return self._outcome(time.monotonic() - started)
        finally:
            self._cleanup()

    def _wait(self, deadline: float) -> None:
        first_failure: float | None = None
        while live := self._live():
            now = time.monotonic()
            if first_failure is None and any(self._failed(r) for r in self.ranks):
                first_failure = now
            if first_failure is not None and now > first_failure + FAILURE_GRACE:
                failed = [r.rank for r in self.ranks if self._failed(r)]
                self._force_end(
                    live, Status.STOPPED, f"still running {FAILURE_GRACE:.0f}s after {rank_ranges(failed)} failed"
                )
            elif now > deadline:
                self._force_end(live, Status.HUNG, f"still running when the {self.timeout:g}s world timeout expired")
            else:
                wake = min(deadline, first_failure + FAILURE_GRACE if first_failure else deadline)
                self._dispatch(self.server.receive(min(max(wake - now, 0.0), 0.5)))
                continue
            self._collect_exits(live)

    def _collect_exits(self, ranks: list[_Rank]) -> None:
        deadline = time.monotonic() + 10
        while any(r.returncode is None for r in ranks) and time.monotonic() < deadline:
            self._dispatch(self.server.receive(0.5))
        for r in ranks:  # the server is gone or wedged: never report a rank as still alive
            if r.returncode is None:
                r.returncode = -signal.SIGKILL

    def _outcome(self, duration: float) -> WorldOutcome:
        results = []
        extra: dict[str, Any] = {}
        for r in self.ranks:
            result = r.result
            output, stack = layout.read_text(layout.output_file(self.workdir, r.rank)), self._stack(r.rank)
            if r.forced is not None:
                results.append(RankResult(r.rank, r.forced, detail=r.forced_detail, output=output, stack=stack))
            elif result is None:
                assert r.returncode is not None
                detail = describe_exit(r.returncode)
                if r.returncode == 0:
                    detail += " without reporting that its body completed"
                results.append(RankResult(r.rank, Status.CRASHED, detail=detail, output=output))
            else:
                if r.rank == 0:
                    extra = result.get("extra") or {}
                results.append(
                    RankResult(
                        r.rank,
                        result["status"],
                        error=result.get("error"),
                        detail=result.get("detail", ""),
                        output=output,
                    )
                )
        return WorldOutcome(self.size, self.backend, tuple(results), duration, extra)

    def _cleanup(self) -> None:
        live = self._live()
        for r in live:
            _signal(r.pid, signal.SIGKILL)
        if self.server.alive:
            try:
                self.server.send(("reap", self.world_id))
            except WorldError:
                pass
            self._collect_exits(live)
        layout.discard(self.workdir)


def _user_frames(dump: str) -> str:
    """faulthandler's dump without the harness frames under the test body (innermost frames come first)."""
    harness = (
        os.sep + "pytest_dsrepro" + os.sep + "rank.py",
        os.sep + "pytest_dsrepro" + os.sep + "server.py",
        "<frozen runpy>",
    )
    return "\n".join(line for line in dump.splitlines() if not any(h in line for h in harness))


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


class WorldRunner:
    """Runs worlds for one pytest process; owns its fork server."""

    def __init__(self, cache_dir: Path, startup_timeout: float) -> None:
        self.server = ForkServer(cache_dir, startup_timeout)
        self._ids = itertools.count(1)

    def facts(self) -> ServerFacts:
        return self.server.start()

    def run(self, job: RankJob, size: int) -> WorldOutcome:
        self.server.start()
        if not self.server.alive:
            self.server.close()
            self.server.start()
        return WorldRun(self.server, next(self._ids), size, job.backend, job.timeout).run(job)

    def close(self) -> None:
        self.server.close()
