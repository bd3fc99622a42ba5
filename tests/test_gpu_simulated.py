"""GPU worlds end to end on a CPU machine: CPU torch made to claim two GPUs and to keep torch's fork rule
(``tests/cuda_sim``), with the real fork server, ranks and DeepSpeed.

What the simulation shows: no rank initialises CUDA in a poisoned fork (every CUDA initialisation is logged with the
process's bad-fork state), with a DeepSpeed that guards its import (0.19.8, this environment's) and with one that
initialises CUDA on import (``DSREPRO_SIM_UNGUARDED``, as every release before 0.19.8 does); NCCL worlds see only their
leased GPUs, one per rank, with DeepSpeed's CUDA accelerator, and gloo worlds DeepSpeed's CPU one. A CPU torch cannot
run a CUDA kernel, so what the simulation cannot show is a ZeRO step on those GPUs.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import REAL_CACHE, RunPytest, first_run_without_a_preload_list
from pytest_dsrepro.core import results
from pytest_dsrepro.core.gates import Verdict
from pytest_dsrepro.core.options import CACHE_ENV
from pytest_dsrepro.worlds.client import leases
from pytest_dsrepro.worlds.client.gpu_probe import Gpu

SIM = Path(__file__).parent / "cuda_sim"


class Simulation:
    def __init__(self, log: Path, uuid: str) -> None:
        self.log = log
        self.uuids = [f"GPU-{uuid}-0000-4000-8000-{i:012d}" for i in range(2)]

    def cuda_inits(self) -> list[str]:
        """``pid bad-fork|ok`` for every CUDA initialisation in every process."""
        return self.log.read_text().splitlines() if self.log.exists() else []


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Simulation]:
    """Two simulated GPUs for every process the test starts, of their own (no other run leases them)."""
    uuid = secrets.token_hex(4)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(SIM), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("DSREPRO_SIM_GPUS", "2")
    monkeypatch.setenv("DSREPRO_SIM_UUID", uuid)
    monkeypatch.setenv("DSREPRO_SIM_LOG", str(tmp_path / "cuda-inits.log"))
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    yield Simulation(tmp_path / "cuda-inits.log", uuid)
    for left in leases.lease_dir(Path(REAL_CACHE)).glob(f"GPU-{uuid}-*"):  # these GPUs' lease files: no one else's
        left.unlink()


FORK_RULE = """
import os, torch
torch.cuda.is_available()  # without PYTORCH_NVML_BASED_CUDA_CHECK=1: the CUDA runtime's count, which poisons
if os.fork() == 0:
    try:
        torch.cuda.set_device(0)
    except RuntimeError as exc:
        print(exc, flush=True)
    os._exit(0)
os.wait()
"""


def test_the_simulation_keeps_torchs_fork_rule(gpus: Simulation) -> None:
    """Without this the other tests here could not fail: a forked child of a process that asked CUDA is refused."""
    out = subprocess.run([sys.executable, "-c", FORK_RULE], capture_output=True, text=True, check=True).stdout
    assert "Cannot re-initialize CUDA in forked subprocess" in out
    assert [line.split()[1] for line in gpus.cuda_inits()] == ["bad-fork"]


WORLDS = """
import importlib, os, sys
import pytest


def deepspeed():
    return importlib.import_module("deepspeed")  # not an import statement: the rank's own import stays visible


@pytest.mark.ds_world(timeout=120)
def test_nccl_world(ds_rank):
    import torch, torch.distributed as dist
    assert ("deepspeed" in sys.modules) is (os.environ["PRELOADED"] == "yes")  # by the fork server, or not yet
    visible = os.environ["CUDA_VISIBLE_DEVICES"].split(",")
    assert len(visible) == 2 and torch.cuda.device_count() == 2
    assert torch.cuda.current_device() == ds_rank
    assert "GPU-" + torch.cuda.get_device_properties(ds_rank).uuid == visible[ds_rank]
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"  # the harness, not NCCL, ends a hang
    accelerator = deepspeed().accelerator.get_accelerator()
    assert (accelerator.device_name(), accelerator.communication_backend_name()) == ("cuda", "nccl")
    t = torch.ones(1)
    dist.all_reduce(t)  # gloo underneath: a CPU torch has no NCCL
    assert t.item() == 2


@pytest.mark.ds_world(backend="gloo", timeout=120)
def test_gloo_world_on_a_gpu_machine(ds_rank):
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    accelerator = deepspeed().accelerator.get_accelerator()
    assert (accelerator.device_name(), accelerator.communication_backend_name()) == ("cpu", "gloo")
"""


def test_nccl_and_gloo_worlds_with_a_deepspeed_that_guards_its_import(
    pytester: pytest.Pytester, run: RunPytest, gpus: Simulation, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PRELOADED", "yes")
    pytester.makepyfile(WORLDS)
    result = run("-v")
    result.assert_outcomes(passed=2)
    out = result.stdout.str()
    result.stdout.re_match_lines(
        [
            r"worlds ran on: DeepSpeed \S+ from .*, accelerator cuda \(communication backend nccl\); comm op not "
            r"used by this accelerator",
            r"worlds ran on: DeepSpeed \S+ from .*, accelerator cpu \(communication backend gloo\); comm op .*",
        ],
        consecutive=False,
    )
    assert "imported by each rank" not in out  # the fork server preloaded DeepSpeed: forks stay clean
    inits = gpus.cuda_inits()
    assert len(inits) >= 3, inits  # the probe, then each rank
    assert all(line.endswith(" ok") for line in inits), inits


DEEPSPEED_GLOO_WORLDS = """
import deepspeed  # the ranks use DeepSpeed: the fork server warms up for them
import pytest


@pytest.mark.ds_world(backend="gloo")
@pytest.mark.parametrize("n", range(3))
def test_gloo(ds_rank, n):
    pass
"""


def test_on_a_gpu_machine_no_world_waits_for_the_preload_search(
    pytester: pytest.Pytester, run: RunPytest, gpus: Simulation, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 48 item 1: on a GPU machine the fork server found what a first engine step imports itself, before its
    first world, forking a throwaway child every few seconds for minutes (a GPU image's Python stack), and worlds with
    a short timeout failed as if it had not started their ranks. A scout finds it beside the worlds there too, and
    the worlds run meanwhile."""
    first_run_without_a_preload_list(pytester, run, monkeypatch, DEEPSPEED_GLOO_WORLDS, passed=3)


def test_a_deepspeed_that_initialises_cuda_on_import_is_left_to_the_ranks(
    pytester: pytest.Pytester, run: RunPytest, gpus: Simulation, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))  # the note that this DeepSpeed poisons forks stays here
    monkeypatch.setenv("DSREPRO_SIM_UNGUARDED", "1")
    monkeypatch.setenv("PRELOADED", "no")
    pytester.makepyfile(WORLDS)
    result = run("-v", "-k", "nccl")
    result.assert_outcomes(passed=1, deselected=1)
    result.stdout.fnmatch_lines(
        [
            "*worlds ran on: DeepSpeed * accelerator cuda (communication backend nccl); DeepSpeed imported by each "
            "rank after the fork (importing DeepSpeed * with its cuda accelerator initialises CUDA, which poisons "
            "the fork server's forks)"
        ]
    )
    inits = gpus.cuda_inits()
    # the probe, the first fork server (poisoned by DeepSpeed: it restarted before forking any rank), each rank
    assert len(inits) >= 4, inits
    assert all(line.endswith(" ok") for line in inits), inits
    assert len(list((tmp_path / "cache" / "fork-safety").glob("deepspeed-*-cuda.json"))) == 1  # for the next server


CPU_ONLY = """
import pytest

pytestmark = [
    pytest.mark.ds_repro(id="cpu-only", title="a bug in the CPU accelerator's code path"),
    pytest.mark.ds_premise(accelerator="cpu"),
]


@pytest.mark.ds_world(size=1, timeout=120)
def test_cpu_only(ds_rank):
    pass
"""


def test_a_cpu_only_repro_is_not_applicable_in_an_nccl_world(
    pytester: pytest.Pytester, run: RunPytest, gpus: Simulation, tmp_path: Path
) -> None:
    """Its premise names the CPU accelerator, and an NCCL world's ranks run CUDA's: NOT-APPLICABLE, with why, and no
    world; in a gloo world on the same machine it runs."""
    pytester.makepyfile(CPU_ONLY)
    result = run("-rs", "--ds-results", str(tmp_path / "nccl"))
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(
        [
            "SKIPPED [[]1[]] test_a_cpu_only_repro_is_not_applicable_in_an_nccl_world.py:9: not applicable in a "
            "nccl world: its bug exists only with DeepSpeed's cpu accelerator (its ds_premise), and this world's ranks "
            "run the cuda one"
        ]
    )
    assert "worlds ran on" not in result.stdout.str()  # no fork server started
    (record,) = [t for f in results.read_all([tmp_path / "nccl"])[0] for t in f.run.tests]
    assert record.verdict is Verdict.NOT_APPLICABLE
    assert "cpu accelerator" in (record.error or "")
    run("--ds-backend", "gloo").assert_outcomes(passed=1)


HUNG = """
import time
import pytest


@pytest.mark.ds_world(backend="nccl", timeout=4)
def test_hangs(ds_rank):
    import torch.distributed as dist
    dist.barrier()
    time.sleep(600)
"""


def test_a_hung_nccl_world_ends_with_stacks_and_flight_recorder(
    pytester: pytest.Pytester, run: RunPytest, gpus: Simulation, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"  # an NCCL-only run needs no comm op: a cache of its own, kept dumps and all
    monkeypatch.setenv(CACHE_ENV, str(cache))
    pytester.makepyfile(HUNG)
    result = run()
    result.assert_outcomes(failed=1)
    kept = sorted((cache / "nccl-flight-recorder").glob("*/nccl-trace-rank-*"))
    assert [p.name for p in kept] == ["nccl-trace-rank-0", "nccl-trace-rank-1"]
    out = result.stdout.str()
    for rank in (0, 1):
        assert (
            f"rank {rank}: hung: still running when the 4s world timeout expired; NCCL flight recorder: 2 collectives "
            f"recorded; not completed: nccl:all_reduce #2 started (sizes [[4]]); dump {kept[rank]} (dumped by torch's "
            "watchdog at the collective's timeout)"
        ) in out
    result.stdout.fnmatch_lines(["---- rank 0: Python stacks when hung ----", "*", "*line 9 in test_hangs"])
    assert "nccl_recorder.py" not in out  # the thread that dumps the flight recorder is the harness's


KEPT = """
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from filelock import FileLock, Timeout

class SEEN:  # the module lives as long as its ranks (its containers a kept rank refills; a class's attributes not)
    pass


def lease_holder():
    leases = Path(os.environ["DSREPRO_CACHE_DIR"]) / "gpu-leases"
    lock = FileLock(str(leases / f"GPU-{os.environ['DSREPRO_SIM_UUID']}-0000-4000-8000-000000000000.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return (leases / f"GPU-{os.environ['DSREPRO_SIM_UUID']}-0000-4000-8000-000000000000.holder").read_text()
    lock.release()
    return None


def all_reduce():
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2


@pytest.mark.ds_world(backend="nccl", reuse=True, timeout=120)
class TestKept:
    def test_1(self, ds_rank):
        all_reduce()
        SEEN.pid, SEEN.group = os.getpid(), dist.group.WORLD
        assert "TestKept.test_1" in lease_holder()

    def test_2_same_ranks_group_and_lease(self, ds_rank):
        assert os.getpid() == SEEN.pid
        assert dist.group.WORLD is SEEN.group  # the communicator is kept, not made again
        assert "TestKept.test_1" in lease_holder()  # the lease taken for the first test, held since
        all_reduce()

    def test_3_fails(self, ds_rank):
        assert os.getpid() == SEEN.pid
        assert ds_rank == 1, "a failure ends the kept world"

    def test_4_new_ranks(self, ds_rank):
        assert not hasattr(SEEN, "pid")  # a new process: the module was imported again
        assert "TestKept.test_4_new_ranks" in lease_holder()
        all_reduce()
"""


def test_a_reuse_class_keeps_its_nccl_ranks_communicator_and_lease_until_a_test_fails(
    pytester: pytest.Pytester, run: RunPytest, gpus: Simulation, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV, str(cache))
    pytester.makepyfile(KEPT)
    result = run("-v")
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(["*test_3_fails*FAILED*", "*a failure ends the kept world*"])
    both = leases.try_lease([Gpu(i, u, "") for i, u in enumerate(gpus.uuids)], 2, leases.lease_dir(cache), "check")
    assert both is not None  # the last world's lease was given back with its world
    both.release()


TIMED_OUT = """
import os
import time

import pytest

PIDS = []  # the module lives as long as its ranks


@pytest.mark.ds_world(backend="nccl", reuse=True, timeout=4)
class TestKept:
    def test_1_outlives_its_groups_timeout(self, ds_rank):
        PIDS.append(os.getpid())
        time.sleep(3.5)  # past the process group's 1s: the simulated watchdog dumps, the test still passes

    def test_2_gets_new_ranks(self, ds_rank):
        assert not PIDS
"""


def test_an_nccl_world_whose_watchdog_dumped_is_not_kept(
    pytester: pytest.Pytester, run: RunPytest, gpus: Simulation, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    pytester.makepyfile(TIMED_OUT)
    run().assert_outcomes(passed=2)


BUSY = """
import pytest


@pytest.mark.ds_world(backend="nccl")
def test_needs_both_gpus(ds_rank):
    pass
"""


def test_an_nccl_world_whose_gpus_stay_busy_is_skipped_naming_them(
    pytester: pytest.Pytester, run: RunPytest, gpus: Simulation, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV, str(cache))
    lease = leases.try_lease([Gpu(1, gpus.uuids[1], "Simulated GPU")], 1, leases.lease_dir(cache), "another session")
    assert lease is not None
    try:
        pytester.makepyfile(BUSY)
        result = run("-v", "-rs", "--ds-gpu-wait", "1")
    finally:
        lease.release()
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(
        [
            f"SKIPPED * no 2 free GPUs within 1s (--ds-gpu-wait); busy: GPU 1 (Simulated GPU, {gpus.uuids[1]}) "
            f"leased by pid {os.getpid()} (another session) since *"
        ]
    )
    assert "worlds ran on" not in result.stdout.str()  # skipped before any fork server started
    free = leases.try_lease([Gpu(0, gpus.uuids[0], "")], 1, leases.lease_dir(cache), "check")
    assert free is not None  # GPU 0, taken at each try while GPU 1 was busy, was given back each time
    free.release()
