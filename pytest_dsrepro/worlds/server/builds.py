"""Runs in the fork server and the build children it starts (a launched rank loads the comm op through it too):
how every DeepSpeed op the plugin builds is built, whether the comm op (``comm_op``) or any other (``op_builds``).

Left to itself, torch keys JIT builds by name under one ``TORCH_EXTENSIONS_DIR`` and ninja rebuilds whenever the
sources' *paths* change, so every environment, clone and bisect probe of a release rebuilt the same few files; and a
build stopped midway leaves torch's ``lock`` file (no pid in it) behind, which makes every later build of the op wait
forever. Hence one directory per op and content (``keyed_directory``), one builder at a time (``BUILD_LOCK``) with
torch's baton removed under it (``remove_stale_locks``), a build loaded in a throwaway child first (``damage``), and a
build beside the worlds whose compilers die with it (``BuildChild``).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import select
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

from ..prctl import PR_SET_CHILD_SUBREAPER, die_with_parent, prctl
from . import preload
from .reaping import kill_descendants

BUILD_LOCK_TIMEOUT = 1800.0  # a cold build on a loaded 2-core machine takes minutes; never forever
#: How long a throwaway child may take to load a build (milliseconds, normally).
LOAD_CHECK_TIMEOUT = 120.0
#: The file lock of the builds in an op's directory: one builder at a time, across processes (a ``filelock``: the
#: kernel lets it go with its holder).
BUILD_LOCK = ".dsrepro-build.lock"
#: Why the last build beside the worlds failed, in its op's directory: told by the next run, which builds it again.
BUILD_FAILED = ".dsrepro-build-failed"
#: How long the build in its directory took, in seconds: what tells the user how long the next one will take.
BUILD_SECONDS = ".dsrepro-build-seconds"
#: The name (``/proc/PID/comm``, ``psutil.Process.name``) of a build's warden, beside the worlds: what marks a build
#: that goes on after its run, so that whoever started it (a test) can wait for it.
BUILDER_NAME = "dsrepro-build"
#: The name of the process under the warden that runs torch's JIT (and so the compilers).
COMPILER_NAME = "dsrepro-compile"
#: The names of a search for what a first engine step imports (``preload.scout``): its warden, and its worker.
SCOUT_NAMES = ("dsrepro-scout", "dsrepro-search")
#: What the server writes on a build's lifeline to let it go on after the server (``BuildChild.detach``).
DETACH = b"d"
#: How long a build that is told to stop may take to unwind before it is killed.
STOP_GRACE = 10.0


def build_key(files: Iterable[Path], flags: Iterable[str], torch_version: str) -> str:
    """What a built op depends on: every source and header byte, the compiler flags, torch and Python."""
    digest = hashlib.sha256()
    for part in (torch_version, sys.version.split()[0], *flags):
        digest.update(part.encode() + b"\0")
    for path in sorted(set(files), key=lambda p: p.name + str(p)):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")  # the name, not where it lies
    return digest.hexdigest()[:16]


def inputs(builder: Any) -> tuple[list[Path], list[str]]:
    """An op's source and header files, and its compiler and linker flags, as DeepSpeed's builder states them."""
    sources = [Path(builder.deepspeed_src_path(p)) for p in builder.strip_empty_entries(builder.sources())]
    headers = [
        f for d in builder.strip_empty_entries(builder.include_paths())
        for f in Path(builder.deepspeed_src_path(d)).rglob("*") if f.is_file()
    ]  # fmt: skip
    flags = [*builder.strip_empty_entries(builder.cxx_args()), *builder.strip_empty_entries(builder.extra_ldflags())]
    return [*sources, *headers], flags


def keyed_directory(cache_dir: Path, builder: Any) -> Path:
    """Where the op of ``builder`` is built in the cache: its own directory, keyed by what it is built from
    (``build_key``: the op's sources and headers, compiler flags, torch, Python), shared by every install whose op is
    the same; a build there is loaded directly, without torch's JIT. Only called where the builder's flags ask no GPU
    (the fork server never touches CUDA): on a CPU accelerator, or in a build child."""
    import torch

    files, flags = inputs(builder)
    return extensions_dir(cache_dir, builder.name, build_key(files, flags, str(torch.__version__)))


def extensions_dir(cache_dir: Path, name: str, key: str) -> Path:
    return cache_dir / "torch_extensions" / f"{name}-{key}"


def shared_library(directory: Path, name: str) -> Path:
    """Where torch's JIT puts op ``name`` built under ``TORCH_EXTENSIONS_DIR=directory``."""
    return directory / name / f"{name}.so"


def holds_builds(cache_dir: Path, name: str) -> bool:
    """Does the cache hold a build of op ``name``, for any release (``extensions_dir``, ``shared_library``)?"""
    return any((cache_dir / "torch_extensions").glob(f"{name}-*/{name}/{name}.so"))


def remove_stale_locks(directory: Path, ours: str) -> list[Path]:
    """Torch's build baton files in ``directory`` that no live build owns; call only while holding the build lock.

    The baton of op ``ours`` is stale then: its builds happen only under that lock. Another op's in the same directory
    (a user's ``TORCH_EXTENSIONS_DIR``, where torch's JIT builds without it) is stale only once it is older than any
    build takes: removing a live one makes that build fail as it ends (torch removes its baton, and finds it gone)."""
    cutoff = time.time() - BUILD_LOCK_TIMEOUT
    stale = [
        p for p in directory.glob("*/lock")
        if p.is_file() and (p.parent.name == ours or p.stat().st_mtime < cutoff)
    ]  # fmt: skip
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def scratch(pid: int) -> Path:
    """Where the compilers of the build that process ``pid`` runs keep their temporary files (their ``TMPDIR``)."""
    return Path(tempfile.gettempdir()) / f"dsrepro-build-{pid}"


#: In a builder (``_builder``): its warden, whose ``scratch`` its compilers use. None elsewhere.
_warden_pid: int | None = None


def in_builder() -> bool:
    """Is this process the one that compiles under a build's warden (where DeepSpeed's own JIT must run)?"""
    return _warden_pid is not None


@contextmanager
def compilers_scratch() -> Iterator[None]:
    """The compilers' temporary files in a ``scratch`` directory, removed afterwards: a compiler killed mid-build
    leaves its files behind, which nobody else would remove. When the build is cut short, whoever kills the compilers
    removes the directory after them: the fork server for its own builds, a build's warden (``BuildChild``) for its
    builder's, and the server after a warden (``BuildChild.stop``)."""
    directory = scratch(_warden_pid or os.getpid())
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


class Unusable(Exception):
    """An op cannot be had from this cache: the message names the directory and what to do."""


def import_library(library: Path, name: str) -> ModuleType:
    """A built op, imported as torch's JIT imports it (under its own name)."""
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"{library} is not an extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _import_error(library: Path, name: str) -> str | None:
    try:
        import_library(library, name)
    except ImportError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def damage(library: Path, name: str) -> str | None:
    """How loading the build at ``library`` fails, found in a throwaway child (a shared object cut short kills
    whatever maps it with SIGBUS); None when it loads."""
    if library.stat().st_size == 0:
        return "it is empty: 0 bytes, a build or a copy cut short"
    try:
        error = preload.in_child(lambda: _import_error(library, name), LOAD_CHECK_TIMEOUT)
    except RuntimeError as exc:
        return f"loading it in a throwaway child: {exc}"
    return None if error is None else f"loading it in a throwaway child: {error}"


def register(builder: Any, module: ModuleType) -> bool:
    """Put an op built before (by any install with the same key) where ``builder.load()`` looks, so that DeepSpeed
    finds it loaded. False where this DeepSpeed keeps loaded ops elsewhere: built by DeepSpeed then."""
    owner = next((c for c in type(builder).__mro__ if isinstance(vars(c).get("_loaded_ops"), dict)), None)
    if owner is None:
        return False
    vars(owner)["_loaded_ops"][builder.name] = module
    return True


def sound(library: Path, name: str, announce: Callable[[str], None], what: str) -> bool:
    """Is there a build at ``library`` that loads? One that does not is discarded (the op's whole build: objects and
    ninja's state too), saying so once. Call while no build is under way there (under the build lock)."""
    if not library.exists():
        return False
    why = damage(library, name)
    if why is None:
        return True
    announce(f"the cached build of {what} does not load ({why}): discarded, building it again ({library})")
    shutil.rmtree(library.parent, ignore_errors=True)
    return False


def expected_build(extensions: Path, name: str, usually: str) -> str:
    """How long a build of op ``name`` takes here, in words: the range of its earlier builds in ``extensions`` (the
    cache's ``torch_extensions``), or ``usually`` (measured on a 2-core machine) when there was none."""
    taken = []
    for path in extensions.glob(f"{name}-*/{BUILD_SECONDS}"):
        with contextlib.suppress(OSError, ValueError):
            taken.append(float(path.read_text()))
    if not taken:
        return usually
    low, high = min(taken), max(taken)
    return f"about {low:.0f} s here" if high - low < 10 else f"{low:.0f}-{high:.0f} s here"


@contextmanager
def timed(directory: Path) -> Iterator[None]:
    """A build, its time kept in ``directory`` for the next estimate once it succeeded."""
    started = time.monotonic()
    yield
    with contextlib.suppress(OSError):
        (directory / BUILD_SECONDS).write_text(f"{time.monotonic() - started:.0f}")


def note_failure(directory: Path, why: str) -> None:
    """Keep why a build beside the worlds failed in its op's ``directory``, for the next run to tell (``said_failure``:
    nobody may be left to read the server's log when the build went on apart)."""
    with contextlib.suppress(OSError):
        (directory / BUILD_FAILED).write_text(why)


def said_failure(directory: Path) -> str | None:
    """Why the last build beside the worlds in ``directory`` failed, once: the file is removed as it is read."""
    failed = directory / BUILD_FAILED
    try:
        why = " ".join(failed.read_text().split())
    except OSError:
        return None
    failed.unlink(missing_ok=True)
    return why


# ---- a build beside the worlds -------------------------------------------------------------------------------------


@dataclass
class BuildChild:
    """A build running in a child of the fork server (the warden, ``_warden``), beside the worlds.

    The warden is in a session of its own (a child subreaper named ``BUILDER_NAME``) over the process that compiles.
    Whichever of the two is killed, even by SIGKILL, the compilers die with it (the warden adopts and kills what a
    killed builder leaves; a killed warden's builder gets SIGTERM from the kernel, unwinds, which removes torch's
    baton, and kills its own): none is left to race the next build.
    """

    child: preload.Child  # the warden; its result is what the build's work returned
    lifeline: int  # the pipe that lets the build go on apart (``detach``); its end without that stops the build
    started: float
    ended: bool = False  # the warden was reaped (``result`` or ``stop``)
    detached: bool = False  # the build goes on after the server (``detach``)

    @classmethod
    def start(cls, work: Callable[[], Any], names: tuple[str, str] = (BUILDER_NAME, COMPILER_NAME)) -> BuildChild:
        """Start ``work()`` (JSON-able result) in a worker under a warden (``names``: theirs); a work that fails notes
        why itself (``note_failure``)."""
        read, lifeline = os.pipe()
        child = preload.Child.start(lambda: _warden(read, lifeline, work, names))
        os.close(read)
        return cls(child, lifeline, time.monotonic())

    def done(self) -> bool:
        return self.ended or self.child.done()

    def result(self, timeout: float = LOAD_CHECK_TIMEOUT) -> Any:
        """What the build's work returned; ``RuntimeError`` saying why there is nothing: how its worker ended (a
        traceback is in the server's log), or that the warden did."""
        try:
            got = self.child.result(timeout)
            if "failed" in got:
                raise RuntimeError(f"its worker {got['failed'].removeprefix('it ')}")  # "its worker failed (...)"
            return got["returned"]
        finally:
            self._ended()

    def detach(self) -> None:
        """The run's tests are over, and it was not cut short: the build goes on after the server, for later runs,
        within ``BUILD_LOCK_TIMEOUT``."""
        with contextlib.suppress(BrokenPipeError):  # the warden ended since it was last polled: nothing goes on
            os.write(self.lifeline, DETACH)
        os.close(self.lifeline)
        self.detached = True

    def stop(self, grace: float = STOP_GRACE) -> None:
        """Cut a running build short: the warden stops its builder (which unwinds: torch removes its baton) and kills
        the compilers; a warden that does not end within ``grace`` is killed, and its files are removed here."""
        if self.ended or self.detached:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.child.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while os.waitpid(self.child.pid, os.WNOHANG)[0] == 0:
            if time.monotonic() > deadline:
                os.kill(self.child.pid, signal.SIGKILL)
                os.waitpid(self.child.pid, 0)
                break
            time.sleep(0.05)
        os.close(self.child.read)
        self._ended()

    def _ended(self) -> None:
        """The warden reaped: its lifeline closed, the files of a warden killed before it could remove them gone."""
        self.ended = True
        with contextlib.suppress(OSError):
            os.close(self.lifeline)
        shutil.rmtree(scratch(self.child.pid), ignore_errors=True)


def _unwind(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _warden(read: int, lifeline: int, work: Callable[[], Any], names: tuple[str, str]) -> Any:
    """The build's first process, under the fork server: in a session of its own (a terminal's signals, and the
    server's process group killed by pytest, miss it), named ``names[0]``, and a child subreaper, so that what its
    builder starts stays its own to kill. The builder (``_builder``) runs ``work``; the warden waits for it and for
    the lifeline: ``DETACH`` lets the build go on, for at most ``BUILD_LOCK_TIMEOUT`` (SIGALRM); its end without it
    (the server stopped, or died) stops the build as SIGTERM does. Whatever ends it, even a builder killed outright,
    the compilers die here, before it returns."""
    os.close(lifeline)
    os.setsid()
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    with contextlib.suppress(OSError):
        Path("/proc/self/comm").write_text(names[0])
    for signum in (signal.SIGTERM, signal.SIGALRM):
        signal.signal(signum, _unwind)
    warden = os.getpid()
    builder = preload.Child.start(lambda: _builder(warden, work, names[1]))
    try:
        return {"returned": _watch(read, builder)}
    except RuntimeError as exc:  # the builder failed, or was killed (its compilers die below)
        return {"failed": str(exc)}
    except SystemExit:  # stopped: the builder may still run
        _stop(builder.pid)
        raise
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the cleanup runs to its end
        kill_descendants()  # what a builder killed outright left: the compilers, adopted here
        shutil.rmtree(scratch(warden), ignore_errors=True)


def _watch(read: int, builder: preload.Child) -> Any:
    """The warden's wait: the builder's result (which reaps it), or the lifeline's word first (see ``_warden``)."""
    watching = [read, builder.read]
    while read in watching and builder.read not in select.select(watching, [], [])[0]:
        watching.remove(read)
        if os.read(read, 1) != DETACH:
            raise SystemExit(128 + signal.SIGTERM)
        signal.alarm(int(BUILD_LOCK_TIMEOUT))
    return builder.result(BUILD_LOCK_TIMEOUT + 60)


def _stop(pid: int) -> None:
    """SIGTERM the builder and give it ``STOP_GRACE`` to unwind (a builder that ended is only reaped)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(pid, os.WNOHANG)[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)


def _builder(warden: int, work: Callable[[], Any], name: str) -> Any:
    """The process that builds, under the warden: SIGTERM (from the warden, or from the kernel when the warden dies)
    unwinds it, so that torch removes its baton; a child subreaper too, so that it kills its own compilers as it
    ends. Its compilers' temporary files are in the warden's ``scratch``, which the warden removes."""
    global _warden_pid
    die_with_parent(warden, signal.SIGTERM)
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    with contextlib.suppress(OSError):
        Path("/proc/self/comm").write_text(name)
    signal.signal(signal.SIGTERM, _unwind)
    _warden_pid = warden
    try:
        return work()
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        kill_descendants()
