"""Runs in a pytest process that an external launcher made a rank: the watcher of one test's body (step 4 of
``launched_world.LaunchedWorld``'s protocol), a thread beside the body's own.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import FrameType
from typing import Any

from ...core.outcome import RankResult, Status, rank_ranges
from ..protocol import FAILURE_GRACE, RankReport
from ..rank import body
from .peers import POLL, Peers, died, text_of

#: The signal that interrupts a body the watcher gave up on (SIGALRM is pytest-timeout's).
INTERRUPT = signal.SIGUSR2


class Interrupted(BaseException):
    """Raised in a body the watcher gave up on (the rank's result is already published as HUNG or STOPPED)."""


class BodyWatch:
    """Watches one body from a thread: at ``deadline``, or ``FAILURE_GRACE`` after another rank's failure, it takes
    the body's stack, publishes the rank's result and interrupts the body. Used as a context manager around it."""

    def __init__(self, peers: Peers, store: Any, deadline: float, timeout: float) -> None:
        self.peers = peers
        self.store = store  # a client of its own: the body's thread may be blocked in a wait on the other one
        self.rank = peers.world.rank
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

    def __enter__(self) -> BodyWatch:
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
            if (who := self.peers.interrupted(watcher=True)) is not None:
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
                failed = sorted({int(r) for r in text_of(self.store.get("failed")).split(",") if r})
                return f"{rank_ranges(failed)} failed"
            dead = self.peers.dead(range(self.peers.world.world_size), watcher=True)
        except RuntimeError:  # the store is unreachable: the deadline still applies
            return ""
        return died(dead) if dead else ""

    def _fire(self, status: Status, detail: str) -> None:
        with self._lock:
            if self._done:
                return
            self.fired = RankResult(self.rank, status, detail=detail, stack=self._stack())
            self.peers.publish(self.store, self.fired)
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
