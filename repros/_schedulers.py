"""What the learning-rate scheduler repros share (not a test module): a config with a ``scheduler`` section, an
engine whose optimizer has two param groups with their own learning rates, and the check of every group's learning
rate against the schedule the repro computes itself.

A scheduler is pure Python over the optimizer, but users meet it through the config: the engine builds it from the
``scheduler`` section, sets the groups' initial learning rates in ``deepspeed.initialize`` and steps it in every
``engine.step()``. So the repros do the same, and read the rates with ``engine.get_lr()``. Imported as
``_schedulers`` (see ``_prerequisites``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from pytest_dsrepro.inrank.devices import precision_dtype
from pytest_dsrepro.inrank.models import make_batch, tiny_mlp

#: What a scan sets for a body's torch optimizer of two groups, and why.
TORCH_OPTIMIZER = {"zero_force_ds_cpu_optimizer": False, "zero_allow_untested_optimizer": True}
TORCH_OPTIMIZER_BECAUSE = (
    "the body trains a torch SGD optimizer of two groups, which ZeRO takes only when allowed (untested optimizers) and "
    "beside CPU optimizer offload only with zero_force_ds_cpu_optimizer off"
)
#: The two param groups' own learning rates: the first layer's, and the output layer's.
BASE_LRS = (0.1, 0.2)


def config(name: str, scheduler: str, **params: Any) -> Any:
    """A ZeRO-0 fp32 ``ds_config`` parameter whose ``scheduler`` section is ``scheduler`` with ``params``."""
    return pytest.param(
        {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,
            **TORCH_OPTIMIZER,
            "scheduler": {"type": scheduler, "params": params},
        },
        id=name,
    )


def linear_warmup_premise(config: dict[str, object]) -> pytest.MarkDecorator:
    """The ``ds_premise`` of a warm-up scheduler's repro: ``config``'s conditions, and the linear warm-up the body's
    reference follows (a scan sets it on a user's config)."""
    return pytest.mark.ds_premise(
        config=config,
        sets={"scheduler.params.warmup_type": "linear", **TORCH_OPTIMIZER},
        because=f"the body computes the linear warm-up each group should follow; {TORCH_OPTIMIZER_BECAUSE}",
    )


def check_schedule(
    ds_engine: Any, ds_config: dict[str, Any], ds_rank: int, expected: Callable[[int], Sequence[float]], steps: int,
    bug: str,
) -> None:  # fmt: skip
    """Train ``steps`` optimizer steps of a two-group SGD engine (each of the config's accumulation steps: the
    scheduler moves at the boundary only); before each step and after the last, every group's learning rate must be
    ``expected(k)`` (``k``: the steps taken so far, 0 right after ``deepspeed.initialize``; the scheduler is then at
    iteration ``k - 1``). A mismatch fails with ``bug``, the step and both lists."""
    import torch

    model = tiny_mlp(seed=3)
    layers = (model[0], model[2])
    groups = [{"params": layer.parameters(), "lr": lr} for layer, lr in zip(layers, BASE_LRS, strict=True)]
    engine = ds_engine(model=model, optimizer=torch.optim.SGD(groups))
    for k in range(steps + 1):
        got, want = list(engine.get_lr()), list(expected(k))
        assert all(_close(g, w) for g, w in zip(got, want, strict=True)), (
            f"{bug}: learning rates {got} after {k} step(s), expected {want}"
        )
        for micro in range(engine.gradient_accumulation_steps() if k < steps else 0):
            x, y = make_batch(ds_config["train_micro_batch_size_per_gpu"], seed=k * 1000 + micro, rank=ds_rank,
                              dtype=precision_dtype(ds_config))  # fmt: skip
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            engine.step()


def _close(got: object, want: float) -> bool:
    """A number within rounding of ``want`` (a list where a number belongs is not close to anything)."""
    return isinstance(got, (int, float)) and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12)
