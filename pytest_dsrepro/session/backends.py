"""Where a session's worlds run, chosen once at configure (``choose``) and kept on ``config.stash[WORLDS_KEY]``:
forked by the fork server (``SpawnedWorlds``, the normal case), or, under an external launcher (torchrun, SLURM),
made of the launched pytest processes themselves (``launched_run.LaunchedRun``). Setup, the body's call,
``run_in_world``, the collector and the session's end ask the backend, never which one it is."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

import pytest

from ..core.errors import HarnessError
from ..core.options import Settings
from ..core.outcome import WorldOutcome
from ..core.results import Environment
from ..core.world_spec import WorldSpec, settle_backend
from ..worlds.client import WorldInterrupted, WorldRunner, leases
from ..worlds.launched import launcher
from ..worlds.protocol import ServerFacts
from . import launched_run, markers, settings, source_digests
from .execution import WorldFailed
from .progress_line import progress_line
from .rank_job import WorldCall, rank_job, uses_deepspeed
from .stash import WORLDS_KEY, Prepared


class Worlds(Protocol):
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


class SpawnedWorlds:
    """Worlds forked by this process's fork servers (``WorldRunner``), one per test."""

    writes = True

    def __init__(self, config: pytest.Config, resolved: Settings) -> None:
        self.config = config
        self.runner = WorldRunner(
            resolved.cache_dir, resolved.startup_timeout, progress=progress_line(config), gpu_wait=resolved.gpu_wait
        )

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
            markers.fail(f"pytest-dsrepro could not start its fork server: {exc}")

    def own_world(self, spec: WorldSpec, where: str) -> Prepared:
        return self._settled(spec)

    def run(self, call: WorldCall, prepared: Prepared, run: int = 0) -> WorldOutcome:
        """The world's outcome. A test failure raised meanwhile (pytest-timeout's) fails the test with its own words
        followed by the world's story, every rank's stack included, instead of a traceback through the plugin."""
        source_digests.check_unchanged(self.config, call.test.module_file)  # the ranks import it anew
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


def choose(config: pytest.Config, resolved: Settings) -> Worlds:
    """At configure, once: the launcher's worlds when one started this process (``srun pytest`` without one is
    refused), else spawned ones (made earlier by ``starting_worlds`` when a plugin asked)."""
    launched = launched_run.configure(config, resolved)
    if launched is not None:
        return launched
    return config.stash.get(WORLDS_KEY, None) or SpawnedWorlds(config, resolved)


@contextmanager
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
    except pytest.UsageError:
        resolved = None
    if resolved is None:
        yield
        return
    spawned = SpawnedWorlds(config, resolved)
    config.stash[WORLDS_KEY] = spawned
    spawned.runner.launch()
    try:
        yield
    except BaseException:
        del config.stash[WORLDS_KEY]
        spawned.close(finish_builds=False)
        raise
