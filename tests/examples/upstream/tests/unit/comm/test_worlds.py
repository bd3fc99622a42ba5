"""Upstream-style tests of world sizes, process groups and launcher variables (written for pytest-dsrepro)."""

import os

import deepspeed
import deepspeed.comm as dist
import pytest
import torch
from deepspeed.accelerator import get_accelerator
from unit.common import DistributedTest, get_master_port, reduce_boolean_flags


class TestTwoRanks(DistributedTest):
    world_size = 2

    def test_world(self):
        assert dist.get_world_size() == 2 == int(os.environ["WORLD_SIZE"]) == int(os.environ["LOCAL_SIZE"])
        assert reduce_boolean_flags(dist.get_rank() == 1, any)
        assert not reduce_boolean_flags(dist.get_rank() == 1, all)

    @pytest.mark.world_size(1)
    def test_one(self):
        assert dist.get_world_size() == 1

    @pytest.mark.world_size(3)
    def test_three(self):
        assert dist.get_world_size() == 3


@pytest.mark.parametrize("n", [5])
class TestSizes(DistributedTest):
    world_size = [1, 2]

    def test_sizes(self, n):
        t = torch.ones(1) * n
        dist.all_reduce(t)
        assert t.item() == n * dist.get_world_size()


class TestNoInit(DistributedTest):
    world_size = 2
    init_distributed = False

    def test_own_group(self):
        assert not torch.distributed.is_initialized()
        assert not dist.is_initialized()
        assert os.environ["WORLD_SIZE"] == "2"
        deepspeed.init_distributed(get_accelerator().communication_backend_name())
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == 2


class TestNoEnv(DistributedTest):
    world_size = 1
    init_distributed = False
    set_dist_env = False

    def test(self):
        assert "RANK" not in os.environ
        assert "MASTER_PORT" not in os.environ
        torch.distributed.init_process_group(
            backend="gloo", init_method=f"tcp://127.0.0.1:{get_master_port()}", world_size=1, rank=0
        )
        assert torch.distributed.is_initialized()


class TestReused(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    def test_a(self):
        assert dist.get_world_size() == 2

    def test_b(self):
        assert dist.get_world_size() == 2


class TestSkips(DistributedTest):
    def test_skips_itself(self):
        pytest.skip("bfloat16 is not supported on this accelerator")

    @pytest.mark.skipif(True, reason="upstream's own skipif")
    def test_skipif(self):
        pass

    @pytest.mark.nightly
    def test_nightly(self):
        pass
