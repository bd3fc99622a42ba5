"""Runs in the fork server: forking its children (a world's ranks, its store process) with what they share done
once, before the fork: the test module compiled, the server's heap frozen out of the collector's reach.

A world is one process per rank, in a process group of its own that rank 0 leads. A child never unwinds into the
server's loop: it runs its body and exits (``fork_child``); what a rank does is ``rank.spawned_rank``'s.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import signal
import socket
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from types import CodeType
from typing import NoReturn

from ..prctl import die_with_parent
from ..protocol import Meeting, RankJob, TestRef
from ..rank import testmodule
from ..rank.reuse_reset import Baseline
from ..rank.spawned_rank import rank_life


def freeze() -> None:
    """Move every object the server holds to the garbage collector's permanent generation.

    A forked rank shares the server's memory until it writes to it, and a collection writes to every object it
    traverses: a rank's first full collection would walk (and copy) the server's whole heap, more than a million
    objects once engine imports are preloaded, costing every rank of every world time and memory (and its exit the
    freeing of those copies). Frozen objects are never traversed again. Nothing is collected first: that would take
    a third of a second for a few dozen objects of import-time garbage, which may as well stay.
    """
    gc.freeze()


def fork_child(
    conn: Connection,
    server_pid: int,
    body: Callable[[], None],
    group: int | None = None,
    theirs: Sequence[Connection] = (),
) -> int:
    """Fork a child of the server that runs ``body`` and exits; it never unwinds into the server's loop. ``group``:
    the process group it joins (0: a new one it leads); the parent sets it too, so neither can act before it is set.
    ``theirs``: the server's ends of reusable ranks' links, which the child closes (a rank must see its link's end
    of file when the server closes its end).
    """
    sys.stdout.flush()  # or the child would inherit, and later write, whatever the server had buffered
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _child(conn, server_pid, body, group, theirs)
    if group is not None:
        with contextlib.suppress(OSError):  # the child may already have set it, or already be gone
            os.setpgid(pid, group or pid)
    return pid


def _child(
    conn: Connection, server_pid: int, body: Callable[[], None], group: int | None, theirs: Sequence[Connection]
) -> NoReturn:
    """The forked child: the server's socket, links and signal handling left behind, dying with the server, ``body``
    run, then its exit (70 when the body raised, its traceback in the output file)."""
    code = 70
    try:
        if group is not None:
            os.setpgid(0, group)
        conn.close()
        for link in theirs:
            link.close()
        die_with_parent(server_pid)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        body()
        code = 0
    except BaseException:  # noqa: BLE001 - reported through the output file, and the missing result
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a body may have closed them: it exits all the same
                stream.flush()
        os._exit(code)


def start_world(
    job: RankJob,
    size: int,
    workdir: Path,
    meeting: Meeting,
    code: CodeType | None,
    server_pid: int,
    conn: Connection,
    reusable: bool = False,
) -> tuple[list[int], list[Connection]]:
    """Fork the world's ranks, in a process group of their own led by rank 0; their pids, and for a reusable world
    the server's end of each rank's link (and what its ranks put back between two tests, taken here, in the server's
    memory, which they share: ``Baseline.take``)."""
    pids: list[int] = []
    links: list[Connection] = []
    baseline = None
    if reusable:
        baseline = Baseline.take()
        freeze()  # what it saved too
    for r in range(size):
        theirs = None
        if reusable:
            a, b = socket.socketpair()
            links.append(Connection(a.detach()))
            theirs = Connection(b.detach())
        body = functools.partial(rank_life, job, r, size, workdir, meeting, code, theirs, baseline)
        try:
            pids.append(fork_child(conn, server_pid, body, group=pids[0] if pids else 0, theirs=links))
        finally:
            if theirs is not None:
                theirs.close()
    return pids, links


@dataclass(frozen=True)
class ForkedWorld:
    """One world the server forked: its ranks, in a process group of their own that rank 0 leads.

    Rank 0 stays unreaped (a zombie once it exits, after its exit has been told) until the world is reaped: while its
    pid is held, the group's id cannot be given to another process, so signalling the group cannot hit a stranger.
    """

    pids: tuple[int, ...]
    links: tuple[Connection, ...] = ()  # a reusable world's: each rank's, for its next test and its Finished
    reuse: str | None = None  # the scope it may be kept for (``Spawn.reuse``)
    reused: bool = False  # its ranks ran an earlier test of the scope

    @property
    def group(self) -> int:
        return self.pids[0]

    def whole(self) -> bool:
        """Is every rank still alive (a kept world's, whose ends no one else waits for)?"""
        return all(os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None for pid in self.pids)


class TestModules:
    """Test modules compiled for the ranks, once per file version, by every world that imports them."""

    __test__ = False  # not a test class, whatever pytest's collection patterns say

    def __init__(self) -> None:
        self._code: dict[tuple[object, ...], CodeType] = {}

    def compiled(self, test: TestRef) -> CodeType | None:
        """The test module's code for every rank of every world that imports it, compiled once per file version.
        None when it does not compile cleanly: each rank then compiles it itself and reports what is wrong."""
        try:
            st = os.stat(test.module_file)
            key = (test.module_file, test.rewrite_asserts, st.st_ino, st.st_size, st.st_mtime_ns)
            if key not in self._code:
                with open(test.module_file, "rb") as f:
                    source = f.read()
                with warnings.catch_warnings(record=True) as warned:  # told by the ranks, where the user reads them
                    warnings.simplefilter("always")
                    code = testmodule.compile_source(test.module_file, source, rewrite=test.rewrite_asserts)
                if warned:
                    return None
                self._code[key] = code
            return self._code[key]
        except Exception:  # noqa: BLE001 - a SyntaxError, a vanished file: the ranks report it
            return None
