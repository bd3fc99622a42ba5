"""The pytest side of a run under an external launcher (torchrun, ``srun ... torchrun``): every pytest process is
one rank, and the processes together make one run.

Each world test passes the lockstep at setup and runs as one world at call (``worlds.launched``); every rank
reports the one outcome rank 0 built, judged by the same gates. Only rank 0 writes the run's files (``--ds-results``,
``--ds-report``, ``--junitxml``): the other ranks would write the same verdicts again. ``srun pytest`` with several
tasks and no launcher stops at startup with what to run instead.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import pytest

from ..core import options, versions
from ..core.options import Launched, Settings
from ..core.outcome import WorldOutcome
from ..core.results import Environment
from ..core.world_spec import WorldSpec
from ..worlds.launched import launcher
from ..worlds.launched.launched_world import LaunchedWorld, stop_as_interrupted
from ..worlds.protocol import ServerFacts
from .rank_job import Prepared, WorldCall
from .verdicts import fail


class LaunchedRun:
    """This process's part in a launched run: the session's world backend (``backends.WorldBackend``), registered as
    a plugin (``dsrepro-launched``) for its hooks."""

    def __init__(self, world: Launched, settings: Settings) -> None:
        self.world = world
        self.settings = settings
        release = versions.installed_text("deepspeed") or "not installed"
        self.ranks = LaunchedWorld(world, release, connect_timeout=settings.timeout)
        self.arrived: str | None = None  # the test this rank passed the lockstep for, until its body runs
        self.uncollected: dict[str, str] = {}  # this rank's world tests that other ranks lack, and which ranks

    @property
    def writes(self) -> bool:
        """Rank 0 writes the run's files; the others would only write the same verdicts again."""
        return self.world.rank == 0

    def prepare(self, item: pytest.Item, spec: WorldSpec) -> Prepared:
        """At setup: a world of the launcher's size, every rank at this test, the backend for this node's devices.

        Skips and failures here are the same on every rank, except the backend's (a node without enough GPUs):
        a rank that skips after the lockstep tells the others (``pytest_runtest_logreport``).
        """
        if spec.size != self.world.world_size:
            pytest.skip(f"needs a {spec.size}-rank world; the launcher started {self.world.world_size} ranks")
        lacking = self.uncollected.get(item.nodeid)
        if lacking is not None:
            fail(f"{item.nodeid}: {lacking}; every world test must run on every rank")
        if not (spec.process_group and spec.launcher_env):
            pytest.skip(
                "ds_world(process_group=False/launcher_env=False) needs worlds that pytest-dsrepro starts itself; "
                "under an external launcher every rank already has the launcher's variables and process group"
            )
        self.arrived = item.nodeid
        problem = self.ranks.arrive(item.nodeid, spec.timeout)
        if problem is not None:
            fail(f"{item.nodeid}: {problem}")
        backend, skip = launcher.settle_backend_here(spec.backend, self.world, launcher.cuda_devices())
        if skip:
            pytest.skip(skip)
        return Prepared(spec, backend)

    def own_world(self, spec: WorldSpec, where: str) -> Prepared:
        fail(f"{where}: run_in_world forks a world of its own, which an externally launched run cannot")

    def run(self, call: WorldCall, prepared: Prepared, run: int = 0) -> WorldOutcome:
        """The body as one world across every rank; the outcome is rank 0's, the same on every rank. ``run``: which
        world of a nondeterministic verdict's series (every rank runs the same series: it stops on one outcome)."""
        self.arrived = None
        spec = prepared.spec
        deepspeed = call.uses_deepspeed and spec.process_group
        return self.ranks.run(
            call.function, call.kwargs, call.fixes, prepared.backend, spec.timeout, deepspeed=deepspeed, run=run,
            setup=call.setup,
        )  # fmt: skip

    def plan(self, items: Sequence[pytest.Item]) -> None:
        """Every rank's world tests compared (``LaunchedWorld.plan``): a test that not every rank has fails."""
        world_tests = [item.nodeid for item in items if item.get_closest_marker("ds_world") is not None]
        self.uncollected = self.ranks.plan(world_tests, self.settings.timeout)

    def started(self) -> list[ServerFacts]:
        return []  # no fork server: this process is a rank

    def environment(self, environment: Environment) -> Environment:
        """What the worlds of this run really ran on: the launcher's world size, this node's devices, the backend
        settled for them, DeepSpeed's accelerator as the bodies got it."""
        devices = launcher.cuda_devices()
        backend, _ = launcher.settle_backend_here(self.settings.backend, self.world, devices)
        return dataclasses.replace(
            environment,
            backend=backend,
            world_size=self.world.world_size,
            gpu=", ".join(sorted(set(names))) if (names := launcher.gpu_names(devices)) else None,
            gpu_count=devices,
            accelerator=launcher.accelerator(devices),
        )

    def close(self, finish_builds: bool) -> None:
        """Rank 0 has written the run's files by now; the other ranks exit only then (``LaunchedWorld.close``)."""
        self.ranks.close()

    # ---- hooks --------------------------------------------------------------------------------------------------

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """A test this rank passed the lockstep for, but whose setup then failed or skipped here: the other ranks
        are told, instead of waiting for this rank at the body."""
        if report.when == "setup" and not report.passed and report.nodeid == self.arrived:
            self.arrived = None
            crash = getattr(report.longrepr, "reprcrash", None)  # the exception line, as the short summary shows it
            if isinstance(report.longrepr, tuple):
                text = str(report.longrepr[2])
            else:
                text = crash.message if crash is not None else report.longreprtext
            first = (text.strip().splitlines() or ["?"])[0]
            self.ranks.abandon(f"its setup {'skipped' if report.skipped else 'failed'}: {first}")

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """Tell the ranks still at a world test that this one has none left (even when it collected none)."""
        self.ranks.finish(self.settings.timeout)


def configure(config: pytest.Config, settings: Settings) -> LaunchedRun | None:
    """At startup: ``srun pytest`` without a launcher is refused; under a launcher, the run's part of this process
    (registered for its hooks), and only rank 0 keeps ``--junitxml``."""
    problem = options.unlaunched_slurm(os.environ)
    if problem is not None:
        raise pytest.UsageError(problem)
    world = launcher.launched()
    if world is None:
        return None
    run = LaunchedRun(world, settings)
    stop_as_interrupted()
    if not run.writes and getattr(config.option, "xmlpath", None):
        config.option.xmlpath = None  # read by pytest's junitxml plugin in its own pytest_configure, after this one
    config.pluginmanager.register(run, "dsrepro-launched")
    return run
