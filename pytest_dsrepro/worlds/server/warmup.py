"""Runs in the fork server: what it imports and does once, ahead of its ranks, so that no forked rank pays for it.

At start-up (``prepare``): torch, DeepSpeed and pytest imported, DeepSpeed's comm op loaded (or its first build
started beside the worlds, ``comm_op.start``), and the facts pytest gets in ``Hello``; where importing DeepSpeed
poisons the server's forks for CUDA, the restart without it (``cuda_reexec``). Before the first world whose test
uses DeepSpeed once the list of a first engine step's imports is at hand (``warm_for_deepspeed``): those imports and
the first use (``preload``). None of it is a test's time: a world's clock starts when its ranks are forked.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...core.options import default_cache_dir
from ..device_nodes import gpu_device_nodes
from ..protocol import ServerFacts
from . import builds, comm_op, cuda_reexec, op_builds, preload


def prepare(
    announce: Callable[[str], None] = lambda _: None, scout: bool = False
) -> tuple[ServerFacts, builds.BuildChild | None, comm_op.Background | None]:
    """Import what every rank imports, once: torch, DeepSpeed and pytest (a rank's fixes and skips use it; the rank
    code itself is imported with this module); load DeepSpeed's comm op, or start its first build beside the worlds
    (``comm_op.start``); report what is in play; leave DeepSpeed to the ranks where importing it poisoned this
    server's forks. Each import made here is one a forked rank does not pay again (pytest alone is ~80 ms per world).
    ``scout``: the first world uses DeepSpeed, so what its ranks will import is found meanwhile, in a child
    (``preload.scout``, collected by ``warm_for_deepspeed``), beside the comm op's first build and the first worlds,
    on every machine (on a GPU machine once DeepSpeed is known to stay in the server).

    Every fact is a builtin (``str(torch.__version__)``, not torch's version object), so that unpickling them in
    the pytest process imports nothing.
    """
    import pytest  # noqa: F401
    import torch

    # Devices are the pytest process's business (``client.gpu_probe``): asking torch here would poison every fork.
    facts = ServerFacts(pid=os.getpid(), torch=str(torch.__version__))
    found = cuda_reexec.deferred(default_cache_dir(), str(torch.__version__))
    if found is not None:
        return cuda_reexec.without_deepspeed(facts, found), None, None
    try:
        import deepspeed
    except ImportError as exc:
        return dataclasses.replace(facts, deepspeed_error=f"{type(exc).__name__}: {exc}"), None, None
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    started = time.monotonic()
    loaded, building = comm_op.start(announce)
    if gpu_device_nodes() and cuda_reexec.poisoned_fork():
        cuda_reexec.restart_without_deepspeed(
            cuda_reexec.Deferred.of(deepspeed, accelerator), default_cache_dir(), str(torch.__version__)
        )
    took = round(time.monotonic() - started, 2)
    scouted = preload.scout(install(), scout_apart) if scout else None  # after the restart: it would orphan it
    facts = dataclasses.replace(facts, comm_op=loaded, comm_op_seconds=took, builds_beside=building is not None)
    return _with_deepspeed(facts, deepspeed, accelerator), scouted, building


def _with_deepspeed(facts: ServerFacts, deepspeed: Any, accelerator: Any) -> ServerFacts:
    """``facts`` with the DeepSpeed in play: its release, where it imports from, its accelerator and that one's
    communication backend (builtins all: unpickled in pytest, they import nothing)."""
    return dataclasses.replace(
        facts,
        deepspeed=str(deepspeed.__version__),
        deepspeed_path=os.path.dirname(os.path.realpath(deepspeed.__file__)),
        accelerator=str(accelerator.device_name()),
        accelerator_backend=str(accelerator.communication_backend_name()),
    )


def install() -> preload.Install:
    """The DeepSpeed install (version, torch, where, accelerator) that preload lists are kept for, and where."""
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator

    return preload.Install(
        default_cache_dir(),
        str(deepspeed.__version__),
        str(torch.__version__),
        Path(deepspeed.__file__).parent,
        str(get_accelerator().device_name()),
    )


def scout_apart(work: Callable[[], Any]) -> builds.BuildChild:
    """A search for what a first engine step imports (``preload.scout``), in a child that works as a build does."""
    return builds.BuildChild.start(work, names=builds.SCOUT_NAMES)


def warm_for_deepspeed(found: preload.Install, scouted: preload.Scout | None, user_dir: str | None) -> str:
    """Do what a rank's first DeepSpeed use would (``preload``: the imports of a first engine step, then the
    first-use work after them), once, before a world whose test uses DeepSpeed, once the list is ``preload.ready``:
    worlds that do not use DeepSpeed never pay for it, and however the test is written, its ranks start warm.
    ``scouted``: the child that found the imports; ``user_dir``: the user's ``TORCH_EXTENSIONS_DIR``, if any."""
    from deepspeed.accelerator import get_accelerator

    preloaded = preload.warm(found, scouted)
    if preloaded.stopped:
        return preloaded.describe()
    built = functools.partial(op_builds.load_built, default_cache_dir(), user_dir)
    return f"{preloaded.describe()}; {preload.first_use(str(get_accelerator().device_name()), built)}"
