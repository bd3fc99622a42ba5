"""Upstream-style distributed fixtures: a checkpoint written by 4 ranks, read by 2 (written for pytest-dsrepro)."""

import os

import deepspeed.comm as dist
import pytest
from unit.common import DistributedFixture, DistributedTest


@pytest.fixture(params=[7])
def payload(request):
    return request.param


class saved_by_four(DistributedFixture):
    world_size = 4

    def run(self, class_tmpdir, payload):
        assert dist.get_world_size() == int(os.environ["WORLD_SIZE"]) == self.world_size
        with open(os.path.join(class_tmpdir, f"shard-{dist.get_rank()}.txt"), "w") as f:
            f.write(f"{dist.get_rank()},{payload}")


class _saved(DistributedFixture):
    world_size = None

    def run(self, tmpdir):
        with open(os.path.join(tmpdir, f"newer-{dist.get_rank()}-of-{dist.get_world_size()}.txt"), "w") as f:
            f.write("x")


class saved_by_three(_saved):
    world_size = 3


@pytest.fixture
def newer_form(request):
    saved_by_three()(request)


class TestLoad(DistributedTest):
    world_size = 2

    def test_by_name(self, saved_by_four, class_tmpdir, payload):
        assert dist.get_world_size() == 2
        for rank in range(4):
            with open(os.path.join(class_tmpdir, f"shard-{rank}.txt")) as f:
                assert f.read() == f"{rank},{payload}"

    def test_newer_form(self, newer_form, tmpdir):
        assert sorted(os.listdir(tmpdir)) == [f"newer-{r}-of-3.txt" for r in range(3)]
