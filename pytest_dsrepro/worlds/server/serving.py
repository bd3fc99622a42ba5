"""Runs in the fork server: its life, from ``python -m pytest_dsrepro.worlds.server FD PARENT_PID LOG [--scout]``
(``__main__``) to its exit, and its one loop over pytest's messages and its ranks' links.

Importing torch and DeepSpeed costs seconds; forking a process that already has them costs milliseconds. Every
world still gets brand-new rank processes, so nothing a test does leaks into the next. The server speaks the typed
messages of ``protocol`` over one socket; it forks every rank and is the only process that signals one. When it forks
it holds no thread, no CUDA context and no process group (``preload.hazard``, checked at start-up, after preloading
and at every world: docs/design.md, "Why a fork server"); how it ends is ``_clean_up``'s.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import os
import shutil
import signal
import sys
from multiprocessing.connection import Connection, wait
from pathlib import Path

from .. import shm, workdir
from ..prctl import PR_SET_CHILD_SUBREAPER, die_with_parent, prctl
from ..protocol import SCOUT_ARGUMENT, Building, Hello, ServerFacts
from . import builds, comm_op, preload
from .dispatch import OpenWorlds
from .reaping import kill_descendants
from .spawning import freeze
from .store import Store
from .warmup import prepare


def _child_exit_wakeups() -> int:
    """A file descriptor that becomes readable whenever a child exits, so the loop answers at once."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    return r


def serve(conn: Connection, worlds: OpenWorlds) -> None:
    """Answer pytest until it goes away; ``worlds.directories`` is left holding worlds never reaped."""
    wakeups = _child_exit_wakeups()
    while True:
        links = worlds.links()
        ops = worlds.ops.waitables()
        ready = wait([conn, wakeups, *links, *ops], timeout=1.0)
        if wakeups in ready:
            os.read(wakeups, 4096)
        for link in ready:
            if isinstance(link, Connection) and link in links:
                worlds.finished(link, *links[link])
        worlds.ops.take([r for r in ready if r in ops])  # requests for ops, and builds that ended
        if conn in ready:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return
            worlds.handle(message)
        worlds.reap()


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
    user_dir = os.environ.get("TORCH_EXTENSIONS_DIR")  # the user's own, before the comm op's sets it
    open_worlds: dict[int, Path] = {}
    store = Store()
    building: comm_op.Background | None = None
    worlds: OpenWorlds | None = None
    try:
        try:
            try:
                facts, scouted, building = prepare(lambda what: conn.send(Building(what)), scout)
                if facts.fatal is None:
                    freeze()
                    store.start(conn, os.getpid())  # the first fork: OpenBLAS ends its threads before any fork
                    facts = dataclasses.replace(facts, store_pid=store.pid, fork_hazard=preload.hazard())
            except builds.Unusable as exc:  # the cache cannot serve any world: the run stops, saying what to do
                facts = ServerFacts(pid=os.getpid(), torch="", fatal=str(exc), stops_run=True)
            except Exception as exc:  # noqa: BLE001 - told to pytest, which fails with the server's log
                # Not SystemExit: pytest's SIGTERM while the comm op builds must unwind the build (torch then
                # removes its build lock) and reach the cleanup below, which kills the compilers.
                facts = ServerFacts(pid=os.getpid(), torch="", fatal=f"{type(exc).__name__}: {exc}")
            conn.send(Hello(facts))
            if facts.fatal is None:
                worlds = OpenWorlds(conn, open_worlds, store, scouted, building, user_dir)
                serve(conn, worlds)
        finally:
            # When pytest dies, end of file and the parent-death SIGTERM come one right after the other: the signal
            # may still land here, before it is ignored, and only the outer block is sure to run to the end.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _clean_up(worlds, building, open_worlds, store)
        if os.getppid() != parent:  # nobody is left to read the log
            log.unlink(missing_ok=True)


def _clean_up(
    worlds: OpenWorlds | None, building: comm_op.Background | None, open_worlds: dict[int, Path], store: Store
) -> None:
    """At the server's end, however it came: every process it started killed (builds let go on spared), the worlds
    never reaped discarded, a kept world's buffers removed.

    End of file on the socket (pytest exited, even by SIGKILL) or SIGTERM (pytest stopping it, maybe mid-build) ends
    the server so: every process it started killed, compilers included; only the op builds that a run ended
    uninterrupted let go on (``FinishBuild``) outlive it. Ranks and the store die with the server (PR_SET_PDEATHSIG),
    and the server is a child subreaper, so even processes that ranks start are its children and get killed. Ctrl-C
    is pytest's to handle: the server ignores SIGINT."""
    if worlds is not None:  # unwound, a build's torch removes its baton; its compilers die next
        going_on = worlds.stop()  # but those let go on for later runs are spared, with their compilers
    else:  # the server ended before its first world: the comm op's build beside them too
        going_on = set()
        if building is not None:
            building.build.stop()
    kill_descendants(spared=going_on)
    shutil.rmtree(builds.scratch(os.getpid()), ignore_errors=True)  # a build cut short: its compilers' files
    for directory in open_worlds.values():  # pytest died mid-world: nothing of it may stay behind
        workdir.discard(directory)
    if store.port:  # a kept world's buffers, which no directory names any more
        shm.remove_world_buffers(workdir.LOOPBACK, store.port)
