"""What the ZeRO-1/2 repros share (not a test module): their configs, and the plain-torch runs their engines'
weights are compared with.

A data-parallel step on N ranks with per-rank mean losses over equal batches averages the ranks' gradients, which
is the gradient of one mean loss over every rank's batch at once: so the reference is a plain model trained on
``global_batch``, with the same seed, optimizer and data. Imported as ``_zero12`` (see ``_prerequisites``).
"""

from __future__ import annotations

from typing import Any

import pytest

from pytest_dsrepro.inrank.devices import engine_dtype, precision_dtype
from pytest_dsrepro.inrank.models import make_batch, tiny_mlp

MICRO_BATCH = 2

#: How far a bf16/fp16 engine's weights may be from the fp32 reference after a few steps (its forward and backward
#: round to 8 or 11 bits), for the repros whose bug is a crash or a slowdown and whose weight check is a sanity check.
HALF_PRECISION_TOLERANCE = 5e-2


def tolerance(engine: Any, fp32: float) -> float:
    """The weight check's tolerance for ``engine``: ``fp32`` where it computes in fp32, else the half precisions'."""
    import torch

    return fp32 if engine_dtype(engine) == torch.float32 else HALF_PRECISION_TOLERANCE


def config(stage: int, *, offload: bool = False, accumulation: int = 1) -> Any:
    """A ZeRO-``stage`` config as a ``ds_config`` parameter, without clipping (DeepSpeed >= 0.19.3 clips by default).

    The bodies pass torch optimizers (``zero_force_ds_cpu_optimizer`` off, so a scan's offloaded config takes them
    too: no C++ CPU Adam to build). ``offload``: the optimizer on CPU (untested optimizers such as SGD allowed).
    """
    zero: dict[str, Any] = {"stage": stage}
    extra: dict[str, Any] = {"zero_force_ds_cpu_optimizer": False}
    if offload:  # what ``offloaded_sgd_premise`` sets on a scanned config, written out
        zero["offload_optimizer"] = {"device": "cpu"}
        extra.update(zero_allow_untested_optimizer=True, bf16={"enabled": False}, fp16={"enabled": False})
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


#: What a scan sets on a user's config for a body that steps torch's SGD in fp32, unclipped, and compares it with
#: plain SGD: DeepSpeed must take the torch optimizer as it is.
PLAIN_SGD_SETS = {
    "gradient_clipping": 0.0,
    "zero_force_ds_cpu_optimizer": False,
    "zero_allow_untested_optimizer": True,
    "bf16.enabled": False,
    "fp16.enabled": False,
}


#: The ``ds_premise`` of a ZeRO-1/2 repro whose body compares the weights with plain torch training of the same torch
#: optimizer (the empty-parameter repros).
TORCH_OPTIMIZER_PREMISE = pytest.mark.ds_premise(
    stage=(1, 2),
    sets={"gradient_clipping": 0.0, "zero_force_ds_cpu_optimizer": False},
    because="the body compares the weights with plain torch training, which does not clip gradients, and passes "
    "that torch optimizer to DeepSpeed, which refuses it beside an offloaded optimizer unless allowed",
)


def offloaded_sgd_premise(**requirements: Any) -> Any:
    """The ``ds_premise`` of a ZeRO-2 offload repro whose body steps torch's SGD and compares with plain fp32 SGD:
    ``requirements`` (``gradient_accumulation=...``) on top of ZeRO-2 with the optimizer offloaded to the CPU, and
    what a scan sets on a user's config for that body, and why."""
    return pytest.mark.ds_premise(
        stage=2,
        offload_optimizer="cpu",
        **requirements,
        sets=PLAIN_SGD_SETS,
        removes=("scheduler",),
        because="the body trains with torch's SGD (no DeepSpeed CPU Adam to build) and compares one optimizer step "
        "with plain, unclipped fp32 SGD's at the same rate to 1e-6, closer than bf16 or fp16 rounds (the bug drops "
        "gradients whatever the precision and the rate), where a scheduler's warm-up from 0 would give that step a "
        "rate of 0",
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
    return max((a.detach().float() - b.detach().float()).abs().max().item() for a, b in pairs if a.numel())


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


def train(
    engine: Any, rank: int, steps: int, hidden: int = 16, moms: list[dict[str, Any]] | None = None
) -> list[float]:
    """``steps`` optimizer steps of ``engine``, each over the config's ``gradient_accumulation_steps`` micro-batches
    (this rank's part of ``global_batch(..., seed=micro_step)``, in the engine's dtype); the learning rate of each
    optimizer step (a config's scheduler sets them), for ``train_reference``; into ``moms``, each step's momentum (a
    OneCycle scheduler cycles Adam's betas and SGD's momentum)."""
    import torch

    used = []
    for micro in range(steps * engine.gradient_accumulation_steps()):
        x, y = make_batch(MICRO_BATCH, hidden=hidden, seed=micro, rank=rank, dtype=engine_dtype(engine))
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        if engine.is_gradient_accumulation_boundary():
            used.append(engine.get_lr()[0])
            group = engine.optimizer.param_groups[0]
            if moms is not None:
                moms.append({k: group[k] for k in ("betas", "momentum") if k in group})
        engine.step()
    return used


def train_reference(
    model: Any,
    optimizer: Any,
    world_size: int,
    steps: int,
    hidden: int = 16,
    lrs: list[float] | None = None,
    accumulation: int = 1,
    moms: list[dict[str, Any]] | None = None,
) -> None:
    """What ``train`` should amount to: ``steps`` plain steps of ``optimizer``, each on the mean gradient of
    ``accumulation`` micro-batches (the config's ``gradient_accumulation_steps``) ``global_batch(..., seed=micro)``,
    at the learning rate ``train`` returned for it (``lrs``; the optimizer's own where not given) and the momentum it
    noted (``moms``)."""
    import torch

    for step in range(steps):
        optimizer.zero_grad()
        for micro in range(step * accumulation, (step + 1) * accumulation):
            x, y = global_batch(world_size, seed=micro, hidden=hidden)
            (torch.nn.functional.mse_loss(model(x), y) / accumulation).backward()
        for group in optimizer.param_groups if lrs else ():
            group["lr"] = lrs[step]
        for group in optimizer.param_groups if moms else ():
            group.update({k: v for k, v in moms[step].items() if k in group})
        optimizer.step()


def sqrt_gain_config(stage: int, precision: str, *, offload: bool = False) -> Any:
    """The ``ds_config`` parameter of the two non-finite norm entries: ZeRO-``stage`` in ``precision`` (fp32 or bf16),
    torch's SGD taken as it is (as their premises set it for a scanned config); without ``offload`` clipping at 1.0,
    which ``zero12-inf-grad-norm-nan`` needs, with it the optimizer offloaded to the CPU and no clipping."""
    zero: dict[str, Any] = {"stage": stage}
    clipping: dict[str, Any] = {"gradient_clipping": 1.0}
    if offload:
        zero["offload_optimizer"], clipping = {"device": "cpu"}, {}
    return pytest.param(
        {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            **clipping,
            "zero_optimization": zero,
            "zero_force_ds_cpu_optimizer": False,
            "zero_allow_untested_optimizer": True,
            **({"bf16": {"enabled": True}} if precision == "bf16" else {}),
        },
        id=f"zero{stage}_{precision}_" + ("offload" if offload else "clip"),
    )


def step_with_one_infinite_gradient(ds_engine: Any, ds_config: dict[str, Any], rank: int, device: Any) -> Any:
    """The body of the two non-finite norm entries (``zero12-inf-grad-norm-nan``, ``-offload-inf-grad-norm-long``):
    one SGD step of a linear layer plus ``sqrt(gain)`` with the gain at 0, so the gain's gradient is infinite and the
    layer's are finite, in the config's dtype on the rank's device, over the config's accumulation of micro-steps
    (the norm is taken at the step's boundary only); the engine after that step."""
    import torch

    class GainedLinear(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(4)
            self.linear = torch.nn.Linear(16, 1)
            self.gain = torch.nn.Parameter(torch.zeros(1, device="cpu"))  # moved with the module

        def forward(self, x: Any) -> Any:
            return self.linear(x) + torch.sqrt(self.gain)

    dtype = precision_dtype(ds_config)
    model = GainedLinear().to(device=device, dtype=dtype)
    engine = ds_engine(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = make_batch(ds_config["train_micro_batch_size_per_gpu"], seed=1, rank=rank, dtype=dtype)
    micro_steps = engine.gradient_accumulation_steps()
    for _ in range(micro_steps):
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    assert engine.global_steps == 1, f"{micro_steps} micro-steps took {engine.global_steps} optimizer steps"
    return engine


def refuse_a_bucket_of_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """Backport of PR #8266 (entries ``zero12-reduce-bucket-size-zero`` and ``zero3-reduce-bucket-size-zero``): the
    ZeRO config refuses a ``reduce_bucket_size`` that is not above 0."""
    from deepspeed.runtime import config as ds_config

    zero_config = ds_config.get_zero_config

    def get_zero_config(param_dict: Any) -> Any:
        parsed = zero_config(param_dict)
        if parsed.reduce_bucket_size <= 0:
            raise ValueError(f"reduce_bucket_size: Input should be greater than 0 (got {parsed.reduce_bucket_size})")
        return parsed

    monkeypatch.setattr(ds_config, "get_zero_config", get_zero_config)


def bucket_of_zero(stage: int) -> Any:
    """The ``ds_config`` parameter of the reduce_bucket_size entries: ZeRO-``stage`` with a bucket of 0 elements,
    torch's SGD taken as it is, in fp32 (ZeRO-3's parameters all partitioned)."""
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 0}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    return pytest.param(
        {
            "train_micro_batch_size_per_gpu": MICRO_BATCH,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,  # PLAIN_SGD_SETS, written out
            "zero_force_ds_cpu_optimizer": False,
            "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": False},
            "fp16": {"enabled": False},
            "zero_optimization": zero,
        },
        id=f"zero{stage}_bucket0",
    )


def bucket_of_zero_error(ds_engine: Any, ds_config: dict[str, Any], rank: int, world_size: int) -> float | None:
    """The body of both reduce_bucket_size entries: how far two SGD steps of ``tiny_mlp`` under ``ds_config`` land
    from plain data-parallel SGD (ZeRO-3's weights gathered for it); None where DeepSpeed refuses the config naming
    ``reduce_bucket_size`` at ``initialize``, PR #8266's answer, where the user can mend it."""
    import deepspeed
    import torch

    from pytest_dsrepro.inrank.engine import ConfigRejected

    lr, steps = 0.1, 2
    model = tiny_mlp(seed=8)
    try:
        engine = ds_engine(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr))
    except ConfigRejected as refused:
        if "reduce_bucket_size" not in str(refused):
            raise
        return None
    lrs = train(engine, rank, steps=steps)
    reference = tiny_mlp(seed=8)
    optimizer = torch.optim.SGD(reference.parameters(), lr=lr)
    accumulation = ds_config["gradient_accumulation_steps"]
    train_reference(reference, optimizer, world_size, steps=steps, lrs=lrs, accumulation=accumulation)
    partitioned = ds_config["zero_optimization"]["stage"] == 3
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=partitioned):
        return max_difference(engine.module, reference)
