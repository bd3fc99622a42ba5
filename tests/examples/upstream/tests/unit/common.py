"""A stand-in for DeepSpeed's tests/unit/common.py, written for pytest-dsrepro's own tests: the same classes,
attributes and helpers, and the same behaviour on a CPU, where DeepSpeed's CPU accelerator counts one device per
socket (here: one), so every test of more than one rank is skipped. Where one rank would do, it refuses to run:
pytest-dsrepro's upstream layer must have run the test in its own world before this harness is ever asked."""

import contextlib
import inspect
import os
import socket
from abc import ABC, abstractmethod

import deepspeed.comm as dist
import pytest
import torch
from deepspeed.accelerator import get_accelerator

DEEPSPEED_TEST_TIMEOUT = int(os.environ.get("DS_UNITTEST_TIMEOUT", "600"))


def get_master_port(base_port=29500, port_range_size=1000):
    sock = socket.socket()
    for port in range(base_port, base_port + port_range_size):
        try:
            sock.bind(("", port))
            sock.close()
            return str(port)
        except OSError:
            continue
    raise OSError("no free ports")


class DistributedExec(ABC):
    world_size = 2
    backend = get_accelerator().communication_backend_name()
    init_distributed = True
    set_dist_env = True
    requires_cuda_env = True
    reuse_dist_env = False
    non_daemonic_procs = False
    exec_timeout = DEEPSPEED_TEST_TIMEOUT

    @abstractmethod
    def run(self): ...

    def __call__(self, request):
        self._fixture_kwargs = self._get_fixture_kwargs(request, self.run)
        if self.requires_cuda_env and not get_accelerator().is_available():
            pytest.skip("only supported in accelerator environments.")
        self._launch(self.world_size)

    def _get_fixture_kwargs(self, request, func):
        kwargs = {}
        for name in inspect.getfullargspec(func).args[1:]:
            with contextlib.suppress(pytest.FixtureLookupError):  # test arguments that are not fixtures
                kwargs[name] = request.getfixturevalue(name)
        return kwargs

    def _launch(self, world_size):
        for procs in [world_size] if isinstance(world_size, int) else world_size:
            self._launch_procs(procs)

    def _launch_procs(self, num_procs):
        available = get_accelerator().device_count()
        if get_accelerator().is_available() and available < num_procs:
            pytest.skip(
                f"Skipping test because not enough GPUs are available: {num_procs} required, {available} available"
            )
        pytest.fail("the stand-in harness was asked to launch ranks: pytest-dsrepro did not run this test")


class DistributedFixture(DistributedExec):
    is_dist_fixture = True

    def __init__(self):
        assert isinstance(self.world_size, int), "Only one world size is allowed for distributed fixtures"


class DistributedTest(DistributedExec):
    is_dist_test = True

    @pytest.fixture(autouse=True, scope="class")
    def class_tmpdir(self, tmpdir_factory):
        return tmpdir_factory.mktemp(self.__class__.__name__)

    def run(self, **fixture_kwargs):
        self._current_test(**fixture_kwargs)

    def __call__(self, request):
        self._current_test = getattr(self, request.function.__name__)
        self._fixture_kwargs = self._get_fixture_kwargs(request, self._current_test)
        if self.requires_cuda_env and not get_accelerator().is_available():
            pytest.skip("only supported in accelerator environments.")
        for mark in getattr(request.function, "pytestmark", []):
            if mark.name == "world_size":
                world_size = mark.args[0]
                break
        else:
            world_size = self._fixture_kwargs.get("world_size", self.world_size)
        self._launch(world_size)


def reduce_boolean_flags(flag, op=all):
    if not dist.is_initialized():
        return flag
    device = get_accelerator().current_device_name()
    mine = torch.tensor([1 if flag else 0], dtype=torch.int, device=device)
    everyone = torch.zeros(dist.get_world_size(), dtype=torch.int, device=device)
    dist.all_gather_into_tensor(everyone, mine)
    return op(bool(f) for f in everyone.tolist())
