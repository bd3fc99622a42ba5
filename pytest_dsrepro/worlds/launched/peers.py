"""Runs in a pytest process that an external launcher made a rank: the launcher's store, as every rank's session
shares it, and the other ranks' liveness (who died, who was interrupted) as the store and this node tell it.

Torch and psutil are imported inside functions only.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

from ...core.options import Launched
from ...core.outcome import RankResult, Status, rank_ranges
from . import launcher

#: How often a wait, and the watcher, look at the clock and at the store.
POLL = 0.1
#: The session's key a rank sets when Ctrl-C (or the launcher's SIGTERM) reached it: its rank, in words.
INTERRUPT_KEY = "interrupted"

_T = TypeVar("_T")


def until(store: Any, key: str, deadline: float, give_up: Callable[[], bool] = lambda: False) -> bool:
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


def text_of(value: bytes) -> str:
    """A store's value, in words."""
    return value.decode(errors="replace")


def died(ranks: Sequence[int]) -> str:
    """``rank 1's pytest process died``: what a wait for ``ranks`` ended on."""
    who = rank_ranges(ranks)
    return f"{who}'s pytest process died" if len(ranks) == 1 else f"the pytest processes of {who} died"


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


class Peers:
    """This rank among the launcher's ranks: the store's keys per test, counting the ranks in, each rank's result, and
    which ranks died or were interrupted."""

    def __init__(self, world: Launched, connect_timeout: float) -> None:
        self.world = world
        self.connect_timeout = connect_timeout
        self._stores: tuple[Any, Any] | None = None
        self._processes: dict[int, RankProcess] = {}  # the other ranks' processes, as they posted them
        self._dead: set[int] = set()

    def store(self, seq: int, watcher: bool = False, run: int = 0) -> Any:
        """The keys of the ``seq``-th world test (0: the session's own); ``run``: of its ``run``-th world when a
        nondeterministic verdict runs several (each on keys of its own). ``watcher``: on the watcher's own client
        (the body's thread may be blocked in a wait on the other one)."""
        import torch.distributed as dist

        if self._stores is None:
            self._stores = launcher.connect(self.connect_timeout)
        prefix = str(seq) if run == 0 else f"{seq}.{run}"
        return dist.PrefixStore(prefix, self._stores[watcher])  # type: ignore[attr-defined]

    def count(self, store: Any, name: str) -> None:
        """Count this rank in; the last one sets ``all-<name>``, which every rank may wait for."""
        if int(store.add(name, 1)) == self.world.world_size:
            store.set(f"all-{name}", "1")

    def missing(self, store: Any, key: str) -> list[int]:
        """The ranks that have not set ``<key>/<rank>``."""
        return [r for r in range(self.world.world_size) if not store.check([f"{key}/{r}"])]

    def announce(self) -> None:
        """Post this rank's process, so that the ranks on its node can tell when it died."""
        self.store(0).set(f"process/{self.world.rank}", pickle.dumps(RankProcess.this()))

    def dead(self, ranks: Iterable[int], watcher: bool = False) -> list[int]:
        """Those of ``ranks`` whose pytest process is seen to have ended (``RankProcess.ended``); whatever a dead
        rank's body started is killed as soon as its death is seen."""
        session = self.store(0, watcher)
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

    def all_dead(self, ranks: Sequence[int]) -> bool:
        """Are ``ranks`` (those a wait still waits for) all dead, so that it can never end?"""
        return bool(ranks) and len(self.dead(ranks)) == len(ranks)

    def publish(self, store: Any, result: RankResult) -> None:
        """This rank's result of the test; a failure is also told to the other ranks' watchers."""
        if result.status in (Status.FAILED, Status.CRASHED):
            store.append("failed", f"{self.world.rank},")
        store.set(f"result/{self.world.rank}", pickle.dumps(result))
        self.count(store, "results")

    # ---- Ctrl-C, on any rank ------------------------------------------------------------------------------------

    def interrupted(self, watcher: bool = False) -> str | None:
        """Which rank Ctrl-C reached first, in words; None while none was."""
        try:
            session = self.store(0, watcher)
            return text_of(session.get(INTERRUPT_KEY)) if session.check([INTERRUPT_KEY]) else None
        except RuntimeError:  # the store went with rank 0 (torch.distributed.DistError is one)
            return None

    def interrupt(self, why: str) -> NoReturn:
        """Ctrl-C (``why``: what the interrupt said, if anything) reached this rank: tell every rank (the first to be
        told stands), and end this session, in its own words."""
        who = f"rank {self.world.rank}"
        with contextlib.suppress(RuntimeError):
            self.store(0).compare_set(INTERRUPT_KEY, "", who)
        raise KeyboardInterrupt(why or f"{who} was interrupted")

    def check_interrupted(self) -> None:
        """End this session too when another rank was interrupted: no further test starts on any rank."""
        who = self.interrupted()
        if who is not None:
            raise KeyboardInterrupt(f"{who} was interrupted")

    def interruptible(self, wait: Callable[[], _T]) -> _T:
        """``wait()``; Ctrl-C meanwhile is told to every rank first."""
        try:
            return wait()
        except KeyboardInterrupt as exc:
            self.interrupt(str(exc))
