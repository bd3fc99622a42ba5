"""Declared reuse (``ds_world(reuse=True)``): a class's tests on the same ranks, each with a fresh process group, and
never a cascade: after a failure of its body the next test runs on the same ranks (as DeepSpeed's ``reuse_dist_env``
pool does), after a hang or a crash it gets a new world; nothing a test sets in its environment or DeepSpeed's
modules reaches the next one.

Each test runs pytest in a subprocess with real gloo worlds and real DeepSpeed; the ranks write their pids into the
test directory, which is how a test tells kept ranks from new ones.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import RunPytest, leftovers

#: Helpers every test file below starts with: which rank process ran which test.
PIDS = """
import os
from pathlib import Path

import pytest

def note(name, rank):
    Path(f"pid-{name}-{rank}").write_text(str(os.getpid()))

def pid(name, rank):
    return int(Path(f"pid-{name}-{rank}").read_text())
"""


def test_a_reuse_class_runs_on_the_same_ranks_with_a_fresh_process_group_and_nothing_leaks(
    pytester: pytest.Pytester, run: RunPytest, private_tmp: Path
) -> None:
    """Three ZeRO-3 engines, written DeepSpeed's way, one after another on the same two processes: each test gets a
    new default process group, DeepSpeed's cached groups and comm layer are forgotten (else the second engine would
    use a destroyed group), and an environment variable or a patched DeepSpeed function set by one test is gone in
    the next. Another class gets ranks of its own."""
    pytester.makepyfile(
        PIDS
        + """
import deepspeed
import torch
import torch.distributed as dist

CONFIG = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "zero_optimization": {"stage": 3}}
SEEN = {}  # the module lives as long as its ranks: a kept group would still be here

def step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.Adam(model.parameters()), config=CONFIG)
    engine.backward(torch.nn.functional.mse_loss(engine(torch.randn(2, 16)), torch.randn(2, 4)))
    engine.step()

@pytest.mark.ds_world(size=2, reuse=True)
class TestKept:
    def test_1_leaks(self, ds_rank):
        step()
        note("1", ds_rank)
        Path("port").write_text(os.environ["MASTER_PORT"])  # DeepSpeed's /dev/shm buffers are named after it
        SEEN["group"] = dist.group.WORLD
        os.environ["DSREPRO_LEAK"] = "1"
        deepspeed.comm.get_rank = lambda group=None: 99

    def test_2_finds_nothing(self, ds_rank):
        assert os.getpid() == pid("1", ds_rank)
        assert "DSREPRO_LEAK" not in os.environ
        assert deepspeed.comm.get_rank() == ds_rank
        assert dist.is_initialized() and dist.group.WORLD is not SEEN["group"]
        from deepspeed.utils import groups
        assert groups._WORLD_GROUP is None
        step()
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == 2

    def test_3_again(self, ds_rank):
        assert os.getpid() == pid("1", ds_rank)
        step()

@pytest.mark.ds_world(size=2, reuse=True)
class TestOther:
    def test_own_ranks(self, ds_rank):
        assert os.getpid() != pid("1", ds_rank)
"""
    )
    result = run("-v")
    result.assert_outcomes(passed=4)
    assert leftovers(private_tmp, [(pytester.path / "port").read_text()]) == []  # the kept world's buffers too


def test_faults_in_a_reused_world(pytester: pytest.Pytester, run: RunPytest, private_tmp: Path) -> None:
    """Faults injected in a reused gloo world: each fails its own test only, with its own story. After a failure of
    the body (one rank failed, the other passed, leaving a collective unmatched) the next test runs on the same ranks,
    with what the failed test set put back and a new group; after a hang or a crash it runs on new ranks. Either way
    it passes (no cascade), and is then kept again."""
    pytester.makepyfile(
        PIDS
        + """
import time

import torch
import torch.distributed as dist

@pytest.mark.ds_world(size=2, reuse=True, timeout=20)
class TestFaults:
    def test_1_passes(self, ds_rank):
        note("1", ds_rank)

    def test_2_fails(self, ds_rank):
        assert os.getpid() == pid("1", ds_rank)
        os.environ["DSREPRO_LEAK"] = "1"
        if ds_rank == 0:
            dist.all_reduce(torch.ones(1), async_op=True)  # never matched: rank 1 fails first
        assert ds_rank == 0, "rank 1 fails on purpose"

    def test_3_same_ranks(self, ds_rank):
        assert os.getpid() == pid("1", ds_rank)
        assert "DSREPRO_LEAK" not in os.environ
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == 2
        note("3", ds_rank)

    def test_4_hangs(self, ds_rank):
        assert os.getpid() == pid("3", ds_rank)
        time.sleep(3600)

    def test_5_new_world(self, ds_rank):
        assert os.getpid() != pid("3", ds_rank)
        note("5", ds_rank)

    def test_6_crashes(self, ds_rank):
        assert os.getpid() == pid("5", ds_rank)
        if ds_rank == 1:
            os._exit(7)

    def test_7_new_world(self, ds_rank):
        assert os.getpid() != pid("5", ds_rank)
        note("7", ds_rank)

    def test_8_kept_again(self, ds_rank):
        assert os.getpid() == pid("7", ds_rank)
"""
    )
    result = run("-v")
    result.assert_outcomes(passed=5, failed=3)
    result.stdout.fnmatch_lines(
        [
            "*::TestFaults::test_2_fails - WorldFailed: rank 1: AssertionError: rank 1 fails on purpose*",
            "*::TestFaults::test_4_hangs - WorldFailed: ranks 0-1: hung: still running when the 20s world timeout*",
            "*::TestFaults::test_6_crashes - WorldFailed: rank 1: crashed: exit code 7*",
        ]
    )
    result.stdout.fnmatch_lines(["*(2-rank gloo world, on ranks kept from an earlier test (reuse=True), *"])
    assert leftovers(private_tmp) == []
