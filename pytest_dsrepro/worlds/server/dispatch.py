"""Runs in the fork server: its answer to each of pytest's messages, and the worlds it started for pytest.

``Spawn`` forks a world's ranks (or hands the test to a kept world's, ``kept``), ``DumpStacks`` and ``Kill`` signal
ranks, ``Reap`` ends a world (``reaping``; one whose ranks all ended is ended unasked: ``WorldEnded``) and discards
its directory, ``FinishBuild`` lets the op builds that run beside the worlds go on after the run (``op_builds``).
What all ranks of a world share is done once, before the fork (``OpenWorlds.spawn``), DeepSpeed's first use included
for a test that uses it (``OpenWorlds.warm``).
"""

from __future__ import annotations

import contextlib
import functools
import marshal
import os
import pickle
import signal
import sys
from multiprocessing.connection import Connection
from pathlib import Path

from ...core.options import default_cache_dir
from .. import workdir
from ..protocol import (
    BuildEnded,
    Building,
    DumpStacks,
    FinishBuild,
    Finished,
    Kill,
    Meeting,
    NextTest,
    RankFinished,
    RankJob,
    Reap,
    Reaped,
    Spawn,
    Spawned,
    WorldEnded,
)
from ..rank.spawned_rank import STACK_SIGNAL
from . import builds, comm_op, op_builds, preload, warmup
from .kept import KeptWorld
from .reaping import RankTable
from .spawning import ForkedWorld, TestModules, freeze, start_world
from .store import Store

#: What ``Spawned.preloaded`` says while the list of a first engine step's imports is being found beside the worlds.
SEARCHING = "nothing yet: what a first DeepSpeed engine step imports is being found beside the worlds"


class OpenWorlds:
    """The worlds this server started for pytest: their ranks until told, their directories until reaped."""

    def __init__(
        self,
        conn: Connection,
        directories: dict[int, Path],
        store: Store,
        scouted: builds.BuildChild | None = None,
        building: comm_op.Background | None = None,
        user_dir: str | None = None,
    ) -> None:
        self.conn = conn
        self.directories = directories  # world -> directory; what is left here when pytest dies is discarded
        self.store = store
        self.worlds: dict[int, ForkedWorld] = {}
        self.ranks = RankTable(conn)
        self.modules = TestModules()
        self.preloaded: str | None = None  # set by the first Spawn of a test that uses DeepSpeed once a list is found
        self.scouted = scouted  # the child finding what such a Spawn imports, beside the worlds
        self.searching = False  # the user was told that it is being found
        asking = functools.partial(world_of, self.worlds)
        self.ops = op_builds.OpBuilds(conn, asking, default_cache_dir(), user_dir)  # every op built beside the worlds
        if "deepspeed" in sys.modules:  # else each rank imports DeepSpeed, and builds as DeepSpeed does
            op_builds.install(self.ops.address, os.getpid())
        if building is not None:
            self.ops.beside(comm_op.OP_NAME, building.build, building.adopt, building.detach)
        self.kept = KeptWorld(self.end, store)  # a reusable world's ranks, alive between two tests of its scope
        self._finished: dict[int, set[int]] = {}  # world -> its ranks that said Finished

    def handle(self, message: object) -> None:
        match message:
            case Spawn(world=world, job=job, size=size, workdir=directory, reuse=reuse):
                self.directories[world] = Path(directory)
                rank_job = pickle.loads(job)
                if rank_job.warm and self.preloaded is None and "deepspeed" in sys.modules:
                    self.warm()
                self.spawn(world, rank_job, size, Path(directory), reuse)
            case DumpStacks(world=world, ranks=ranks):
                self.ranks.signal(world, ranks, STACK_SIGNAL)
            case Kill(world=world, ranks=ranks):
                opened = self.worlds.get(world)
                self.ranks.signal(world, ranks, signal.SIGKILL, opened.group if opened is not None else None)
            case Reap(world=world, keep=keep):
                self.reap_world(world, keep)
            case FinishBuild():
                self.conn.send(BuildEnded(self.leave()))
            case _:
                print(f"pytest-dsrepro fork server: ignored an unknown message {message!r}", file=sys.stderr)

    def warm(self) -> None:
        """Before a world whose test uses DeepSpeed: its first use done here (``warmup.warm_for_deepspeed``) once the
        list of what it imports is at hand; until then (a first run of the install) the list is found by a scout
        beside the worlds, started now if pytest did not ask for one at start-up, and the world runs without it."""
        install = warmup.install()
        if preload.ready(install, self.scouted):
            self.preloaded = warmup.warm_for_deepspeed(install, self.scouted, self.ops.user_dir)
            self.scouted = None
            return
        if self.scouted is None:
            self.scouted = preload.scout(install, warmup.scout_apart)
        if not self.searching:
            self.searching = True
            self.conn.send(
                Building(
                    f"finding what a first DeepSpeed engine step imports, first time only for deepspeed "
                    f"{install.deepspeed_version} ({preload.expected_discovery(install.cache_dir)}), beside the "
                    "worlds: until it is found, they run without it"
                )
            )

    def leave(self) -> str:
        """The run's tests are over, uninterrupted (``FinishBuild``): what still works beside the worlds goes on apart
        for later runs, op builds (``op_builds.OpBuilds.leave``) and the search for a first engine step's imports
        alike; what to tell the user."""
        said = [self.ops.leave()]
        if self.scouted is not None and not self.scouted.done():
            self.scouted.detach()
            said.append(
                f"what a first DeepSpeed engine step imports goes on being found apart (process "
                f"{self.scouted.child.pid}): later runs preload it"
            )
        return "; ".join(filter(None, said))

    def stop(self) -> set[int]:
        """At the server's end: what works beside the worlds is stopped, unless it was let go on (``leave``): those
        pids, which go on."""
        going_on = self.ops.stop()
        if self.scouted is not None:
            self.scouted.stop()
            if self.scouted.detached:
                going_on.add(self.scouted.child.pid)
        return going_on

    def spawn(self, world: int, job: RankJob, size: int, directory: Path, reuse: str | None = None) -> None:
        """Fork the world's ranks with everything they share done once, here: the job unpickled, the test module
        compiled (its asserts rewritten), the store running and its port (which names the world's ``/dev/shm``
        buffers) written down. A world kept for this ``reuse`` scope and size runs the test instead, on its live
        ranks. A world whose directory pytest has already discarded (it gave up on it while the server prepared it)
        is not forked: pytest's ``Reap`` follows, and is answered as for any world."""
        if self.store.pid is None:
            self.store.start(self.conn, os.getpid())
        try:
            workdir.write_port(directory, self.store.port)
        except OSError as exc:  # pytest gave up on it while it was prepared here: its Reap follows
            print(f"pytest-dsrepro fork server: world {world} not started, its directory gone ({exc})", file=sys.stderr)
            return
        meeting = Meeting(self.store.port, world)
        code = self.modules.compiled(job.test)
        marshalled = None if code is None else marshal.dumps(code)
        started = self.kept.resume(reuse, size, NextTest(job, str(directory), meeting, marshalled))
        hazard = None
        if started is None:
            hazard = preload.hazard()
            if hazard is not None:  # never expected: told to pytest, which shows it in 'worlds ran on'
                print(f"pytest-dsrepro fork server: WARNING: forking world {world} with {hazard}", file=sys.stderr)
            freeze()  # what the server made since, too
            pids, links = start_world(job, size, directory, meeting, code, os.getpid(), self.conn, reuse is not None)
            started = ForkedWorld(tuple(pids), tuple(links), reuse)
        self.worlds[world] = started
        self._finished[world] = set()
        self.ranks.add(world, started.pids)
        preloaded = self.preloaded or (SEARCHING if self.scouted is not None else None)
        self.conn.send(Spawned(world, started.pids, preloaded, hazard, reused=started.reused))

    def links(self) -> dict[Connection, tuple[int, int]]:
        """The links of ranks in open reusable worlds that have not said Finished: link -> (world, rank)."""
        return {
            link: (world, rank)
            for world, w in self.worlds.items()
            for rank, link in enumerate(w.links)
            if rank not in self._finished.get(world, ())
        }

    def finished(self, link: Connection, world: int, rank: int) -> None:
        """A rank of a reusable world said it finished its test cleanly (``RankFinished``; end of file: it died, which
        its exit tells)."""
        try:
            said = link.recv()
        except (EOFError, OSError):
            said = None
        self._finished.setdefault(world, set()).add(rank)  # no longer waited on; reap() tells how a dead one ended
        if isinstance(said, RankFinished):
            self.conn.send(Finished(world, rank, said.at))

    def reap_world(self, world: int, keep: bool = False) -> None:
        """Kill what is left of the world, tell pytest how each rank ended, discard the directory, say ``Reaped``.
        ``keep``: a reusable world whose ranks all finished cleanly and live is kept instead, for the next test of
        its scope (its ``/dev/shm`` buffers too, which its ranks still map).

        The directory is discarded here, by the process that outlives the world, not left to pytest: a second Ctrl-C
        may cut pytest's own cleanup short, and a directory forgotten here would never be removed.
        """
        ending = self.worlds.pop(world, None)
        finished = self._finished.pop(world, set())
        kept = False
        if ending is not None:
            if keep and ending.links and len(finished) == len(ending.pids) and self._alive(ending):
                for pid in ending.pids:
                    self.ranks.pids.pop(pid, None)
                self.kept.keep(ending)
                kept = True
            else:
                self.end(ending)
                for link in ending.links:
                    link.close()
        directory = self.directories.pop(world, None)
        if directory is not None:
            workdir.discard(directory, buffers=not kept)
        self.conn.send(Reaped(world))

    def _alive(self, world: ForkedWorld) -> bool:
        """Every rank of the world still runs: none was told dead, nor died since."""
        return all(pid in self.ranks.pids for pid in world.pids) and world.whole()

    def _end_exited(self) -> None:
        """Each open world not kept between tests (no links) whose every rank has ended (exited, or was killed as
        pytest asked), each told by ``Exited``: what its ranks left is ended now (``end``), rank 0 reaped, and pytest
        told ``WorldEnded`` right after the last ``Exited``, so that it need not wait for ``Reaped``; the directory
        waits for pytest's ``Reap``."""
        for world, forked in list(self.worlds.items()):
            if not forked.links and not any(pid in self.ranks.pids for pid in forked.pids):
                del self.worlds[world]
                self._finished.pop(world, None)
                self.end(forked)
                self.conn.send(WorldEnded(world))

    def end(self, world: ForkedWorld) -> None:
        """Kill every process of ``world`` (``RankTable.end``), sparing the server's own children and other worlds."""
        own = {self.store.pid, *(c.child.pid for c in (self.scouted,) if c), *self.ops.spared()}
        self.ranks.end(world, own, {w.group for w in self.worlds.values()})

    def reap(self) -> None:
        """Tell the ends of ranks that exited (rank 0 of an open world without reaping it: it holds its group's id
        until the world is reaped); a store process that ended is replaced at the next world, a kept world whose rank
        died is ended. Processes that ranks left behind are reaped with their world."""
        self.ranks.poll({w.group for w in self.worlds.values()})
        self._end_exited()
        if self.store.pid is not None:
            done, _ = os.waitpid(self.store.pid, os.WNOHANG)
            if done:
                self.store.ended()
        self.kept.check()


def world_of(worlds: dict[int, ForkedWorld], pid: int) -> int | None:
    """The open world whose rank ``pid`` is, or descends from (a process a rank forked)."""
    import psutil

    lineage = {pid}
    with contextlib.suppress(psutil.Error):
        lineage |= {p.pid for p in psutil.Process(pid).parents()}
    return next((world for world, forked in worlds.items() if lineage & set(forked.pids)), None)
