"""The session's world backend: where its worlds run, chosen once at configure (``configure``) and kept on
``config.stash[WORLD_BACKEND_KEY]``: forked by the fork server (``SpawnedWorlds``, the normal case), or, under an
external launcher (torchrun, SLURM), made of the launched pytest processes themselves (``launched_run.LaunchedRun``).
Setup, the body's call, ``run_in_world``, the collector and the session's end ask the world backend, never which one
it is. Once the run's tests are known the world backend plans them and the cache directory is checked (``plan``)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import Any, Protocol

import pytest

from ..core.errors import HarnessError
from ..core.escape import terminal
from ..core.options import Settings, SettingsError
from ..core.outcome import WorldOutcome
from ..core.paths import unwritable
from ..core.results import Environment
from ..core.world_spec import WorldSpec, settle_backend
from ..worlds.client import WorldInterrupted, WorldRunner, leases
from ..worlds.launched import launcher
from ..worlds.protocol import ServerFacts
from ..worlds.server import comm_op
from . import launched_run, settings
from .rank_job import Prepared, WorldCall, check_unchanged, rank_job, uses_deepspeed
from .verdicts import WorldFailed, fail_harness


class WorldBackend(Protocol):
    """What the pytest side asks of the worlds of its session."""

    @property
    def writes(self) -> bool:
        """Does this process write the run's files (``--ds-results``, ``--ds-report``, ``--junitxml``)?"""

    def prepare(self, item: pytest.Item, spec: WorldSpec) -> Prepared:
        """At a world test's setup: its backend settled for the devices at hand (skips, fails as pytest does)."""

    def own_world(self, spec: WorldSpec, where: str) -> Prepared:
        """A world of its own for ``run_in_world`` (``where``), settled; ``HarnessError`` when none can start."""

    def run(self, call: WorldCall, prepared: Prepared, run: int = 0) -> WorldOutcome:
        """One world's outcome; ``run``: which world of a nondeterministic verdict's series."""

    def plan(self, items: Sequence[pytest.Item]) -> None:
        """Once the run's tests are known, before the first."""

    def started(self) -> list[ServerFacts]:
        """What the worlds ran on, one entry per fork server started."""

    def environment(self, environment: Environment) -> Environment:
        """The run's environment as its worlds really had it."""

    def close(self, finish_builds: bool) -> None:
        """At the session's very end; ``finish_builds``: it was not interrupted, so work for later runs may go on."""


#: The session's world backend, chosen once at configure (``configure``), or earlier by ``starting_worlds``.
WORLD_BACKEND_KEY: pytest.StashKey[WorldBackend] = pytest.StashKey()
#: Did the session end interrupted (Ctrl-C)? Then nothing is waited for at its end.
INTERRUPTED_KEY = pytest.StashKey[bool]()


class SpawnedWorlds:
    """Worlds forked by this process's fork servers (``WorldRunner``), one per test."""

    writes = True

    def __init__(self, config: pytest.Config, resolved: Settings) -> None:
        self.config = config
        self.runner = WorldRunner(
            resolved.cache_dir, resolved.startup_timeout, progress=progress_line(config), gpu_wait=resolved.gpu_wait
        )
        self.sigterm = stop_on_sigterm()

    def _settled(self, spec: WorldSpec) -> Prepared:
        """The backend for the CUDA devices found (a spawned probe: no CUDA here, before any fork server starts)."""
        backend, skip = settle_backend(spec.backend, spec.size, self.runner.cuda_devices())
        if skip:
            pytest.skip(skip)
        return Prepared(spec, backend)

    def prepare(self, item: pytest.Item, spec: WorldSpec) -> Prepared:
        try:
            return self._settled(spec)
        except HarnessError as exc:
            fail_harness("start its fork server", exc)

    def own_world(self, spec: WorldSpec, where: str) -> Prepared:
        return self._settled(spec)

    def run(self, call: WorldCall, prepared: Prepared, run: int = 0) -> WorldOutcome:
        """The world's outcome. A test failure raised meanwhile (pytest-timeout's) fails the test with its own words
        followed by the world's story, every rank's stack included, instead of a traceback through the plugin."""
        check_unchanged(self.config, call.test.module_file)  # the ranks import it anew
        job = rank_job(call, prepared)
        try:
            return self.runner.run(job, prepared.spec.size, call.reuse)
        except leases.Busy as busy:  # other workers' or sessions' worlds held the GPUs for longer than --ds-gpu-wait
            pytest.skip(str(busy))
        except WorldInterrupted as interrupted:
            cause = interrupted.cause
            if isinstance(cause, pytest.fail.Exception):
                raise WorldFailed(interrupted.outcome, heading=str(cause.msg)) from None
            raise cause from None

    def plan(self, items: Sequence[pytest.Item]) -> None:
        """Tell the world runner how many tests are worlds, and whether more than one world will use DeepSpeed (a
        ``ds_nondeterministic`` test runs a series of them): ``WorldRunner.plan``."""
        worlds = deepspeed_worlds = 0
        for item in items:
            if item.get_closest_marker("ds_world") is None:
                continue
            worlds += 1
            if deepspeed_worlds < 2 and uses_deepspeed(item):
                deepspeed_worlds += 2 if item.get_closest_marker("ds_nondeterministic") is not None else 1
        self.runner.plan(worlds, deepspeed_worlds)

    def started(self) -> list[ServerFacts]:
        return self.runner.started()

    def environment(self, environment: Environment) -> Environment:
        return environment

    def close(self, finish_builds: bool) -> None:
        self.runner.close(finish_builds=finish_builds)
        if self.sigterm is not None and signal.getsignal(signal.SIGTERM) is _terminated:  # else held since, as the
            signal.signal(signal.SIGTERM, self.sigterm)  # collector holds CI's second signal: left to its holder


def _terminated(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt("pytest-dsrepro: SIGTERM: the run stops as on Ctrl-C, the tests that ended recorded")


def stop_on_sigterm() -> Any:
    """SIGTERM (a CI job cancelled, a scheduler's time limit, ``kill``) ends this pytest process as Ctrl-C does: the
    world running is stopped and reaped, the session ends interrupted (exit 2), and the tests that ended are in the
    summary, ``--ds-results`` and ``--ds-report``, where SIGTERM's default would lose them all. Only where nobody set a
    handler of their own, and from the main thread; the handler it replaced (for ``close``), else None."""
    if threading.current_thread() is not threading.main_thread():
        return None
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return None
    return signal.signal(signal.SIGTERM, _terminated)


def configure(config: pytest.Config, resolved: Settings) -> None:
    """At configure, once: the launcher's worlds when one started this process (``srun pytest`` without one is
    refused), else spawned ones (made earlier by ``starting_worlds`` when a plugin asked)."""
    launched = launched_run.configure(config, resolved)
    chosen = launched or config.stash.get(WORLD_BACKEND_KEY, None) or SpawnedWorlds(config, resolved)
    config.stash[WORLD_BACKEND_KEY] = chosen


def plan(session: pytest.Session) -> None:
    """Once the run's tests are known, before the first: the world backend plans them, and a cache directory that
    can serve no world stops a run that has world tests, in one line, rather than failing each of them."""
    config = session.config
    config.stash[WORLD_BACKEND_KEY].plan(session.items)
    if config.option.collectonly or not any(item.get_closest_marker("ds_world") for item in session.items):
        return
    cache = config.stash[settings.SETTINGS_KEY].cache_dir
    why = unwritable(cache)
    if why is None:
        return
    if not comm_op.holds_builds(cache):
        raise pytest.UsageError(  # one line, as every startup error: pytest.exit() here reads "! Exit: ... !"
            f"pytest-dsrepro: the cache directory {cache} cannot be written ({why}) and holds no build of DeepSpeed's "
            "comm op for worlds to use: point --ds-cache-dir (or DSREPRO_CACHE_DIR) at a writable directory"
        )
    progress_line(config)(f"the cache directory {cache} cannot be written ({why}): worlds use the builds it holds")


def session_finished(session: pytest.Session, exitstatus: int) -> None:
    """Note whether the session was interrupted, for ``close``."""
    session.config.stash[INTERRUPTED_KEY] = exitstatus == pytest.ExitCode.INTERRUPTED


def close(config: pytest.Config) -> None:
    """At the very end (after the summary and every output written: a launched rank 0's, for its peers); a comm-op
    build beside the worlds is let go on here, for later runs, unless the session was interrupted."""
    world_backend = config.stash.get(WORLD_BACKEND_KEY, None)
    if world_backend is not None:
        world_backend.close(finish_builds=not config.stash.get(INTERRUPTED_KEY, True))


def progress_line(config: pytest.Config) -> Callable[[str], None]:
    """A line on the terminal, now, even mid-test: ``pytest-dsrepro: <text>``, for what takes long or changes the run
    (a fork server's first start, a cache that cannot be written).

    pytest captures a test's output at the file-descriptor level, so the line is written with capturing suspended,
    as pytest's own live logging does (the capture manager reached through the plugin manager, by its registered
    name, as pytest-timeout does). Silent where there is no terminal reporter (``-p no:terminal``, xdist workers).
    """

    def write(text: str) -> None:
        if not config.pluginmanager.has_plugin("terminalreporter"):
            return
        capture = config.pluginmanager.getplugin("capturemanager")
        suspended = getattr(capture, "global_and_fixture_disabled", contextlib.nullcontext)
        writer = config.get_terminal_writer()
        with suspended():
            writer.line()
            writer.line(terminal(f"pytest-dsrepro: {text}"), bold=True)
            writer.flush()

    return write


@contextlib.contextmanager
def starting_worlds(config: pytest.Config) -> Iterator[None]:
    """For a run whose tests are nearly all DeepSpeed worlds (``pytest_dsrepro.upstream``), around its earliest
    work: make the spawned worlds and start their fork server, whose import of torch and DeepSpeed (seconds) then
    overlaps pytest's own and its collection. Should the block raise (the run ends before ``pytest_configure``, so
    before anything stops the server), the server is stopped. Not for a run that starts no world (collection only,
    help, an xdist controller), nor for a launcher's rank (no fork server there); bad options are left for
    ``pytest_configure`` to report, once."""
    known = config.known_args_namespace
    no_world = any(getattr(known, name, None) for name in ("collectonly", "help", "version", "numprocesses"))
    try:
        resolved = None if no_world or launcher.launched() else settings.resolve(config, namespace=known)
    except (pytest.UsageError, SettingsError):  # said once, by pytest_configure
        resolved = None
    if resolved is None:
        yield
        return
    spawned = SpawnedWorlds(config, resolved)
    config.stash[WORLD_BACKEND_KEY] = spawned
    spawned.runner.launch()
    try:
        yield
    except BaseException:
        del config.stash[WORLD_BACKEND_KEY]
        spawned.close(finish_builds=False)
        raise
