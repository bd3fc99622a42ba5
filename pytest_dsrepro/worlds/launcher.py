"""Multi-node: when an existing launcher started pytest, every pytest process already is a rank.

torchrun (and ``srun ... torchrun``, DeepSpeed's launcher, MPI wrappers that export the same variables) sets RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT. Then the plugin spawns nothing: it joins that world once
(``env://``) and runs each world test's body in place. Nothing here is home-made launching.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..core import options
from ..core.options import Launched
from ..core.outcome import WorldOutcome
from ..inrank.context import RankContext
from .rank import Fix, run_body

if TYPE_CHECKING:
    from ..core.worlds import WorldSpec


def launched() -> Launched | None:
    """The rank the launcher made this process, from its environment; None when no launcher started pytest."""
    return options.launched(os.environ)


def cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_here(
    fn: Callable[..., Any],
    kwargs: dict[str, Any],
    fixes: Sequence[Fix],
    spec: WorldSpec,
    backend: str,
    *,
    deepspeed: bool = False,
) -> WorldOutcome:
    """Run one body in the launcher's world, joining it on first use; ``deepspeed`` as in ``rank.run_body``."""
    import torch.distributed as dist

    world = launched()
    assert world is not None, "run_here outside a launched world"
    assert world.world_size == spec.size, "the pytest side skips worlds of another size"
    if not dist.is_initialized():
        if backend == "nccl":
            import torch

            torch.cuda.set_device(world.local_rank)
        import datetime

        dist.init_process_group(backend, init_method="env://", timeout=datetime.timedelta(seconds=spec.timeout))
    ctx = RankContext(world.rank, world.world_size, world.local_rank, backend)
    started = time.monotonic()
    report = run_body(fn, kwargs, fixes, ctx, deepspeed=deepspeed)
    result = report.result(world.rank, started=started)
    return WorldOutcome(world.world_size, backend, (result,), time.monotonic() - started)
