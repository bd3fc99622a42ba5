"""Upstream-style timeout: a test that hangs ends alone, with every rank's stack (written for pytest-dsrepro)."""

import time

import deepspeed.comm as dist
from unit.common import DistributedTest


class TestHangs(DistributedTest):
    world_size = 2
    exec_timeout = 6

    def test_hangs(self):
        if dist.get_rank() == 1:
            time.sleep(600)
        dist.barrier()

    def test_after(self):
        dist.barrier()
