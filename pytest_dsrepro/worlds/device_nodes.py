"""Runs in every process (nothing imported): whether this machine has a GPU at all, from its device nodes.

torch sees no CUDA device without one of them, so a CPU machine asks nothing more: the pytest process starts no device
probe (``client.gpu_probe``) and the fork server no bad-fork check (``server.cuda_reexec``).
"""

from __future__ import annotations

from pathlib import Path

#: Where device nodes are looked for (the test-suite's CUDA simulation points it elsewhere).
DEVICE_DIR = Path("/dev")


#: Device nodes through which any CUDA (or ROCm, or WSL's) GPU is reached; torch sees no device without one.
GPU_DEVICE_NODES = ("nvidiactl", "nvidia0", "dxg", "kfd")


def gpu_device_nodes(dev: Path | None = None) -> list[Path]:
    where = DEVICE_DIR if dev is None else dev
    return [where / name for name in GPU_DEVICE_NODES if (where / name).exists()]
