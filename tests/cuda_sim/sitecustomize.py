"""A CPU torch that claims GPUs and keeps torch's fork rule: the test-suite's CUDA simulation.

Put this directory on ``PYTHONPATH`` with ``DSREPRO_SIM_GPUS=N`` and every Python process started with it (pytest,
the fork server, the device probe, the ranks) sees N CUDA devices. Only torch's C entry points are replaced; torch's
own Python code runs on them, so what counts, names and binds devices is torch's, as on a GPU machine:

- ``_cuda_getDeviceCount`` (what ``torch.cuda.is_available()`` calls without ``PYTORCH_NVML_BASED_CUDA_CHECK=1``) and
  ``_cuda_init`` (the lazy initialisation behind ``get_device_name``, ``set_device``, ...) poison fork as torch's
  C++ does: every child forked afterwards is in torch's bad-fork state, where ``_lazy_init`` raises "Cannot
  re-initialize CUDA in forked subprocess";
- NVML answers (``_raw_device_count_nvml``, ``_raw_device_uuid_nvml``) without poisoning, so ``device_count()`` and
  the NVML-based availability check behave as torch's do, ``CUDA_VISIBLE_DEVICES`` (ordinals or UUIDs) included;
- an NCCL process group is a gloo one underneath (a CPU torch has no NCCL), after checking that the rank's
  ``device_id`` is its current device;
- ``/dev/nvidia0`` exists for pytest-dsrepro's device-node check (``worlds.device_nodes.DEVICE_DIR``; in a pytest
  process through ``dsrepro_cuda_sim``, a plugin this module names in ``PYTEST_PLUGINS``);
- the NCCL flight recorder (``_dump_nccl_trace``) holds one unfinished all-reduce (``FLIGHT_RECORDER``); torch's
  watchdog is simulated where its dump on a timeout is asked for (``TORCH_NCCL_DUMP_ON_TIMEOUT=1``): a test of an
  NCCL group that outlives the group's timeout finds the recorder dumped at ``TORCH_FR_DUMP_TEMP_FILE<rank>``, as
  torch writes it (``_watchdog``; torch dumps only for a collective that timed out, the simulation for any test);
- ``DSREPRO_SIM_UNGUARDED=1``: importing DeepSpeed with its CUDA accelerator initialises CUDA, as releases before
  0.19.8 do (0.19.8 itself, the test environment's, guards its import);
- ``DSREPRO_SIM_NVCC=1``: a ``nvcc`` on ``PATH`` and ``CUDA_HOME`` for DeepSpeed's import-time op checks, which read
  the CUDA toolkit's version.

``DSREPRO_SIM_LOG=FILE``: each process appends a line per CUDA initialisation, ``pid ok``, and per attempt in a
poisoned fork, ``pid bad-fork``.
Nothing here runs unless ``DSREPRO_SIM_GPUS`` is set.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import tempfile
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

COUNT = int(os.environ.get("DSREPRO_SIM_GPUS") or 0)
#: ``DSREPRO_SIM_UUID``: 8 hex digits that make this simulation's GPUs its own (their leases too).
UUIDS = [f"GPU-{os.environ.get('DSREPRO_SIM_UUID', '5e1a0000')}-0000-4000-8000-{i:012d}" for i in range(COUNT)]
NAME = "Simulated GPU"


class _State:
    poisoned = False  # this process registered the fork handler (torch's poison_fork)
    bad_fork = False  # this process was forked after its parent poisoned
    initialised = False
    device = 0


def _mark_bad_fork() -> None:
    _State.bad_fork = True
    _State.initialised = False


def _poison() -> None:
    if not _State.poisoned:
        _State.poisoned = True
        os.register_at_fork(after_in_child=_mark_bad_fork)


def _visible(torch: Any) -> list[int]:
    """Physical indices of the devices this process may use, in CUDA's order, as torch's NVML path reads them."""
    seen = torch.cuda._parse_visible_devices()
    if seen and isinstance(seen[0], str):
        return list(torch.cuda._transform_uuid_to_ordinals(seen, UUIDS))
    return [i for i in seen if i < COUNT][: len(seen)]


def _properties(torch: Any, device: int) -> Any:
    physical = _visible(torch)[device]
    return types.SimpleNamespace(
        name=NAME, major=9, minor=0, total_memory=80 << 30, multi_processor_count=132, uuid=UUIDS[physical][4:]
    )


def _log(what: str) -> None:
    path = os.environ.get("DSREPRO_SIM_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {what}\n")


def _patch_cuda(cuda: types.ModuleType) -> None:
    import torch

    def get_device_count() -> int:
        _poison()
        return len(_visible(torch))

    def cuda_init() -> None:
        _log("ok")
        _poison()
        _State.initialised = True
        cuda._get_device_properties = lambda i: _properties(torch, i)  # type: ignore[attr-defined]

    def set_device(index: int) -> None:
        cuda._lazy_init()  # type: ignore[attr-defined]  # as torch's C++ does: in a bad fork, it raises
        if index >= len(_visible(torch)):
            raise RuntimeError(f"CUDA error: invalid device ordinal {index}")
        _State.device = index

    fakes: dict[str, Callable[..., Any]] = {
        "_cuda_getDeviceCount": get_device_count,
        "_cuda_init": cuda_init,
        "_cuda_isInBadFork": lambda: _State.bad_fork,
        "_cuda_setDevice": set_device,
        "_cuda_getDevice": lambda: (cuda._lazy_init(), _State.device)[1],  # type: ignore[attr-defined]
        "_cuda_getArchFlags": lambda: "sm_90",
        "_cuda_getCurrentRawStream": lambda device: 0,  # imported by name where torch thinks it has CUDA
    }
    lazy_init = cuda._lazy_init  # type: ignore[attr-defined]

    def logged_lazy_init() -> None:
        if _State.bad_fork and not _State.initialised:
            _log("bad-fork")  # torch's own check, next, raises
        lazy_init()

    cuda._lazy_init = logged_lazy_init  # type: ignore[attr-defined]
    for name, fake in fakes.items():
        setattr(torch._C, name, fake)
    cuda._is_in_bad_fork = fakes["_cuda_isInBadFork"]  # type: ignore[attr-defined]  # bound at torch's import
    cuda._cudart = types.SimpleNamespace()  # type: ignore[attr-defined]
    cuda._queued_calls.clear()  # type: ignore[attr-defined]  # capability checks of a real device
    cuda._raw_device_count_nvml = lambda: COUNT  # type: ignore[attr-defined]
    cuda._raw_device_uuid_nvml = lambda: list(UUIDS)  # type: ignore[attr-defined]
    torch.version.cuda = "12.8"  # type: ignore[misc]


#: What the simulated flight recorder holds: one collective done, the next one started and never finished.
FLIGHT_RECORDER = {
    "version": "2.10",
    "entries": [
        {"profiling_name": "nccl:all_reduce", "collective_seq_id": 1, "state": "completed", "input_sizes": [[4]]},
        {"profiling_name": "nccl:all_reduce", "collective_seq_id": 2, "state": "started", "input_sizes": [[4]]},
    ],
}


def _patch_distributed(dist: types.ModuleType) -> None:
    import pickle

    import torch

    torch._C._distributed_c10d._dump_nccl_trace = lambda *args, **kwargs: pickle.dumps(FLIGHT_RECORDER)

    original = dist.init_process_group

    def init_process_group(backend: str | None = None, *args: Any, **kwargs: Any) -> Any:
        if backend == "nccl":
            device = kwargs.pop("device_id", None)
            if device is not None and device.index != torch.cuda.current_device():
                raise RuntimeError(f"device_id {device} is not the current device {torch.cuda.current_device()}")
            backend = "gloo"
            if os.environ.get("TORCH_NCCL_DUMP_ON_TIMEOUT") == "1":
                _watchdog(dist, int(kwargs["rank"]), kwargs["timeout"].total_seconds())
        return original(backend, *args, **kwargs)

    dist.init_process_group = init_process_group  # type: ignore[attr-defined]
    dist.distributed_c10d.init_process_group = init_process_group  # type: ignore[attr-defined]


def _watchdog(dist: types.ModuleType, rank: int, timeout: float) -> None:
    """torch's watchdog, as far as its dump goes: a thread (C++ in torch) that writes the flight recorder once a test
    has run for the group's timeout. A test starts when the dump's prefix changes (each test's world has its own
    directory: a kept rank's next test sets another)."""
    import _thread
    import math
    import pickle
    import time

    def watch() -> None:
        prefix, since = None, time.monotonic()
        while True:
            time.sleep(0.05)
            now = os.environ.get("TORCH_FR_DUMP_TEMP_FILE")
            if now != prefix:
                prefix, since = now, time.monotonic()
            elif prefix and dist.is_initialized() and time.monotonic() - since > timeout:
                Path(f"{prefix}{rank}").write_bytes(pickle.dumps(FLIGHT_RECORDER))
                since = math.inf  # once a test

    _thread.start_new_thread(watch, ())  # a thread Python does not list, as torch's own C++ watchdog


def _patch_deepspeed(deepspeed: types.ModuleType) -> None:
    """``DSREPRO_SIM_UNGUARDED=1``: a DeepSpeed whose import initialises CUDA with its CUDA accelerator, as releases
    before 0.19.8 do (their op builders' compatibility checks read device 0's properties)."""
    if os.environ.get("DSREPRO_SIM_UNGUARDED"):
        import torch
        from deepspeed.accelerator import get_accelerator

        if get_accelerator().device_name() == "cuda":
            torch.cuda.get_device_properties(0)


def patch_devices(devices: types.ModuleType) -> None:
    fake = Path(tempfile.gettempdir()) / f"cuda-sim-dev-{os.getuid()}"
    fake.mkdir(exist_ok=True)
    (fake / "nvidia0").touch()
    devices.DEVICE_DIR = fake  # type: ignore[attr-defined]


def _fake_nvcc() -> None:
    home = Path(tempfile.gettempdir()) / f"cuda-sim-toolkit-{os.getuid()}"
    nvcc = home / "bin" / "nvcc"
    if not nvcc.exists():
        nvcc.parent.mkdir(parents=True, exist_ok=True)
        tmp = nvcc.with_suffix(f".{os.getpid()}")
        tmp.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.8, V12.8.93'\n")
        tmp.chmod(0o755)
        tmp.rename(nvcc)
    os.environ["CUDA_HOME"] = str(home)
    os.environ["PATH"] = f"{home / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"


PATCHES: dict[str, Callable[[types.ModuleType], None]] = {
    "torch.cuda": _patch_cuda,
    "torch.distributed": _patch_distributed,
    "pytest_dsrepro.worlds.device_nodes": patch_devices,
    "deepspeed": _patch_deepspeed,
}


def _then(
    execute: Callable[[types.ModuleType], None], patch: Callable[[types.ModuleType], None]
) -> Callable[[types.ModuleType], None]:
    def exec_module(module: types.ModuleType) -> None:
        execute(module)
        patch(module)

    return exec_module


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Runs a patch right after its module has executed, whoever imports it, without importing anything early."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        patch = PATCHES.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader.exec_module = _then(spec.loader.exec_module, patch)  # type: ignore[method-assign]
                return spec
        return None


if COUNT:
    if os.environ.get("DSREPRO_SIM_NVCC"):
        _fake_nvcc()
    sys.meta_path.insert(0, _PatchAfterImport())
    os.environ["PYTEST_PLUGINS"] = ",".join(filter(None, [os.environ.get("PYTEST_PLUGINS"), "dsrepro_cuda_sim"]))
