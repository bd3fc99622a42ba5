"""Runs in the fork server: its forks kept fit for CUDA, and its restart without DeepSpeed where an import poisons them.

The fork server never asks torch about devices (the pytest process found them, ``client.gpu_probe``). It runs with
``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (so that what it imports asks NVML), and after preloading it forks a throwaway
child that says whether it is in torch's bad-fork state (``poisoned_fork``). DeepSpeed releases before 0.19.8
initialise CUDA on ``import deepspeed`` with their CUDA accelerator (op builders' compatibility checks); then the
server starts again in its own place without DeepSpeed (``restart_without_deepspeed``, an ``execv``), and each rank
imports DeepSpeed itself, after the fork.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...core import versions
from ...core.files import write_atomically
from ..device_nodes import gpu_device_nodes
from ..protocol import ServerFacts

#: Set by a fork server for the server that replaces it without DeepSpeed: what it had found, as JSON.
DEFERRED = "DSREPRO_DEEPSPEED_IN_RANKS"


def poisoned_fork() -> bool:
    """Is a child forked from this process now in torch's bad-fork state (where CUDA cannot be initialised)? Asked
    of a throwaway child, which exits at once; False where torch is not imported."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = 3 if torch.cuda._is_in_bad_fork() else 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 3


@dataclass(frozen=True)
class Deferred:
    """What a fork server found before it restarted without DeepSpeed, for the one that replaced it."""

    reason: str
    deepspeed: str
    deepspeed_path: str
    accelerator: str
    accelerator_backend: str

    @classmethod
    def of(cls, deepspeed: Any, accelerator: Any) -> Deferred:
        why = (
            f"importing DeepSpeed {deepspeed.__version__} with its {accelerator.device_name()} accelerator "
            "initialises CUDA, which poisons the fork server's forks"
        )
        return cls(
            why,
            str(deepspeed.__version__),
            os.path.dirname(os.path.realpath(deepspeed.__file__)),
            str(accelerator.device_name()),
            str(accelerator.communication_backend_name()),
        )

    def dumps(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def loads(cls, text: str) -> Deferred:
        return cls(**json.loads(text))


def verdict_file(
    cache_dir: Path, deepspeed: str | None, deepspeed_path: str | None, torch: str, accelerator: str
) -> Path:
    """Where a fork server notes that a DeepSpeed install poisons forks with an accelerator (and this torch)."""
    where = hashlib.sha256(str(deepspeed_path).encode()).hexdigest()[:10]
    return cache_dir / "fork-safety" / f"deepspeed-{deepspeed}-{where}-torch-{torch}-{accelerator}.json"


def restart_without_deepspeed(found: Deferred, cache_dir: Path, torch: str) -> None:
    """Replace this fork server (same pid, same socket, same arguments) by one that leaves DeepSpeed to the ranks,
    and note why in the cache, so that later servers for this install start that way. Only before the server has
    forked anything: nothing of its own is lost."""
    noted = verdict_file(cache_dir, found.deepspeed, found.deepspeed_path, torch, found.accelerator)
    with contextlib.suppress(OSError):  # a note that cannot be written costs the next server this restart, no more
        write_atomically(noted, found.dumps())
    sys.stdout.flush()
    sys.stderr.flush()
    os.environ[DEFERRED] = found.dumps()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def deferred(cache_dir: Path, torch: str) -> Deferred | None:
    """What says this fork server must leave DeepSpeed to its ranks: the server it replaced (taken out of the
    environment, so that ranks do not inherit it), or, where GPUs exist, an earlier server's note about this install
    (metadata only: nothing is imported)."""
    text = os.environ.pop(DEFERRED, None)
    if text is not None:
        return Deferred.loads(text)
    accelerator = os.environ.get("DS_ACCELERATOR")
    if accelerator is None or not gpu_device_nodes():
        return None
    release = versions.resolved("deepspeed", "deepspeed")
    noted = verdict_file(cache_dir, release.version, release.path, torch, accelerator)
    try:
        found = Deferred.loads(noted.read_text())
    except (OSError, ValueError, TypeError):
        return None
    return dataclasses.replace(found, reason=f"{found.reason}; noted by an earlier fork server in {noted}")


def without_deepspeed(facts: ServerFacts, found: Deferred) -> ServerFacts:
    """The facts of a fork server that leaves DeepSpeed to its ranks: what its predecessor found, and why. Fatal
    where even this server's forks are poisoned (torch or pytest touched CUDA): no world could use CUDA."""
    fatal = "its forks are poisoned for CUDA even without DeepSpeed (torch initialised CUDA)"
    return dataclasses.replace(
        facts,
        deepspeed=found.deepspeed,
        deepspeed_path=found.deepspeed_path,
        accelerator=found.accelerator,
        accelerator_backend=found.accelerator_backend,
        deepspeed_in_ranks=found.reason,
        fatal=fatal if poisoned_fork() else None,
    )
