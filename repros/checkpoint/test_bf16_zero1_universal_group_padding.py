"""``ds_to_universal`` cannot convert the checkpoint of a bf16 ZeRO-1 run (``BF16_Optimizer``) that has a small
param group: ``RuntimeError: narrow(): length must be non-negative``.

With bf16 weights and fp32 gradient accumulation, ZeRO stage 1 trains through ``BF16_Optimizer`` (as
Megatron-DeepSpeed does). It flattens each param group, pads it to a multiple of twice the data-parallel size and
gives each rank an equal partition; its checkpoint records each group's padding (``group_paddings``), which
``ds_to_universal`` strips from the end of every optimizer state of the partition (``_strip_tensor_paddings``).
``BF16_Optimizer`` writes the whole padding into the last rank's file and 0 into the others, as if the padding always
fit in the last partition. It does not when a group is small beside the data-parallel size (fewer elements than
about twice its square: Megatron-DeepSpeed's no-weight-decay group of a pipeline stage at a large data-parallel size,
or a learnable scalar in its own group): the padding then reaches into earlier ranks' partitions, the last rank's
partition is shorter than the padding, and stripping narrows to a negative length (PR #7426's report, a
Megatron-DeepSpeed checkpoint). The ZeRO-1/2 optimizer (``stage_1_and_2``) records each rank's own share of the
padding, and its checkpoints convert.

PR #7426 (0.17.3) only made the stripping optional in ``get_zero_checkpoint_state``; ``ds_to_universal`` still strips,
and no release records the padding per rank (the last-rank rule dates from PR #1801, 0.6.2; the converter ships with
DeepSpeed from 0.11.2, PR #4516): open in every release the catalogue covers. The fix here records, on
every rank, the part of its own partition that lies past the group's real elements, as ``stage_1_and_2`` does.
"""

import pytest
from _prerequisites import BF16_ZERO1_OPTIMIZER, TORCH_LOAD_WEIGHTS_ONLY
from _universal import to_universal

from pytest_dsrepro.inrank.devices import precision_dtype
from pytest_dsrepro.inrank.models import make_batch, tiny_mlp

pytestmark = [
    pytest.mark.ds_repro(
        id="checkpoint-bf16-zero1-universal-group-padding",
        title="ds_to_universal on a bf16 ZeRO-1 (BF16_Optimizer) checkpoint with a small param group: narrow() "
        "length must be non-negative",
        # Reported in PR #7426 (a face below), which is no fix: the line that records the padding.
        upstream="https://github.com/deepspeedai/DeepSpeed/blob/v0.19.5/deepspeed/runtime/bf16_optimizer.py#L203",
        fix_ref=None,  # PR #7426 only made the stripping optional; nothing upstream fixes the padding
        fixed_in=None,
        root_cause="BF16_Optimizer records a group's whole alignment padding on the last data-parallel rank, though "
        "for a small group it spans earlier ranks' partitions too; ds_to_universal's _strip_tensor_paddings then "
        "narrows the last rank's shorter partition to a negative length.",
    ),
    pytest.mark.ds_premise(
        stage=1,
        precision="bf16",
        config={"data_types.grad_accum_dtype": "fp32"},
    ),
    TORCH_LOAD_WEIGHTS_ONLY,  # the converter reads the checkpoint
    BF16_ZERO1_OPTIMIZER,
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/7426",
        raises="RuntimeError",
        match=r"narrow\(\): length must be non-negative",
        frames=(
            "zero_checkpoint.py:_strip_tensor_paddings",
            "zero_checkpoint.py:get_state_for_rank",
            "ds_to_universal.py:extract_zero_shards",
        ),
        words=("ds_to_universal", "strip_tensor_paddings", "Megatron-DeepSpeed"),
        gpu=True,
    ),
]

#: bf16 ZeRO-1 with fp32 gradient accumulation: the engine picks BF16_Optimizer.
BF16_ZERO1 = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "bf16": {"enabled": True},
    "data_types": {"grad_accum_dtype": "fp32"},
    "zero_optimization": {"stage": 1},
}


def padding_per_rank(monkeypatch):
    """Each rank records the padding that lies in its own partition (``stage_1_and_2``'s rule): none before the
    group's real end, the whole partition past it, the tail in the partition that holds the end."""
    from deepspeed.runtime import bf16_optimizer

    from pytest_dsrepro.inrank.backport import backport, release_has

    if not release_has(
        bf16_optimizer.BF16_Optimizer, "padding = self.bf16_groups_flat[i].numel() - length_without_padding"
    ):
        return  # this release records the padding otherwise
    backport(
        monkeypatch,
        "deepspeed.runtime.bf16_optimizer",
        [(r"if partition_id == dist\.get_world_size\(group=self\.real_dp_process_group\[i\]\) - 1:\n"
          r"( +)padding = self\.bf16_groups_flat\[i\]\.numel\(\) - length_without_padding\n"
          r" +else:\n +padding = 0\n",
          r"if True:\n\1end = (partition_id + 1) * partition_size\n"
          r"\1padding = min(partition_size, max(0, end - length_without_padding))\n")],
    )  # fmt: skip


@pytest.mark.ds_config(pytest.param(BF16_ZERO1, id="bf16_zero1_fp32_accum"))
@pytest.mark.ds_version(
    affected=">=0.11.2",  # ds_to_universal ships with DeepSpeed from 0.11.2 (PR #4516); the padding rule is older
    raises=RuntimeError,
    match=r"narrow\(\): length must be non-negative",
    fix=padding_per_rank,
)
def test_ds_to_universal_converts_a_small_group(ds_engine, ds_config, ds_rank, ds_device, tmp_path):
    import torch

    class ScaledMLP(torch.nn.Module):
        """A tiny MLP whose output a learnable scalar scales (as CLIP's logit scale), trained in a group of its
        own: one element, against a padding of twice the data-parallel size."""

        def __init__(self):
            super().__init__()
            self.mlp = tiny_mlp(seed=21)
            self.scale = torch.nn.Parameter(torch.ones(1, device=ds_device))

        def forward(self, x):
            return self.mlp(x) * self.scale

    model = ScaledMLP()
    groups = [{"params": list(model.mlp.parameters())}, {"params": [model.scale], "lr": 1e-2}]
    engine = ds_engine(model=model, optimizer=torch.optim.Adam(groups, lr=1e-3))
    for step in range(2 * engine.gradient_accumulation_steps()):
        x, y = make_batch(ds_config["train_micro_batch_size_per_gpu"], seed=22 + step, rank=ds_rank,
                          dtype=precision_dtype(ds_config))  # fmt: skip
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    # The state Megatron-DeepSpeed adds for ds_to_universal (no tensor-parallel patterns here).
    info = {"universal_checkpoint_info": {"universal_checkpoint_version": 0.2}}
    engine.save_checkpoint(str(tmp_path / "checkpoint"), tag="step2", client_state=info)

    torch.distributed.barrier()  # every rank's files are written
    universal = tmp_path / f"universal-{ds_rank}"
    to_universal(tmp_path / "checkpoint" / "step2", universal)

    # The scalar's fp32 weight in the universal checkpoint is the trained one.
    stored = torch.load(universal / "zero" / "scale" / "fp32.pt", map_location=ds_device, weights_only=False)
    stored = stored["param"] if isinstance(stored, dict) else stored
    torch.testing.assert_close(stored.float().flatten(), model.scale.detach().float().flatten(), atol=1e-2, rtol=1e-2)
