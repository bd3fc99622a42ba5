"""Pipeline parallelism with bf16 and bf16 gradient accumulation: the optimizer never updates the weights.

With ``data_types.grad_accum_dtype: "bf16"`` (which DeepSpeed allows for bf16 without ZeRO only under pipeline
parallelism) ``BF16_Optimizer`` accumulates gradients in bf16 buffers, while the torch optimizer it wraps steps fp32
master partitions. The wrapper gave those partitions their ``.grad`` once, in ``initialize_optimizer_states`` at
construction: an fp32 *copy* of the bf16 gradient buffer, which it then dropped again (``grad = None``) since a copy
would not follow the buffer. ``step()`` never handed the gradients over again, so the torch optimizer saw no gradient
on any step and left every weight as it was, silently: the loss of such a run stays flat. The code came with bf16
gradient accumulation (PR #4713), older than every release the catalogue runs; PR #6485 (first released in 0.15.1)
casts the accumulated gradients to fp32 for the optimizer in every ``step()`` and drops them after it.
"""

import pytest
from _prerequisites import distinct_ddp_bf16

pytestmark = [
    pytest.mark.ds_repro(
        id="bf16-pipeline-bf16-accum-no-update",
        title="bf16 pipeline with grad_accum_dtype bf16: BF16_Optimizer steps without gradients, weights never change",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/6485",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/6485",
        fixed_in="0.15.1",
        root_cause="With a bf16 gradient-accumulation dtype BF16_Optimizer gave the fp32 master partitions a copy of "
        "the gradients only once at init, then cleared it, so every optimizer step ran without gradients.",
    ),
    pytest.mark.ds_premise(
        stage=0,
        precision="bf16",
        config={"data_types.grad_accum_dtype": "bf16"},
        sets={"gradient_clipping": 0.0, "steps_per_print": 100},
        removes=("scheduler", "optimizer"),
        because="the body compares one pipeline train_batch with plain, unclipped SGD at its own rate (the config's "
        "optimizer and scheduler would change the update); the pipeline engine's train_batch of 0.15-0.16 takes the "
        "step modulo steps_per_print, whose default there is None",
    ),
    # From 0.17.6 to 0.18.4 bf16 without ZeRO gets the fp16 wrapper, whatever the accumulation dtype; from 0.18.3
    # that wrapper divides bf16's unscaled gradients by its 65536 loss scale, which leaves the weights as they were
    # too (entry bf16-zero0-grads-unscaled). With PR #7788's fix the pipeline gets the BF16_Optimizer it asks for.
    pytest.mark.ds_prerequisite(
        fix=distinct_ddp_bf16,
        releases=">=0.17.6,<0.18.5",
        reason="bf16-zero1-fp32-accum-wrong-optimizer (PR #7788): bf16 with a bf16 accumulation dtype gets "
        "FP16_UnfusedOptimizer there, not BF16_Optimizer",
    ),
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/6485",
        words=("gradient accumulation data type", "initialize_optimizer_states"),
    ),
]

BF16_PIPELINE = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "steps_per_print": 100,
    "bf16": {"enabled": True},
    "data_types": {"grad_accum_dtype": "bf16"},
}
LR = 0.5
WIDTH = 8


def give_gradients_every_step(monkeypatch):
    """Backport of PR #6485: every ``step()`` gives the fp32 master partitions their gradients (cast to fp32 where
    they accumulate in another dtype) before the torch optimizer steps, and drops the casts after it."""
    import functools

    import torch
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    if not hasattr(BF16_Optimizer, "initialize_optimizer_states"):
        return  # PR #6485 is in this release (it removed the method)
    step = BF16_Optimizer.step

    @functools.wraps(step)
    def step_with_gradients(self, closure=None):
        for param_partition, grad_partition in zip(
            self.fp32_groups_flat_partition, self.fp32_groups_gradient_flat_partition, strict=True
        ):
            param_partition.grad = (
                grad_partition.to(param_partition.dtype)
                if grad_partition.dtype != param_partition.dtype
                else grad_partition
            )
        result = step(self, closure)
        if self.grad_acc_dtype is not torch.float32:
            for param_partition in self.fp32_groups_flat_partition:
                param_partition.grad = None
        return result

    monkeypatch.setattr(BF16_Optimizer, "step", step_with_gradients)


def layers(seed):
    """Three layers, the same on every rank."""
    import torch

    torch.manual_seed(seed)
    return [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, 1)]


def rank_batch(micro, rank, device, dtype):
    import torch

    generator = torch.Generator().manual_seed(40 + rank)
    x = torch.randn(micro, WIDTH, generator=generator, device="cpu")
    y = torch.randn(micro, 1, generator=generator, device="cpu")
    return x.to(device=device, dtype=dtype), y.to(device=device, dtype=dtype)


@pytest.mark.ds_config(pytest.param(BF16_PIPELINE, id="bf16_pipeline_bf16_accum"))
@pytest.mark.ds_version(
    affected="<0.15.1",
    raises=AssertionError,
    match=r"the pipeline's bf16 step did not update the weights as SGD does",
    fix=give_gradients_every_step,
)
def test_pipeline_bf16_accumulation_updates_weights(ds_config, ds_rank, ds_world_size, ds_device):
    import deepspeed
    import torch
    from deepspeed.pipe import PipelineModule

    from pytest_dsrepro.inrank.devices import precision_dtype

    dtype = precision_dtype(ds_config)
    micro, accumulation = ds_config["train_micro_batch_size_per_gpu"], ds_config["gradient_accumulation_steps"]
    # One stage, every rank data-parallel (a pipeline of one stage still runs the pipeline engine and its
    # optimizer wrapper; it needs no bf16 point-to-point transfers between stages).
    module = PipelineModule(layers=layers(seed=3), num_stages=1, loss_fn=torch.nn.MSELoss())
    engine, *_ = deepspeed.initialize(
        model=module, optimizer=torch.optim.SGD(module.parameters(), lr=LR), config=ds_config
    )
    before = {name: p.detach().float().clone() for name, p in engine.module.named_parameters()}
    data = [rank_batch(micro, ds_rank, ds_device, dtype)] * accumulation
    engine.train_batch(data_iter=iter(data))

    # Reference: plain fp32 SGD from the same (bf16-rounded) weights on the mean loss of every rank's batch.
    reference = torch.nn.Sequential(*layers(seed=3)).to(ds_device)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            p.copy_(before[name])
    losses = []
    for rank in range(ds_world_size):
        x, y = rank_batch(micro, rank, ds_device, dtype)
        losses.append(torch.nn.functional.mse_loss(reference(x.float()), y.float()))
    torch.stack(losses).mean().backward()
    for name, p in engine.module.named_parameters():
        update = p.detach().float() - before[name]
        expected = -LR * dict(reference.named_parameters())[name].grad
        # bf16 gradients and weights round the update by a few percent; a step without gradients leaves it 0.
        assert (update - expected).norm() <= 0.2 * expected.norm(), (
            f"the pipeline's bf16 step did not update the weights as SGD does: {name} moved by "
            f"{update.norm().item():.4g}, SGD by {expected.norm().item():.4g}"
        )
