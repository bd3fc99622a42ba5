"""Runs in a rank: it meets its world's other ranks (the fork server's store, or rank 0's own for a body that makes
its process group), gets torchrun's variables, and joins the default process group, all ranks together.

Under an external launcher there is none of this (``launched``): the launcher's store is the meeting place.
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Any

from ..workdir import LOOPBACK
from . import nccl_recorder


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def world_prefix(world: int) -> str:
    return f"dsrepro/world-{world}/"


def rendezvous(port: int, world: int, timeout: float) -> Any:
    """The world's own view of the fork server's store: its keys under the world's prefix."""
    import torch.distributed as dist

    client = dist.TCPStore(  # type: ignore[attr-defined]
        LOOPBACK, port, None, False, timeout=_timeout(timeout), wait_for_workers=False
    )
    return dist.PrefixStore(world_prefix(world), client)  # type: ignore[attr-defined]


def set_rank_environment(rank: int, world_size: int, port: int) -> None:
    """The variables torchrun and DeepSpeed's own launcher set, so DeepSpeed code reading them behaves as launched.

    ``LOCAL_SIZE`` is what DeepSpeed's launcher exports; its CPU shared-memory allreduce keys on it.
    """
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        LOCAL_SIZE=str(world_size),
        MASTER_ADDR=LOOPBACK,
        MASTER_PORT=str(port),
    )


#: Store key under which rank 0 of a world without the plugin's process group publishes its own master port.
MASTER_PORT_KEY = "dsrepro/master_port"


def own_master_port(store: Any, rank: int, timeout: float) -> tuple[int, Any]:
    """A ``MASTER_PORT`` for a world whose body makes its own process group (``init_process_group()`` reads it):
    rank 0 hosts a TCPStore on a loopback port the OS picks and publishes it on the world's store; every rank reads
    it. The store is multi-tenant, so the ``env://`` rendezvous of rank 0's body serves on it instead of binding
    the port again (no free port guessed, no bind-and-close race). Returns the port and the store, which must stay
    alive as long as the rank."""
    import torch.distributed as dist

    server = None
    if rank == 0:
        server = dist.TCPStore(  # type: ignore[attr-defined]
            LOOPBACK, 0, None, True, timeout=_timeout(timeout), wait_for_workers=False, multi_tenant=True
        )
        store.set(MASTER_PORT_KEY, str(server.port))
    store.wait([MASTER_PORT_KEY], _timeout(timeout))
    return int(store.get(MASTER_PORT_KEY)), server


def init_default_group(backend: str, store: Any, rank: int, world_size: int, timeout: float) -> None:
    """The world's default process group; a kept NCCL rank's, made for an earlier test of its scope (same size,
    backend and timeout), is kept: its communicator is what a kept NCCL world saves."""
    import torch
    import torch.distributed as dist

    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        timeout = nccl_recorder.process_group_timeout(timeout)  # torch's watchdog dumps before the harness's deadline
        if dist.is_initialized():
            return
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local_rank)
        kwargs["device_id"] = torch.device("cuda", local_rank)
        nccl_recorder.serve_dump_request(rank)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=_timeout(timeout), **kwargs)


#: Store key prefix of the agreement below: each rank sets its own key once it has its process group.
CONNECTED = "dsrepro/connected/"


def agree_connected(store: Any, rank: int, world_size: int, timeout: float) -> None:
    """Return only once every rank of the world has its default process group: no rank may exit (closing its
    connections) while a slower one is still connecting. Without it a body that runs no collective failed ~0.3% of
    its worlds with gloo's "connectFullMesh failed ... Connection closed by peer" in the slow rank.

    On the world's own store (not the process group's), so it adds no collective to the test: each rank sets a key
    of its own and waits for every rank's, two requests each (a shared counter took three for the last rank to
    arrive, which the whole world waits for).
    """
    store.set(f"{CONNECTED}{rank}", "1")
    store.wait([f"{CONNECTED}{r}" for r in range(world_size)], _timeout(timeout))


#: Store key prefix under which each rank of a reusable world says that its body ended.
BODY_ENDED = "dsrepro/body-ended/"
#: How long a rank of a reusable world whose body did not pass waits for its peers' bodies to end: a peer that runs
#: on may be waiting on it, and the rank then leaves the world, as a fresh rank would (``spawned_rank.run_rank``).
PEERS_WAIT = 0.5


def body_ended(store: Any, rank: int) -> None:
    store.set(f"{BODY_ENDED}{rank}", "1")


def peers_ended(store: Any, world_size: int, wait: float = PEERS_WAIT) -> bool:
    """Have every rank's body ended, within ``wait`` seconds? Asked with ``check``, which never blocks: a timed-out
    ``wait`` writes torch's socket warnings into the rank's output."""
    keys = [f"{BODY_ENDED}{r}" for r in range(world_size)]
    deadline = time.monotonic() + wait
    while not store.check(keys):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True
