"""CUDA devices, known without a CUDA context in any process that forks ranks.

torch's rule: a process that initialised CUDA, or merely asked the CUDA runtime for its device count (what
``torch.cuda.is_available()`` does unless ``PYTORCH_NVML_BASED_CUDA_CHECK=1``), poisons every later fork: a forked
child that touches CUDA raises "Cannot re-initialize CUDA in forked subprocess". Ranks are forked, so:

- the pytest process learns the devices from a short *spawned* probe (a fresh interpreter that asks torch and exits),
  and only where a GPU device node exists: a CPU machine starts no probe and has none;
- the fork server never asks torch about devices. It runs with ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (so that what it
  imports asks NVML), and after preloading it forks a throwaway child that says whether it is in torch's bad-fork
  state (``poisoned_fork``). DeepSpeed releases before 0.19.8 initialise CUDA on ``import deepspeed`` with their CUDA
  accelerator (op builders' compatibility checks); then the server starts again in its own place without DeepSpeed
  (``restart_without_deepspeed``), and each rank imports DeepSpeed itself, after the fork.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core import versions
from ..core.errors import HarnessError
from .protocol import ServerFacts

#: Where device nodes are looked for (the test-suite's CUDA simulation points it elsewhere).
DEVICE_DIR = Path("/dev")
#: Device nodes through which any CUDA (or ROCm, or WSL's) GPU is reached; torch sees no device without one.
GPU_DEVICE_NODES = ("nvidiactl", "nvidia0", "dxg", "kfd")
#: Set in the fork server's environment where GPUs exist: torch's availability check then asks NVML, which creates no
#: CUDA context (DeepSpeed 0.19.8 sets the same on import).
NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"
#: Set by a fork server for the server that replaces it without DeepSpeed: what it had found, as JSON.
DEFERRED = "DSREPRO_DEEPSPEED_IN_RANKS"
#: How long the spawned probe may take (importing torch and initialising CUDA on a loaded machine).
PROBE_TIMEOUT = 180.0

#: The probe: a fresh interpreter may initialise CUDA; it exits right after. One JSON line: index, UUID, name.
PROBE = """
import json, torch
found = []
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        found.append([i, str(getattr(p, "uuid", "") or ""), str(p.name)])
print("dsrepro-gpus:", json.dumps(found))
"""
PROBE_LINE = "dsrepro-gpus:"


@dataclass(frozen=True)
class Gpu:
    """One CUDA device as the pytest process sees it (its ``CUDA_VISIBLE_DEVICES`` applied)."""

    index: int
    uuid: str  # "GPU-..." as CUDA_VISIBLE_DEVICES takes it; "" where torch gives none
    name: str

    @property
    def visible_id(self) -> str:
        """This device in ``CUDA_VISIBLE_DEVICES``: its UUID, which names it whatever the enumeration order."""
        return self.uuid or str(self.index)

    def describe(self) -> str:
        return f"GPU {self.index} ({self.name}, {self.uuid or 'no UUID'})"


def gpu_device_nodes(dev: Path | None = None) -> list[Path]:
    where = DEVICE_DIR if dev is None else dev
    return [where / name for name in GPU_DEVICE_NODES if (where / name).exists()]


def _uuid(text: str) -> str:
    """torch gives a CUDA UUID without the ``GPU-`` prefix that ``CUDA_VISIBLE_DEVICES`` and NVML use."""
    if not text or text.startswith(("GPU-", "MIG-")):
        return text
    return "GPU-" + text


def parse_probe(output: str) -> tuple[Gpu, ...]:
    """The probe's devices from what it printed (other lines, warnings say, are ignored)."""
    for line in reversed(output.splitlines()):
        if line.startswith(PROBE_LINE):
            found = json.loads(line.removeprefix(PROBE_LINE))
            return tuple(Gpu(int(i), _uuid(str(uuid)), str(name)) for i, uuid, name in found)
    raise ValueError("the probe printed no device list")


def probe(environ: Mapping[str, str] | None = None, timeout: float = PROBE_TIMEOUT) -> tuple[Gpu, ...]:
    """The CUDA devices torch sees, asked in a spawned interpreter: no CUDA context in this process or any other
    that forks. ``HarnessError`` saying why when the probe fails: a world must not silently fall back to gloo."""
    command = [sys.executable, "-P", "-c", PROBE]
    env = dict(os.environ if environ is None else environ)
    try:
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise HarnessError(
            f"counting CUDA devices (torch in a fresh interpreter) took longer than {timeout:g}s"
        ) from None
    try:
        if proc.returncode:
            raise ValueError(f"exit code {proc.returncode}")
        return parse_probe(proc.stdout)
    except ValueError as exc:
        tail = (proc.stdout + proc.stderr).strip()[-2000:]
        raise HarnessError(f"counting CUDA devices (torch in a fresh interpreter) failed ({exc}):\n{tail}") from None


def find() -> tuple[Gpu, ...]:
    """The machine's CUDA devices: none without a GPU device node (no probe, nothing imported), else the probe's."""
    return probe() if gpu_device_nodes() else ()


def server_environment(env: dict[str, str], accelerator: str, gpus: tuple[Gpu, ...]) -> dict[str, str]:
    """``env`` for a fork server whose ranks run DeepSpeed's ``accelerator``: the user's ``DS_ACCELERATOR`` wins;
    where GPUs exist, torch's NVML-based availability check (unless the user chose otherwise)."""
    env.setdefault("DS_ACCELERATOR", accelerator)
    if gpus:
        env.setdefault(NVML_CHECK, "1")
    return env


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
        noted.parent.mkdir(parents=True, exist_ok=True)
        tmp = noted.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(found.dumps())
        tmp.rename(noted)
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
