"""ZeRO-3 bf16 training of a PEFT LoRA model loaded with ``from_pretrained`` fails after the first step
(deepspeedai/DeepSpeed#8072).

After every optimizer step ZeRO-3 re-gathers its persistent parameters (small ones, kept whole on every rank) in
``Init._allgather_params_coalesced``, which allocates every output buffer with the dtype of the *first* parameter.
Up to 0.19.1 ``deepspeed.initialize`` cast the whole bf16 model to bf16, LoRA adapters included, so the dtypes
agreed. PR #8066 (0.19.2) stopped casting models built under ``zero.Init`` (what ``from_pretrained`` does with a
ZeRO-3 config), and PEFT keeps its adapters in fp32 (``autocast_adapter_dtype=True``): the bf16 and fp32 persistent
parameters meet in one gather. NCCL says ``TypeError: output tensor must have the same type as input tensor``
(the issue's message); gloo, here, ``RuntimeError: ProcessGroupGloo::allgather: invalid tensor type``; on every rank,
at the end of the first ``step()``. PR #8073 gives each buffer its own parameter's dtype (first released in 0.19.3).
"""

import math

import pytest
from _prerequisites import PERSISTENT_ALLGATHER_RACE

from pytest_dsrepro.inrank.hf import requires_hf, tiny_checkpoint, token_batch

pytestmark = [
    pytest.mark.ds_repro(
        id="hf-lora-fp32-adapters-bf16",
        title="ZeRO-3 bf16 + PEFT LoRA (fp32 adapters) on a from_pretrained model: TypeError in the persistent "
        "parameters' all-gather after step()",
        upstream="https://github.com/deepspeedai/DeepSpeed/issues/8072",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/8073",
        fixed_in="0.19.3",
        root_cause="_allgather_params_coalesced allocates every output buffer in the first parameter's dtype; from "
        "0.19.2 a zero.Init model is no longer cast to bf16 as a whole, so PEFT's fp32 adapters meet bf16 weights.",
    ),
    pytest.mark.ds_premise(
        stage=3,
        precision="bf16",
        sets={"zero_force_ds_cpu_optimizer": False},
        because="the body trains the adapters with its own torch AdamW, which DeepSpeed refuses beside an offloaded "
        "optimizer unless told",
    ),
    requires_hf,
    PERSISTENT_ALLGATHER_RACE,
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/issues/8072",
        raises="TypeError",
        match="output tensor must have the same type as input tensor",
        frames=("partition_parameters.py:_allgather_params_coalesced",),
        words=("_allgather_params_coalesced", "autocast_adapter_dtype", "LoRA"),
        gpu=True,
    ),
    pytest.mark.ds_seen(
        "https://github.com/huggingface/trl/pull/6091",
        words=("non-quantized PEFT", "mixed-dtype"),
        gpu=True,
    ),
]

ZERO3_BF16 = {
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 3},  # the default persistence threshold: every tiny parameter is persistent
    "zero_force_ds_cpu_optimizer": False,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
}


def gather_each_dtype_apart(monkeypatch):
    """PR #8073's effect: every all-gather buffer has its own parameter's dtype. Here each dtype's parameters are
    gathered by their own call of the installed method (which may carry the persistent-gather prerequisite)."""
    import functools

    from deepspeed.runtime.zero.partition_parameters import Init

    from pytest_dsrepro.inrank.backport import release_has

    gather = Init._allgather_params_coalesced
    if not release_has(gather, "param_list[0].ds_tensor.dtype"):
        return  # this release has the fix

    @functools.wraps(gather)
    def per_dtype(self, param_list, *args, **kwargs):
        for dtype in dict.fromkeys(p.ds_tensor.dtype for p in param_list):
            gather(self, [p for p in param_list if p.ds_tensor.dtype == dtype], *args, **kwargs)

    monkeypatch.setattr(Init, "_allgather_params_coalesced", per_dtype)


@pytest.mark.ds_config(pytest.param(ZERO3_BF16, id="zero3_bf16"))
@pytest.mark.ds_version(
    affected=">=0.19.2,<0.19.3",
    raises=RuntimeError,
    match="allgather: invalid tensor type",
    fix=gather_each_dtype_apart,
)
def test_lora_adapters_train_on_bf16_model(ds_engine, ds_config, ds_rank, tmp_path):
    import deepspeed
    import torch
    from deepspeed.utils import safe_get_full_fp32_param
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    checkpoint, saved = tiny_checkpoint(tmp_path / "tiny-llama", "llama", seed=4)

    zero3 = HfDeepSpeedConfig(ds_config)  # noqa: F841 - what the Trainer and accelerate set up for ZeRO-3
    base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16, local_files_only=True)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    adapters = [p for p in model.parameters() if p.requires_grad]
    assert {p.dtype for p in adapters} == {torch.float32}, "PEFT keeps its adapters in fp32"
    engine = ds_engine(model=model, optimizer=torch.optim.AdamW(adapters, lr=1e-2))
    engine.train()  # from_pretrained returns the model in eval mode (0.14.4 refuses a backward then)
    initial = [safe_get_full_fp32_param(p).clone() for p in adapters]  # a collective: every rank, in order

    batch = token_batch(ds_config["train_micro_batch_size_per_gpu"], seed=6, rank=ds_rank)
    losses = []
    for _ in range(4 * engine.gradient_accumulation_steps()):  # 4 optimizer steps, at the config's accumulation
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert all(math.isfinite(loss) for loss in losses), losses
    # They trained: their fp32 weights moved (a bf16 model's loss may not show the steps of a small rate, and a
    # config's warm-up may give the first a rate of 0).
    trained = [safe_get_full_fp32_param(p) for p in adapters]
    unmoved = sum(torch.equal(a, b) for a, b in zip(initial, trained, strict=True))
    assert not unmoved, f"the adapters did not train: {unmoved} of {len(adapters)} unmoved; losses {losses}"
    # The frozen bf16 weights are still exactly the checkpoint's (gathered from their ZeRO-3 partitions).
    frozen = dict(model.base_model.model.named_parameters())
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.base_layer.weight"]
    for name in names:  # one at a time: gathering several is racy on gloo before 0.19.8 (the prerequisite's bug)
        with deepspeed.zero.GatheredParameters([frozen[name]]):
            stored = saved[name.replace(".base_layer", "")].to(torch.bfloat16)
            torch.testing.assert_close(frozen[name].data, stored, rtol=0, atol=0, msg=f"{name} moved")
