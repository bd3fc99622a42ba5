"""Runs in a pytest process that an external launcher made a rank: one world test, every pytest process one rank,
and together they make one run.

The ranks go through each world test together over the launcher's store (``LaunchedWorld``: the protocol, step by
step). The modules beside this one: ``peers`` (the launcher's store and which ranks died or were interrupted),
``lockstep`` (steps 0 to 2 and every rank's end), ``body_watch`` (step 4's watcher). Torch is imported inside functions
only; nothing here knows pytest (``session/launched_run`` is the pytest side).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

from ...core.errors import HarnessError
from ...core.options import Launched
from ...core.outcome import ErrorInfo, RankResult, Status, WorldOutcome
from ...inrank.context import RankContext
from ...inrank.fixtures import RankFixture
from ..prctl import PR_SET_CHILD_SUBREAPER, prctl
from ..protocol import RankReport
from ..rank import body, rendezvous
from ..rank.body import Fix
from .body_watch import BodyWatch, Interrupted
from .lockstep import Lockstep, unrunnable
from .peers import POLL, Peers, RankProcess, died, until

#: What the pytest side (``session.launched_run``) and the tests use: this module stays the launched path's front.
__all__ = ["LaunchedWorld", "RankProcess", "stop_as_interrupted", "unrunnable"]

#: How long past the latest a rank's body can end (the group's timeout) its result, and rank 0's outcome, may take.
SLACK = 15.0
#: The process group's own timeout exceeds the world's by this much, so that the watcher, which takes the stacks,
#: always acts first (NCCL's watchdog would otherwise end the whole pytest process).
GROUP_MARGIN = 10.0
#: How long the other ranks wait for rank 0 to write the run's files once its tests have ended (a --ds-report runs
#: DeepSpeed's ds_report and torch's collect_env, up to 180 s each).
CLOSE_WAIT = 600.0
#: A rank's result when none came.
NO_RESULT = (
    "published no result by the world's deadline: its pytest process died, or its body is stuck where Python "
    "cannot interrupt it"
)
#: A rank's result when its process was seen to end first.
DIED = "its pytest process died before it published a result"


def stop_as_interrupted() -> None:
    """Under a launcher, this pytest process ends as on Ctrl-C when the launcher stops it (torchrun sends SIGTERM,
    or SIGINT, to every rank when it is interrupted itself); and it adopts what a body leaves (a child subreaper),
    so that ``_kill_what_it_started`` finds even a daemon."""

    def interrupted(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"the launcher stopped this rank ({signal.Signals(signum).name})")

    signal.signal(signal.SIGTERM, interrupted)
    prctl(PR_SET_CHILD_SUBREAPER, 1)


class LaunchedWorld:
    """This process's rank in the launcher's world, one world test at a time.

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
    5. **One outcome**: each rank publishes its ``RankResult``, then leaves the process group (a peer still waiting in a
       collective gets "Connection closed by peer", as when a spawned rank exits); rank 0 builds the ``WorldOutcome``
       from every rank's result and publishes it; every rank returns that same outcome.
    6. **Ctrl-C** (or the launcher's SIGTERM, which the pytest side turns into one) in any rank ends the session on
       every rank as pytest's own interrupt does: the rank posts it, the others' watchers stop their bodies and the
       lockstep starts no further test; each rank re-raises ``KeyboardInterrupt`` (never a test's outcome), and whatever
       the body started is killed.
    7. **A rank that died** (SIGKILL, the OOM killer, a crash of the interpreter) is noticed at once by the ranks on its
       node: every rank posts its process (``RankProcess``), and no wait goes on for a rank whose process has ended; its
       result is that it died, and what its body started is killed with its process group. A dead rank on another node
       is its launcher's to notice (torchrun stops every rank): after an interrupt no rank waits long for another.
    """

    def __init__(self, world: Launched, release: str, connect_timeout: float) -> None:
        self.world = world
        self.peers = Peers(world, connect_timeout)
        self.lockstep = Lockstep(self.peers, release)

    def plan(self, nodeids: Sequence[str], timeout: float) -> dict[str, str]:
        """The tests of ``nodeids`` that cannot run as one world, and why (``Lockstep.plan``)."""
        return self.lockstep.plan(nodeids, timeout)

    def arrive(self, nodeid: str, timeout: float) -> str | None:
        """Wait until every rank is at ``nodeid``: None, or what went wrong (``Lockstep.arrive``)."""
        return self.lockstep.arrive(nodeid, timeout)

    def abandon(self, why: str) -> None:
        """This rank will not run the current test's body, for ``why`` (``Lockstep.abandon``)."""
        self.lockstep.abandon(why)

    def finish(self, timeout: float) -> None:
        """This rank has no further world test (``Lockstep.finish``)."""
        self.lockstep.finish(timeout)

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
        store = self.peers.store(self.lockstep.seq, run=run)
        if self.world.rank == 0:
            _post_arguments(store, kwargs)
        self.lockstep.start(store, timeout)
        kwargs = kwargs if self.world.rank == 0 else _arguments_of_rank_0(store, kwargs)
        started = time.monotonic()
        result = self._set_up(store, backend, timeout, deepspeed, started)
        if result is None:
            ctx = RankContext(self.world.rank, self.world.world_size, self.world.local_rank, backend)
            call = functools.partial(body.run_body, fn, kwargs, fixes, ctx, deepspeed=deepspeed, setup=setup)
            result = self._watched(call, store, run, backend, started, timeout)
        _leave(backend, failed=result.status is not Status.PASSED)
        self.peers.check_interrupted()
        return self._one_outcome(store, backend, started, timeout)

    def _set_up(self, store: Any, backend: str, timeout: float, deepspeed: bool, started: float) -> RankResult | None:
        """A default process group of this test's own, on its own keys, every rank connected before any body runs
        (DeepSpeed's comm op loaded first where the test uses DeepSpeed). None, or this rank's failure, published as
        a spawned rank reports it."""
        import torch.distributed as dist

        try:
            if deepspeed:
                _warm_comm_op()
            if dist.is_initialized():  # left by something else than this plugin: never share it with a test
                _leave(backend, failed=True)
            if backend == "nccl":
                # CleanUpOnly: NCCL's watchdog aborts a failed communicator, but leaves the pytest process alive.
                os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
            group_store = dist.PrefixStore("pg", store)  # type: ignore[attr-defined]
            rank, size = self.world.rank, self.world.world_size
            rendezvous.init_default_group(backend, group_store, rank, size, timeout + GROUP_MARGIN)
            rendezvous.agree_connected(group_store, rank, size, timeout)
        except BaseException as exc:  # noqa: BLE001 - this rank's failure, as a spawned rank reports it
            error = ErrorInfo.from_exception(exc, "world setup failed:\n" + traceback.format_exc())
            result = RankReport(Status.FAILED, error=error, at=time.monotonic()).result(self.world.rank, "", started)
            self.peers.publish(store, result)
            return result
        return None

    def _watched(
        self, call: Callable[[], RankReport], store: Any, run: int, backend: str, started: float, timeout: float
    ) -> RankResult:
        """The body, ``call``, under its watcher (``BodyWatch``), and what it started killed after it: this rank's
        result, published (by the watcher, when it stopped the body); Ctrl-C in the body is told to every rank."""
        report: RankReport | None = None
        # Interrupted escapes run_body only when it came after the body, as run_body reported it: the watcher's
        # result stands either way.
        before = _children()
        watcher = self.peers.store(self.lockstep.seq, watcher=True, run=run)
        watch = BodyWatch(self.peers, watcher, started + timeout, timeout)
        with watch, contextlib.suppress(Interrupted):
            report = watch.interruptible(call)
        _kill_what_it_started(before)
        if watch.fired is not None:
            return watch.fired
        assert report is not None, "only the watcher interrupts a body, having published the rank's result"
        result = report.result(self.world.rank, started=started)
        if result.error is not None and result.error.is_instance_of(KeyboardInterrupt):
            _leave(backend, failed=True)
            self.peers.interrupt(result.error.text)
        self.peers.publish(store, result)
        return result

    def _one_outcome(self, store: Any, backend: str, started: float, timeout: float) -> WorldOutcome:
        """The world's outcome, the same on every rank: rank 0 gathers every rank's result and publishes it, the
        others wait for it."""
        peers = self.peers
        # A rank blocked in a collective that no peer will join is answered by the group's own timeout at the latest.
        final = started + timeout + GROUP_MARGIN + SLACK
        if self.world.rank == 0:
            results = peers.interruptible(lambda: self._gather(store, final))
            outcome = WorldOutcome(self.world.world_size, backend, results, time.monotonic() - started)
            store.set("outcome", pickle.dumps(outcome))
            return outcome
        if not peers.interruptible(lambda: until(store, "outcome", final + SLACK, lambda: bool(peers.dead([0])))):
            if peers.dead([0]):
                raise HarnessError(f"rank 0 published no outcome of this world: {died([0])}")
            raise HarnessError(f"rank 0 published no outcome of this world within {final + SLACK - started:.0f}s")
        outcome = pickle.loads(store.get("outcome"))
        assert isinstance(outcome, WorldOutcome)
        return outcome

    def _gather(self, store: Any, deadline: float) -> tuple[RankResult, ...]:
        """Every rank's result; a rank whose result never came is named as such (and one that died, at once)."""
        until(store, "all-results", deadline, lambda: self.peers.all_dead(self.peers.missing(store, "result")))
        results = []
        for r in range(self.world.world_size):
            key = f"result/{r}"
            if store.check([key]):
                result = pickle.loads(store.get(key))
                assert isinstance(result, RankResult)
                results.append(result)
            else:
                results.append(RankResult(r, Status.CRASHED, detail=DIED if self.peers.dead([r]) else NO_RESULT))
        return tuple(results)

    def close(self) -> None:
        """The end of this process. torchrun stops every rank as soon as one exits with a failure, so the others
        wait until rank 0 says it has written the run's files (while rank 0 still runs tests, and ``CLOSE_WAIT``
        after it ended them); a store that is gone, or a process that ended, means rank 0 is."""
        import torch.distributed as dist

        try:
            session = self.peers.store(0)
            if self.world.rank == 0:
                session.set("closed", "1")
                return
            deadline = None
            while not session.check(["closed"]) and not self.peers.dead([0]):
                if deadline is None and session.check(["ended/0"]):
                    deadline = time.monotonic() + CLOSE_WAIT
                if deadline is not None and time.monotonic() > deadline:
                    return
                time.sleep(POLL)
        except dist.DistError:
            pass


@functools.cache
def _warm_comm_op() -> None:
    """DeepSpeed's CPU comm op from the plugin's cache (as the fork server loads it), once per process."""
    from ..server import comm_op

    comm_op.warm_up()


def _children() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def _kill_what_it_started(before: set[int]) -> None:
    """Kill what the body started and left (as a spawned world's end does): this process is a child subreaper under
    a launcher (``session.launched_run``), so even a daemon the body made is among its descendants."""
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
