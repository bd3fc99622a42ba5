"""Runs in the pytest process: the machine's CUDA devices, learnt without a CUDA context in any process that forks
ranks.

torch's rule: a process that initialised CUDA, or merely asked the CUDA runtime for its device count (what
``torch.cuda.is_available()`` does unless ``PYTORCH_NVML_BASED_CUDA_CHECK=1``), poisons every later fork: a forked
child that touches CUDA raises "Cannot re-initialize CUDA in forked subprocess". Ranks are forked, so the pytest
process learns the devices from a short *spawned* probe (a fresh interpreter that asks torch and exits), and only
where a GPU device node exists (``device_nodes``): a CPU machine starts no probe and has none. The fork server gets
torch's NVML-based check (``server_environment``) and never asks torch about devices (``server.cuda_reexec``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from ...core.errors import HarnessError
from ..device_nodes import gpu_device_nodes

#: Set in the fork server's environment where GPUs exist: torch's availability check then asks NVML, which creates no
#: CUDA context (DeepSpeed 0.19.8 sets the same on import).
NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"


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
