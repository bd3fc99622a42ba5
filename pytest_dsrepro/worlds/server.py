"""The fork server: one preloaded interpreter per pytest process that forks fresh ranks for every world.

Importing torch and DeepSpeed costs seconds; forking a process that already has them costs milliseconds. Every
world still gets brand-new rank processes, so nothing a test does leaks into the next.

Started by the pytest process (``worlds.client``) as
``python -m pytest_dsrepro.worlds.server FD PARENT_PID LOG [--scout]``. It speaks the typed messages of
``worlds.protocol`` over one socket (``multiprocessing.connection`` framing):
    server -> pytest  Hello(facts) once ready; Spawned(world, pids); Exited(world, rank, returncode);
                      Finished(world, rank); Reaped(world)
    pytest -> server  Spawn(world, job, size, workdir, reuse); DumpStacks(world, ranks); Kill(world, ranks);
                      Reap(world, keep)
The server forks every rank and is the only process that signals one (it alone knows which pids are still its
unreaped ranks): pytest asks it to dump stacks (SIGUSR1, faulthandler) or to kill ranks, then to reap the world,
which the server answers with ``Reaped`` once every process of it is dead and its directory is gone.
End of file on the socket (pytest exited, even by SIGKILL) or SIGTERM (pytest stopping it, maybe mid-build) makes
the server kill every process it started, compilers included, discard the worlds not yet reaped, and exit.

A world of a reuse scope (``ds_world(reuse=True)``) may be kept after a clean test and run the scope's next test on
the same ranks, each test with a fresh process group (``Spawn.reuse``, ``Finished``, ``Reap.keep``; ``worlds.reuse``).

A world is one process per rank, in a process group of its own; they meet on the server's store process (one
TCPStore for every world, each under its own key prefix, forked once at start-up). What all ranks of a world share
is done once, before the fork: the job unpickled, the test module compiled with its asserts rewritten. Reaping a
world kills its process group, then whatever its ranks left among the server's children (no scan of every process
on the machine). Ranks and the store die with the server (PR_SET_PDEATHSIG), and the server is a child subreaper,
so even processes that ranks start are its children and get killed.

Fork safety: when the server forks, it holds no thread, no CUDA context and no process group (``preload.hazard``,
checked at start-up, after preloading, and at every world); its objects are frozen out of the garbage collector's
reach, so that a rank's collections do not copy the whole shared heap (``freeze``).

The rule on GPUs: the fork server never touches a CUDA context, nor lets an import do so, since a forked child of a
process that did cannot use CUDA (torch's bad-fork state). It never asks torch about devices (the pytest process
found them, ``devices.probe``), runs with torch's NVML-based availability check, and after preloading checks that a
forked child is not in the bad-fork state; where importing DeepSpeed put it there (releases before 0.19.8 with their
CUDA accelerator), it restarts without DeepSpeed, which each rank then imports after the fork (``devices``). There is
one server per DeepSpeed accelerator (``DS_ACCELERATOR``, chosen by the pytest process from the world's backend).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import faulthandler
import functools
import gc
import marshal
import os
import pickle
import shutil
import signal
import socket
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from types import CodeType

from ..core.options import default_cache_dir
from ..core.outcome import Status
from . import comm_op as extensions
from . import devices, shm, testmodule
from . import preload as preload_mod
from . import rank as rank_mod
from . import reuse as reuse_mod
from . import workdir as layout
from .protocol import (
    SCOUT_ARGUMENT,
    BuildEnded,
    Building,
    DumpStacks,
    Exited,
    FinishBuild,
    Finished,
    Hello,
    Kill,
    RankJob,
    Reap,
    Reaped,
    ServerFacts,
    Spawn,
    Spawned,
    TestRef,
)
from .rank import Meeting

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
#: What the user is told when the run's tests are over and a comm-op build beside the worlds is not.
FINISHING = "the tests are over: finishing DeepSpeed's CPU comm op for later runs (Ctrl-C stops it)"
STACK_SIGNAL = signal.SIGUSR1  # ranks dump every thread's Python stack on it
#: Connections the store's socket queues before it accepts them: every rank of the largest world at once.
STORE_BACKLOG = 4096
#: How long a SIGKILLed process may take to die before the reaping moves on (it is stuck in the kernel).
DEATH_WAIT = 5.0
#: Rounds of killing what ranks left behind: each round's dead hand their own children to the server.
REAP_ROUNDS = 5


def prctl(option: int, value: int) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def die_with_parent(parent: int, sig: int = signal.SIGKILL) -> None:
    prctl(PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def preload(
    announce: Callable[[str], None] = lambda _: None, scout: bool = False
) -> tuple[ServerFacts, preload_mod.Child | None, extensions.Background | None]:
    """Import what every rank imports, once: torch, DeepSpeed and pytest (a rank's fixes and skips use it; the rank
    code itself is imported with this module); load DeepSpeed's comm op, or start its first build beside the worlds
    (``comm_op.start``); report what is in play; leave DeepSpeed to the ranks where importing it poisoned this
    server's forks. Each import made here is one a forked rank does not pay again (pytest alone is ~80 ms per world).
    ``scout``: the first world uses DeepSpeed, so what its ranks will import is found meanwhile, in a child
    (``preload.scout``, collected by ``warm_for_deepspeed``), beside the comm op's loading or first build.

    Every fact is a builtin (``str(torch.__version__)``, not torch's version object), so that unpickling them in
    the pytest process imports nothing.
    """
    import pytest  # noqa: F401
    import torch

    # Devices are the pytest process's business (``devices.probe``): asking torch here would poison every fork.
    facts = ServerFacts(pid=os.getpid(), torch=str(torch.__version__))
    found = devices.deferred(default_cache_dir(), str(torch.__version__))
    if found is not None:
        return devices.without_deepspeed(facts, found), None, None
    try:
        import deepspeed
    except ImportError as exc:
        return dataclasses.replace(facts, deepspeed_error=f"{type(exc).__name__}: {exc}"), None, None
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    # Not on GPUs, where DeepSpeed may yet be left to the ranks (below).
    scouted = preload_mod.scout(*_install()) if scout and not devices.gpu_device_nodes() else None
    started = time.monotonic()
    comm_op, building = extensions.start(announce)
    if devices.gpu_device_nodes() and devices.poisoned_fork():
        devices.restart_without_deepspeed(
            devices.Deferred.of(deepspeed, accelerator), default_cache_dir(), str(torch.__version__)
        )
    return (
        dataclasses.replace(
            facts,
            deepspeed=str(deepspeed.__version__),
            deepspeed_path=os.path.dirname(os.path.realpath(deepspeed.__file__)),
            comm_op=comm_op,
            comm_op_seconds=round(time.monotonic() - started, 2),
            accelerator=str(accelerator.device_name()),
            accelerator_backend=str(accelerator.communication_backend_name()),
        ),
        scouted,
        building,
    )


def _marshal(code: CodeType | None) -> bytes | None:
    return None if code is None else marshal.dumps(code)


def freeze() -> None:
    """Move every object the server holds to the garbage collector's permanent generation.

    A forked rank shares the server's memory until it writes to it, and a collection writes to every object it
    traverses: a rank's first full collection would walk (and copy) the server's whole heap, more than a million
    objects once engine imports are preloaded, costing every rank of every world time and memory (and its exit the
    freeing of those copies). Frozen objects are never traversed again. Nothing is collected first: that would take
    a third of a second for a few dozen objects of import-time garbage, which may as well stay.
    """
    gc.freeze()


def _install() -> tuple[Path, str, str, Path]:
    """The cache directory and the DeepSpeed install (version, torch, where) that preload lists are kept for."""
    import deepspeed
    import torch

    return default_cache_dir(), str(deepspeed.__version__), str(torch.__version__), Path(deepspeed.__file__).parent


def warm_for_deepspeed(scouted: preload_mod.Child | None, announce: Callable[[str], None]) -> str:
    """Do what a rank's first DeepSpeed use would (``worlds.preload``: the imports of a first engine step, then the
    first-use work after them), once, before the first world whose test uses DeepSpeed: worlds that do not never pay
    for it, and however the test is written, its ranks start warm. ``scouted``: the child finding the imports,
    started beside the comm-op build (``preload``)."""
    from deepspeed.accelerator import get_accelerator

    preloaded = preload_mod.warm(*_install(), scouted, announce)
    if preloaded.stopped:
        return preloaded.describe()
    return f"{preloaded.describe()}; {preload_mod.first_use(str(get_accelerator().device_name()))}"


def _fork(
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
    if pid:
        if group is not None:
            with contextlib.suppress(OSError):  # the child may already have set it, or already be gone
                os.setpgid(pid, group or pid)
        return pid
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


def _into(workdir: Path, rank: int) -> None:
    """The rank's output and stack files are this world's: fds 1 and 2, and faulthandler's file."""
    sys.stdout.flush()
    sys.stderr.flush()
    out = os.open(layout.output_file(workdir, rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    for stream in (sys.stdout, sys.stderr):  # keep Python's prints in order with C-level writes to the same file
        stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    stack_file = open(layout.stack_file(workdir, rank), "w")  # noqa: SIM115 - must stay open for faulthandler
    faulthandler.register(STACK_SIGNAL, file=stack_file, all_threads=True)
    faulthandler.enable(file=stack_file, all_threads=True)  # a segfault or abort leaves the Python stack too


@dataclass(frozen=True)
class NextTest:
    """What a kept rank of a reusable world receives on its link for its next test (``code``: marshalled)."""

    job: RankJob
    workdir: str
    meeting: Meeting
    code: bytes | None


def _rank_body(
    job: RankJob,
    rank: int,
    size: int,
    workdir: Path,
    meeting: Meeting,
    code: CodeType | None,
    link: Connection | None = None,
) -> None:
    """One rank: its test, reported. A rank of a reusable world (``link``) that passed puts back what it had when it
    was forked (``worlds.reuse``), says it finished, and waits on its link for the next test of its scope; it exits
    after any other ending, or when the server closes its link."""
    baseline = reuse_mod.Baseline.take() if link is not None else None
    while True:
        _into(workdir, rank)
        report = rank_mod.run_rank(job, rank, size, meeting, code)
        layout.record_buffers(workdir, rank)
        if link is None or baseline is None or report.status is not Status.PASSED:
            layout.write_report(workdir, rank, report)
            return
        baseline.restore()
        layout.write_report(workdir, rank, report)
        link.send(time.monotonic())
        try:
            following: NextTest = link.recv()
        except (EOFError, OSError):
            return
        job, workdir, meeting = following.job, Path(following.workdir), following.meeting
        code = None if following.code is None else marshal.loads(following.code)


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
    the server's end of each rank's link."""
    pids: list[int] = []
    links: list[Connection] = []
    for r in range(size):
        theirs = None
        if reusable:
            a, b = socket.socketpair()
            links.append(Connection(a.detach()))
            theirs = Connection(b.detach())
        body = functools.partial(_rank_body, job, r, size, workdir, meeting, code, theirs)
        try:
            pids.append(_fork(conn, server_pid, body, group=pids[0] if pids else 0, theirs=links))
        finally:
            if theirs is not None:
                theirs.close()
    return pids, links


def _child_exit_wakeups() -> int:
    """A file descriptor that becomes readable whenever a child exits, so the loop answers at once."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    return r


class Store:
    """The TCPStore every world of this server meets on, in one child process forked once (``rank.serve_store``).

    Not in the server itself: a TCPStore serves from a thread of its own, and the server must hold none when it
    forks. Not one per world either: that costs a fork and a wait for its port in every world. Worlds keep apart
    under their own key prefixes, and DeepSpeed names its ``/dev/shm`` buffers after this port, which the server
    holds while it lives, so they are this server's (its worlds run one at a time and are reaped in between).
    """

    def __init__(self) -> None:
        self.pid: int | None = None
        self.port = 0

    def start(self, conn: Connection, server_pid: int) -> None:
        listener = socket.create_server((layout.LOOPBACK, 0), backlog=STORE_BACKLOG)
        self.port = listener.getsockname()[1]
        try:
            self.pid = _fork(conn, server_pid, functools.partial(rank_mod.serve_store, listener))
        finally:
            listener.close()

    def ended(self) -> None:
        """The store process was reaped: the next world starts a new one."""
        print("pytest-dsrepro fork server: the store process ended; the next world gets a new one", file=sys.stderr)
        self.pid = None


@dataclass(frozen=True)
class World:
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


def _exit_code(result: os.waitid_result) -> int:
    """``subprocess``'s convention: the exit status, or minus the signal that killed it."""
    return result.si_status if result.si_code == os.CLD_EXITED else -result.si_status


def children() -> list[int]:
    """This process's children (the server's own ranks, its store, and orphans adopted as a child subreaper), from
    the kernel's list for this process alone: no scan of every process on the machine."""
    found: list[int] = []
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/children") as f:
                found += [int(pid) for pid in f.read().split()]
    except OSError:  # no such list (CONFIG_PROC_CHILDREN is off): every process is scanned
        import psutil

        return [p.pid for p in psutil.Process().children()]
    return found


class Worlds:
    """The worlds this server started for pytest: their ranks' pids until reaped, their directories until reaped."""

    def __init__(
        self,
        conn: Connection,
        directories: dict[int, Path],
        store: Store,
        scouted: preload_mod.Child | None = None,
        building: extensions.Background | None = None,
    ) -> None:
        self.conn = conn
        self.directories = directories  # world -> directory; what is left here when pytest dies is discarded
        self.store = store
        self.worlds: dict[int, World] = {}
        self._ranks: dict[int, tuple[int, int]] = {}  # pid -> (world, rank), for ranks whose exit is not told yet
        self._code: dict[tuple[object, ...], CodeType] = {}  # test modules compiled for the ranks, by file version
        self.preloaded: str | None = None  # set by the first Spawn of a test that uses DeepSpeed
        self.scouted = scouted  # the child finding what that first Spawn imports, started before the comm-op build
        self.building = building  # DeepSpeed's comm op building beside the worlds, until adopted
        self.kept: World | None = None  # a reusable world's ranks, alive between two tests of its scope
        self._finished: dict[int, set[int]] = {}  # world -> its ranks that said Finished

    def handle(self, message: object) -> None:
        match message:
            case Spawn(world=world, job=job, size=size, workdir=workdir, reuse=reuse):
                self.directories[world] = Path(workdir)
                if self.building is not None and self.building.done():
                    self.conn.send(Building(self.adopt_build()))
                rank_job = pickle.loads(job)
                if rank_job.warm and self.preloaded is None and "deepspeed" in sys.modules:
                    self.preloaded = warm_for_deepspeed(self.scouted, lambda what: self.conn.send(Building(what)))
                    self.scouted = None
                self.spawn(world, rank_job, size, Path(workdir), reuse)
            case DumpStacks(world=world, ranks=ranks):
                self.signal(world, ranks, STACK_SIGNAL)
            case Kill(world=world, ranks=ranks):
                self.signal(world, ranks, signal.SIGKILL)
            case Reap(world=world, keep=keep):
                self.reap_world(world, keep)
            case FinishBuild():
                if self.building is not None and not self.building.done():
                    self.conn.send(Building(FINISHING))
                    self.building.wait()
                self.conn.send(BuildEnded(self.adopt_build() if self.building is not None else ""))
            case _:
                print(f"pytest-dsrepro fork server: ignored an unknown message {message!r}", file=sys.stderr)

    def adopt_build(self) -> str:
        """The comm op built beside the worlds, loaded here for the worlds forked from now on; what to tell the user."""
        assert self.building is not None
        said, self.building = self.building.adopt(), None
        return said

    def spawn(self, world: int, job: RankJob, size: int, workdir: Path, reuse: str | None = None) -> None:
        """Fork the world's ranks with everything they share done once, here: the job unpickled, the test module
        compiled, the store running and its port (which names the world's ``/dev/shm`` buffers) written down. A
        world kept for this ``reuse`` scope and size runs the test instead, on its live ranks."""
        if self.store.pid is None:
            self.store.start(self.conn, os.getpid())
        layout.write_port(workdir, self.store.port)
        meeting = Meeting(self.store.port, world)
        code = self.compiled(job.test)
        started = self._resume(self._kept_for(reuse, size), NextTest(job, str(workdir), meeting, _marshal(code)))
        hazard = None
        if started is None:
            hazard = preload_mod.hazard()
            if hazard is not None:  # never expected: told to pytest, which shows it in 'worlds ran on'
                print(f"pytest-dsrepro fork server: WARNING: forking world {world} with {hazard}", file=sys.stderr)
            freeze()  # what the server made since, too
            pids, links = start_world(job, size, workdir, meeting, code, os.getpid(), self.conn, reuse is not None)
            started = World(tuple(pids), tuple(links), reuse)
        self.worlds[world] = started
        self._finished[world] = set()
        self._ranks.update({pid: (world, rank) for rank, pid in enumerate(started.pids)})
        self.conn.send(Spawned(world, started.pids, self.preloaded, hazard, reused=started.reused))

    def _kept_for(self, reuse: str | None, size: int) -> World | None:
        """The kept world when it may run this test (same scope, same size, every rank alive); any other kept world
        is ended: one world at a time."""
        kept, self.kept = self.kept, None
        if kept is None:
            return None
        if reuse is not None and kept.reuse == reuse and len(kept.pids) == size and kept.whole():
            return kept
        self.discard_kept(kept)
        return None

    def _resume(self, kept: World | None, test: NextTest) -> World | None:
        """Hand the test to the kept world's ranks; None (the world ended) when one of them cannot take it."""
        if kept is None:
            return None
        try:
            for link in kept.links:
                link.send(test)
        except OSError:
            self.discard_kept(kept)
            return None
        return dataclasses.replace(kept, reused=True)

    def discard_kept(self, kept: World) -> None:
        """End a kept world: its ranks, their links, and the ``/dev/shm`` buffers DeepSpeed named after the store."""
        self.end(kept)
        for link in kept.links:
            link.close()
        shm.remove_world_buffers(layout.LOOPBACK, self.store.port)

    def links(self) -> dict[Connection, tuple[int, int]]:
        """The links of ranks in open reusable worlds that have not said Finished: link -> (world, rank)."""
        return {
            link: (world, rank)
            for world, w in self.worlds.items()
            for rank, link in enumerate(w.links)
            if rank not in self._finished.get(world, ())
        }

    def finished(self, link: Connection, world: int, rank: int) -> None:
        """A rank of a reusable world said it finished its test cleanly (end of file: it died, which its exit
        tells)."""
        try:
            at = link.recv()
        except (EOFError, OSError):
            self._finished.setdefault(world, set()).add(rank)  # no longer waited on; reap() tells how it ended
            return
        self._finished.setdefault(world, set()).add(rank)
        self.conn.send(Finished(world, rank, float(at)))

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

    def signal(self, world: int, ranks: tuple[int, ...], sig: int) -> None:
        """Only ranks whose exit was not told yet: their pids cannot have been recycled for another process."""
        for pid, (w, r) in self._ranks.items():
            if w == world and r in ranks:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)

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
                    self._ranks.pop(pid, None)
                if self.kept is not None:  # never expected: one world at a time
                    self.discard_kept(self.kept)
                self.kept, kept = dataclasses.replace(ending, reused=False), True
            else:
                self.end(ending)
                for link in ending.links:
                    link.close()
        directory = self.directories.pop(world, None)
        if directory is not None:
            layout.discard(directory, buffers=not kept)
        self.conn.send(Reaped(world))

    def _alive(self, world: World) -> bool:
        """Every rank of the world still runs: none was told dead, nor died since."""
        return all(pid in self._ranks for pid in world.pids) and world.whole()

    def end(self, world: World) -> None:
        """SIGKILL the world's process group and wait for its ranks; then whatever else they left among the server's
        children (processes they started, adopted by the server when their parent died: in the group, or gone
        elsewhere with setsid), round after round, since a dying process's children are adopted only as it dies.
        Rank 0, which holds the group's id, is reaped last."""
        leader = world.group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(leader, signal.SIGKILL)
        ranks = [pid for pid in world.pids if pid in self._ranks]  # not told yet, so not reaped: safe to signal
        for pid in ranks:  # one that left the group (setsid in a body) too
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._wait_dead([pid for pid in ranks if pid != leader])
        others = {w.group for w in self.worlds.values()}  # worlds still open (never more than one, in practice)
        own = {leader, self.store.pid, *(c.pid for c in (self.scouted, self.building and self.building.child) if c)}
        for _ in range(REAP_ROUNDS):
            strays = [pid for pid in children() if pid not in own and not self._of(pid, others)]
            if not strays:
                break
            for pid in strays:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(leader, signal.SIGKILL)  # whatever joined the group meanwhile
            self._wait_dead(strays)
        self._wait_dead([leader])

    def _of(self, pid: int, groups: set[int]) -> bool:
        try:
            return os.getpgid(pid) in groups
        except ProcessLookupError:
            return False

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
                    self._report(pid, os.waitstatus_to_exitcode(status))
            if left:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.0005)

    def _report(self, pid: int, returncode: int) -> None:
        ended = self._ranks.pop(pid, None)
        if ended is not None:
            world, rank = ended
            self.conn.send(Exited(world, rank, returncode, at=time.monotonic()))

    def reap(self) -> None:
        """Tell the ends of ranks that exited; rank 0 of a world only once it has ended, without reaping it (it holds
        its group's id until the world is reaped). Processes that ranks left behind are reaped with their world."""
        for pid, (world, _) in list(self._ranks.items()):
            open_world = self.worlds.get(world)
            if open_world is not None and pid == open_world.group:
                ended = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                if ended is not None and ended.si_pid == pid:
                    self._report(pid, _exit_code(ended))
                continue
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # never expected: only this loop and the world's reaping wait for ranks
                self._report(pid, -signal.SIGKILL)
                continue
            if done:
                self._report(pid, os.waitstatus_to_exitcode(status))
        if self.store.pid is not None:
            done, _ = os.waitpid(self.store.pid, os.WNOHANG)
            if done:
                self.store.ended()
        if self.kept is not None and not self.kept.whole():  # a kept rank died: nothing to keep
            self.discard_kept(self.kept)
            self.kept = None


def serve(
    conn: Connection,
    open_worlds: dict[int, Path],
    store: Store,
    scouted: preload_mod.Child | None = None,
    building: extensions.Background | None = None,
) -> None:
    """Answer pytest until it goes away. ``open_worlds`` (world -> directory) is left holding worlds never reaped."""
    worlds = Worlds(conn, open_worlds, store, scouted, building)
    wakeups = _child_exit_wakeups()
    while True:
        links = worlds.links()
        ready = wait([conn, wakeups, *links], timeout=1.0)
        if wakeups in ready:
            os.read(wakeups, 4096)
        for link in ready:
            if isinstance(link, Connection) and link in links:
                worlds.finished(link, *links[link])
        if conn in ready:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return
            worlds.handle(message)
        worlds.reap()


def kill_descendants(rounds: int = 5) -> list[tuple[int, int | None]]:
    """SIGKILL every process below the server and wait for them; ``(pid, returncode)`` of those it reaped.

    Several rounds: a process killed in one round may have started another (a compiler driver its next stage), and
    the grandchildren of a killed process are re-parented to the server (a child subreaper) only as it dies.
    """
    import psutil

    reaped: list[tuple[int, int | None]] = []
    for _ in range(rounds):
        procs = psutil.Process().children(recursive=True)
        if not procs:
            break
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        gone, _alive = psutil.wait_procs(procs, timeout=5)
        reaped += [(p.pid, getattr(p, "returncode", None)) for p in gone]  # psutil sets it on the processes gone
    return reaped


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main() -> None:
    """Serve until pytest goes away, clean up, then leave at once: the interpreter's own teardown of torch and
    DeepSpeed takes a second or more, and pytest waits for the server's exit."""
    code = 1
    try:
        run(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:] == [SCOUT_ARGUMENT])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - into the log, which pytest shows when the server failed
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run(fd: int, parent: int, log: Path, scout: bool = False) -> None:
    faulthandler.enable()  # a fatal signal (a damaged shared object's SIGBUS, say) leaves its stack in the log
    signal.signal(signal.SIGTERM, _exit_on_signal)
    die_with_parent(parent, signal.SIGTERM)  # not SIGKILL: the server must still clean up after its worlds
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is pytest's to handle; it then tears the world down
    conn = Connection(fd)
    open_worlds: dict[int, Path] = {}
    store = Store()
    scouted: preload_mod.Child | None = None
    building: extensions.Background | None = None
    try:
        try:
            try:
                facts, scouted, building = preload(lambda what: conn.send(Building(what)), scout)
                if facts.fatal is None:
                    freeze()
                    store.start(conn, os.getpid())  # the first fork: OpenBLAS ends its threads before any fork
                    facts = dataclasses.replace(facts, store_pid=store.pid, fork_hazard=preload_mod.hazard())
            except extensions.Unusable as exc:  # the cache cannot serve any world: the run stops, saying what to do
                facts = ServerFacts(pid=os.getpid(), torch="", fatal=str(exc), stops_run=True)
            except Exception as exc:  # noqa: BLE001 - told to pytest, which fails with the server's log
                # Not SystemExit: pytest's SIGTERM while the comm op builds must unwind the build (torch then
                # removes its build lock) and reach the cleanup below, which kills the compilers.
                facts = ServerFacts(pid=os.getpid(), torch="", fatal=f"{type(exc).__name__}: {exc}")
            conn.send(Hello(facts))
            if facts.fatal is None:
                serve(conn, open_worlds, store, scouted, building)
        finally:
            # When pytest dies, end of file and the parent-death SIGTERM come one right after the other: the signal
            # may still land here, before it is ignored, and only the outer block is sure to run to the end.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if building is not None:  # unwound, the build's torch removes its build lock; its compilers die next
            building.stop()
        kill_descendants()
        shutil.rmtree(extensions.scratch(os.getpid()), ignore_errors=True)  # a build cut short: its compilers' files
        for directory in open_worlds.values():  # pytest died mid-world: nothing of it may stay behind
            layout.discard(directory)
        if store.port:  # a kept world's buffers, which no directory names any more
            shm.remove_world_buffers(layout.LOOPBACK, store.port)
        if os.getppid() != parent:  # nobody is left to read the log
            log.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
