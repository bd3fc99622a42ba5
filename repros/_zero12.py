"""What the ZeRO-1/2 repros share (not a test module): their configs, and the plain-torch runs their engines'
weights are compared with.

A data-parallel step on N ranks with per-rank mean losses over equal batches averages the ranks' gradients, which
is the gradient of one mean loss over every rank's batch at once: so the reference is a plain model trained on
``global_batch``, with the same seed, optimizer and data. Imported as ``_zero12`` (see ``_prerequisites``).
"""

from __future__ import annotations

from typing import Any

import pytest

from pytest_dsrepro.inrank.models import make_batch

MICRO_BATCH = 2


def config(stage: int, *, offload: bool = False, accumulation: int = 1) -> Any:
    """A ZeRO-``stage`` config as a ``ds_config`` parameter, without clipping (DeepSpeed >= 0.19.3 clips by default).

    ``offload``: the optimizer on CPU, still torch's (``zero_force_ds_cpu_optimizer`` off: no C++ CPU Adam to
    build; untested optimizers such as SGD allowed).
    """
    zero: dict[str, Any] = {"stage": stage}
    extra: dict[str, Any] = {}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        extra = {"zero_force_ds_cpu_optimizer": False, "zero_allow_untested_optimizer": True}
    return pytest.param(
        {
            "zero_optimization": zero,
            **extra,
            "train_micro_batch_size_per_gpu": MICRO_BATCH,
            "gradient_accumulation_steps": accumulation,
            "gradient_clipping": 0.0,
        },
        id=f"zero{stage}" + ("_offload" if offload else ""),
    )


def global_batch(world_size: int, seed: int, hidden: int = 16) -> tuple[Any, Any]:
    """Every rank's ``make_batch(MICRO_BATCH, hidden, seed, rank)``, concatenated: what the ranks see together."""
    import torch

    parts = [make_batch(MICRO_BATCH, hidden=hidden, seed=seed, rank=r) for r in range(world_size)]
    x, y = zip(*parts, strict=True)
    return torch.cat(x), torch.cat(y)


def max_difference(model: Any, reference: Any) -> float:
    """The largest absolute difference between two models' parameters (zero-element ones have none)."""
    pairs = zip(model.parameters(), reference.parameters(), strict=True)
    return max((a.detach() - b.detach()).abs().max().item() for a, b in pairs if a.numel())


def sgd_step_error(engine: Any, reference: Any, lr: float) -> tuple[float, float]:
    """One plain SGD step of ``reference`` on the gradients it holds; then how far ``engine``'s weights are from it,
    and, for scale, how far the step moved a weight (both the largest over every element)."""
    import torch

    moved = 0.0
    with torch.no_grad():
        for p in reference.parameters():
            moved = max(moved, (lr * p.grad).abs().max().item())
            p -= lr * p.grad
    return max_difference(engine.module, reference), moved


def train(engine: Any, rank: int, steps: int, hidden: int = 16) -> None:
    """``steps`` optimizer steps of ``engine`` on this rank's part of ``global_batch(..., seed=step)``."""
    import torch

    for step in range(steps):
        x, y = make_batch(MICRO_BATCH, hidden=hidden, seed=step, rank=rank)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()


def train_reference(model: Any, optimizer: Any, world_size: int, steps: int, hidden: int = 16) -> None:
    """What ``train`` should amount to: ``steps`` plain steps of ``optimizer`` on ``global_batch(..., seed=step)``."""
    import torch

    for step in range(steps):
        x, y = global_batch(world_size, seed=step, hidden=hidden)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
