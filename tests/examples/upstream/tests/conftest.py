"""A DeepSpeed-style tests/conftest.py, written for pytest-dsrepro's own tests: the same hooks as DeepSpeed's."""

import os
import sys
from os.path import abspath, dirname

import pytest

# As DeepSpeed's does: the checkout's root first on sys.path, so that tests import its sources.
sys.path.insert(1, abspath(dirname(dirname(__file__))))
os.environ["DSREPRO_FAKE_CONFTEST"] = "loaded"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    # The harness runs DistributedTest classes itself, then makes pytest's own call a no-op.
    if getattr(item.cls, "is_dist_test", False):
        item.cls()(item._request)
        item.runtest = lambda: True


def pytest_runtest_teardown(item, nextitem):
    # DeepSpeed's closes its reused process pools here; every item it tears down must have a ``cls``.
    assert getattr(item.cls, "reuse_dist_env", False) in (True, False)


@pytest.hookimpl(tryfirst=True)
def pytest_fixture_setup(fixturedef, request):
    if getattr(fixturedef.func, "is_dist_fixture", False):
        fixturedef.func()(request)
