"""Runs in a pytest process that an external launcher made a rank: one world test, every pytest process one rank,
and together they make one run.

For the n-th world test of the session, over the launcher's store (keys under ``pytest-dsrepro/<restart>/<n>``):

0. **The plan** (once, after collection): every rank posts the world tests it collected; a test that not every rank
   has fails at once on the ranks that have it, and the count of the others stays the same on every rank.
1. **Lockstep** (at setup): every rank posts the test it is at (node id and DeepSpeed release). Once all have, a
   difference fails the test on every rank, naming what each rank was at; a rank that never arrives is named too.
2. **Start** (at call, after the fixtures): every rank says it is ready, or why not (its setup failed or skipped
   after the lockstep). A rank that is not ready fails the test on the others as a harness error. Every body gets
   rank 0's fixture values, as every rank of a spawned world gets the pytest process's (one ``tmp_path``).
3. **A fresh default process group** per test, on the test's own keys: a collective left pending by one test's
   failure can never be answered by the next test.
4. **The body, watched**: at the world timeout, or 5 s after another rank failed, a watcher thread takes the body's
   Python stack, publishes the rank as HUNG or STOPPED, and interrupts the body with a signal.
5. **One outcome**: each rank publishes its ``RankResult``, then leaves the process group (a peer still waiting in
   a collective gets "Connection closed by peer", as when a spawned rank exits); rank 0 builds the
   ``WorldOutcome`` from every rank's result and publishes it; every rank returns that same outcome.
6. **Ctrl-C** (or the launcher's SIGTERM, which the pytest side turns into one) in any rank ends the session on every
   rank as pytest's own interrupt does: the rank posts it, the others' watchers stop their bodies and the lockstep
   starts no further test; each rank re-raises ``KeyboardInterrupt`` (never a test's outcome), and whatever the body
   started is killed.
7. **A rank that died** (SIGKILL, the OOM killer, a crash of the interpreter) is noticed at once by the ranks on its
   node: every rank posts its process (``RankProcess``), and no wait goes on for a rank whose process has ended; its
   result is that it died, and what its body started is killed with its process group. A dead rank on another node
   is its launcher's to notice (torchrun stops every rank): after an interrupt no rank waits long for another.

Torch is imported inside functions only; nothing here knows pytest (``session/launched`` is the pytest side).
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any, NoReturn, TypeVar

from ...core.errors import HarnessError
from ...core.options import Launched
from ...core.outcome import ErrorInfo, RankResult, Status, WorldOutcome, rank_ranges
from ...inrank.context import RankContext
from ...inrank.fixtures import RankFixture
from ..prctl import PR_SET_CHILD_SUBREAPER, prctl
from ..protocol import FAILURE_GRACE, RankReport
from ..rank import body, rendezvous
from ..rank.body import Fix
from . import launcher

#: How often the watcher looks at the clock and at the store.
POLL = 0.1
#: How long past the latest a rank's body can end (the group's timeout) its result, and rank 0's outcome, may take.
SLACK = 15.0
#: The process group's own timeout exceeds the world's by this much, so that the watcher, which takes the stacks,
#: always acts first (NCCL's watchdog would otherwise end the whole pytest process).
GROUP_MARGIN = 10.0
#: The signal that interrupts a body the watcher gave up on (SIGALRM is pytest-timeout's).
INTERRUPT = signal.SIGUSR2
#: How long the other ranks wait for rank 0 to write the run's files once its tests have ended (a --ds-report runs
#: DeepSpeed's ds_report and torch's collect_env, up to 180 s each).
CLOSE_WAIT = 600.0
#: What a rank that ran out of world tests posts where the next one would be.
END_OF_SESSION = "(its session ended)"
#: A rank's result when none came.
NO_RESULT = (
    "published no result by the world's deadline: its pytest process died, or its body is stuck where Python "
    "cannot interrupt it"
)
#: A rank's result when its process was seen to end first.
DIED = "its pytest process died before it published a result"
#: After an interrupt, how long rank 0 waits for the other ranks to end their sessions (they end at once, unless
#: dead on another node, where only their launcher can tell).
INTERRUPTED_WAIT = 10.0


_T = TypeVar("_T")

#: The session's key a rank sets when Ctrl-C (or the launcher's SIGTERM) reached it: its rank, in words.
INTERRUPT_KEY = "interrupted"


class Interrupted(BaseException):
    """Raised in a body the watcher gave up on (the rank's result is already published as HUNG or STOPPED)."""


def _until(store: Any, key: str, deadline: float, give_up: Callable[[], bool] = lambda: False) -> bool:
    """Did ``key`` appear by ``deadline`` (``time.monotonic()``), before ``give_up()`` said it never will?

    Polled with ``check`` rather than a blocking ``wait``: a wait that times out logs socket warnings into the test's
    output, and a poll can also notice a reason to stop waiting.
    """
    pause = 0.001
    while not store.check([key]):
        if time.monotonic() >= deadline or give_up():
            return False
        time.sleep(pause)
        pause = min(pause * 2, POLL)
    return True


def _text(value: bytes) -> str:
    return value.decode(errors="replace")


def stop_as_interrupted() -> None:
    """Under a launcher, this pytest process ends as on Ctrl-C when the launcher stops it (torchrun sends SIGTERM,
    or SIGINT, to every rank when it is interrupted itself); and it adopts what a body leaves (a child subreaper),
    so that ``_kill_what_it_started`` finds even a daemon."""

    def interrupted(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"the launcher stopped this rank ({signal.Signals(signum).name})")

    signal.signal(signal.SIGTERM, interrupted)
    prctl(PR_SET_CHILD_SUBREAPER, 1)


@dataclass(frozen=True)
class RankProcess:
    """A rank's pytest process as it posted itself: enough for a rank on the same node to tell whether it ended."""

    host: str
    pid: int
    created: float  # psutil's create_time: a later process with the same pid is another one
    leads_group: bool  # its process group is its own (torchrun starts each rank in a session of its own)

    @classmethod
    def this(cls) -> RankProcess:
        import psutil

        pid = os.getpid()
        return cls(socket.gethostname(), pid, psutil.Process(pid).create_time(), os.getpgrp() == pid)

    def ended(self) -> bool:
        """Has it ended? Known only on its own node: elsewhere, False."""
        import psutil

        if self.host != socket.gethostname():
            return False
        try:
            proc = psutil.Process(self.pid)
            return proc.create_time() != self.created or proc.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    def kill_leftovers(self) -> None:
        """Kill what it started and left when it died (they keep its process group, though reparented): only when
        that group was its own, so that no one else's process is in it."""
        if self.leads_group:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)


class LaunchedWorld:
    """This process's rank in the launcher's world: the protocol above, one world test at a time."""

    def __init__(self, world: Launched, release: str, connect_timeout: float) -> None:
        self.world = world
        self.release = release
        self.connect_timeout = connect_timeout
        self.seq = 0  # the world test this rank is at: the n-th of its session
        self._stores: tuple[Any, Any] | None = None
        self._settled: set[int] = set()  # tests whose start this rank has posted (ready or not)
        self._comm_op_ready = False
        self._processes: dict[int, RankProcess] = {}  # the other ranks' processes, as they posted them
        self._dead: set[int] = set()

    # ---- the store ----------------------------------------------------------------------------------------------

    def _store(self, seq: int, watcher: bool = False, run: int = 0) -> Any:
        """The keys of the ``seq``-th world test (0: the session's own); ``run``: of its ``run``-th world when a
        nondeterministic verdict runs several (each on keys of its own)."""
        import torch.distributed as dist

        if self._stores is None:
            self._stores = launcher.connect(self.connect_timeout)
        prefix = str(seq) if run == 0 else f"{seq}.{run}"
        return dist.PrefixStore(prefix, self._stores[watcher])  # type: ignore[attr-defined]

    def _count(self, store: Any, name: str) -> None:
        """Count this rank in; the last one sets ``all-<name>``, which every rank may wait for."""
        if int(store.add(name, 1)) == self.world.world_size:
            store.set(f"all-{name}", "1")

    def _missing(self, store: Any, key: str) -> list[int]:
        return [r for r in range(self.world.world_size) if not store.check([f"{key}/{r}"])]

    def dead(self, ranks: Iterable[int], watcher: bool = False) -> list[int]:
        """Those of ``ranks`` whose pytest process is seen to have ended (``RankProcess.ended``); whatever a dead
        rank's body started is killed as soon as its death is seen."""
        session = self._store(0, watcher)
        for r in ranks:
            if r in self._dead or r == self.world.rank:
                continue
            if r not in self._processes:
                with contextlib.suppress(RuntimeError):  # the store went with rank 0
                    if not session.check([f"process/{r}"]):
                        continue
                    process = pickle.loads(session.get(f"process/{r}"))
                    assert isinstance(process, RankProcess)
                    self._processes[r] = process
            if r in self._processes and self._processes[r].ended():
                self._dead.add(r)
                self._processes[r].kill_leftovers()
        return sorted(self._dead.intersection(ranks))

    def _all_dead(self, ranks: Sequence[int]) -> bool:
        """Are ``ranks`` (those a wait still waits for) all dead, so that it can never end?"""
        return bool(ranks) and len(self.dead(ranks)) == len(ranks)

    def publish(self, store: Any, result: RankResult) -> None:
        """This rank's result of the test; a failure is also told to the other ranks' watchers."""
        if result.status in (Status.FAILED, Status.CRASHED):
            store.append("failed", f"{self.world.rank},")
        store.set(f"result/{self.world.rank}", pickle.dumps(result))
        self._count(store, "results")

    # ---- 0. the plan ---------------------------------------------------------------------------------------------

    def plan(self, nodeids: Sequence[str], timeout: float) -> dict[str, str]:
        """Before the first world test, every rank posts the world tests it collected, in order. Returned: the tests
        of this rank that cannot run as one world, each with why (which ranks did not collect it, or that the ranks
        reach it in another order). The lockstep then counts only the tests every rank runs, so one rank's extra test
        fails once instead of putting every later test out of step. Lists that never came (a rank died) are left to
        the lockstep, which names where each rank is."""
        session = self._store(0)
        session.set(f"process/{self.world.rank}", pickle.dumps(RankProcess.this()))
        session.set(f"plan/{self.world.rank}", "\n".join(nodeids))
        self._count(session, "planned")

        def given_up() -> bool:
            return bool(session.check(["ended"])) or bool(self.dead(self._missing(session, "plan")))

        if not _until(session, "all-planned", time.monotonic() + timeout, given_up):
            return {}
        keys = [f"plan/{r}" for r in range(self.world.world_size)]
        return unrunnable(nodeids, [text.split("\n") if (text := _text(v)) else [] for v in session.multi_get(keys)])

    # ---- 1. lockstep --------------------------------------------------------------------------------------------

    def _post_arrival(self, store: Any, label: str) -> None:
        """Post what this rank is at; a label other than the first rank's counts as a difference (before the count,
        so that once all have arrived the differences are final)."""
        store.set(f"at/{self.world.rank}", label)
        if _text(store.compare_set("first", "", label)) != label:
            store.add("differ", 1)
        self._count(store, "arrived")

    def arrive(self, nodeid: str, timeout: float) -> str | None:
        """Wait until every rank is at the next world test: None when all are at ``nodeid`` (and this release),
        else what went wrong, in words. On a failure this rank posts that it will not start the body."""
        self.check_interrupted()
        self.seq += 1
        store = self._store(self.seq)
        label = f"{nodeid} (deepspeed {self.release})"
        self._post_arrival(store, label)
        session = self._store(0)

        def given_up() -> bool:
            missing = self._missing(store, "at")
            return self._ended_missing(store, session) or bool(self.dead(missing)) or self.interrupted() is not None

        arrived = self._interruptible(lambda: _until(store, "all-arrived", time.monotonic() + timeout, given_up))
        self.check_interrupted()
        if not arrived:
            missing = self._missing(store, "at")
            ended = [r for r in missing if session.check([f"ended/{r}"])]
            dead = self.dead(missing)
            why = f"; {rank_ranges(ended)} ended {'its' if len(ended) == 1 else 'their'} session" if ended else ""
            why += f"; {_died(dead)}" if dead else ""
            problem = f"{rank_ranges(missing)} did not reach this test within {timeout:g}s{why}"
            if ended or dead:
                problem = f"{rank_ranges(missing)} will not reach this test{why}"
        elif int(store.add("differ", 0)):
            keys = [f"at/{r}" for r in range(self.world.world_size)]
            at: dict[str, list[int]] = {}
            for r, value in enumerate(store.multi_get(keys)):
                at.setdefault(_text(value), []).append(r)
            where = "; ".join(f"{rank_ranges(ranks)} at {text}" for text, ranks in at.items())
            problem = f"the ranks are not at the same test ({where}); every world test must run on every rank"
        else:
            return None
        self.abandon(f"lockstep failed: {problem}")
        return problem

    def _ended_missing(self, store: Any, session: Any) -> bool:
        """Has a rank that is not at this test ended its session (so that it never will be)?"""
        return bool(session.check(["ended"])) and any(session.check([f"ended/{r}"]) for r in self._missing(store, "at"))

    def abandon(self, why: str) -> None:
        """This rank will not run the current test's body: say why, so that no other rank waits for it."""
        if self.seq in self._settled or self.seq == 0:
            return
        self._settled.add(self.seq)
        store = self._store(self.seq)
        store.set(f"start/{self.world.rank}", why)
        store.add("unready", 1)
        self._count(store, "started")

    # ---- 2.-5. one world test -----------------------------------------------------------------------------------

    def run(
        self,
        fn: Callable[..., Any],
        kwargs: dict[str, Any],
        fixes: Sequence[Fix],
        backend: str,
        timeout: float,
        *,
        deepspeed: bool = False,
        run: int = 0,
        setup: Sequence[RankFixture] = (),
    ) -> WorldOutcome:
        """Run the body of the test all ranks arrived at, as one world; every rank returns the same outcome.
        ``run``: which world of a nondeterministic verdict's series this is (each starts anew on its own keys)."""
        store = self._store(self.seq, run=run)
        if self.world.rank == 0:
            _post_arguments(store, kwargs)
        self._start(store, timeout)
        kwargs = kwargs if self.world.rank == 0 else _arguments_of_rank_0(store, kwargs)
        started = time.monotonic()
        deadline = started + timeout
        try:
            if deepspeed:
                self._warm_comm_op()
            self._join(store, backend, timeout)
        except BaseException as exc:  # noqa: BLE001 - this rank's failure, as a spawned rank reports it
            error = ErrorInfo.from_exception(exc, "world setup failed:\n" + traceback.format_exc())
            result = RankReport(Status.FAILED, error=error, at=time.monotonic()).result(self.world.rank, "", started)
            self.publish(store, result)
        else:
            ctx = RankContext(self.world.rank, self.world.world_size, self.world.local_rank, backend)
            report: RankReport | None = None
            # Interrupted escapes run_body only when it came after the body, as run_body reported it: the watcher's
            # result stands either way.
            before = _children()
            watch = _Watch(self, self._store(self.seq, watcher=True, run=run), deadline, timeout)
            with watch, contextlib.suppress(Interrupted):
                report = watch.interruptible(body.run_body, fn, kwargs, fixes, ctx, deepspeed=deepspeed, setup=setup)
            _kill_what_it_started(before)
            if watch.fired is not None:
                result = watch.fired
            else:
                assert report is not None, "only the watcher interrupts a body, having published the rank's result"
                result = report.result(self.world.rank, started=started)
                if result.error is not None and result.error.is_instance_of(KeyboardInterrupt):
                    _leave(backend, failed=True)
                    self.interrupt(result.error.text)
                self.publish(store, result)
        _leave(backend, failed=result.status is not Status.PASSED)
        self.check_interrupted()
        # A rank blocked in a collective that no peer will join is answered by the group's own timeout at the latest.
        final = deadline + GROUP_MARGIN + SLACK
        if self.world.rank == 0:
            results = self._interruptible(lambda: self._gather(store, final))
            outcome = WorldOutcome(self.world.world_size, backend, results, time.monotonic() - started)
            store.set("outcome", pickle.dumps(outcome))
            return outcome
        if not self._interruptible(lambda: _until(store, "outcome", final + SLACK, lambda: bool(self.dead([0])))):
            if self.dead([0]):
                raise HarnessError(f"rank 0 published no outcome of this world: {_died([0])}")
            raise HarnessError(f"rank 0 published no outcome of this world within {final + SLACK - started:.0f}s")
        outcome = pickle.loads(store.get("outcome"))
        assert isinstance(outcome, WorldOutcome)
        return outcome

    def _start(self, store: Any, timeout: float) -> None:
        self._settled.add(self.seq)
        store.set(f"start/{self.world.rank}", "")
        self._count(store, "started")

        def given_up() -> bool:
            return self.interrupted() is not None or bool(self.dead(self._missing(store, "start")))

        started = self._interruptible(lambda: _until(store, "all-started", time.monotonic() + timeout, given_up))
        self.check_interrupted()
        if not started:
            late = self._missing(store, "start")
            if dead := self.dead(late):
                raise HarnessError(f"{rank_ranges(late)} did not get to this test's body: {_died(dead)}")
            raise HarnessError(f"{rank_ranges(late)} did not get to this test's body within {timeout:g}s")
        if int(store.add("unready", 0)):
            keys = [f"start/{r}" for r in range(self.world.world_size)]
            why = [(r, _text(v)) for r, v in enumerate(store.multi_get(keys)) if v]
            told = "; ".join(f"rank {r}: {text}" for r, text in why)
            raise HarnessError(f"{rank_ranges(r for r, _ in why)} did not run this test's body ({told})")

    def _join(self, store: Any, backend: str, timeout: float) -> None:
        """A default process group of this test's own, on its own keys; every rank connected before any body runs."""
        import torch.distributed as dist

        if dist.is_initialized():  # left by something else than this plugin: never share it with a test
            _leave(backend, failed=True)
        if backend == "nccl":
            # CleanUpOnly: NCCL's watchdog aborts a failed communicator, but leaves the pytest process alive.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        group_store = dist.PrefixStore("pg", store)  # type: ignore[attr-defined]
        rendezvous.init_default_group(
            backend, group_store, self.world.rank, self.world.world_size, timeout + GROUP_MARGIN
        )
        rendezvous.agree_connected(group_store, self.world.world_size, timeout)

    def _warm_comm_op(self) -> None:
        """DeepSpeed's CPU comm op from the plugin's cache (as the fork server loads it), once per process."""
        if not self._comm_op_ready:
            from ..server import comm_op

            comm_op.warm_up()
            self._comm_op_ready = True

    def _gather(self, store: Any, deadline: float) -> tuple[RankResult, ...]:
        """Every rank's result; a rank whose result never came is named as such (and one that died, at once)."""
        _until(store, "all-results", deadline, lambda: self._all_dead(self._missing(store, "result")))
        results = []
        for r in range(self.world.world_size):
            key = f"result/{r}"
            if store.check([key]):
                result = pickle.loads(store.get(key))
                assert isinstance(result, RankResult)
                results.append(result)
            else:
                results.append(RankResult(r, Status.CRASHED, detail=DIED if self.dead([r]) else NO_RESULT))
        return tuple(results)

    # ---- 6. Ctrl-C ----------------------------------------------------------------------------------------------

    def interrupted(self, watcher: bool = False) -> str | None:
        """Which rank Ctrl-C reached first, in words; None while none was."""
        try:
            session = self._store(0, watcher)
            return _text(session.get(INTERRUPT_KEY)) if session.check([INTERRUPT_KEY]) else None
        except RuntimeError:  # the store went with rank 0 (torch.distributed.DistError is one)
            return None

    def interrupt(self, why: str) -> NoReturn:
        """Ctrl-C (``why``: what the interrupt said, if anything) reached this rank: tell every rank (the first to be
        told stands), and end this session, in its own words."""
        who = f"rank {self.world.rank}"
        with contextlib.suppress(RuntimeError):
            self._store(0).compare_set(INTERRUPT_KEY, "", who)
        raise KeyboardInterrupt(why or f"{who} was interrupted")

    def check_interrupted(self) -> None:
        """End this session too when another rank was interrupted: no further test starts on any rank."""
        who = self.interrupted()
        if who is not None:
            raise KeyboardInterrupt(f"{who} was interrupted")

    def _interruptible(self, wait: Callable[[], _T]) -> _T:
        """``wait()``; Ctrl-C meanwhile is told to every rank first."""
        try:
            return wait()
        except KeyboardInterrupt as exc:
            self.interrupt(str(exc))

    # ---- the end ------------------------------------------------------------------------------------------------

    def close(self) -> None:
        """The end of this process. torchrun stops every rank as soon as one exits with a failure, so the others
        wait until rank 0 says it has written the run's files (while rank 0 still runs tests, and ``CLOSE_WAIT``
        after it ended them); a store that is gone, or a process that ended, means rank 0 is."""
        import torch.distributed as dist

        try:
            session = self._store(0)
            if self.world.rank == 0:
                session.set("closed", "1")
                return
            deadline = None
            while not session.check(["closed"]) and not self.dead([0]):
                if deadline is None and session.check(["ended/0"]):
                    deadline = time.monotonic() + CLOSE_WAIT
                if deadline is not None and time.monotonic() > deadline:
                    return
                time.sleep(POLL)
        except dist.DistError:
            pass

    def finish(self, timeout: float) -> None:
        """Tell any rank still waiting at a next world test that this one has none; rank 0 (which hosts the store
        under launchers other than torchrun) waits, within ``timeout`` (``INTERRUPTED_WAIT`` after an interrupt),
        until every rank has said so, or died. What the dead ranks of this node started is killed by then."""
        import torch.distributed as dist

        try:
            self._post_arrival(self._store(self.seq + 1), END_OF_SESSION)
            session = self._store(0)
            session.set(f"ended/{self.world.rank}", "1")
            self._count(session, "ended")
            self.dead(range(self.world.world_size))
            if self.world.rank == 0:
                wait = min(timeout, INTERRUPTED_WAIT) if self.interrupted() is not None else timeout
                given_up = lambda: self._all_dead(self._missing(session, "ended"))  # noqa: E731
                _until(session, "all-ended", time.monotonic() + wait, given_up)
        except dist.DistError:
            pass  # the store went with rank 0: nobody is left to tell


def unrunnable(mine: Sequence[str], lists: Sequence[Sequence[str]]) -> dict[str, str]:
    """Which of ``mine`` cannot run as one world, given every rank's world tests in order (``lists[r]``), and why.

    A test runs when every rank collected it and every rank reaches it in the same order: taken in rank 0's order,
    a common test is kept when it comes after the last kept one on every rank (the same on every rank, as each
    computes it from the same lists).
    """
    everywhere = set.intersection(*(set(tests) for tests in lists))
    positions = [{n: i for i, n in enumerate(tests)} for tests in lists]
    kept: set[str] = set()
    last = [-1] * len(lists)
    for name in (n for n in lists[0] if n in everywhere):
        if all(pos[name] > last[r] for r, pos in enumerate(positions)):
            kept.add(name)
            last = [pos[name] for pos in positions]
    why = {}
    for name in mine:
        if name not in everywhere:
            why[name] = (
                f"{rank_ranges(r for r, tests in enumerate(lists) if name not in tests)} did not collect this test"
            )
        elif name not in kept:
            places = "; ".join(f"rank {r}: world test {pos[name] + 1}" for r, pos in enumerate(positions))
            why[name] = f"the ranks reach this test in another order ({places})"
    return why


def _died(ranks: Sequence[int]) -> str:
    """``rank 1's pytest process died``: what a wait for ``ranks`` ended on."""
    who = rank_ranges(ranks)
    return f"{who}'s pytest process died" if len(ranks) == 1 else f"the pytest processes of {who} died"


def _children() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def _kill_what_it_started(before: set[int]) -> None:
    """Kill what the body started and left (as a spawned world's end does): this process is a child subreaper under
    a launcher (``session.launched``), so even a daemon the body made is among its descendants."""
    import psutil

    left = [psutil.Process(pid) for pid in _children() - before if psutil.pid_exists(pid)]
    for proc in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(left, timeout=5)


def _post_arguments(store: Any, kwargs: dict[str, Any]) -> None:
    """Rank 0's fixture values, for every rank's body: as in a spawned world, where the pytest process resolves the
    fixtures once and every rank gets the same values (one ``tmp_path``, one random seed)."""
    try:
        payload = pickle.dumps(kwargs)
    except Exception:  # noqa: BLE001 - values that cannot travel: every rank keeps its own
        payload = b""
    store.set("arguments", payload)


def _arguments_of_rank_0(store: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    payload = store.get("arguments")
    if not payload:
        return kwargs
    shared = pickle.loads(payload)
    assert isinstance(shared, dict)
    return shared


def _leave(backend: str, *, failed: bool) -> None:
    """Leave this test's process group, closing its connections (and DeepSpeed's references to its groups)."""
    import torch.distributed as dist

    if dist.is_initialized():
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if backend == "nccl" and failed and abort is not None:
            abort()  # NCCL: a destroy would wait for collectives that will never complete
        else:
            dist.destroy_process_group()
    release_deepspeed_groups()
    # gloo closes a group's connections only when the group is deleted, and an engine that held it is kept alive by
    # its reference cycles (module hooks): collected now, a peer still waiting on this rank is answered at once.
    gc.collect()


def release_deepspeed_groups() -> None:
    """Forget the process groups DeepSpeed cached (``deepspeed.utils.groups``): they belonged to a test's world that
    is gone. DeepSpeed 0.19 does it itself when asked; older releases keep module globals named ``_..._GROUP...``."""
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is None:
        return
    release = getattr(groups, "_release_process_group_references", None)
    if release is not None:
        release(None)
        return
    for name, value in list(vars(groups).items()):
        if name.startswith("_") and name.isupper() and "_GROUP" in name:
            if isinstance(value, dict):
                value.clear()
            elif not callable(value):
                setattr(groups, name, None)


class _Watch:
    """Watches one body from a thread: at ``deadline``, or ``FAILURE_GRACE`` after another rank's failure, it takes
    the body's stack, publishes the rank's result and interrupts the body. Used as a context manager around it."""

    def __init__(self, world: LaunchedWorld, store: Any, deadline: float, timeout: float) -> None:
        self.world = world
        self.store = store  # a client of its own: the body's thread may be blocked in a wait on the other one
        self.rank = world.world.rank
        self.deadline = deadline
        self.timeout = timeout
        self.fired: RankResult | None = None
        self._armed = False  # the body is running: an interruption may be raised in it
        self._done = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._main = threading.get_ident()
        self._thread = threading.Thread(target=self._loop, name="pytest-dsrepro watcher", daemon=True)
        self._previous: Any = None

    def __enter__(self) -> _Watch:
        self._previous = signal.signal(INTERRUPT, self._interrupt)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._done = True
        self._stop.set()
        self._thread.join()
        signal.signal(INTERRUPT, signal.SIG_DFL if self._previous is None else self._previous)  # None: set in C

    def interruptible(self, run: Callable[..., RankReport], *args: Any, **kwargs: Any) -> RankReport:
        """``run(*args, **kwargs)``, which the watcher may interrupt while it runs (and only then)."""
        self._armed = True
        try:
            return run(*args, **kwargs)
        finally:
            self._armed = False

    def _interrupt(self, signum: int, frame: FrameType | None) -> None:
        if self._armed and self.fired is not None:  # a stray SIGUSR2 interrupts nothing
            self._armed = False
            raise Interrupted(self.fired.detail)

    def _loop(self) -> None:
        failed = ""
        failed_at: float | None = None
        while not self._stop.wait(POLL):
            now = time.monotonic()
            if failed_at is None and (failed := self._peers_failed()):
                failed_at = now
            if (who := self.world.interrupted(watcher=True)) is not None:
                self._fire(Status.STOPPED, f"{who} was interrupted")
            elif now >= self.deadline:
                self._fire(Status.HUNG, f"still running when the {self.timeout:g}s world timeout expired")
            elif failed_at is not None and now >= failed_at + FAILURE_GRACE:
                self._fire(Status.STOPPED, f"still running {FAILURE_GRACE:g}s after {failed}")
            else:
                continue
            return

    def _peers_failed(self) -> str:
        """Which other ranks failed, or died, in words; empty while none has."""
        try:
            if self.store.check(["failed"]):
                failed = sorted({int(r) for r in _text(self.store.get("failed")).split(",") if r})
                return f"{rank_ranges(failed)} failed"
            dead = self.world.dead(range(self.world.world.world_size), watcher=True)
        except RuntimeError:  # the store is unreachable: the deadline still applies
            return ""
        return _died(dead) if dead else ""

    def _fire(self, status: Status, detail: str) -> None:
        with self._lock:
            if self._done:
                return
            self.fired = RankResult(self.rank, status, detail=detail, stack=self._stack())
            self.world.publish(self.store, self.fired)
        signal.pthread_kill(self._main, INTERRUPT)

    def _stack(self) -> str:
        """The body's thread's Python stack, from the body's own frame in (faulthandler's order: innermost first,
        as spawned ranks report theirs)."""
        frame = sys._current_frames().get(self._main)
        entries = traceback.extract_stack(frame)
        inner = max(
            (i for i, e in enumerate(entries) if e.name == "run_body" and e.filename == body.__file__), default=-1
        )
        lines = [f'  File "{e.filename}", line {e.lineno} in {e.name}' for e in reversed(entries[inner + 1 :])]
        return "\n".join(["Stack (most recent call first):", *lines])
