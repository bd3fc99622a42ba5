"""Upstream-style test of a helper that a newer DeepSpeed added (written for pytest-dsrepro)."""

from deepspeed.runtime.zero.added_by_a_newer_fix import ensure_it_holds
from unit.common import DistributedTest


class TestNewer(DistributedTest):
    def test_helper(self):
        assert ensure_it_holds()
