"""Runs in the fork server (and its build child; a launched rank warms it up too, and pytest asks ``holds_builds``):
DeepSpeed's JIT-built CPU comm op, built once per distinct source (``builds``), never inside a test's critical path.

DeepSpeed builds ``deepspeed_shm_comm`` with ninja/g++ the first time a process group is set up on CPU (45-150 s
cold): every world would wait for it. The plugin builds it as it builds every op (``builds``), but ahead of the worlds
rather than when a rank asks (``warm_up``); and a first build never holds up a world (``start``, ``Background``): the
worlds forked meanwhile run without the op, as DeepSpeed itself runs where it cannot build it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...core.options import default_cache_dir
from . import builds, op_builds
from .builds import BUILD_LOCK, BUILD_LOCK_TIMEOUT, BuildChild, Unusable

#: The op's name (DeepSpeed's ``ShareMemCommBuilder.NAME``, 0.14-0.19): torch builds it into ``<dir>/<name>/<name>.so``.
OP_NAME = "deepspeed_shm_comm"
#: How long a first build takes when the cache has no earlier one to tell (measured on 2 quiet cores).
USUALLY = "usually 50-135 s"


def holds_builds(cache_dir: Path) -> bool:
    """Does the cache hold a comm-op build of any release (what a read-only cache can still serve)?"""
    return builds.holds_builds(cache_dir, OP_NAME)


def shared_library(directory: Path) -> Path:
    return builds.shared_library(directory, OP_NAME)


def _builder() -> Any:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().create_op_builder("ShareMemCommBuilder")


def _directory(builder: Any, cache_dir: Path | None) -> Path:
    """The op's directory in the cache, per content (``builds.keyed_directory``): 0.15.4-0.16.4 share one."""
    return builds.keyed_directory(cache_dir or default_cache_dir(), builder)


def op_directory(cache_dir: Path | None = None) -> Path | None:
    """Where this interpreter's DeepSpeed keeps its comm op (imports DeepSpeed); None when its accelerator has none."""
    builder = _builder()
    return None if builder is None else _directory(builder, cache_dir)


def _cached(builder: Any, library: Path, announce: Callable[[str], None], release: str) -> bool:
    """Load the cached build at ``library`` if it loads (``builds.sound``)."""
    return builds.sound(library, OP_NAME, announce, release) and builds.register(
        builder, builds.import_library(library, OP_NAME)
    )


def _discarded(directory: Path, library: Path, announce: Callable[[str], None], release: str) -> bool:
    """Was the build at ``library`` damaged, and so discarded now (``builds.sound``)? Only while no build holds the
    lock: a library that another process is still linking is no damaged one."""
    from filelock import FileLock, Timeout

    try:
        with FileLock(directory / BUILD_LOCK, timeout=0):
            return not builds.sound(library, OP_NAME, announce, release)
    except Timeout:
        return False  # built elsewhere now: warm_up waits for that build


def _build_noting_failure(directory: Path) -> str:
    """``warm_up`` in a build beside the worlds: a build that leaves the cache unusable notes why for the next run."""
    try:
        return warm_up(lambda what: print(what, file=sys.stderr))
    except Unusable as exc:
        builds.note_failure(directory, str(exc))
        raise


def warm_up(announce: Callable[[str], None] = lambda _: None) -> str:
    """Build (or load from cache) DeepSpeed's shm comm op in this process, so forked ranks inherit it loaded.

    Runs in the fork server after ``import deepspeed``. ``announce`` is told, in words for the user, before a build
    (minutes, the first time a release is used) or a wait for another process's build. Returns a short description
    for the report header; raises ``Unusable`` when the op can be neither loaded nor built here. A
    ``TORCH_EXTENSIONS_DIR`` set by the user is used with torch's own JIT, once a damaged build there is discarded
    (only the op's own build directory there, which torch would rebuild anyway).
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
        builds.remove_stale_locks(directory, OP_NAME)
        if chosen:
            builds.sound(library, OP_NAME, announce, release)  # torch's JIT loads it, or builds it again
        elif _cached(builder, library, announce, release):
            return f"loaded from {directory}"
        op = _build(directory, library, bool(chosen), announce, release)
    finally:
        lock.release()
    return f"built in {directory}" if op is not None else "not used by this accelerator"


def _read_only(builder: Any, directory: Path, chosen: bool, release: str, exc: OSError) -> str:
    """A cache that cannot be written: what it holds is used as it is, or ``Unusable`` says where to point instead."""
    library = shared_library(directory)
    if (
        not chosen
        and library.exists()
        and builds.damage(library, OP_NAME) is None
        and builds.register(builder, builds.import_library(library, OP_NAME))
    ):
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
        took = builds.expected_build(directory.parent, OP_NAME, USUALLY)
        said = f"building {release}, first time only ({took}; cached in {directory})"
        announce(f"{said}; the first DeepSpeed world waits for it")
    try:
        with builds.compilers_scratch(), builds.timed(directory):
            op = build_shm_op()
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
#: In the fork server while the op builds beside its worlds, and in the ranks it forks meanwhile: they run without
#: the op, and ``inference_all_reduce`` asks the server for it.
_beside = False


@dataclass
class Background:
    """DeepSpeed's comm op building in a child of the fork server (``builds.BuildChild``), while worlds run without
    it (its compatibility switch, which ``build_shm_op`` reads). The op serves one collective only,
    ``inference_all_reduce``: a rank that calls it before the build ends asks the server for it (``_wait_in_ranks``),
    loads it and goes on as DeepSpeed would have with it. Once built, the server loads it, and later worlds inherit it
    loaded. A run whose tests are over holds nothing up for it either: the build goes on apart (``detach``), for later
    runs, while a run cut short stops it."""

    build: BuildChild
    builder: Any
    library: Path
    release: str
    compatible: object  # DeepSpeed's compatibility switch for the op before it was turned off

    @classmethod
    def begin(cls, builder: Any, directory: Path, release: str, announce: Callable[[str], None]) -> Background:
        """Start the build in a child (``warm_up`` there), saying so (and why, when the last one failed), and switch
        the op off here meanwhile: the worlds forked now run without it, as DeepSpeed does where it cannot build it."""
        global _beside
        import deepspeed.ops

        failed = builds.said_failure(directory)
        if failed is not None:
            announce(f"the last build of {release} failed ({failed}): building it again")
        announce(
            f"building {release}, first time only ({builds.expected_build(directory.parent, OP_NAME, USUALLY)}; "
            f"cached in {directory}), beside the worlds: until it is built they run without it, as DeepSpeed does "
            "where it cannot build it, and a test that calls inference_all_reduce waits for it there"
        )
        os.environ["TORCH_EXTENSIONS_DIR"] = str(directory)  # as after a load
        build = BuildChild.start(functools.partial(_build_noting_failure, directory))
        library = shared_library(directory)
        switch = deepspeed.ops.__compatible_ops__.get(builder.NAME, True)
        background = cls(build, builder, library, release, switch)
        deepspeed.ops.__compatible_ops__[builder.NAME] = False  # after the fork: the child builds it
        _beside = True
        _wait_in_ranks()
        return background

    def detach(self) -> str:
        """The run's tests are over, and it was not cut short: let the build go on after the server, for later runs,
        within ``BUILD_LOCK_TIMEOUT``. Returns the words for the user."""
        self.build.detach()
        return (
            f"{self.release} goes on building apart (process {self.build.child.pid}, for at most "
            f"{BUILD_LOCK_TIMEOUT:.0f}s): later runs load it; a run started before it is built builds beside it"
        )

    def adopt(self) -> op_builds.BuildResult:
        """Load the finished build here (later worlds inherit it loaded), or say why there is none; either way the
        worlds go on as DeepSpeed's switch then says. The words for the user, and the library for the ranks that wait
        for it in ``inference_all_reduce`` (or why there is none: their error)."""
        global _beside
        import deepspeed.ops

        _beside = False
        took = time.monotonic() - self.build.started
        try:
            self.build.result()
        except RuntimeError as exc:
            said = (
                f"{self.release} could not be built in {self.library.parent.parent} ({exc}; the fork server's log "
                "says why): worlds go on without it, as DeepSpeed does where it cannot build it"
            )
            error = f"pytest-dsrepro: {said}, and this test calls inference_all_reduce"
            return op_builds.BuildResult(said, None, error, again=True)  # a rank that needs it builds it (op_builds)
        if not _cached(self.builder, self.library, lambda _: None, self.release):
            said = f"{self.release} was built but does not load: worlds go on without it"
            return op_builds.BuildResult(
                said, None, f"pytest-dsrepro: {said}, and this test calls inference_all_reduce"
            )
        deepspeed.ops.__compatible_ops__[self.builder.NAME] = self.compatible
        said = f"{self.release} built beside the worlds in {took:.0f}s; worlds from now on use it, later runs load it"
        return op_builds.BuildResult(said, str(self.library))


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


def _wait_in_ranks() -> None:
    """Make ``inference_all_reduce`` of a rank forked while the op builds ask the server for it (``op_builds.fetch``:
    the test's clock stops while it waits), load it, then do what DeepSpeed's backend does with an op it built
    (``TorchBackend.__init__``, 0.14-0.19)."""
    from deepspeed.comm.torch import TorchBackend

    original = TorchBackend.inference_all_reduce
    if getattr(original, "dsrepro_waits", False):
        return

    @functools.wraps(original)
    def inference_all_reduce(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "shm_comm_op", None) is None and _beside:
            self.shm_comm_op = op_builds.fetch(_builder())
            self.shm_comm_op.initialize(self.get_world_size(), self.get_rank())
            if hasattr(self.shm_comm_op, "vector_kernel_level"):
                self.shm_vector_kernel_level = self.shm_comm_op.vector_kernel_level()
        return original(self, *args, **kwargs)

    inference_all_reduce.dsrepro_waits = True  # type: ignore[attr-defined]
    TorchBackend.inference_all_reduce = inference_all_reduce
