"""ZeRO-3, reentrant activation checkpointing and a PyTorch-style ``output.backward(gradient)``: the second step dies
(deepspeedai/DeepSpeed PR #7780).

PR #7665 (0.18.3) lets a ZeRO engine be trained without ``engine.backward``: the user calls ``backward`` on a
tensor, as plain PyTorch code and disaggregated trainers do, and ZeRO's gradient hooks run the post-backward work
themselves once the last expected hook has fired. With reentrant checkpointing (``use_reentrant=True``, still the
default of many model codes) the checkpointed block's parameters only join the backward graph when the block is
recomputed, mid-backward: ZeRO-3 counts the hooks before they exist, runs its epilogue after the first phase, and
the recomputed block's gradients land in reduction buckets that nothing flushes. ``step()`` leaves them there, so
the next backward reduces parameters whose gradients are gone: ``AttributeError: 'NoneType' object has no
attribute 'numel'``. PR #7780 (first released in 0.18.5) runs the epilogue from an autograd callback at the end of
the whole backward and clears the buckets before each step.
"""

import pytest
from _zero3 import ZERO3
from _zero12 import tolerance

from pytest_dsrepro.inrank.devices import precision_dtype

pytestmark = [
    pytest.mark.ds_repro(
        id="zero3-reentrant-checkpoint-tensor-backward",
        title="ZeRO-3 with reentrant checkpointing and output.backward(gradient): AttributeError 'NoneType' object "
        "has no attribute 'numel' in the second step",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/7780",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/7780",
        fixed_in="0.18.5",
        root_cause="Under a backward called on a tensor, ZeRO-3 ran its gradient epilogue once the hooks it had "
        "counted had fired, before reentrant checkpointing recomputed its block, whose gradients then stayed in "
        "the reduction buckets across step().",
    ),
    pytest.mark.ds_premise(
        stage=3,
        sets={"zero_optimization.stage3_param_persistence_threshold": 0, "zero_force_ds_cpu_optimizer": False},
        because="every parameter of the tiny model partitioned, and the body trains with torch's Adam",
    ),
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    # The GPU face, by its frames: the bare message is common to other ZeRO bugs (issue #5019, a LoRA backward).
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/7780",
        raises="AttributeError",
        frames=("stage3.py:reduce_partition_and_remove_grads", "stage3.py:reduce_ready_partitions_and_remove_grads"),
        words=("use_reentrant=True", "non-scalar backward"),
        gpu=True,
    ),
]

#: The bug's faces: on a GPU the second backward reduces a bucketed parameter whose gradient is gone; on the CPU
#: accelerator the first ``step()`` already meets the recomputed block's gradients, never reduced and still on the
#: parameters, where ``zero_grad`` hands them to ``record_stream``, which refuses CPU tensors.
LEFTOVER_GRADIENTS = r"'NoneType' object has no attribute 'numel'|^unknown parameter type$"

HIDDEN = 8
STEPS = 3
LR = 1e-2


def checkpointed_model(seed=42):
    """Two linear layers, the first (with its activation) under reentrant activation checkpointing."""
    import torch
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear1 = torch.nn.Linear(HIDDEN, HIDDEN)
            self.linear2 = torch.nn.Linear(HIDDEN, HIDDEN)

        def block(self, x):
            return torch.relu(self.linear1(x))

        def forward(self, x):
            return self.linear2(checkpoint(self.block, x, use_reentrant=True))

    torch.manual_seed(seed)
    return Checkpointed()


def batch(step, rank, batch_size, dtype, device):
    """This rank's inputs of ``step`` (reentrant checkpointing needs inputs that require grad)."""
    import torch

    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(batch_size, HIDDEN, generator=generator, device="cpu")
    return x.to(device, dtype).requires_grad_(True)


def epilogue_at_end_of_backward(monkeypatch):
    """PR #7780's fix, the part on this repro's path: the post-backward work that ZeRO-3's gradient hooks trigger
    runs once, from a callback queued on the autograd engine, when the whole backward (both phases of reentrant
    checkpointing) has completed, and the hook count starts afresh after it; ``_pre_step`` empties the gradient
    buckets of anything a backward left in them. A no-op where the release does it."""
    import functools

    import torch
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    from pytest_dsrepro.inrank.backport import release_has

    if release_has(DeepSpeedZeroOptimizer_Stage3, "bucket.clear_params()"):
        return  # this release has the fix
    run_post_hooks = DeepSpeedZeroOptimizer_Stage3.run_grad_acc_post_hooks
    pre_step = DeepSpeedZeroOptimizer_Stage3._pre_step

    @functools.wraps(run_post_hooks)
    def run_post_hooks_when_backward_ends(self):
        if torch._C._current_graph_task_id() == -1:
            return run_post_hooks(self)  # not inside a backward: as before
        if getattr(self, "_post_hooks_queued", False):
            return None

        def at_end_of_backward():
            self._post_hooks_queued = False
            self._remaining_grad_acc_hooks = 0
            run_post_hooks(self)

        self._post_hooks_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(at_end_of_backward)
        return None

    @functools.wraps(pre_step)
    def pre_step_with_empty_buckets(self, *args, **kwargs):
        result = pre_step(self, *args, **kwargs)
        for bucket in self.ipg_buckets.values():
            bucket.params.clear()
            bucket.elements = 0
        return result

    monkeypatch.setattr(DeepSpeedZeroOptimizer_Stage3, "run_grad_acc_post_hooks", run_post_hooks_when_backward_ends)
    monkeypatch.setattr(DeepSpeedZeroOptimizer_Stage3, "_pre_step", pre_step_with_empty_buckets)


@pytest.mark.ds_config(pytest.param(ZERO3, id="zero3_all_partitioned"))
@pytest.mark.ds_not_applicable(
    releases="<0.18.3",
    reason="a backward called on a tensor instead of engine.backward drives ZeRO's gradient reduction from 0.18.3 "
    "(PR #7665); before it no gradient is reduced that way",
)
@pytest.mark.ds_version(
    affected=">=0.18.3,<0.18.5",
    raises=Exception,
    match=LEFTOVER_GRADIENTS,
    fix=epilogue_at_end_of_backward,
)
def test_reentrant_checkpoint_with_tensor_backward(ds_engine, ds_config, ds_rank, ds_world_size, ds_device):
    import torch
    from deepspeed import zero

    dtype = precision_dtype(ds_config)
    micro = ds_config["train_micro_batch_size_per_gpu"]
    model = checkpointed_model()
    engine = ds_engine(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=LR))
    accumulation = engine.gradient_accumulation_steps()  # the config's: STEPS optimizer steps of that many backwards
    used = []  # each optimizer step's rate and Adam betas (a config's scheduler sets them; OneCycle cycles betas)
    for step in range(STEPS * accumulation):
        output = engine(batch(step, ds_rank, micro, dtype, ds_device))
        output.backward(torch.ones_like(output))  # PyTorch style, no engine.backward
        if engine.is_gradient_accumulation_boundary():
            used.append({"lr": engine.get_lr()[0], "betas": engine.optimizer.param_groups[0]["betas"]})
        engine.step()

    # Past the crash: plain Adam on the gradient the ranks' backward calls average to (over the accumulation's
    # backward calls too, which DeepSpeed divides by their number), clipped as the config clips, at each step's rate.
    reference = checkpointed_model().to(ds_device, dtype)
    adam = torch.optim.Adam(reference.parameters(), lr=LR)
    clipping = engine.gradient_clipping()
    for step, settings in enumerate(used):
        adam.zero_grad()
        for micro_step in range(step * accumulation, (step + 1) * accumulation):
            for rank in range(ds_world_size):
                output = reference(batch(micro_step, rank, micro, dtype, ds_device))
                output.backward(torch.ones_like(output) / (ds_world_size * accumulation))
        if clipping:  # DeepSpeed's 0 is no clipping
            torch.nn.utils.clip_grad_norm_(reference.parameters(), clipping)
        adam.param_groups[0].update(settings)
        adam.step()
    for (name, trained), expected in zip(engine.module.named_parameters(), reference.parameters(), strict=True):
        # one parameter at a time: a gather of several races on gloo before 0.19.8 (zero3-persistent-allgather-race)
        with zero.GatheredParameters([trained]):
            error = (trained.float() - expected.float()).abs().max().item()
        assert error < tolerance(engine, 1e-5), f"{name} differs from plain Adam's by {error:.3e}"
