"""Runs in the fork server: the only process that signals a rank, and the one that reaps every process of a world.

The server is a child subreaper, so even the processes ranks start are its children: ending a world kills its
process group, then whatever its ranks left among the server's children (no scan of every process on the machine).
Each rank's end is told to pytest once (``Exited``); until then its pid cannot name another process, and rank 0,
whose pid is the group's id, is reaped last. Before it kills a rank (and the processes it started), the server reads
which of DeepSpeed's ``/dev/shm`` buffers they map, whatever port named them, and removes every buffer of those
process groups once the world is dead (``shm``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Collection, Iterable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from .. import shm
from ..protocol import Exited
from .spawning import ForkedWorld

#: How long a SIGKILLed process may take to die before the reaping moves on (it is stuck in the kernel).
DEATH_WAIT = 5.0


#: Rounds of killing what ranks left behind: each round's dead hand their own children to the server.
REAP_ROUNDS = 5


def _exit_code(result: os.waitid_result) -> int:
    """``subprocess``'s convention: the exit status, or minus the signal that killed it."""
    return result.si_status if result.si_code == os.CLD_EXITED else -result.si_status


def _children_of(pid: int | str) -> list[int]:
    """The children of process ``pid`` (``"self"``), from the kernel's list of each of its threads; ``OSError`` where
    there is no such list (the process is gone, or CONFIG_PROC_CHILDREN is off)."""
    found: list[int] = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            found += [int(child) for child in f.read().split()]
    return found


def children() -> list[int]:
    """This process's children (the server's own ranks, its store, and orphans adopted as a child subreaper), from
    the kernel's list for this process alone: no scan of every process on the machine."""
    try:
        return _children_of("self")
    except OSError:  # no such list: every process is scanned
        import psutil

        return [p.pid for p in psutil.Process().children()]


def kill_descendants(rounds: int = 5, spared: Collection[int] = ()) -> list[tuple[int, int | None]]:
    """SIGKILL every process below the server and wait for them; ``(pid, returncode)`` of those it reaped. ``spared``:
    children left to go on after the server with their own children (builds, ``builds.BuildChild.detach``). The
    DeepSpeed buffers they mapped go with them.

    Several rounds: a process killed in one round may have started another (a compiler driver its next stage), and
    the grandchildren of a killed process are re-parented to the server (a child subreaper) only as it dies.
    """
    import psutil

    reaped: list[tuple[int, int | None]] = []
    buffers: set[Path] = set()
    for _ in range(rounds):
        procs = [p for p in psutil.Process().children() if p.pid not in spared]
        procs += [d for p in procs for d in _descendants(p)]
        if not procs:
            break
        buffers |= shm.mapped_by(p.pid for p in procs)
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        gone, _alive = psutil.wait_procs(procs, timeout=5)
        reaped += [(p.pid, getattr(p, "returncode", None)) for p in gone]  # psutil sets it on the processes gone
    shm.remove(shm.group_buffers(buffers))
    return reaped


def _tree(pids: Iterable[int]) -> list[int]:
    """These processes and every process below them, from the kernel's lists of each one's children."""
    found: list[int] = []
    todo = list(pids)
    while todo:
        pid = todo.pop()
        found.append(pid)
        with contextlib.suppress(OSError):
            todo += [child for child in _children_of(pid) if child not in found]
    return found


def _descendants(process: Any) -> list[Any]:
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):
        return list(process.children(recursive=True))
    return []


class RankTable:
    """The ranks whose end pytest has not been told yet (pid -> world, rank): only they may be signalled, since a pid
    told is reaped, and may name another process."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.pids: dict[int, tuple[int, int]] = {}
        self.buffers: dict[int, set[Path]] = {}  # process group -> DeepSpeed buffers its killed processes mapped

    def add(self, world: int, pids: Sequence[int]) -> None:
        self.pids.update({pid: (world, rank) for rank, pid in enumerate(pids)})

    def signal(self, world: int, ranks: tuple[int, ...], sig: int, group: int | None = None) -> None:
        """Only ranks whose exit was not told yet: their pids cannot have been recycled for another process. Before
        a SIGKILL, the DeepSpeed buffers the ranks (and what they started) map are noted for the end of the world
        whose process group is ``group`` (None: a world no longer open)."""
        pids = [pid for pid, (w, r) in self.pids.items() if w == world and r in ranks]
        if sig == signal.SIGKILL and group is not None:
            self.buffers.setdefault(group, set()).update(shm.mapped_by(_tree(pids)))
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def tell(self, pid: int, returncode: int) -> None:
        ended = self.pids.pop(pid, None)
        if ended is not None:
            world, rank = ended
            self.conn.send(Exited(world, rank, returncode, at=time.monotonic()))

    def poll(self, leaders: set[int]) -> None:
        """Tell the ends of ranks that exited; a world's rank 0 (one of ``leaders``) only once it has ended, without
        reaping it (it holds its group's id until the world is reaped)."""
        for pid in list(self.pids):
            if pid in leaders:
                ended = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                if ended is not None and ended.si_pid == pid:
                    self.tell(pid, _exit_code(ended))
                continue
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # never expected: only this loop and the world's reaping wait for ranks
                self.tell(pid, -signal.SIGKILL)
                continue
            if done:
                self.tell(pid, os.waitstatus_to_exitcode(status))

    def end(self, world: ForkedWorld, spared: set[int | None], others: set[int]) -> None:
        """SIGKILL the world's process group and wait for its ranks; then whatever else they left among the server's
        children (processes they started, adopted by the server when their parent died: in the group, or gone
        elsewhere with setsid), round after round, since a dying process's children are adopted only as it dies.
        Rank 0, which holds the group's id, is reaped last. ``spared``: the server's own children (its store, a
        build); ``others``: the process groups of worlds still open. Then every DeepSpeed buffer of the process groups
        whose buffers they mapped, read before they were killed (the world's own port's go with its directory)."""
        leader = world.group
        ranks = [pid for pid in world.pids if pid in self.pids]  # not told yet, so not reaped: safe to signal
        ours = set(children())  # a kept world's ranks too, which no one waits for: none was reaped, none recycled
        buffers = self.buffers.pop(leader, set()) | shm.mapped_by(_tree(p for p in world.pids if p in ours))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(leader, signal.SIGKILL)
        for pid in ranks:  # one that left the group (setsid in a body) too
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._wait_dead([pid for pid in ranks if pid != leader])
        own = {leader, *spared}
        for _ in range(REAP_ROUNDS):
            strays = [pid for pid in children() if pid not in own and not _in_group(pid, others)]
            if not strays:
                break
            buffers |= shm.mapped_by(strays)
            for pid in strays:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(leader, signal.SIGKILL)  # whatever joined the group meanwhile
            self._wait_dead(strays)
        self._wait_dead([leader])
        shm.remove(shm.group_buffers(buffers))

    def _wait_dead(self, pids: list[int]) -> None:
        """Reap these (SIGKILLed) children, telling the ranks' ends; a process the kernel cannot end within
        ``DEATH_WAIT`` (stuck in the kernel) is left to the next round, or to the server's exit."""
        left = set(pids)
        deadline = time.monotonic() + DEATH_WAIT
        while left:
            for pid in list(left):
                try:
                    done, status = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    left.discard(pid)
                    continue
                if done:
                    left.discard(pid)
                    self.tell(pid, os.waitstatus_to_exitcode(status))
            if left:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.0005)


def _in_group(pid: int, groups: set[int]) -> bool:
    try:
        return os.getpgid(pid) in groups
    except ProcessLookupError:
        return False
