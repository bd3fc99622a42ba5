"""Where a rank's data lives, and a check that a body puts it there.

A body runs in a gloo world on CPU and in an NCCL world on ``cuda:LOCAL_RANK``; the engine DeepSpeed builds sits on
that device, so the data a body feeds it must too. ``rank_device()`` names it (the ``ds_device`` fixture in the
body), and every helper of ``inrank`` defaults to it.

On a CPU machine both places are the CPU, so a body that forgets the device passes there and fails on a GPU with
"Expected all tensors to be on the same device": ``placement_check`` makes that visible without a GPU.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from pytest_dsrepro.core.premises import precision

#: The tensor factories whose result lands on the default (CPU) device unless given ``device=``.
FACTORIES = (
    "arange", "empty", "empty_strided", "eye", "full", "linspace", "logspace", "ones", "rand", "randint", "randn",
    "randperm", "scalar_tensor", "tensor", "zeros",
)  # fmt: skip

#: The plugin's rank context (``inrank.context``), by module name.
CONTEXT = "pytest_dsrepro.inrank.context"

#: Where ``inrank``'s own helpers live: always checked, as every body calls them.
INRANK = os.path.dirname(os.path.abspath(__file__))


class MisplacedTensor(RuntimeError):
    """Checked code made a tensor without saying its device: on a GPU it would be on the CPU, beside a CUDA engine."""


def rank_device() -> Any:
    """This rank's ``torch.device``: ``cuda:LOCAL_RANK`` in an NCCL world (or process group), else the CPU."""
    import torch

    plugin = sys.modules.get(CONTEXT)  # looked up, not imported: a script ``dsrepro export`` wrote has no plugin
    try:
        return torch.device(plugin.current().device) if plugin is not None else _process_group_device()
    except RuntimeError:  # not in a world: a reference computed in the pytest process
        return _process_group_device()


def _process_group_device() -> Any:
    """``cuda:LOCAL_RANK`` under an NCCL process group (a script run by torchrun), else the CPU."""
    import torch
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def precision_dtype(config: Mapping[str, Any]) -> Any:
    """The dtype an engine built from ``config`` computes in (its ``bf16``/``fp16`` section, else fp32): the dtype of
    the inputs a body feeds it and of the references it compares with."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision(config)]


def engine_dtype(engine: Any) -> Any:
    """The dtype ``engine`` (a ``DeepSpeedEngine``) computes in: what its inputs must be."""
    import torch

    if engine.bfloat16_enabled():
        return torch.bfloat16
    return torch.float16 if engine.fp16_enabled() else torch.float32


def _checked(filename: str, roots: tuple[str, ...]) -> bool:
    path = os.path.abspath(filename)
    return any(path == root or path.startswith(root + os.sep) for root in roots)


@contextmanager
def placement_check(roots: Iterable[str | os.PathLike[str]] = ()) -> Iterator[None]:
    """Refuse, while active, a tensor factory (``torch.randn``, ``torch.ones``, ...) called directly without
    ``device=`` from checked code: a file under ``roots`` (the catalogue's files) or ``inrank`` (its helpers), as the
    tensor it makes lands on the CPU whatever the rank's device. Factories called by torch, DeepSpeed or transformers
    are theirs to place, and are not checked. ``device="cpu"`` said on purpose (data kept on the host) passes."""
    import torch
    from torch.overrides import TorchFunctionMode

    factories = {getattr(torch, name) for name in FACTORIES}
    checked = (INRANK, *(os.path.abspath(os.fspath(r)) for r in roots))

    class RefuseImplicitDevice(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if func in factories and kwargs.get("device") is None:
                caller = sys._getframe(1)  # the code that called the factory (the mode is entered from C)
                if _checked(caller.f_code.co_filename, checked):
                    raise MisplacedTensor(
                        f"torch.{func.__name__}() without device= at {caller.f_code.co_filename}:{caller.f_lineno}: "
                        f"on a GPU this tensor would be on the CPU, not on the rank's device ({rank_device()}). "
                        "Pass device=ds_device (the fixture), or use the inrank helpers, which default to it"
                    )
            return func(*args, **kwargs)

    with RefuseImplicitDevice():
        yield
