"""Runs in a pytest process that an external launcher made a rank: the ranks' lockstep across the session's world
tests (steps 0 to 2 and the end of ``launched_world.LaunchedWorld``'s protocol): the plan, every rank's arrival at each
test, its start or why not, and the end of every rank's session.

Torch is imported inside functions only.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ...core.errors import HarnessError
from ...core.outcome import rank_ranges
from .peers import Peers, died, text_of, until

#: What a rank that ran out of world tests posts where the next one would be.
END_OF_SESSION = "(its session ended)"
#: After an interrupt, how long rank 0 waits for the other ranks to end their sessions (they end at once, unless
#: dead on another node, where only their launcher can tell).
INTERRUPTED_WAIT = 10.0


class Lockstep:
    """Keeps every rank at the same world test: ``seq`` is the one this rank is at, the n-th of its session."""

    def __init__(self, peers: Peers, release: str) -> None:
        self.peers = peers
        self.release = release
        self.seq = 0
        self._settled: set[int] = set()  # tests whose start this rank has posted (ready or not)

    def plan(self, nodeids: Sequence[str], timeout: float) -> dict[str, str]:
        """Before the first world test, every rank posts the world tests it collected, in order. Returned: the tests
        of this rank that cannot run as one world, each with why (which ranks did not collect it, or that the ranks
        reach it in another order). The lockstep then counts only the tests every rank runs, so one rank's extra test
        fails once instead of putting every later test out of step. Lists that never came (a rank died) are left to
        the lockstep, which names where each rank is."""
        peers = self.peers
        session = peers.store(0)
        peers.announce()
        session.set(f"plan/{peers.world.rank}", "\n".join(nodeids))
        peers.count(session, "planned")

        def given_up() -> bool:
            return bool(session.check(["ended"])) or bool(peers.dead(peers.missing(session, "plan")))

        if not until(session, "all-planned", time.monotonic() + timeout, given_up):
            return {}
        keys = [f"plan/{r}" for r in range(peers.world.world_size)]
        return unrunnable(nodeids, [text.split("\n") if (text := text_of(v)) else [] for v in session.multi_get(keys)])

    def _post_arrival(self, store: Any, label: str) -> None:
        """Post what this rank is at; a label other than the first rank's counts as a difference (before the count,
        so that once all have arrived the differences are final)."""
        store.set(f"at/{self.peers.world.rank}", label)
        if text_of(store.compare_set("first", "", label)) != label:
            store.add("differ", 1)
        self.peers.count(store, "arrived")

    def arrive(self, nodeid: str, timeout: float) -> str | None:
        """Wait until every rank is at the next world test: None when all are at ``nodeid`` (and this release),
        else what went wrong, in words. On a failure this rank posts that it will not start the body."""
        peers = self.peers
        peers.check_interrupted()
        self.seq += 1
        store = peers.store(self.seq)
        label = f"{nodeid} (deepspeed {self.release})"
        self._post_arrival(store, label)
        session = peers.store(0)

        def given_up() -> bool:
            missing = peers.missing(store, "at")
            return self._ended_missing(store, session) or bool(peers.dead(missing)) or peers.interrupted() is not None

        arrived = peers.interruptible(lambda: until(store, "all-arrived", time.monotonic() + timeout, given_up))
        peers.check_interrupted()
        if not arrived:
            missing = peers.missing(store, "at")
            ended = [r for r in missing if session.check([f"ended/{r}"])]
            dead = peers.dead(missing)
            why = f"; {rank_ranges(ended)} ended {'its' if len(ended) == 1 else 'their'} session" if ended else ""
            why += f"; {died(dead)}" if dead else ""
            problem = f"{rank_ranges(missing)} did not reach this test within {timeout:g}s{why}"
            if ended or dead:
                problem = f"{rank_ranges(missing)} will not reach this test{why}"
        elif int(store.add("differ", 0)):
            keys = [f"at/{r}" for r in range(peers.world.world_size)]
            at: dict[str, list[int]] = {}
            for r, value in enumerate(store.multi_get(keys)):
                at.setdefault(text_of(value), []).append(r)
            where = "; ".join(f"{rank_ranges(ranks)} at {text}" for text, ranks in at.items())
            problem = f"the ranks are not at the same test ({where}); every world test must run on every rank"
        else:
            return None
        self.abandon(f"lockstep failed: {problem}")
        return problem

    def _ended_missing(self, store: Any, session: Any) -> bool:
        """Has a rank that is not at this test ended its session (so that it never will be)?"""
        ended = bool(session.check(["ended"]))
        return ended and any(session.check([f"ended/{r}"]) for r in self.peers.missing(store, "at"))

    def abandon(self, why: str) -> None:
        """This rank will not run the current test's body: say why, so that no other rank waits for it."""
        if self.seq in self._settled or self.seq == 0:
            return
        self._settled.add(self.seq)
        store = self.peers.store(self.seq)
        store.set(f"start/{self.peers.world.rank}", why)
        store.add("unready", 1)
        self.peers.count(store, "started")

    def start(self, store: Any, timeout: float) -> None:
        """This rank is ready to run the current test's body; returns once every rank is, else raises a
        ``HarnessError`` naming the ranks that are not, and why."""
        peers = self.peers
        self._settled.add(self.seq)
        store.set(f"start/{peers.world.rank}", "")
        peers.count(store, "started")

        def given_up() -> bool:
            return peers.interrupted() is not None or bool(peers.dead(peers.missing(store, "start")))

        started = peers.interruptible(lambda: until(store, "all-started", time.monotonic() + timeout, given_up))
        peers.check_interrupted()
        if not started:
            late = peers.missing(store, "start")
            if dead := peers.dead(late):
                raise HarnessError(f"{rank_ranges(late)} did not get to this test's body: {died(dead)}")
            raise HarnessError(f"{rank_ranges(late)} did not get to this test's body within {timeout:g}s")
        if int(store.add("unready", 0)):
            keys = [f"start/{r}" for r in range(peers.world.world_size)]
            why = [(r, text_of(v)) for r, v in enumerate(store.multi_get(keys)) if v]
            told = "; ".join(f"rank {r}: {text}" for r, text in why)
            raise HarnessError(f"{rank_ranges(r for r, _ in why)} did not run this test's body ({told})")

    def finish(self, timeout: float) -> None:
        """Tell any rank still waiting at a next world test that this one has none; rank 0 (which hosts the store
        under launchers other than torchrun) waits, within ``timeout`` (``INTERRUPTED_WAIT`` after an interrupt),
        until every rank has said so, or died. What the dead ranks of this node started is killed by then."""
        import torch.distributed as dist

        peers = self.peers
        try:
            self._post_arrival(peers.store(self.seq + 1), END_OF_SESSION)
            session = peers.store(0)
            session.set(f"ended/{peers.world.rank}", "1")
            peers.count(session, "ended")
            peers.dead(range(peers.world.world_size))
            if peers.world.rank == 0:
                wait = min(timeout, INTERRUPTED_WAIT) if peers.interrupted() is not None else timeout
                given_up = lambda: peers.all_dead(peers.missing(session, "ended"))  # noqa: E731
                until(session, "all-ended", time.monotonic() + wait, given_up)
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
