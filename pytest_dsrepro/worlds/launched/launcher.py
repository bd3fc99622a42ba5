"""Runs in a pytest process that an external launcher made a rank (multi-node): what the launcher made of it.

torchrun (and ``srun ... torchrun``, DeepSpeed's launcher, MPI wrappers that export the same variables) sets RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT. Then the plugin spawns nothing: each world
test runs in place, in every pytest process, as one world (``launched_world``). This module answers what the
launcher made of this process and of its node: the rank, its devices, the backend, the launcher's store.
"""

from __future__ import annotations

import datetime
import os
import sys
from typing import Any

from ...core import options
from ...core.options import Launched
from ...core.world_spec import ds_accelerator, settle_backend


def launched() -> Launched | None:
    """The rank the launcher made this process, from its environment; None when no launcher started pytest."""
    return options.launched(os.environ)


def cuda_devices() -> int:
    """CUDA devices this process sees: its node's."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def settle_backend_here(requested: str, world: Launched, devices: int) -> tuple[str, str | None]:
    """``(backend, skip_reason)`` by the ranks on this node, which share its devices (``LOCAL_WORLD_SIZE``), not by
    the whole world's size: two nodes of one GPU each run NCCL."""
    backend, skip = settle_backend(requested, world.ranks_here, devices)
    if skip is not None:
        skip = f"NCCL needs a CUDA device for each of the {world.ranks_here} ranks on this node; found {devices}"
    return backend, skip


def gpu_names(devices: int) -> list[str]:
    import torch

    return [torch.cuda.get_device_name(i) for i in range(devices)]


def accelerator(devices: int) -> str | None:
    """DeepSpeed's accelerator as this process's bodies got it (asked of DeepSpeed when a body imported it), else
    the rule the fork server applies."""
    if "deepspeed" in sys.modules:
        from deepspeed.accelerator import get_accelerator

        found = get_accelerator()
        return f"{found.device_name()} (communication backend {found.communication_backend_name()})"
    return ds_accelerator(os.environ, devices)


#: Keys of this plugin in the launcher's store, apart from the launcher's own and from each restart's.
STORE_PREFIX = "pytest-dsrepro"


def connect(timeout: float) -> tuple[Any, Any]:
    """Two clients of the launcher's store, each under this plugin's prefix: one for the pytest process's own
    waits, one for the watcher thread, so that neither queues behind the other's blocking wait.

    torch's own ``env://`` rendezvous finds the store: torchrun's agent hosts it (``TORCHELASTIC_USE_AGENT_STORE``);
    under other launchers rank 0 does. Each torchrun restart gets keys of its own.
    """
    import torch.distributed as dist

    limit = datetime.timedelta(seconds=timeout)
    store, _, _ = next(dist.rendezvous("env://", timeout=limit))  # type: ignore[attr-defined]
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    watcher = dist.TCPStore(addr, port, is_master=False, timeout=limit)  # type: ignore[attr-defined]
    prefix = f"{STORE_PREFIX}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return dist.PrefixStore(prefix, store), dist.PrefixStore(prefix, watcher)  # type: ignore[attr-defined]
