"""ZeRO-1/2: a param group too small to reach every rank makes the first backward raise IndexError.

ZeRO-1/2 splits each param group's flat buffer into one partition per rank; a group smaller than the ranks' share
(a learnable scalar such as a temperature or an output scale, kept in its own group without weight decay) leaves
the last rank's partition with no parameter at all, only padding. PR #7509 (Muon, 0.17.6) made
``get_flat_partition`` read ``tensor_list[0]`` (is the partition's first parameter a Muon one?) before anything else,
so on that rank the gradient epilogue of the first backward dies with ``IndexError: list index out of range``,
whatever the optimizer. PR #7700 (first released in 0.18.3) returns a zero (padding) partition for an empty list.
Before 0.17.6 an empty partition was padded and nothing read its first parameter.
"""

import pytest
from _prerequisites import ZERO12_CPU_FLAT_BUFFER

from pytest_dsrepro.inrank.devices import precision_dtype
from pytest_dsrepro.inrank.models import make_batch, tiny_mlp

pytestmark = [
    pytest.mark.ds_repro(
        id="zero12-empty-partition-flat",
        title="ZeRO-1/2: a param group smaller than the ranks' share makes get_flat_partition raise IndexError",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/7700",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/7700",
        fixed_in="0.18.3",
        root_cause="get_flat_partition read tensor_list[0] for Muon's check (PR #7509) before handling a rank whose "
        "partition of a param group holds no parameter.",
    ),
    pytest.mark.ds_premise(stage=(1, 2), offload_optimizer="none"),
    ZERO12_CPU_FLAT_BUFFER,
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/7700",
        raises="IndexError",
        match=r"list index out of range",
        frames=("stage_1_and_2.py:get_flat_partition", "stage_1_and_2.py:independent_gradient_partition_epilogue"),
        words=("small parameteters and many ranks",),
    ),
]

#: The most optimizer steps the body takes for the scalar to move (two in its own config).
MAX_STEPS = 4


def zero_config(stage):
    return pytest.param(
        {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage},
        },
        id=f"zero{stage}",
    )


def pad_an_empty_partition(monkeypatch):
    """Backport of PR #7700: an empty partition's flat gradient is its padding, zeros."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from pytest_dsrepro.inrank.backport import release_has

    flat = DeepSpeedZeroOptimizer.get_flat_partition
    if release_has(flat, "if len(tensor_list) == 0:"):
        return  # this release has the fix

    def get_flat_partition(self, tensor_list, first_offset, partition_size, dtype, device, *args, **kwargs):
        import torch

        if len(tensor_list) == 0:
            zeros = torch.zeros(int(partition_size), dtype=dtype, device=device)
            return [zeros] if kwargs.get("return_tensor_list", args[1:2] == (True,)) else zeros
        return flat(self, tensor_list, first_offset, partition_size, dtype, device, *args, **kwargs)

    monkeypatch.setattr(DeepSpeedZeroOptimizer, "get_flat_partition", get_flat_partition)


@pytest.mark.ds_config(zero_config(1), zero_config(2))
@pytest.mark.ds_version(
    affected=">=0.17.6,<0.18.3", raises=IndexError, match=r"list index out of range", fix=pad_an_empty_partition
)
def test_a_scalar_param_group_trains(ds_engine, ds_config, ds_rank, ds_device):
    import torch
    from deepspeed.utils import safe_get_full_fp32_param

    class ScaledMLP(torch.nn.Module):
        """The tiny MLP times a learnable scalar, which trains in a group of its own (no weight decay)."""

        def __init__(self):
            super().__init__()
            self.mlp = tiny_mlp(seed=6)
            self.scale = torch.nn.Parameter(torch.ones(1, device="cpu"))  # moved with the module

        def forward(self, x):
            return self.mlp(x) * self.scale

    dtype = precision_dtype(ds_config)
    model = ScaledMLP().to(device=ds_device, dtype=dtype)
    groups = [
        {"params": list(model.mlp.parameters()), "weight_decay": 0.01},
        {"params": [model.scale], "weight_decay": 0.0},
    ]
    engine = ds_engine(model=model, optimizer=torch.optim.AdamW(groups, lr=1e-2))
    before = model.scale.detach().float().clone()
    # At least two optimizer steps of the config's accumulation steps each, until the scalar's fp32 master moved (a
    # config's warm-up may give the first step a rate of 0; a bf16 copy moves only by whole bf16 units).
    for step in range(MAX_STEPS):
        for micro in range(engine.gradient_accumulation_steps()):
            seed = step if micro == 0 else 100 * step + micro
            x, y = make_batch(ds_config["train_micro_batch_size_per_gpu"], seed=seed, rank=ds_rank, dtype=dtype)
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            engine.step()
        master = safe_get_full_fp32_param(engine.module.scale).float()  # a collective: every rank, every step
        if step >= 1 and not torch.equal(master, before):
            break
    assert not torch.equal(master, before), "the scalar's group did not train"
    trained = engine.module.scale.detach()
    assert torch.equal(trained, master.to(trained.dtype)), f"the module's scale {trained} is not its fp32 {master}"
