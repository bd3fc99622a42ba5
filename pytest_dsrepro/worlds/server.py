"""The fork server: one preloaded interpreter per pytest process that forks fresh ranks for every world.

Importing torch and DeepSpeed costs seconds; forking a process that already has them costs milliseconds. Every
world still gets brand-new rank processes, so nothing a test does leaks into the next.

Started by the pytest process (``worlds.client``) as ``python -m pytest_dsrepro.worlds.server FD PARENT_PID LOG``.
It speaks the typed messages of ``worlds.protocol`` over one socket (``multiprocessing.connection`` framing):
    server -> pytest  Hello(facts) once ready; Spawned(world, pids); Exited(world, rank, returncode); Reaped(world)
    pytest -> server  Spawn(world, job, size, workdir); DumpStacks(world, ranks); Kill(world, ranks); Reap(world)
The server forks every rank and is the only process that signals one (it alone knows which pids are still its
unreaped ranks): pytest asks it to dump stacks (SIGUSR1, faulthandler) or to kill ranks, then to reap the world,
which the server answers with ``Reaped`` once every process of it is dead and its directory is gone.
End of file on the socket (pytest exited, even by SIGKILL) or SIGTERM (pytest stopping it, maybe mid-build) makes
the server kill every process it started, compilers included, discard the worlds not yet reaped, and exit.
Each world is a store process (its TCPStore) and one process per rank. They die with the server
(PR_SET_PDEATHSIG), and the server is a child subreaper, so even processes that ranks
start are its children and get killed.

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
import os
import pickle
import signal
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from pathlib import Path

from ..core.options import default_cache_dir
from . import comm_op as extensions
from . import devices
from . import workdir as layout
from .preload import warm as preload_rank_imports
from .protocol import Building, DumpStacks, Exited, Hello, Kill, Reap, Reaped, ServerFacts, Spawn, Spawned

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
STACK_SIGNAL = signal.SIGUSR1  # ranks dump every thread's Python stack on it


def _prctl(option: int, value: int) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def die_with_parent(parent: int, sig: int = signal.SIGKILL) -> None:
    _prctl(PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def preload(announce: Callable[[str], None] = lambda _: None) -> ServerFacts:
    """Import what every rank imports, once: torch, DeepSpeed, pytest (a rank's fixes and skips use it) and the rank
    code itself; build DeepSpeed's comm op; report what is in play; leave DeepSpeed to the ranks where importing it
    poisoned this server's forks. Each import made here
    is one a forked rank does not pay again (pytest alone is ~80 ms per world).

    Every fact is a builtin (``str(torch.__version__)``, not torch's version object), so that unpickling them in
    the pytest process imports nothing.
    """
    import pytest  # noqa: F401
    import torch

    from . import rank  # noqa: F401

    # Devices are the pytest process's business (``devices.probe``): asking torch here would poison every fork.
    facts = ServerFacts(pid=os.getpid(), torch=str(torch.__version__))
    found = devices.deferred(default_cache_dir(), str(torch.__version__))
    if found is not None:
        return devices.without_deepspeed(facts, found)
    try:
        import deepspeed
    except ImportError as exc:
        return dataclasses.replace(facts, deepspeed_error=f"{type(exc).__name__}: {exc}")
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    started = time.monotonic()
    comm_op = extensions.warm_up(announce)
    if devices.gpu_device_nodes() and devices.poisoned_fork():
        devices.restart_without_deepspeed(
            devices.Deferred.of(deepspeed, accelerator), default_cache_dir(), str(torch.__version__)
        )
    return dataclasses.replace(
        facts,
        deepspeed=str(deepspeed.__version__),
        deepspeed_path=os.path.dirname(os.path.realpath(deepspeed.__file__)),
        comm_op=comm_op,
        comm_op_seconds=round(time.monotonic() - started, 2),
        accelerator=str(accelerator.device_name()),
        accelerator_backend=str(accelerator.communication_backend_name()),
    )


def preload_for_engines() -> str:
    """Import what a rank's first DeepSpeed engine step needs (``worlds.preload``), once, before the first world that
    builds engines: worlds that do not never pay for it."""
    import deepspeed
    import torch

    where = Path(deepspeed.__file__).parent
    return preload_rank_imports(
        default_cache_dir(), str(deepspeed.__version__), str(torch.__version__), where
    ).describe()


def _fork(conn: Connection, server_pid: int, body: Callable[[], None]) -> int:
    """Fork a child of the server that runs ``body`` and exits; it never unwinds into the server's loop."""
    sys.stdout.flush()  # or the child would inherit, and later write, whatever the server had buffered
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 70
    try:
        conn.close()
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
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _rank_body(job: bytes, rank: int, size: int, workdir: Path) -> None:
    out = os.open(layout.output_file(workdir, rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    for stream in (sys.stdout, sys.stderr):  # keep Python's prints in order with C-level writes to the same file
        stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    stack_file = open(layout.stack_file(workdir, rank), "w")  # noqa: SIM115 - must stay open for faulthandler
    faulthandler.register(STACK_SIGNAL, file=stack_file, all_threads=True)
    faulthandler.enable(file=stack_file, all_threads=True)  # a segfault or abort leaves the Python stack too
    from . import rank as rank_mod

    layout.write_report(workdir, rank, rank_mod.run_rank(pickle.loads(job), rank, size, workdir))


def start_world(job: bytes, size: int, workdir: Path, server_pid: int, conn: Connection) -> list[int]:
    """The world's store process, then its ranks; returns the ranks' pids."""
    from . import rank as rank_mod

    _fork(conn, server_pid, lambda: rank_mod.serve_store(workdir, size))
    return [_fork(conn, server_pid, lambda r=r: _rank_body(job, r, size, workdir)) for r in range(size)]  # type: ignore[misc]


def _child_exit_wakeups() -> int:
    """A file descriptor that becomes readable whenever a child exits, so the loop answers at once."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    return r


class Worlds:
    """The worlds this server started for pytest: their ranks' pids until reaped, their directories until reaped."""

    def __init__(self, conn: Connection, directories: dict[int, Path]) -> None:
        self.conn = conn
        self.directories = directories  # world -> directory; what is left here when pytest dies is discarded
        self._ranks: dict[int, tuple[int, int]] = {}  # pid -> (world, rank), for ranks not reaped yet
        self.preloaded: str | None = None  # set by the first Spawn that asks for preloading

    def handle(self, message: object) -> None:
        match message:
            case Spawn(world=world, job=job, size=size, workdir=workdir, preload=preload):
                self.directories[world] = Path(workdir)
                if preload and self.preloaded is None and "deepspeed" in sys.modules:
                    self.preloaded = preload_for_engines()
                pids = start_world(job, size, Path(workdir), os.getpid(), self.conn)
                self._ranks.update({pid: (world, rank) for rank, pid in enumerate(pids)})
                self.conn.send(Spawned(world, tuple(pids), self.preloaded))
            case DumpStacks(world=world, ranks=ranks):
                self.signal(world, ranks, STACK_SIGNAL)
            case Kill(world=world, ranks=ranks):
                self.signal(world, ranks, signal.SIGKILL)
            case Reap(world=world):
                self.reap_world(world)
            case _:
                print(f"pytest-dsrepro fork server: ignored an unknown message {message!r}", file=sys.stderr)

    def signal(self, world: int, ranks: tuple[int, ...], sig: int) -> None:
        """Only ranks not reaped yet: their pids cannot have been recycled for another process."""
        for pid, (w, r) in self._ranks.items():
            if w == world and r in ranks:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)

    def reap_world(self, world: int) -> None:
        """Kill what is left of the world, tell pytest how each rank ended, discard the directory, say ``Reaped``.

        The directory is discarded here, by the process that outlives the world, not left to pytest: a second Ctrl-C
        may cut pytest's own cleanup short, and a directory forgotten here would never be removed.
        """
        for pid, returncode in kill_descendants():
            self._report(pid, returncode)
        self.reap()  # ranks that ended on their own before the kill
        directory = self.directories.get(world)
        if directory is not None:
            layout.discard(directory)
            del self.directories[world]
        self.conn.send(Reaped(world))

    def _report(self, pid: int, returncode: int | None) -> None:
        ended = self._ranks.pop(pid, None)
        if ended is not None:
            world, rank = ended
            code = -signal.SIGKILL if returncode is None else returncode
            self.conn.send(Exited(world, rank, code, at=time.monotonic()))

    def reap(self) -> None:
        """Reap whatever ended: ranks are reported, orphans they left behind are just reaped."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self._report(pid, os.waitstatus_to_exitcode(status))


def serve(conn: Connection, open_worlds: dict[int, Path]) -> None:
    """Answer pytest until it goes away. ``open_worlds`` (world -> directory) is left holding worlds never reaped."""
    worlds = Worlds(conn, open_worlds)
    wakeups = _child_exit_wakeups()
    while True:
        ready = wait([conn, wakeups], timeout=1.0)
        if wakeups in ready:
            os.read(wakeups, 4096)
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
    fd, parent, log = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    signal.signal(signal.SIGTERM, _exit_on_signal)
    die_with_parent(parent, signal.SIGTERM)  # not SIGKILL: the server must still clean up after its worlds
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is pytest's to handle; it then tears the world down
    conn = Connection(fd)
    open_worlds: dict[int, Path] = {}
    try:
        try:
            try:
                facts = preload(lambda what: conn.send(Building(what)))
            except Exception as exc:  # noqa: BLE001 - told to pytest, which fails with the server's log
                # Not SystemExit: pytest's SIGTERM while the comm op builds must unwind the build (torch then
                # removes its build lock) and reach the cleanup below, which kills the compilers.
                facts = ServerFacts(pid=os.getpid(), torch="", fatal=f"{type(exc).__name__}: {exc}")
            conn.send(Hello(facts))
            if facts.fatal is None:
                serve(conn, open_worlds)
        finally:
            # When pytest dies, end of file and the parent-death SIGTERM come one right after the other: the signal
            # may still land here, before it is ignored, and only the outer block is sure to run to the end.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        kill_descendants()
        for directory in open_worlds.values():  # pytest died mid-world: nothing of it may stay behind
            layout.discard(directory)
        if os.getppid() != parent:  # nobody is left to read the log
            log.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
