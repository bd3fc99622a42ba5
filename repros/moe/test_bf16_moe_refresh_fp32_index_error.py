"""bf16 without ZeRO and an MoE model with expert parallelism: loading a module-only checkpoint raises IndexError.

``BF16_Optimizer`` (what bf16 without ZeRO builds before 0.17.6) keeps, per parameter group, the bf16 weights split
into one partition per rank of that group's data-parallel group; an MoE expert group's data-parallel group is the
expert-data-parallel one (world / ep_size ranks), the other groups' the whole world. ``_restore_from_bit16_weights``
(called by ``refresh_fp32_params``, which ``load_checkpoint(load_module_only=True)`` runs to copy the loaded weights
into the fp32 master copy) had a loop over the groups nested in another one: for each group's rank it walked every
group's partitions, so the world rank of the dense group indexed the expert group's partitions too. With ``ep_size``
2 on 2 ranks the expert group has one partition, and rank 1 dies with ``IndexError: list index out of range``. The
nested loop dates from bf16 pipeline support (PR #1801), older than every release the catalogue runs; PR #7054
(first released in 0.16.4) walks the groups once, each with its own rank.
"""

import pytest
from _moe import moe_engine, moe_model
from _prerequisites import TORCH_LOAD_WEIGHTS_ONLY

pytestmark = [
    pytest.mark.ds_repro(
        id="bf16-moe-refresh-fp32-index-error",
        title="bf16 + MoE expert parallelism without ZeRO: load_checkpoint(load_module_only=True) raises IndexError",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/7054",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/7054",
        fixed_in="0.16.4",
        root_cause="BF16_Optimizer._restore_from_bit16_weights nested a loop over every group's partitions inside "
        "the loop over the groups, indexing an expert group's partitions with the dense group's data-parallel rank.",
    ),
    pytest.mark.ds_premise(stage=0, precision="bf16"),
    TORCH_LOAD_WEIGHTS_ONLY,
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/7054",
        raises="IndexError",
        match=r"list index out of range",
        frames=("bf16_optimizer.py:_restore_from_bit16_weights", "bf16_optimizer.py:refresh_fp32_params"),
        words=("refresh optimizer state from bf16 ckpt",),
    ),
]

BF16_NO_ZERO = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "bf16": {"enabled": True},
}


def restore_each_group_once(monkeypatch):
    """Backport of PR #7054: each group's fp32 partition is copied from its own bf16 partitions, at its own rank."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    from pytest_dsrepro.inrank.backport import backport, release_has

    if not release_has(BF16_Optimizer._restore_from_bit16_weights, "for i, group in enumerate(self.bf16_groups):"):
        return  # PR #7054 is in this release
    backport(
        monkeypatch,
        "deepspeed.runtime.bf16_optimizer",
        [
            (
                r"for i, group in enumerate\(self\.bf16_groups\):\n"
                r"(\s+)partition_id = dist\.get_rank\(group=self\.real_dp_process_group\[i\]\)\n"
                r"\s+for bf16_partitions, fp32_partition in zip\(self\.bf16_partitioned_groups, "
                r"self\.fp32_groups_flat_partition\):\n"
                r"\s+fp32_partition\.data\.copy_\(bf16_partitions\[partition_id\]\.data\)",
                r"for i, (bf16_partitions, fp32_partition) in enumerate(zip(self.bf16_partitioned_groups, "
                r"self.fp32_groups_flat_partition)):\n"
                r"\1partition_id = dist.get_rank(group=self.real_dp_process_group[i])\n"
                r"\1fp32_partition.data.copy_(bf16_partitions[partition_id].data)",
            )
        ],
    )


def no_zero_load_path_without_zero(monkeypatch):
    """PR #7586 (0.18.0), the fix of entry bf16-zero0-checkpoint-loses-optimizer's crash: loading takes ZeRO's path
    only with ZeRO on. In 0.17.6 bf16 without ZeRO builds the fp16 wrapper, which has no _restore_from_bit16_weights,
    and a module-only load of any model fails with AttributeError before this bug's code could run."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    from pytest_dsrepro.inrank.backport import backport, release_has

    if not release_has(DeepSpeedEngine.load_checkpoint, "self.zero_optimization() or self.bfloat16_enabled())"):
        return
    backport(
        monkeypatch,
        "deepspeed.runtime.engine",
        [
            (
                r"load_zero_checkpoint = load_path is not None and \(self\.zero_optimization\(\) or "
                r"self\.bfloat16_enabled\(\)\)",
                "load_zero_checkpoint = load_path is not None and self.zero_optimization()",
            )
        ],
    )


@pytest.mark.ds_prerequisite(
    fix=no_zero_load_path_without_zero,
    releases=">=0.17.6,<0.18.0",
    reason="bf16-zero0-checkpoint-loses-optimizer (PR #7586): in 0.17.6 a module-only load of a bf16 engine without "
    "ZeRO calls _restore_from_bit16_weights on the fp16 wrapper, which has none (AttributeError)",
)
@pytest.mark.ds_config(pytest.param(BF16_NO_ZERO, id="bf16_no_zero"))
@pytest.mark.ds_version(
    affected="<0.16.4",
    raises=IndexError,
    match=r"list index out of range",
    fix=restore_each_group_once,
)
def test_load_module_only_checkpoint_with_experts(ds_engine, ds_config, ds_world_size, ds_device, tmp_path):
    import deepspeed
    import torch

    # Top-1 routing without random token selection (the routing plays no part: no token goes through the model).
    gate = {"use_rts": False, "capacity_factor": 2.0, "eval_capacity_factor": 2.0, "min_capacity": 1}

    def engine_over(seed):
        # One expert per rank (ep_size = world size), its parameters in a group of their own (moe_engine).
        return moe_engine(ds_engine, ds_config, moe_model(ds_world_size, 1, ep_size=ds_world_size, seed=seed,
                                                          device=ds_device, **gate))  # fmt: skip

    # A checkpoint of other weights (a pretrained model), which a fresh run starts from without its optimizer
    # state. (No training step here: BF16_Optimizer.step with MoE layers fails on the CPU accelerator, whose
    # FloatTensor cannot take the float norms get_norm_with_moe_layers gives it: TypeError, seen on 0.16.3.)
    pretrained = engine_over(seed=7)
    pretrained.save_checkpoint(str(tmp_path), tag="pretrained")
    loaded = {name: p.detach().clone() for name, p in pretrained.module.named_parameters()}

    engine = engine_over(seed=8)
    engine.load_checkpoint(str(tmp_path), tag="pretrained", load_module_only=True)

    # The fp32 master weights the next step updates must be the loaded ones (a release whose optimizer keeps no
    # fp32 copy that deepspeed.utils can read answers None: there the module's own weights are compared).
    for name, p in engine.module.named_parameters():
        master = deepspeed.utils.safe_get_full_fp32_param(p)
        trained = (master if master is not None else p.detach()).to(loaded[name].dtype)
        assert torch.equal(trained, loaded[name]), f"{name}'s fp32 master weight is not the loaded one"
