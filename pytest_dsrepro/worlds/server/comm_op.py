"""Runs in the fork server (and its build child; a launched rank warms it up too, and pytest asks ``holds_builds``):
DeepSpeed's JIT-built CPU comm op, built once per distinct source, never inside a test's critical path.

DeepSpeed builds ``deepspeed_shm_comm`` with ninja/g++ the first time a process group is set up on CPU (45-150 s
cold). Left to itself, torch keys builds by name under one ``TORCH_EXTENSIONS_DIR`` and ninja rebuilds whenever
the sources' *paths* change, so every environment, clone and bisect probe of a release rebuilt the same few files;
and a build killed midway leaves torch's ``lock`` file behind, which makes every later build wait forever.

Hence: one directory per *content* (:func:`build_key`: the op's sources and headers, compiler flags, torch, Python),
shared by every install whose op is the same (0.15.4-0.16.4 share one); an op already built there is loaded
directly, without torch's JIT (and so without ninja noticing new paths); one builder at a time across processes
(``filelock``); stale torch locks removed while we hold ours.

A cached build is loaded in a throwaway child first: a shared object cut short (a full disk, a copy interrupted)
kills whatever maps it with SIGBUS, and must never take the fork server with it. One that does not load is discarded
and built again, once, beside the worlds as a first build is; a read-only cache serves the builds it holds and builds
nothing. The same holds in a ``TORCH_EXTENSIONS_DIR`` the user set, where torch's JIT then builds it again: only the
op's own build directory there is discarded, which torch would rebuild anyway.

A first build never holds up a world (:func:`start`): the fork server builds in a child of its own, and the worlds
forked meanwhile run without the op, as DeepSpeed itself runs where it cannot build it (its compatibility switch,
which ``build_shm_op`` reads). The op serves one collective only, ``inference_all_reduce``: a rank that calls it
before the build ends waits for the build there, loads it and goes on as DeepSpeed would have with it. Once built,
the server loads it, and later worlds inherit it loaded. A run whose tests are over holds nothing up for it either:
the build goes on apart (:meth:`Background.detach`), for later runs, while a run cut short stops it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from ...core.options import default_cache_dir
from ..prctl import PR_SET_CHILD_SUBREAPER, prctl
from . import preload
from .reaping import kill_descendants

BUILD_LOCK_TIMEOUT = 1800.0  # a cold build on a loaded 2-core machine takes minutes; never forever
#: How long a throwaway child may take to load a cached build (milliseconds, normally).
LOAD_CHECK_TIMEOUT = 120.0
#: The file lock of the builds in an op's directory: one builder at a time, across processes.
BUILD_LOCK = ".dsrepro-build.lock"
#: The op's name (DeepSpeed's ``ShareMemCommBuilder.NAME``, 0.14-0.19): torch builds it into ``<dir>/<name>/<name>.so``.
OP_NAME = "deepspeed_shm_comm"
#: Why the last build beside the worlds failed, in its op's directory: told by the next run, which builds it again.
BUILD_FAILED = ".dsrepro-build-failed"
#: The name (``/proc/PID/comm``, ``psutil.Process.name``) of the child building beside the worlds: what marks a
#: build that goes on after its run, so that whoever started it (a test) can wait for it.
BUILDER_NAME = "dsrepro-build"


def build_key(files: Iterable[Path], flags: Iterable[str], torch_version: str) -> str:
    """What the built op depends on: every source and header byte, the compiler flags, torch and Python."""
    digest = hashlib.sha256()
    for part in (torch_version, sys.version.split()[0], *flags):
        digest.update(part.encode() + b"\0")
    for path in sorted(set(files), key=lambda p: p.name + str(p)):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")  # the name, not where it lies
    return digest.hexdigest()[:16]


def _inputs(builder: Any) -> tuple[list[Path], list[str]]:
    """The op's source and header files, and its compiler and linker flags, as DeepSpeed's builder states them."""
    sources = [Path(builder.deepspeed_src_path(p)) for p in builder.strip_empty_entries(builder.sources())]
    headers = [
        f for d in builder.strip_empty_entries(builder.include_paths())
        for f in Path(builder.deepspeed_src_path(d)).rglob("*") if f.is_file()
    ]  # fmt: skip
    flags = [*builder.strip_empty_entries(builder.cxx_args()), *builder.strip_empty_entries(builder.extra_ldflags())]
    return [*sources, *headers], flags


def extensions_dir(cache_dir: Path, key: str) -> Path:
    return cache_dir / "torch_extensions" / f"{OP_NAME}-{key}"


def shared_library(directory: Path) -> Path:
    return directory / OP_NAME / f"{OP_NAME}.so"


def holds_builds(cache_dir: Path) -> bool:
    """Does the cache hold a comm-op build of any release (what a read-only cache can still serve)?"""
    return any((cache_dir / "torch_extensions").glob(f"{OP_NAME}-*/{OP_NAME}/{OP_NAME}.so"))


def remove_stale_locks(directory: Path) -> list[Path]:
    """Torch's build baton files that no live build owns; call only while holding the build lock.

    The comm op's own is stale then: its builds happen only under that lock. The other ops that ranks JIT-build in
    the same directory (FusedAdam, CPUAdam, ...) are built without it, so their baton is stale only once it is older
    than any build takes: removing a live one makes that build fail as it ends (torch removes its baton, and finds
    it gone)."""
    cutoff = time.time() - BUILD_LOCK_TIMEOUT
    stale = [
        p for p in directory.glob("*/lock")
        if p.is_file() and (p.parent.name == OP_NAME or p.stat().st_mtime < cutoff)
    ]  # fmt: skip
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def scratch(pid: int) -> Path:
    """Where the compilers of the build in process ``pid`` keep their temporary files (their ``TMPDIR``)."""
    return Path(tempfile.gettempdir()) / f"dsrepro-build-{pid}"


@contextmanager
def _compilers_scratch() -> Iterator[None]:
    """The compilers' temporary files in a directory of this build's own, removed afterwards: a compiler killed
    mid-build (Ctrl-C) leaves its files behind, which nobody else would remove. When the build is cut short, the
    process that builds removes the directory once its compilers are killed: the fork server (``server.run``), or
    its child building beside the worlds (``_apart``), or the server after that child (``Background.stop``)."""
    directory = scratch(os.getpid())
    directory.mkdir(exist_ok=True)
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(directory)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = before
    shutil.rmtree(directory, ignore_errors=True)


def _builder() -> Any:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().create_op_builder("ShareMemCommBuilder")


def _directory(builder: Any, cache_dir: Path | None) -> Path:
    import torch

    files, flags = _inputs(builder)
    return extensions_dir(cache_dir or default_cache_dir(), build_key(files, flags, str(torch.__version__)))


def op_directory(cache_dir: Path | None = None) -> Path | None:
    """Where this interpreter's DeepSpeed keeps its comm op (imports DeepSpeed); None when its accelerator has none."""
    builder = _builder()
    return None if builder is None else _directory(builder, cache_dir)


class Unusable(Exception):
    """DeepSpeed's comm op cannot be had from this cache: the message names the directory and what to do. Every world
    of the run would fail the same way, so the run stops (``worlds.client.CacheUnusable``)."""


def _import(library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(OP_NAME, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"{library} is not an extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _import_error(library: Path) -> str | None:
    try:
        _import(library)
    except ImportError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def damage(library: Path) -> str | None:
    """How loading the build at ``library`` fails, found in a throwaway child; None when it loads."""
    if library.stat().st_size == 0:
        return "it is empty: 0 bytes, a build or a copy cut short"
    try:
        error = preload.in_child(lambda: _import_error(library), LOAD_CHECK_TIMEOUT)
    except RuntimeError as exc:
        return f"loading it in a throwaway child: {exc}"
    return None if error is None else f"loading it in a throwaway child: {error}"


def _register(builder: Any, module: ModuleType) -> bool:
    """Put an op built before (by any install with the same key) where ``builder.load()`` looks, so DeepSpeed's own
    ``build_shm_op()`` finds it loaded. False where this DeepSpeed keeps loaded ops elsewhere: built then."""
    owner = next((c for c in type(builder).__mro__ if isinstance(vars(c).get("_loaded_ops"), dict)), None)
    if owner is None:
        return False
    vars(owner)["_loaded_ops"][builder.name] = module
    return True


def _sound(library: Path, announce: Callable[[str], None], release: str) -> bool:
    """Is there a build at ``library`` that loads? One that does not is discarded (the op's whole build: objects
    and ninja's state too), saying so. Call while no build is under way there (under the build lock)."""
    if not library.exists():
        return False
    why = damage(library)
    if why is None:
        return True
    announce(f"the cached build of {release} does not load ({why}): discarded, building it again ({library})")
    shutil.rmtree(library.parent, ignore_errors=True)
    return False


def _cached(builder: Any, library: Path, announce: Callable[[str], None], release: str) -> bool:
    """Load the cached build at ``library`` if it loads (``_sound``)."""
    return _sound(library, announce, release) and _register(builder, _import(library))


def _discarded(directory: Path, library: Path, announce: Callable[[str], None], release: str) -> bool:
    """Was the build at ``library`` damaged, and so discarded now (``_sound``)? Only while no build holds the lock:
    a library that another process is still linking is no damaged one."""
    from filelock import FileLock, Timeout

    try:
        with FileLock(directory / BUILD_LOCK, timeout=0):
            return not _sound(library, announce, release)
    except Timeout:
        return False  # built elsewhere now: warm_up waits for that build


#: How long the build in its directory took, in seconds: what tells the user how long the next one will take.
BUILD_SECONDS = ".dsrepro-build-seconds"


def expected_build(extensions: Path) -> str:
    """How long a build takes here, in words: the range of the earlier builds in ``extensions`` (the cache's
    ``torch_extensions``), or the range measured on a 2-core machine when there was none."""
    taken = []
    for path in extensions.glob(f"*/{BUILD_SECONDS}"):
        with contextlib.suppress(OSError, ValueError):
            taken.append(float(path.read_text()))
    if not taken:
        return "usually 50-135 s"
    low, high = min(taken), max(taken)
    return f"about {low:.0f} s here" if high - low < 10 else f"{low:.0f}-{high:.0f} s here"


def warm_up(announce: Callable[[str], None] = lambda _: None) -> str:
    """Build (or load from cache) DeepSpeed's shm comm op in this process, so forked ranks inherit it loaded.

    Runs in the fork server after ``import deepspeed``. ``announce`` is told, in words for the user, before a build
    (minutes, the first time a release is used) or a wait for another process's build. Returns a short description
    for the report header; raises ``Unusable`` when the op can be neither loaded nor built here. A
    ``TORCH_EXTENSIONS_DIR`` set by the user is used with torch's own JIT, once a damaged build there is discarded.
    """
    import deepspeed
    from filelock import FileLock, Timeout

    builder = _builder()
    if builder is None or not builder.is_compatible(False):
        return "not used by this accelerator"
    chosen = os.environ.get("TORCH_EXTENSIONS_DIR")
    directory = Path(chosen) if chosen else _directory(builder, None)
    os.environ["TORCH_EXTENSIONS_DIR"] = str(directory)
    release = f"DeepSpeed's CPU comm op for {deepspeed.__version__}"
    library = shared_library(directory)
    lock = FileLock(directory / BUILD_LOCK, timeout=BUILD_LOCK_TIMEOUT)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        lock.acquire(timeout=0)
    except Timeout:
        announce(f"waiting for another pytest-dsrepro process to build {release} (first time only)")
        lock.acquire()
    except OSError as exc:
        return _read_only(builder, directory, bool(chosen), release, exc)
    try:
        remove_stale_locks(directory)
        if chosen:
            _sound(library, announce, release)  # torch's JIT loads it, or builds it again
        elif _cached(builder, library, announce, release):
            return f"loaded from {directory}"
        op = _build(directory, library, bool(chosen), announce, release)
    finally:
        lock.release()
    return f"built in {directory}" if op is not None else "not used by this accelerator"


def _read_only(builder: Any, directory: Path, chosen: bool, release: str, exc: OSError) -> str:
    """A cache that cannot be written: what it holds is used as it is, or ``Unusable`` says where to point instead."""
    library = shared_library(directory)
    if not chosen and library.exists() and damage(library) is None and _register(builder, _import(library)):
        return f"loaded from {directory} (a read-only cache)"
    raise Unusable(
        f"{directory} cannot be written ({exc.strerror or exc}) and holds no build of {release} that loads: point "
        "--ds-cache-dir (or DSREPRO_CACHE_DIR) at a writable directory"
    ) from None


def _build(directory: Path, library: Path, chosen: bool, announce: Callable[[str], None], release: str) -> object:
    """Build the op with DeepSpeed's own JIT, under the cache's lock, telling the user how long a first build takes;
    its time kept for the next estimate. ``Unusable``, saying what to do, when it fails: every world would fail on it.
    ``chosen``: ``directory`` is the user's ``TORCH_EXTENSIONS_DIR``."""
    from deepspeed.comm.torch import build_shm_op

    if not library.exists():
        took = expected_build(directory.parent)
        said = f"building {release}, first time only ({took}; cached in {directory})"
        announce(f"{said}; the first DeepSpeed world waits for it")
    started = time.monotonic()
    try:
        with _compilers_scratch():
            op = build_shm_op()
        with contextlib.suppress(OSError):  # for the next build's estimate
            (directory / BUILD_SECONDS).write_text(f"{time.monotonic() - started:.0f}")
    except Exception as exc:  # noqa: BLE001 - told as what to do: every world would fail on it
        ours = library.parent if chosen else directory  # the user's directory may hold other builds
        elsewhere = "unset TORCH_EXTENSIONS_DIR" if chosen else "point --ds-cache-dir elsewhere"
        raise Unusable(
            f"{release} could not be built in {directory} ({type(exc).__name__}: {exc}); remove its build "
            f"(rm -rf {ours}) and run again, or {elsewhere}"
        ) from None
    return op


# ---- a first build beside the worlds -------------------------------------------------------------------------------

#: How ``start`` says that the op builds beside the worlds (``ServerFacts.comm_op``).
BESIDE = "building beside the worlds"
#: In the fork server while a build runs beside its worlds, and in the ranks it forks meanwhile: the op's library
#: and the pid of the child building it, which a rank that calls ``inference_all_reduce`` waits for.
_pending: tuple[Path, int] | None = None


@dataclass
class Background:
    """DeepSpeed's comm op building in a child of the fork server, while worlds run without it."""

    child: Any  # preload.Child
    lifeline: int  # the pipe that tells the child to go on apart (``detach``); its end (the server's) stops the build
    builder: Any
    library: Path
    release: str
    compatible: object  # DeepSpeed's compatibility switch for the op before it was turned off
    started: float
    ended: bool = False  # the child was reaped (``adopt``)
    detached: bool = False  # the child goes on after the server (``detach``)

    @classmethod
    def begin(cls, builder: Any, directory: Path, release: str, announce: Callable[[str], None]) -> Background:
        """Start the build in a child (``_apart``), saying so (and why, when the last one failed), and switch the op
        off here meanwhile: the worlds forked now run without it, as DeepSpeed does where it cannot build it."""
        import deepspeed.ops

        from . import preload

        failed = directory / BUILD_FAILED
        with contextlib.suppress(OSError):
            announce(f"the last build of {release} failed ({' '.join(failed.read_text().split())}): building it again")
            failed.unlink()
        announce(
            f"building {release}, first time only ({expected_build(directory.parent)}; cached in {directory}), beside "
            "the worlds: until it is built they run without it, as DeepSpeed does where it cannot build it, and a "
            "test that calls inference_all_reduce waits for it there"
        )
        os.environ["TORCH_EXTENSIONS_DIR"] = str(
            directory
        )  # where ranks JIT-build DeepSpeed's other ops, as after a load
        read, lifeline = os.pipe()
        child = preload.Child.start(lambda: _apart(read, lifeline, failed))
        os.close(read)
        library = shared_library(directory)
        switch = deepspeed.ops.__compatible_ops__.get(builder.NAME, True)
        background = cls(child, lifeline, builder, library, release, switch, time.monotonic())
        deepspeed.ops.__compatible_ops__[builder.NAME] = False  # after the fork: the child builds it
        _wait_in_ranks(library, child.pid)
        return background

    def done(self) -> bool:
        return self.ended or self.child.done()

    def detach(self) -> str:
        """The run's tests are over, and it was not cut short: let the build go on after the server, for later runs,
        within ``BUILD_LOCK_TIMEOUT`` (``_apart``). Returns the words for the user."""
        os.write(self.lifeline, DETACH)
        os.close(self.lifeline)
        self.detached = True
        return (
            f"{self.release} goes on building apart (process {self.child.pid}, for at most "
            f"{BUILD_LOCK_TIMEOUT:.0f}s): later runs load it; a run started before it is built builds beside it"
        )

    def stop(self, grace: float = 10.0) -> None:
        """Cut a running build short as SIGTERM cuts a build in the server itself: the child unwinds (torch removes
        its build lock) and kills its compilers; what is left, the server kills, and it removes their files after."""
        if self.ended or self.detached:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.child.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while os.waitpid(self.child.pid, os.WNOHANG)[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        self.ended = True
        shutil.rmtree(scratch(self.child.pid), ignore_errors=True)  # a child killed before it could remove them

    def adopt(self) -> str:
        """Load the finished build here (later worlds inherit it loaded), or say why there is none; either way the
        worlds go on as DeepSpeed's switch then says. Returns the words for the user."""
        global _pending
        import deepspeed.ops

        took = time.monotonic() - self.started
        try:
            self.child.result(LOAD_CHECK_TIMEOUT)
        except RuntimeError as exc:
            return (
                f"{self.release} could not be built in {self.library.parent.parent} ({exc}; the fork server's log "
                "says why): worlds go on without it, as DeepSpeed does where it cannot build it"
            )
        finally:
            self.ended = True
        if not _cached(self.builder, self.library, lambda _: None, self.release):
            return f"{self.release} was built but does not load: worlds go on without it"
        deepspeed.ops.__compatible_ops__[self.builder.NAME] = self.compatible
        _pending = None
        return f"{self.release} built beside the worlds in {took:.0f}s; worlds from now on use it, later runs load it"


def start(announce: Callable[[str], None] = lambda _: None) -> tuple[str, Background | None]:
    """In the fork server: load the op (``warm_up``), or, when it is not built yet and the cache can be written,
    build it in a child (or wait there for another process's build) and let worlds run without it meanwhile. A
    ``TORCH_EXTENSIONS_DIR`` set by the user is torch's own JIT's, built as ``warm_up`` builds it."""
    import deepspeed

    builder = _builder()
    if builder is None or not builder.is_compatible(False) or os.environ.get("TORCH_EXTENSIONS_DIR"):
        return warm_up(announce), None
    directory = _directory(builder, None)
    library = shared_library(directory)
    with contextlib.suppress(OSError):
        directory.mkdir(parents=True, exist_ok=True)
    writable = os.access(directory, os.W_OK)  # a read-only cache is warm_up's to tell
    release = f"DeepSpeed's CPU comm op for {deepspeed.__version__}"
    if not writable or (library.exists() and not _discarded(directory, library, announce, release)):
        return warm_up(announce), None  # loaded now
    return BESIDE, Background.begin(builder, directory, release, announce)


#: What the server writes on the lifeline to let the build go on after it (``Background.detach``).
DETACH = b"d"


def _unwind(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _apart(read: int, lifeline: int, failed: Path) -> str:
    """The build in the fork server's child (``warm_up``), made to outlive the server only when told to.

    In a session of its own (a terminal's signals, and the server's process group killed by pytest, miss it), named
    ``BUILDER_NAME``, and a child subreaper, so that its compilers stay its own to kill. A thread reads the lifeline:
    ``DETACH`` lets the build go on, for at most ``BUILD_LOCK_TIMEOUT`` (SIGALRM); its end without it (the server
    stopped, or died) stops the build as SIGTERM does: it unwinds, and torch removes its lock. A failure is kept in
    ``failed`` for the next run to tell: nobody may be left to read the server's log."""
    import threading

    os.close(lifeline)
    os.setsid()
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    with contextlib.suppress(OSError):
        Path("/proc/self/comm").write_text(BUILDER_NAME)
    for signum in (signal.SIGTERM, signal.SIGALRM):
        signal.signal(signum, _unwind)

    def watch() -> None:
        if os.read(read, 1) == DETACH:
            signal.alarm(int(BUILD_LOCK_TIMEOUT))
        else:
            os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, daemon=True).start()
    try:
        return warm_up(lambda what: print(what, file=sys.stderr))
    except Unusable as exc:
        with contextlib.suppress(OSError):
            failed.write_text(str(exc))
        raise
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the cleanup runs to its end
        kill_descendants()
        shutil.rmtree(scratch(os.getpid()), ignore_errors=True)


def _wait_in_ranks(library: Path, builder: int) -> None:
    """Make ``inference_all_reduce`` of a rank forked while the op builds wait for the build and load it, then do
    what DeepSpeed's backend does with an op it built (``TorchBackend.__init__``, 0.14-0.19)."""
    global _pending
    from deepspeed.comm.torch import TorchBackend

    _pending = library, builder
    original = TorchBackend.inference_all_reduce
    if getattr(original, "dsrepro_waits", False):
        return

    @functools.wraps(original)
    def inference_all_reduce(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "shm_comm_op", None) is None and _pending is not None:
            self.shm_comm_op = _when_built(*_pending)
            self.shm_comm_op.initialize(self.get_world_size(), self.get_rank())
            if hasattr(self.shm_comm_op, "vector_kernel_level"):
                self.shm_vector_kernel_level = self.shm_comm_op.vector_kernel_level()
        return original(self, *args, **kwargs)

    inference_all_reduce.dsrepro_waits = True  # type: ignore[attr-defined]
    TorchBackend.inference_all_reduce = inference_all_reduce


def _when_built(library: Path, builder: int) -> ModuleType:
    """The op, once the fork server's child ``builder`` has built it (in a rank: the wait counts against its world's
    timeout). The library appears as the build links it, complete only once the builder lets the build lock go; a
    builder that ended without it failed."""
    import psutil
    from filelock import FileLock

    def building() -> bool:
        try:
            return psutil.Process(builder).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    while not library.exists() and building():
        time.sleep(0.2)
    with FileLock(library.parent.parent / BUILD_LOCK, timeout=BUILD_LOCK_TIMEOUT):
        if not library.exists():
            raise RuntimeError(
                f"pytest-dsrepro: DeepSpeed's CPU comm op could not be built in {library.parent.parent} (the fork "
                "server's log says why), and this test calls inference_all_reduce, which needs it"
            )
    return _import(library)
