"""The pytest process's side of the worlds: its fork servers and the worlds it runs on them.

``server_process`` (the fork server as a child process), ``fork_server`` (the handle, and the one loop over the
server's messages), ``world_run`` (one world in flight), ``runner`` (``WorldRunner``: the worlds of one pytest
process), ``gpu_probe`` (CUDA devices from a spawned probe), ``leases`` (GPUs per NCCL world), ``nccl_diagnostics``
(an NCCL world's flight recorder, read here). None of them imports torch, DeepSpeed, the server or the rank side.
"""

from .fork_server import CacheUnusable, ForkServer, RunStops, WrongRelease
from .runner import WorldRunner
from .server_process import ServerGone
from .world_run import WorldInterrupted, WorldRun

__all__ = [
    "CacheUnusable",
    "ForkServer",
    "RunStops",
    "ServerGone",
    "WorldInterrupted",
    "WorldRun",
    "WorldRunner",
    "WrongRelease",
]
