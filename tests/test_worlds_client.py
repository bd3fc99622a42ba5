"""The pytest side of a world, one level below the plugin: ``WorldRun`` against a scripted server, then
``WorldRunner`` against a real fork server, in this process, with short failure grace and stack-dump waits.

The client never signals a rank: it asks the server, which forked the ranks, to dump stacks and to kill them.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from conftest import REAL_CACHE
from pytest_dsrepro.core.errors import HarnessError
from pytest_dsrepro.core.outcome import PHASES, Status, WorldOutcome
from pytest_dsrepro.tools import processes
from pytest_dsrepro.worlds import client, device_nodes, protocol
from pytest_dsrepro.worlds.client import ForkServer, WorldRun, WorldRunner, fork_server, server_process
from pytest_dsrepro.worlds.protocol import (
    Building,
    ClientMessage,
    DumpStacks,
    Exited,
    FinishBuild,
    Hello,
    Kill,
    OpWait,
    RankJob,
    RankReport,
    RankValue,
    Reap,
    Reaped,
    ServerFacts,
    ServerMessage,
    Spawn,
    Spawned,
    TestRef,
    WorldEnded,
)

WORLD = 1


class ScriptedServer(ForkServer):
    """Stands in for ``ForkServer``: on ``Spawn`` the ranks in ``ends`` write their report (if any) and exit with
    their code; the others run until the client has them killed."""

    alive = True  # type: ignore[assignment]

    def __init__(
        self,
        ends: dict[int, tuple[RankReport | None, int]] | None = None,
        *,
        starts: bool = True,
        preparing: float = 0.0,
        startup_timeout: float = 0.0,
        script: tuple[tuple[float, ServerMessage], ...] = (),
    ) -> None:
        super().__init__(Path("/nonexistent"), startup_timeout=startup_timeout)
        self.ends = ends or {}
        self.starts = starts
        self.preparing = preparing  # how long the server prepares the ranks (a first warm-up) before Spawned
        self.script = script  # more messages, each due so long after Spawned
        self.sent: list[ClientMessage] = []
        self.replies: list[ServerMessage] = []
        self.alive = True
        self.workdir: Path | None = None

    def send(self, message: ClientMessage) -> None:
        self.sent.append(message)
        if isinstance(message, Spawn) and self.starts:
            self.workdir = Path(message.workdir)
            time.sleep(self.preparing)
            self.replies.append(Spawned(message.world, tuple(range(1000, 1000 + message.size))))
            self.due = [(time.monotonic() + after, m) for after, m in self.script]
            for rank, (report, code) in self.ends.items():
                if report is not None:
                    protocol.write_report(self.workdir, rank, report)
                self.replies.append(Exited(message.world, rank, code))
        elif isinstance(message, Kill):
            self.replies += [Exited(message.world, rank, -9) for rank in message.ranks]
        elif isinstance(message, Reap):
            self.replies.append(Reaped(message.world))

    def receive(self, timeout: float) -> ServerMessage | None:
        if self.replies:
            return self.replies.pop(0)
        if getattr(self, "due", None) and self.due[0][0] <= time.monotonic():
            return self.due.pop(0)[1]
        time.sleep(min(timeout, 0.01))
        return None


def _job(timeout: float = 30.0) -> RankJob:
    return RankJob(TestRef("m", "/m.py", "test_x", (), "/"), b"", "gloo", timeout)


def _run(server: ScriptedServer, size: int = 2, timeout: float = 30.0, **kwargs: Any) -> WorldOutcome:
    run = WorldRun(server, WORLD, size, "gloo", timeout, **kwargs)  # type: ignore[arg-type]
    return run.run(_job(timeout))


@pytest.fixture
def no_signals_from_here(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Records any signal this process sends while a world runs; the tests expect none."""
    sent: list[tuple[int, int]] = []
    real_kill = os.kill

    def kill(pid: int, sig: int) -> None:
        sent.append((pid, sig))
        real_kill(pid, sig)

    monkeypatch.setattr(os, "kill", kill)
    return sent


def test_after_a_failure_the_client_asks_the_server_to_dump_stacks_then_kill(
    no_signals_from_here: list[tuple[int, int]],
) -> None:
    server = ScriptedServer({0: (None, 1)})  # rank 0 fails at once; rank 1 runs until stopped
    outcome = _run(server, failure_grace=0.1, stack_dump_wait=0.05)
    assert [type(m) for m in server.sent] == [Spawn, DumpStacks, Kill, Reap]
    assert server.sent[1:] == [DumpStacks(WORLD, (1,)), Kill(WORLD, (1,)), Reap(WORLD)]
    failed, stopped = outcome.ranks
    assert (failed.status, failed.detail) == (Status.CRASHED, "exit code 1")
    assert (stopped.status, stopped.detail) == (Status.STOPPED, "still running 0.1s after rank 0 failed")
    assert no_signals_from_here == []


def test_at_the_timeout_every_live_rank_is_hung(no_signals_from_here: list[tuple[int, int]]) -> None:
    server = ScriptedServer()
    outcome = _run(server, size=3, timeout=0.2, stack_dump_wait=0.05)
    assert server.sent[1:] == [DumpStacks(WORLD, (0, 1, 2)), Kill(WORLD, (0, 1, 2)), Reap(WORLD)]
    assert {r.status for r in outcome.ranks} == {Status.HUNG}
    assert outcome.ranks[0].detail == "still running when the 0.2s world timeout expired"
    assert no_signals_from_here == []


def test_reports_are_read_from_the_world_directory() -> None:
    server = ScriptedServer({0: (RankReport(Status.PASSED), 0), 1: (RankReport(Status.SKIPPED, detail="no GPU"), 0)})
    outcome = _run(server)
    assert [(r.status, r.detail) for r in outcome.ranks] == [(Status.PASSED, ""), (Status.SKIPPED, "no GPU")]
    assert outcome.declared == outcome.ranks[1]
    assert server.sent[1:] == [Reap(WORLD)]
    assert server.workdir is not None
    assert not server.workdir.exists()  # discarded after the world


def test_a_rank_that_exits_without_a_report_crashed() -> None:
    outcome = _run(ScriptedServer({0: (RankReport(Status.PASSED), 0), 1: (None, 0)}), failure_grace=0.1)
    assert (outcome.ranks[1].status, outcome.ranks[1].detail) == (
        Status.CRASHED,
        "exit code 0 without reporting that its body completed",
    )


def test_a_server_that_does_not_start_the_ranks_is_a_harness_error() -> None:
    server = ScriptedServer(starts=False)
    with pytest.raises(HarnessError, match="did not start the ranks"):
        _run(server, timeout=0.1)


def test_a_worlds_clock_starts_when_its_ranks_run(no_signals_from_here: list[tuple[int, int]]) -> None:
    """Issue 49 item 5: the server's preparation of a world (a first warm-up) is bounded by its start-up timeout, not
    the world's: ranks that end within the world's timeout after they were started pass, however long it took."""
    ends = {rank: (RankReport(Status.PASSED), 0) for rank in range(2)}
    outcome = _run(ScriptedServer(ends, preparing=0.5, startup_timeout=60), timeout=0.2)
    assert outcome.passed, outcome


def test_a_worlds_clock_stops_while_its_ranks_wait_for_an_op_the_server_builds(
    no_signals_from_here: list[tuple[int, int]],
) -> None:
    """Issue 49 item 2: a rank waiting for an op the server builds for it (``OpWait``) is not its test's time: a 1 s
    world whose ranks waited 2 s and ended 0.5 s later is no hang; one that runs on past its own 1 s after the wait
    is, and only then."""
    waited = ((0.1, OpWait(WORLD, 0.0, waiting=True)), (2.0, OpWait(WORLD, 2.0, waiting=False)))
    script = (*waited, (2.5, Exited(WORLD, 0, 0)), (2.5, Exited(WORLD, 1, 0)))
    outcome = _run(ScriptedServer(script=_at_spawn(script)), timeout=1.0)
    assert Status.HUNG not in {r.status for r in outcome.ranks}  # they ended on their own (with no report: crashed)
    hung = _run(ScriptedServer(script=_at_spawn(waited)), timeout=1.0, stack_dump_wait=0.05)
    assert {r.status for r in hung.ranks} == {Status.HUNG}
    assert hung.duration > 2.8  # 2 s waiting, then its own 1 s


def _at_spawn(script: tuple[tuple[float, ServerMessage], ...]) -> tuple[tuple[float, ServerMessage], ...]:
    """``OpWait`` times (``at``) made relative to now, as the server stamps them on the same clock."""
    now = time.monotonic()
    return tuple((after, OpWait(m.world, now + m.at, m.waiting) if isinstance(m, OpWait) else m) for after, m in script)


def test_a_server_that_does_not_start_is_a_harness_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_process, "SERVER_MODULE", "pytest_dsrepro.worlds.no_such_module")
    server = ForkServer(tmp_path, startup_timeout=60)
    with pytest.raises(HarnessError) as failed:
        server.start()
    message = str(failed.value)
    assert "the pytest-dsrepro fork server ended (exit code 1) " in message
    assert "s after it was started, before it was ready; its log:" in message
    assert "No module named pytest_dsrepro.worlds.no_such_module" in message  # the tail of its log
    assert not server.alive


def test_sending_without_a_server_is_a_harness_error(tmp_path: Path) -> None:
    with pytest.raises(HarnessError, match=r"fork server is gone \(not running\)"):
        ForkServer(tmp_path, startup_timeout=60).send(Reap(WORLD))


# ---- a real fork server ---------------------------------------------------------------------------------------

BODIES = """
import os
import signal
import time


def test_one_fails(rank):
    if rank == 0:
        raise RuntimeError("rank 0 failed first")
    time.sleep(3600)


def test_passes(rank, world_size):
    assert world_size == 2


def test_interrupts_pytest(rank, world_size):
    import torch.distributed as dist

    dist.barrier()  # every rank is in its body (and its stack shows this function) before pytest is interrupted
    if rank == 0:
        os.kill(PYTEST_PID, signal.SIGUSR2)  # stands in for Ctrl-C
    time.sleep(3600)


def test_kills_the_server(rank, world_size):
    if rank == 0:
        os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(3600)
"""


@pytest.fixture(scope="module")
def runner() -> Iterator[WorldRunner]:
    """One real fork server for this module (preloading torch and DeepSpeed costs seconds), with short waits."""
    runner = WorldRunner(Path(REAL_CACHE), startup_timeout=600, failure_grace=0.5, stack_dump_wait=2.0)
    try:
        facts = runner.facts()
        yield runner
    finally:
        runner.close()
    assert not psutil.pid_exists(facts.pid) or psutil.Process(facts.pid).status() == psutil.STATUS_ZOMBIE


def _real_job(tmp_path: Path, name: str, timeout: float = 120.0) -> RankJob:
    module = tmp_path / "dsrepro_bodies.py"
    module.write_text(textwrap.dedent(BODIES) + f"\nPYTEST_PID = {os.getpid()}\n")
    kwargs = {"rank": RankValue("rank"), "world_size": RankValue("world_size")}
    if name == "test_one_fails":
        kwargs.pop("world_size")
    ref = TestRef("dsrepro_bodies", str(module), name, (str(tmp_path), *sys.path), str(tmp_path))
    return RankJob(ref, pickle.dumps((kwargs, [], ())), "gloo", timeout)


def _server_children(runner: WorldRunner, timeout: float = 10.0) -> list[psutil.Process]:
    """What the server still has running once a world is over (the Reap may still be in progress), besides its
    store process, which serves every world."""
    facts = runner.server.facts
    assert facts is not None
    server = psutil.Process(facts.pid)

    def left() -> list[psutil.Process]:
        return [p for p in server.children(recursive=True) if p.pid != facts.store_pid]

    deadline = time.monotonic() + timeout
    while (found := left()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def test_the_servers_facts_are_builtins(runner: WorldRunner) -> None:
    """Unpickling them in pytest must not import torch: no TorchVersion, only str, int, tuple."""
    facts = runner.facts()
    assert type(facts.torch) is str
    assert facts.torch
    assert type(facts.deepspeed) is str
    assert type(facts.cuda_devices) is int
    assert type(facts.gpus) is tuple
    assert all(type(g) is str for g in facts.gpus)
    assert facts.fatal is None


def test_healthy_ranks_are_stopped_with_their_stacks(
    runner: WorldRunner, tmp_path: Path, no_signals_from_here: list[tuple[int, int]]
) -> None:
    outcome = runner.run(_real_job(tmp_path, "test_one_fails"), size=2)
    failed, stopped = outcome.ranks
    assert failed.status is Status.FAILED
    assert failed.error is not None
    assert failed.error.summary == "RuntimeError: rank 0 failed first"
    assert (stopped.status, stopped.detail) == (Status.STOPPED, "still running 0.5s after rank 0 failed")
    assert outcome.phases == ()  # a rank that was stopped never got through them
    assert "dsrepro_bodies.py" in stopped.stack
    assert "in test_one_fails" in stopped.stack
    assert "pytest_dsrepro" not in stopped.stack  # the harness frames under the body are left out
    assert no_signals_from_here == [], "the pytest process signalled a process the server forked"
    assert _server_children(runner) == [], "the reaped world left a process behind"


def test_a_world_after_a_stopped_one_runs_clean(runner: WorldRunner, tmp_path: Path) -> None:
    outcome = runner.run(_real_job(tmp_path, "test_passes"), size=2)
    assert outcome.passed, outcome
    assert _server_children(runner) == []
    assert [name for name, _ in outcome.phases] == list(PHASES)  # where its time went, every phase told
    assert 0 < sum(seconds for _, seconds in outcome.phases) <= outcome.duration


@dataclasses.dataclass
class _Listening(WorldRun):
    """A world that keeps the classes of the messages it hears."""

    heard: list[type] = dataclasses.field(default_factory=list)

    def take(self, message: Any) -> None:
        self.heard.append(type(message))
        super().take(message)


def test_a_world_whose_ranks_all_exited_ends_without_a_round_trip(runner: WorldRunner, tmp_path: Path) -> None:
    """Issue 53: once every rank of a world exited on its own, the server ends what they left unasked and says
    ``WorldEnded`` after the last ``Exited``: the test waits for no ``Reaped``, and nothing of the world is left when it
    ends all the same."""
    world = _Listening(runner.server, 1003, 2, "gloo", 120.0)
    outcome = world.run(_real_job(tmp_path, "test_passes"))
    assert outcome.passed, outcome
    assert world.heard == [Spawned, Exited, Exited, WorldEnded]
    assert not world.workdir.exists()
    assert _server_children(runner, timeout=0) == []


@pytest.mark.parametrize(
    ("report", "code", "expected"),
    [
        (RankReport(Status.PASSED), -11, (Status.CRASHED, "killed by signal SIGSEGV after its body passed")),
        (RankReport(Status.SKIPPED, detail="no GPU"), 3, (Status.CRASHED, "exit code 3 after its body skipped")),
        (RankReport(Status.FAILED), -6, (Status.FAILED, "then killed by signal SIGABRT")),
    ],
    ids=["passed-then-segfault", "skipped-then-exit3", "failed-then-abort"],
)
def test_a_report_counts_only_with_a_clean_exit(report: RankReport, code: int, expected: tuple[Status, str]) -> None:
    """A crash is never a pass: what the rank wrote is outweighed by how its process ended."""
    outcome = _run(ScriptedServer({0: (RankReport(Status.PASSED), 0), 1: (report, code)}), failure_grace=0.1)
    assert (outcome.ranks[1].status, outcome.ranks[1].detail) == expected
    assert not outcome.passed
    assert outcome.declared is None


@pytest.fixture
def interrupt_on_sigusr2() -> Iterator[None]:
    """SIGUSR2 raises KeyboardInterrupt here, as Ctrl-C does in pytest's main thread."""
    with processes.interrupting(signal.SIGUSR2):
        yield


@pytest.mark.usefixtures("interrupt_on_sigusr2")
def test_an_interrupted_world_is_reaped_at_once(runner: WorldRunner, tmp_path: Path) -> None:
    """Issue 11, item 3: Ctrl-C mid-world. The server kills the ranks and answers Reap; the client waits for that
    answer, not for Exited messages a reaped world never sends (it used to wait 10 s for them)."""
    world = WorldRun(runner.server, 1001, 2, "gloo", 120.0)
    with pytest.raises(KeyboardInterrupt):
        world.run(_real_job(tmp_path, "test_interrupts_pytest"))
    assert world.reaped, "the client stopped waiting before the server said the world was reaped"
    assert not world.workdir.exists()
    assert _server_children(runner, timeout=0) == []
    assert runner.run(_real_job(tmp_path, "test_passes"), size=2).passed  # the server serves the next world


def test_the_servers_death_mid_world_is_reported_as_such(runner: WorldRunner, tmp_path: Path) -> None:
    """Issue 11, item 6: a harness error that names the server's death, not a hang at the world's timeout; the next
    world gets a new server."""
    assert runner.server.facts is not None
    first = runner.server.facts.pid
    world = WorldRun(runner.server, 1002, 2, "gloo", 120.0)
    with pytest.raises(HarnessError) as failed:
        world.run(_real_job(tmp_path, "test_kills_the_server"))
    assert str(failed.value).startswith(
        "the pytest-dsrepro fork server died while this test's world ran (killed by signal SIGKILL)"
    )
    assert not world.workdir.exists()
    assert not runner.server.alive
    outcome = runner.run(_real_job(tmp_path, "test_passes"), size=2)
    assert outcome.passed, outcome
    assert runner.server.facts is not None
    assert runner.server.facts.pid != first


def test_without_gpu_device_nodes_no_server_is_needed_to_count_devices(tmp_path: Path) -> None:
    """Issue 11, item 11: a CPU machine settles its backend without starting the fork server."""
    assert device_nodes.gpu_device_nodes(tmp_path) == []
    (tmp_path / "nvidiactl").touch()
    assert device_nodes.gpu_device_nodes(tmp_path) == [tmp_path / "nvidiactl"]
    runner = WorldRunner(tmp_path, startup_timeout=60)
    if not device_nodes.gpu_device_nodes():
        assert runner.cuda_devices() == 0
        assert runner.server.facts is None  # nothing was started


def test_a_first_build_is_told_while_it_runs_and_when_it_is_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 11, item 12, the client's side: Building is passed on at once, then every PROGRESS_EVERY seconds
    without news, then how long it took (the server's side is end to end, in test_faults.py)."""
    told: list[str] = []
    server = ForkServer(tmp_path, startup_timeout=60, progress=told.append)
    script: list[ServerMessage | None] = [
        Building("building DeepSpeed's CPU comm op for 0.19.8, first time only"),
        None,
        Hello(ServerFacts(pid=1, torch="2.13.0")),
    ]
    monkeypatch.setattr(server, "receive", lambda timeout: script.pop(0))
    assert isinstance(server._hello(), Hello)
    assert told[0] == "building DeepSpeed's CPU comm op for 0.19.8, first time only"
    assert told[1].startswith("... still building (")
    assert told[2].startswith("DeepSpeed's CPU comm op ready after ")
    assert told[2].endswith("s; later runs load it from the cache")


def test_the_end_of_a_run_does_not_wait_on_a_server_busy_with_a_first_preload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On an H100 a run that had given up on its world waited at its end for the server's answer to ``FinishBuild``,
    which the server, busy finding a first preload list, could not give (the wait was the startup timeout, 30
    minutes). The end of a run waits ``FINISH_WAIT`` at most, says why, and leaves the server to ``close``."""
    told: list[str] = []
    server = ScriptedServer()
    server.progress = told.append
    server.facts = ServerFacts(pid=1, torch="2.13.0", deepspeed="0.19.8")
    busy = Building("... still finding what a first DeepSpeed engine step imports (20s)")
    monkeypatch.setattr(fork_server, "FINISH_WAIT", 0.3)
    monkeypatch.setattr(server, "receive", lambda timeout: time.sleep(min(timeout, 0.05)) or busy)
    started = time.monotonic()
    server.finish_build()
    assert time.monotonic() - started < 5
    assert any(isinstance(m, FinishBuild) for m in server.sent)
    assert told[-1].startswith("the fork server did not answer within 0.3s at the end of the run")


class Interruption(Exception):
    """Stands in for pytest-timeout's failure, raised in the main thread by a signal handler."""


@pytest.fixture
def interrupt_otherwise_on_sigusr2() -> Iterator[None]:
    def interrupt(signum: int, frame: object) -> None:
        raise Interruption("Timeout (>5.0s) from pytest-timeout.")

    previous = signal.signal(signal.SIGUSR2, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR2, previous)


@pytest.mark.usefixtures("interrupt_otherwise_on_sigusr2")
def test_a_world_interrupted_by_a_timeout_keeps_every_ranks_stack(runner: WorldRunner, tmp_path: Path) -> None:
    """Issue 11, item 3: an interruption other than Ctrl-C (pytest-timeout's failure) gets the live ranks' stacks
    before they are killed, and the world is reaped at once."""
    world = WorldRun(runner.server, 1003, 2, "gloo", 120.0)
    with pytest.raises(client.WorldInterrupted) as interrupted:
        world.run(_real_job(tmp_path, "test_interrupts_pytest"))
    assert isinstance(interrupted.value.cause, Interruption)
    ranks = interrupted.value.outcome.ranks
    assert {r.status for r in ranks} == {Status.HUNG}
    assert ranks[0].detail == (
        "still running when the test was interrupted (Interruption: Timeout (>5.0s) from pytest-timeout.)"
    )
    assert all("in test_interrupts_pytest" in r.stack for r in ranks)
    assert world.reaped
    assert not world.workdir.exists()


def test_an_interruption_before_spawned_was_read_still_names_the_running_ranks() -> None:
    """On a loaded machine a body can interrupt pytest before pytest has read ``Spawned``: the ranks already run, so
    the interruption waits for the server's word of them and ends them as HUNG (their stacks asked for), instead of
    letting the bare interruption through with no story."""

    class InterruptedBeforeSpawned(ScriptedServer):
        interrupted = False

        def receive(self, timeout: float) -> ServerMessage | None:
            if not self.interrupted:
                self.interrupted = True
                raise Interruption("Timeout (>5.0s) from pytest-timeout.")
            return super().receive(timeout)

    server = InterruptedBeforeSpawned()
    world = WorldRun(server, WORLD, 2, "gloo", 30.0)  # type: ignore[arg-type]
    with pytest.raises(client.WorldInterrupted) as interrupted:
        world.run(_job())
    assert {r.status for r in interrupted.value.outcome.ranks} == {Status.HUNG}
    assert any(isinstance(m, DumpStacks) for m in server.sent)
    assert world.reaped


def test_a_world_interrupted_before_its_ranks_were_announced_is_still_reaped(tmp_path: Path) -> None:
    """Ctrl-C between Spawn and Spawned: the server reaps ranks the client never heard of; nothing breaks."""

    class InterruptedAtSpawned(ScriptedServer):
        def receive(self, timeout: float) -> ServerMessage | None:
            message = super().receive(timeout)
            if isinstance(message, Spawned):
                raise KeyboardInterrupt
            return message

        def send(self, message: ClientMessage) -> None:
            super().send(message)
            if isinstance(message, Reap):  # the server reports the ranks it killed, then Reaped
                self.replies[-1:-1] = [Exited(message.world, rank, -9) for rank in range(2)]

    server = InterruptedAtSpawned()
    world = WorldRun(server, WORLD, 2, "gloo", 30.0)  # type: ignore[arg-type]
    with pytest.raises(KeyboardInterrupt):
        world.run(_job())
    assert world.reaped
    assert not world.workdir.exists()


def test_a_world_whose_directory_pytest_discarded_is_never_forked(runner: WorldRunner, tmp_path: Path) -> None:
    """Issue 49 item 5: pytest gave up on a world while the server was still preparing it (a first warm-up) and
    discarded its directory; the server then crashed forking it (FileNotFoundError on the store's port file). It now
    forks nothing for it, answers the world's Reap, and serves the next world."""
    facts = runner.facts()
    gone = tmp_path / "discarded-by-pytest"
    world = _Heard(1002)
    runner.server.send(Spawn(world.world_id, pickle.dumps(_real_job(tmp_path, "test_passes")), 2, str(gone)))
    runner.server.send(Reap(world.world_id))
    assert runner.server.wait_for(lambda: Reaped(world.world_id) in world.seen, time.monotonic() + 60, world)
    assert not any(isinstance(m, Spawned) for m in world.seen), world.seen
    assert runner.server.alive
    assert _server_children(runner, timeout=0) == []
    assert runner.run(_real_job(tmp_path, "test_passes"), size=2).passed
    assert runner.facts().pid == facts.pid


class _Heard:
    """What a world hears from the server, kept (``fork_server.WorldListener``)."""

    def __init__(self, world_id: int) -> None:
        self.world_id = world_id
        self.seen: list[object] = []

    def take(self, message: object) -> None:
        self.seen.append(message)
