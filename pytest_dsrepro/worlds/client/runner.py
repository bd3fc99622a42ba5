"""Runs in the pytest process: the worlds of one pytest process, on its fork servers (one per DeepSpeed accelerator
its worlds use; on a CPU machine, one), with the GPUs of its NCCL worlds leased for each.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from pathlib import Path

from ...core.outcome import WorldOutcome
from ...core.world_spec import accelerator_for
from ..protocol import FAILURE_GRACE, EnvironChanges, RankJob, ServerFacts
from . import gpu_probe, leases, nccl_diagnostics
from .fork_server import ForkServer, Progress, _silent
from .gpu_probe import Gpu
from .world_run import STACK_DUMP_WAIT, WorldRun

#: The report header's note (``ServerFacts.preloaded``) for a run of one world that uses DeepSpeed (``plan``).
NOT_WARMED = "nothing: one world of this run uses DeepSpeed, and its ranks import what they need themselves"


class WorldRunner:
    """Runs worlds for one pytest process; owns its fork servers, one per DeepSpeed accelerator its worlds use (on a
    CPU machine, one), and leases the GPUs of its NCCL worlds (``leases``).

    ``failure_grace``: after one rank fails, how long the others get before they are stopped; ``stack_dump_wait``:
    how long ranks get to write their Python stacks before they are killed; ``progress``: told what a slow fork
    server start is doing; ``gpu_wait``: how long an NCCL world waits for its GPUs before ``leases.Busy``.
    """

    def __init__(
        self,
        cache_dir: Path,
        startup_timeout: float,
        *,
        failure_grace: float = FAILURE_GRACE,
        stack_dump_wait: float = STACK_DUMP_WAIT,
        progress: Progress = _silent,
        gpu_wait: float = leases.WAIT,
    ) -> None:
        self.cache_dir = cache_dir
        self.startup_timeout = startup_timeout
        self.progress = progress
        self.failure_grace = failure_grace
        self.stack_dump_wait = stack_dump_wait
        self.servers: dict[str, ForkServer] = {}  # accelerator -> its fork server
        self.warm_ahead = True  # ``plan``
        self.gpu_leases = leases.WorldLeases(leases.lease_dir(cache_dir), gpu_wait)
        self._gpus: tuple[Gpu, ...] | None = None
        self._ids = itertools.count(1)

    def gpus(self) -> tuple[Gpu, ...]:
        """The machine's CUDA devices, found once (``gpu_probe.find``: nothing to find, and no probe, without a GPU
        device node), before any fork server starts: the backend, hence the server, depends on them."""
        if self._gpus is None:
            self._gpus = gpu_probe.find()
        return self._gpus

    def cuda_devices(self) -> int:
        return len(self.gpus())

    def server_for(self, backend: str) -> ForkServer:
        """The fork server of worlds with this backend: DeepSpeed's accelerator follows it (``accelerator_for``)."""
        accelerator = accelerator_for(backend, os.environ)
        if accelerator not in self.servers:
            self.servers[accelerator] = ForkServer(
                self.cache_dir, self.startup_timeout, self.progress, accelerator=accelerator, gpus=self.gpus()
            )
        return self.servers[accelerator]

    @property
    def server(self) -> ForkServer:
        """The fork server of gloo worlds (on a CPU machine, the only one)."""
        return self.server_for("gloo")

    def started(self) -> list[ServerFacts]:
        """The facts of every fork server that started, in the order they did."""
        return [s.facts for s in self.servers.values() if s.facts is not None]

    def facts(self) -> ServerFacts:
        return self.server.start()

    def launch(self) -> None:
        """Start the gloo worlds' fork server now, for DeepSpeed's worlds, without waiting for it: the run's first
        world then finds it ready, or nearly."""
        self.server.launch(deepspeed=True)

    def plan(self, worlds: int, deepspeed_worlds: int) -> None:
        """How many worlds the run has, and how many use DeepSpeed (counted up to 2). The fork server warms up ahead
        of its ranks (``RankJob.warm``, ``server.preload``) only for more than one: warming there costs about what
        one cold world's ranks spend on the same work side by side, and more where a test skips or fails before it
        needs all of it. A run of one such world (one repro, one upstream test) gets its verdict that much sooner.
        A run of no world stops a server started early (``launch``), which would only take CPU from the tests."""
        self.warm_ahead = deepspeed_worlds > 1
        if not worlds:
            self.close()

    def run(self, job: RankJob, size: int, reuse: str | None = None) -> WorldOutcome:
        """Run one world of ``size`` ranks (a test that uses DeepSpeed, ``job.warm``, starts warm); ``reuse``: the
        test's reuse scope (``Spawn.reuse``): ranks kept from its previous test may run it. An NCCL world
        runs on GPUs leased for it alone (``leases.WorldLeases``); ``leases.Busy`` when none came free within
        ``gpu_wait``."""
        server = self.server_for(job.backend)
        nccl = job.backend == "nccl"
        lease = self.gpu_leases.take(self.gpus(), size, _holder(job)) if nccl else None
        cold = job.warm and not self.warm_ahead
        job = dataclasses.replace(job, warm=job.warm and self.warm_ahead)
        world = None
        try:
            server.start(job.warm)
            if not server.alive:
                server.close()
                server.start(job.warm)
            world = WorldRun(
                server,
                next(self._ids),
                size,
                job.backend,
                job.timeout,
                failure_grace=self.failure_grace,
                stack_dump_wait=self.stack_dump_wait,
                reuse=reuse,
                flight_recorder=_flight_recorder(self.cache_dir) if nccl else None,
            )
            seen = {**os.environ, **(lease.environ() if lease else {})}
            if nccl:
                seen.update(nccl_diagnostics.environment(world.workdir, os.environ, job.timeout))
            job = dataclasses.replace(job, environ=EnvironChanges.between(server.process.environ, seen))
            try:
                return world.run(job)
            finally:
                server.noted_preload(world.preloaded or (NOT_WARMED if cold else None), world.fork_hazard)
        finally:
            if lease is not None:
                self.gpu_leases.ended(lease, kept=world is not None and world.kept)

    def close(self, finish_builds: bool = False) -> None:
        """Stop every fork server; ``finish_builds``: the run was not interrupted, so comm-op builds still running
        beside its worlds go on apart, for later runs, without holding this one up (``ForkServer.finish_build``)."""
        try:
            if finish_builds:
                for server in self.servers.values():
                    server.finish_build()
        finally:
            for server in self.servers.values():
                server.close()
            self.gpu_leases.release_kept()


def _flight_recorder(cache_dir: Path) -> Path:
    """Where a stopped NCCL world's flight recorder dumps are kept (its own directory is discarded)."""
    return cache_dir / "nccl-flight-recorder" / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


def _holder(job: RankJob) -> str:
    """Who holds an NCCL world's lease, in words for those who wait: its test, and its xdist worker."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    return f"{Path(job.test.module_file).name}::{job.test.qualname}" + (f", xdist {worker}" if worker else "")
