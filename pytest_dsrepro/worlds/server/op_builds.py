"""Runs in the fork server, its build children and the ranks it forks: every op that DeepSpeed JIT-builds in a rank
(``OpBuilder.jit_load``), built by the server as the comm op is (``builds``). Left to DeepSpeed, a rank builds on
its test's clock (minutes on a busy machine, so the world's timeout could stop it every time, leaving torch's baton
for every later build to wait on); here a rank asks the server (``Wanted``, answered by ``Got``: the op channel of
``protocol``), whose child builds beside the worlds, keyed by content in the cache, while the world's clock stops.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from types import ModuleType
from typing import Any

from ..protocol import Building, Got, OpWait, Wanted
from . import builds

# How: the server builds in a child (``builds.BuildChild``: the op's own directory, under the cache's file lock, its
# baton removed there, a damaged build discarded and built again), which no world's end stops; a user's
# ``TORCH_EXTENSIONS_DIR`` is built in by torch's JIT in the same child. While a rank of a world waits, the world's
# clock stops (``OpWait`` to pytest). Once built, the server loads the op itself (later worlds inherit it) and answers
# every waiting rank; a failed build is each one's ``RuntimeError``, as DeepSpeed's JIT raises it. A build still
# running when the run ends goes on apart for later runs (``OpBuilds.leave``); one cut short leaves nothing. The comm
# op is one of these builds: started before the first world (``comm_op.start``), handed here
# (``OpBuilds.adopt_comm_op``).

#: How long a build may run before the server says it builds (a cached op is found and checked in about a second).
QUIET = 3.0
#: How long a first build of an op takes when the cache has no earlier one to tell (cpu_adam, fused_adam: 2 quiet
#: cores).
USUALLY = "usually 40-90 s"


#: In the fork server and the ranks it forks: ``(address, server pid)`` of the server's socket (``OpBuilds``).
_serving: tuple[str, int] | None = None
#: DeepSpeed's own ``OpBuilder.jit_load``, for the processes that build (``install``).
_original: Callable[..., Any] | None = None


def install(address: str, server: int) -> None:
    """In the fork server, once DeepSpeed is imported: every process it forks from now on asks it for the ops that
    DeepSpeed would JIT-build there. The server itself and its build children keep DeepSpeed's own ``jit_load``. A
    DeepSpeed with no op builder (a commit older than ``deepspeed.ops.op_builder``, as ``dsrepro bisect`` may install)
    has nothing to build: its ranks run as it is."""
    global _serving, _original
    try:
        from deepspeed.ops.op_builder.builder import OpBuilder
    except ImportError:
        return

    _serving = (address, server)
    if _original is not None:
        return
    _original = OpBuilder.jit_load

    def jit_load(self: Any, verbose: bool = True) -> Any:
        if _serving is None or os.getpid() == _serving[1] or builds.in_builder():
            return _jit(self, verbose)
        return fetch(self)

    OpBuilder.jit_load = jit_load


def _jit(builder: Any, verbose: bool = False) -> Any:
    """DeepSpeed's own JIT build and load of ``builder``'s op, in this process."""
    assert _original is not None
    return _original(builder, verbose)


def fetch(builder: Any) -> ModuleType:
    """In a rank: the op of ``builder`` as the fork server built it (or already had it), loaded here and put where
    DeepSpeed's ``load()`` finds it. ``RuntimeError`` with the server's reason when it could not be built."""
    assert _serving is not None
    cls = type(builder)
    wanted = Wanted(cls.__module__, cls.__qualname__, builder.name, os.getpid())
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(_serving[0])
    with Connection(sock.detach()) as conn:
        conn.send(wanted)
        got = conn.recv()
    if got.library is None:
        raise RuntimeError(got.error)
    module = builds.import_library(Path(got.library), builder.name)
    builds.register(builder, module)
    return module


def load_built(cache_dir: Path, user_dir: str | None) -> str | None:
    """In the fork server, on the CPU accelerator (``preload.first_use``): every op already built in the cache for
    this install (its keyed directory), loaded here, so that no rank forked from now on asks for it. Ops in a user's
    ``TORCH_EXTENSIONS_DIR`` are left to the ranks' asking: torch's JIT decides there whether they are current."""
    import deepspeed.ops
    from deepspeed.ops.op_builder.all_ops import ALL_OPS

    if user_dir:
        return None
    loaded = []
    for name, builder in sorted(ALL_OPS.items()):
        if builder is None or deepspeed.ops.__compatible_ops__.get(name) is False or name in builder._loaded_ops:
            continue  # switched off: the comm op while it builds beside the worlds
        if not builds.holds_builds(cache_dir, builder.name):
            continue  # never built here: its key (every source and header hashed) is not worth computing
        try:
            library = builds.shared_library(builds.keyed_directory(cache_dir, builder), name)
            if library.exists() and builds.damage(library, name) is None:
                builds.register(builder, builds.import_library(library, name))
                loaded.append(name)
        except Exception:  # noqa: BLE001 - an optimisation: a rank that needs the op asks for it, and hears why
            continue
    return f"ops loaded: {', '.join(loaded)}" if loaded else None


# ---- in the build child -------------------------------------------------------------------------------------------


def _resolve(module: str, qualname: str) -> Any:
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


def ensure(wanted: Wanted, cache_dir: str, user_dir: str | None) -> dict[str, Any]:
    """In a build child: the op's build, loaded from the cache if it is there and loads, else built (under the
    directory's lock, torch's baton removed); its library, and what to tell the user. A failure is kept in the op's
    directory for the next run to say, and returned as the ranks' error."""
    import deepspeed
    from filelock import FileLock

    builder = _resolve(wanted.module, wanted.qualname)()
    what = f"DeepSpeed's {builder.name} op for {deepspeed.__version__}"
    directory = Path(user_dir) if user_dir else builds.keyed_directory(Path(cache_dir), builder)
    library = builds.shared_library(directory, builder.name)
    said: list[str] = []
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with FileLock(directory / builds.BUILD_LOCK, timeout=builds.BUILD_LOCK_TIMEOUT):
            builds.remove_stale_locks(directory, builder.name)
            failed = builds.said_failure(directory)
            if failed is not None:
                said.append(f"the last build of {what} failed ({failed}): building it again")
            if builds.sound(library, builder.name, said.append, what) and not user_dir:
                return {"library": str(library), "said": said, "built": False}
            os.environ["TORCH_EXTENSIONS_DIR"] = str(directory)  # torch's JIT builds there (a user's: it decides)
            with builds.compilers_scratch(), builds.timed(directory):
                _jit(builder)
    except Exception as exc:  # noqa: BLE001 - every rank that waits fails with it, as with DeepSpeed's own JIT
        error = f"{what} could not be built in {directory} ({type(exc).__name__}: {exc})"
        builds.note_failure(directory, error)
        return {"error": f"pytest-dsrepro: {error}; the fork server's log has the compiler's output", "said": said}
    return {"library": str(library), "said": said, "built": True}


# ---- in the fork server -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BuildResult:
    """How a build beside the worlds ended: the words for the user, the op's library, or the ranks' error.
    ``again``: the build was cut short (its process killed), not refused by a compiler: the next rank that asks
    starts another."""

    said: str
    library: str | None
    error: str = ""
    again: bool = False


@dataclass
class Pending:
    """An op building beside the worlds: its child, the ranks that wait for it, how its end is taken in (``finish``)
    and how it goes on apart (``leave``: the words for the user)."""

    name: str
    build: builds.BuildChild
    finish: Callable[[], BuildResult]
    leave: Callable[[], str]
    waiters: list[tuple[Connection, int | None]] = field(default_factory=list)  # each asking rank, and its world
    told: bool = False  # the user was told it builds


class OpBuilds:
    """The fork server's end: the socket ranks ask on, the builds beside the worlds, the ops it already has.

    ``world_of``: the world of a process that asks (a rank, or what it forked), whose clock stops while it waits;
    ``user_dir``: a ``TORCH_EXTENSIONS_DIR`` the user set, where torch's JIT builds and decides what is current."""

    def __init__(
        self, conn: Connection, world_of: Callable[[int], int | None], cache_dir: Path, user_dir: str | None = None
    ) -> None:
        self.conn = conn
        self.world_of = world_of
        self.cache_dir = cache_dir
        self.user_dir = user_dir
        self.address = f"\0pytest-dsrepro-ops-{os.getpid()}"  # abstract: nothing is left on disk
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.address)
        self.listener.listen()
        os.register_at_fork(after_in_child=self.listener.close)  # the name goes with the server, not a build apart
        self.asking: list[Connection] = []  # ranks connected, their request not read yet
        self.pending: dict[str, Pending] = {}  # op name -> its build
        self.ended: dict[str, BuildResult] = {}  # op name -> how its build ended, this run
        self.waiting: dict[int, int] = {}  # world -> its ranks waiting for a build

    def waitables(self) -> list[Any]:
        """What the server's loop waits on for this: the socket, the ranks that connected, the builds' results."""
        return [self.listener, *self.asking, *(p.build.child.read for p in self.pending.values())]

    def take(self, ready: list[Any]) -> None:
        """What became readable among ``waitables``: a rank connecting, a rank's request; then builds that ended."""
        if self.listener in ready:
            sock, _ = self.listener.accept()
            self.asking.append(Connection(sock.detach()))
        for conn in [c for c in self.asking if c in ready]:
            self.asking.remove(conn)
            try:
                wanted = conn.recv()
            except (EOFError, OSError):
                conn.close()
                continue
            self.want(conn, wanted)
        self.poll()

    def want(self, conn: Connection, wanted: Wanted) -> None:
        """A rank's request: answered at once for an op this run has, else it waits for the op's build (started now
        if none runs), and its world's clock stops meanwhile."""
        if wanted.name in self.ended:
            self._answer(conn, None, self.ended[wanted.name])
            return
        if wanted.name not in self.pending:
            self._start(wanted)
        world = self.world_of(wanted.pid)
        self.pending[wanted.name].waiters.append((conn, world))
        if world is not None:
            self.waiting[world] = self.waiting.get(world, 0) + 1
            if self.waiting[world] == 1:
                self.conn.send(OpWait(world, time.monotonic(), waiting=True))

    def _start(self, wanted: Wanted) -> None:
        cache, user = str(self.cache_dir), self.user_dir
        build = builds.BuildChild.start(lambda: ensure(wanted, cache, user))

        def leave() -> str:
            build.detach()
            return (
                f"DeepSpeed's {wanted.name} op goes on building apart (process {build.child.pid}, for at most "
                f"{builds.BUILD_LOCK_TIMEOUT:.0f}s): later runs load it"
            )

        self.pending[wanted.name] = Pending(wanted.name, build, lambda: _finish(wanted, build), leave)

    def beside(
        self, name: str, build: builds.BuildChild, finish: Callable[[], BuildResult], leave: Callable[[], str]
    ) -> None:
        """A build the server started itself (DeepSpeed's comm op, ``comm_op.Background``): a rank that needs the op
        waits for it as for any other."""
        self.pending[name] = Pending(name, build, finish, leave, told=True)

    def poll(self) -> None:
        """Builds that ended are taken in (loaded here, said, their ranks answered); one that has run ``QUIET``
        seconds is said to build, once."""
        for pending in list(self.pending.values()):
            if pending.build.done():
                del self.pending[pending.name]
                outcome = pending.finish()
                if not outcome.again:
                    self.ended[pending.name] = outcome
                if outcome.said:
                    self.conn.send(Building(outcome.said))
                for conn, world in pending.waiters:
                    self._answer(conn, world, outcome)
            elif not pending.told and time.monotonic() - pending.build.started > QUIET and self._compiling(pending):
                pending.told = True
                took = builds.expected_build(self.cache_dir / "torch_extensions", pending.name, USUALLY)
                self.conn.send(
                    Building(
                        f"building DeepSpeed's {pending.name} op, first time only ({took}; cached in "
                        f"{self.cache_dir / 'torch_extensions'}), beside the worlds: a test that needs it waits, "
                        "its clock stopped"
                    )
                )

    @staticmethod
    def _compiling(pending: Pending) -> bool:
        """Has the build begun to compile? Its compilers' scratch exists only then: before, its child finds the op
        in the cache and loads it (importing DeepSpeed, hashing the op's sources, a throwaway load), which takes more
        than ``QUIET`` on a loaded machine and is no build to announce (it was, and read as a cache that missed)."""
        return builds.scratch(pending.build.child.pid).exists()

    def _answer(self, conn: Connection, world: int | None, outcome: BuildResult) -> None:
        with contextlib.suppress(OSError):  # a rank whose world ended meanwhile
            conn.send(Got(outcome.library, outcome.error))
        conn.close()
        if world is not None and world in self.waiting:
            self.waiting[world] -= 1
            if not self.waiting[world]:
                del self.waiting[world]
                self.conn.send(OpWait(world, time.monotonic(), waiting=False))

    def spared(self) -> set[int]:
        """The build children, which a world's end must not kill."""
        return {p.build.child.pid for p in self.pending.values()}

    def leave(self) -> str:
        """The run's tests are over, uninterrupted: builds that ended are taken in, those still running go on apart
        for later runs (``builds.BuildChild.detach``); what to tell the user ("" when nothing was building)."""
        self.poll()
        return "; ".join(pending.leave() for pending in self.pending.values())

    def stop(self) -> set[int]:
        """At the server's end: builds not let go on are stopped; the pids of those that were, which go on."""
        for pending in self.pending.values():
            pending.build.stop()
        return {p.build.child.pid for p in self.pending.values() if p.build.detached}


def _finish(wanted: Wanted, build: builds.BuildChild) -> BuildResult:
    """A build of an op a rank asked for ended: loaded here (later worlds inherit it), or why not."""
    try:
        found = build.result()
    except RuntimeError as exc:  # killed: nothing of it blocks the next build (``ensure``), which the next rank starts
        error = f"DeepSpeed's {wanted.name} op could not be built ({exc}; the fork server's log says why)"
        return BuildResult(error, None, f"pytest-dsrepro: {error}", again=True)
    said = [str(s) for s in found.get("said", ())]
    if "error" in found:
        return BuildResult("; ".join(said), None, str(found["error"]))
    library = str(found["library"])
    builds.register(_resolve(wanted.module, wanted.qualname)(), builds.import_library(Path(library), wanted.name))
    if found.get("built"):
        took = time.monotonic() - build.started
        said.append(f"DeepSpeed's {wanted.name} op built beside the worlds in {took:.0f}s; later runs load it")
    return BuildResult("; ".join(said), library)
