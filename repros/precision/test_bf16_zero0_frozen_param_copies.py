"""bf16 without ZeRO (LoRA/PEFT): the optimizer wrapper keeps fp32 master copies of the frozen weights too.

PR #7515 (0.17.6) sent bf16 + ZeRO stage 0 to the fp16 wrappers (``FP16_UnfusedOptimizer`` for a torch optimizer,
``FP16_Optimizer`` for fused Adam) instead of ``BF16_Optimizer``. ``BF16_Optimizer`` builds its flat bf16 and fp32
buffers from the trainable parameters only; the fp16 wrappers took every parameter of each optimizer group, frozen
ones included. A LoRA/PEFT run hands the optimizer ``model.parameters()`` with nearly all of them frozen, so
``deepspeed.initialize`` allocated an fp32 copy (and, for fused Adam, a flat bf16 copy) of the whole frozen base
model, which will never be updated: several times the memory the training needs, and a CUDA out-of-memory error
before the first step (Qwen3-8B + LoRA on a 40 GB A100 in PR #8029). PR #8029 keeps only the parameters that
require gradients. It is merged after the v0.19.1 tag, yet the 0.19.1 wheel on PyPI already carries it (built from
a later commit of the release branch: its ``unfused_optimizer.py`` and ``fused_optimizer.py`` have the filter), so
the observed range ends at 0.19.1, one release before the ledger's first tagged 0.19.2.

The body measures the memory ``deepspeed.initialize`` keeps (the accelerator's ``memory_allocated``: allocated
device memory on GPUs, the process's resident memory on the CPU accelerator) for a LoRA layer with a frozen
4096 x 4096 bf16 base, after a first engine has paid for what any first ``initialize`` loads.
"""

import pytest

from pytest_dsrepro.inrank.models import lora_linear

pytestmark = [
    pytest.mark.ds_repro(
        id="bf16-zero0-frozen-param-copies",
        title="bf16 + ZeRO stage 0: the fp16 wrapper allocates fp32 master copies of frozen (LoRA base) weights",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/8029",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/8029",
        fixed_in="0.19.1",
        root_cause="FP16_Optimizer and FP16_UnfusedOptimizer, which bf16 without ZeRO uses from 0.17.6, built their "
        "low-precision and fp32 copies from every parameter of a group, frozen ones included.",
    ),
    pytest.mark.ds_premise(stage=0, precision="bf16"),
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/8029",
        words=("frozen weights", "CUDA OOM", "LoRA", "FP16_UnfusedOptimizer"),
        gpu=True,
    ),
]

BF16_NO_ZERO = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "bf16": {"enabled": True},
}
FEATURES = 4096  # the frozen base: 16.8M parameters, 32 MiB in bf16, 64 MiB as fp32 copies
MIB = 2**20


def trainable_copies_only(monkeypatch):
    """Backport of PR #8029: the fp16 wrappers' groups hold the parameters that require gradients, and the fp32
    (and flat low-precision) copies are made of those."""
    from deepspeed.runtime.fp16 import unfused_optimizer

    from pytest_dsrepro.inrank.backport import backport, release_has

    if not release_has(unfused_optimizer, "self.fp16_groups.append(param_group['params'])"):
        return  # before 0.17.6 bf16 without ZeRO uses BF16_Optimizer, which filters; from 0.19.1 fixed
    backport(
        monkeypatch,
        "deepspeed.runtime.fp16.unfused_optimizer",
        [
            (
                r"self\.fp16_groups\.append\(param_group\['params'\]\)",
                "self.fp16_groups.append([p for p in param_group['params'] if p.requires_grad])",
            ),
            (
                r"fp32_group = \[p\.clone\(\)\.float\(\)\.detach\(\) for p in param_group\['params'\]\]",
                "fp32_group = [p.clone().float().detach() for p in self.fp16_groups[i]]",
            ),
        ],
    )
    backport(
        monkeypatch,
        "deepspeed.runtime.fp16.fused_optimizer",
        [
            (
                r"self\.fp16_groups\.append\(param_group\['params'\]\)",
                "self.fp16_groups.append([p for p in param_group['params'] if p.requires_grad])",
            ),
        ],
    )


@pytest.mark.ds_config(pytest.param(BF16_NO_ZERO, id="bf16_no_zero"))
@pytest.mark.ds_version(
    affected=">=0.17.6,<0.19.1",
    raises=AssertionError,
    match=r"deepspeed\.initialize kept \d+ MiB for a LoRA layer",
    fix=trainable_copies_only,
)
def test_lora_initialize_keeps_no_copies_of_frozen_weights(ds_engine, ds_config):
    import gc

    import torch
    from deepspeed.accelerator import get_accelerator

    # What any first initialize loads (modules, groups, buffers of the comm layer) is paid for here, with a small
    # LoRA layer: the measured initialize below then keeps only what belongs to its own engine.
    warm_up = ds_engine(model=lora_linear(16, 4, seed=1).to(torch.bfloat16))
    del warm_up
    gc.collect()

    model = lora_linear(FEATURES, 4, seed=2).to(torch.bfloat16)  # a PEFT model: base frozen, adapters trainable
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    gc.collect()
    accelerator = get_accelerator()
    before = accelerator.memory_allocated()
    engine = ds_engine(model=model)  # a torch Adam over model.parameters(), as a LoRA script passes them
    gc.collect()
    kept = accelerator.memory_allocated() - before

    # The engine's copies of the trainable adapters (fp32 master, Adam's state) are well under 1 MiB; fp32 copies
    # of the frozen base would be 4 bytes per frozen parameter (64 MiB). Half of that is the limit.
    limit = frozen * 4 // 2
    assert kept < limit, (
        f"deepspeed.initialize kept {kept // MIB} MiB for a LoRA layer of {trainable} trainable and {frozen} frozen "
        f"parameters (limit {limit // MIB} MiB; {type(engine.optimizer).__name__})"
    )
