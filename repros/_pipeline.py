"""What the pipeline repros share (not a test module): a two-stage pipeline over the world's ranks, its data, and
the plain model it is compared with. Imported as ``_pipeline`` (see ``_prerequisites``).
"""

from __future__ import annotations

from typing import Any

import pytest

from pytest_dsrepro.inrank.models import make_batch

STAGES = 2
#: A pipeline of ``STAGES`` stages needs that many ranks: its repros pin their world, whatever ``--ds-world-size``.
PIPELINE_WORLD = pytest.mark.ds_world(size=STAGES)

#: A pipeline config without ZeRO. ``steps_per_print``: the pipeline engine's ``train_batch`` of 0.15-0.16 takes the
#: step modulo ``steps_per_print``, whose default there is None. fp32, no timers, written out: what
#: ``pipeline_premise`` sets.
PIPELINE = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "zero_force_ds_cpu_optimizer": False,
    "steps_per_print": 100,
    "wall_clock_breakdown": False,
    "flops_profiler": {"enabled": False},
    "zero_allow_untested_optimizer": True,
    "bf16": {"enabled": False},
    "fp16": {"enabled": False},
}
#: ... with gradient accumulation: what the accumulation repros need, stated once.
PIPELINE_ACCUMULATION = {**PIPELINE, "gradient_accumulation_steps": 2}


def pipeline_premise(**requirements: Any) -> pytest.MarkDecorator:
    """The ``ds_premise`` of a pipeline repro (its ``requirements``), and what a scan changes in a user's config for
    a body that compares one ``train_batch`` with plain fp32 SGD, and why."""
    return pytest.mark.ds_premise(
        **requirements,
        sets={"gradient_clipping": 0.0, "steps_per_print": 100, "zero_allow_untested_optimizer": True,
              "bf16.enabled": False, "fp16.enabled": False, "wall_clock_breakdown": False,
              "flops_profiler.enabled": False, "zero_force_ds_cpu_optimizer": False},
        removes=("scheduler",),
        because="the body compares the weights with plain, unclipped fp32 SGD at its own rate, to 1e-6 (which ZeRO-1 "
        "must be allowed to wrap, and which a config's scheduler or half precision would change); and the pipeline "
        "engine's train_batch of 0.15-0.16 takes the step modulo steps_per_print, whose default there is None; from "
        "0.18.3 a stage's backward under wall_clock_breakdown (which the flops profiler turns on too) starts the "
        "bwd_microstep timer twice (the pipeline's own and the backward hook's: AssertionError, entry "
        "pipeline-backward-timer-started-twice), before the compared step; a torch optimizer beside CPU optimizer "
        "offload needs zero_force_ds_cpu_optimizer off",
    )  # fmt: skip


ACCUMULATION_PREMISE = pipeline_premise(stage=(0, 1), gradient_accumulation=">=2")


def layers(seed: int) -> list[Any]:
    """Four layers, two per stage (``partition_method="uniform"``), the same on every rank."""
    import torch

    torch.manual_seed(seed)
    return [torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Linear(16, 1)]


def pipeline_engine(ds_config: dict[str, Any], world_size: int, seed: int, lr: float) -> Any:
    """A ``PipelineEngine`` of ``STAGES`` stages over ``layers(seed)``, trained with SGD.

    Not ``ds_engine``: its batch size counts every rank as data-parallel, and the pipeline's data-parallel size is
    the world's divided by the stages (DeepSpeed checks it against the pipeline's own topology)."""
    import deepspeed
    import torch
    from deepspeed.pipe import PipelineModule

    micro, accumulation = ds_config["train_micro_batch_size_per_gpu"], ds_config["gradient_accumulation_steps"]
    config = {**ds_config, "train_batch_size": micro * accumulation * world_size // STAGES}
    module = PipelineModule(
        layers=layers(seed), num_stages=STAGES, loss_fn=torch.nn.MSELoss(), partition_method="uniform"
    )
    engine, *_ = deepspeed.initialize(
        model=module, optimizer=torch.optim.SGD(module.parameters(), lr=lr), config=config
    )
    return engine


def batches(ds_config: dict[str, Any]) -> list[tuple[Any, Any]]:
    """The micro-batches of one ``train_batch``: the same on every stage (the first reads inputs, the last labels)."""
    micro = ds_config["train_micro_batch_size_per_gpu"]
    return [make_batch(micro, seed=m) for m in range(ds_config["gradient_accumulation_steps"])]


def one_batch_errors(ds_config: dict[str, Any], world_size: int, seed: int, lr: float) -> list[Any]:
    """One ``train_batch`` of ``pipeline_engine``; then every rank's ``(stage, max |w - w_reference|)`` over its
    stage's weights, where the reference is ``layers(seed)`` as one plain model after one SGD step on the mean loss
    over the same micro-batches."""
    import torch

    engine = pipeline_engine(ds_config, world_size, seed, lr)
    data = batches(ds_config)
    engine.train_batch(data_iter=iter(data))

    reference = torch.nn.Sequential(*layers(seed)).to(data[0][0].device)  # where the batches are: the rank's
    for x, y in data:
        (torch.nn.functional.mse_loss(reference(x), y) / len(data)).backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= lr * p.grad
    expected = dict(reference.named_parameters())  # PipelineModule names its layers by their index, as Sequential
    pairs = [(p, expected[name]) for name, p in engine.module.named_parameters()]
    error = max((p.detach() - q.detach()).abs().max().item() for p, q in pairs)
    errors: list[Any] = [None] * world_size
    torch.distributed.all_gather_object(errors, (engine.stage_id, error))
    return errors
