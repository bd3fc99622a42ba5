"""bf16 + ZeRO-1 + ``grad_accum_dtype: fp32`` silently gets the fp16 wrapper instead of ``BF16_Optimizer``.

PR #7515 (0.17.6) added ``DDP_BFLOAT16 = "bf16"`` for bf16 without ZeRO, the same string as ``BFLOAT16``.
``_configure_optimizer`` tests ``optimizer_wrapper in [FP16, DDP_BFLOAT16]`` before ``== BFLOAT16``, so the
``BF16_Optimizer`` branch became unreachable: the configuration that asks for fp32 gradient accumulation got
``FP16_UnfusedOptimizer`` (bf16 accumulation, no ZeRO-1 partitioning of the fp32 master weights, no ``_hp_mapping``),
and ``deepspeed.utils.safe_get_full_fp32_param`` & co. return ``None``. PR #7788 gives ``DDP_BFLOAT16`` its own
value and lets ``BF16_Optimizer`` answer the loss-scaling calls it meets since 0.18.3 (first released in 0.18.5).
"""

import pytest
from _prerequisites import distinct_ddp_bf16

from pytest_dsrepro.inrank.models import make_batch, tiny_mlp

pytestmark = [
    pytest.mark.ds_repro(
        id="bf16-zero1-fp32-accum-wrong-optimizer",
        title="bf16 + ZeRO-1 + grad_accum_dtype fp32 builds FP16_UnfusedOptimizer instead of BF16_Optimizer",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/7788",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/7788",
        fixed_in="0.18.5",
        root_cause="DDP_BFLOAT16 and BFLOAT16 were the same string, and the engine tested the fp16/DDP-bf16 wrapper "
        "first, so the BF16_Optimizer branch was never taken.",
    ),
    pytest.mark.ds_premise(
        stage=1,
        precision="bf16",
        config={"data_types.grad_accum_dtype": "fp32"},
        sets={"zero_force_ds_cpu_optimizer": False},
        because="the body trains with torch's AdamW: a torch optimizer beside CPU optimizer offload needs "
        "zero_force_ds_cpu_optimizer off",
    ),
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/7788",
        words=("grad_accum_dtype", "BF16_Optimizer", "DDP_BFLOAT16", "_hp_mapping", "optimizer selection"),
    ),
]

BF16_ZERO1_FP32_ACCUM = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "zero_force_ds_cpu_optimizer": False,
    "bf16": {"enabled": True},
    "data_types": {"grad_accum_dtype": "fp32"},
    "zero_optimization": {"stage": 1},
}


@pytest.mark.ds_config(pytest.param(BF16_ZERO1_FP32_ACCUM, id="bf16_zero1_fp32_accum"))
@pytest.mark.ds_version(
    affected=">=0.17.6,<0.18.5",
    raises=AssertionError,
    match=r"no fp32 master weights behind the bf16 parameters",
    fix=distinct_ddp_bf16,
)
def test_bf16_zero1_keeps_fp32_master_weights(ds_engine, ds_config, ds_rank):
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    model = tiny_mlp(seed=7).to(torch.bfloat16)
    engine = ds_engine(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))
    x, y = make_batch(ds_config["train_micro_batch_size_per_gpu"], seed=6, rank=ds_rank)
    losses = []
    for _ in range(3):
        loss = torch.nn.functional.mse_loss(engine(x.to(torch.bfloat16)).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())

    kind = type(engine.optimizer).__name__
    for name, param in engine.module.named_parameters():
        master = safe_get_full_fp32_param(param)
        assert master is not None, f"no fp32 master weights behind the bf16 parameters ({kind}): {name}"
        # The master weights are the full fp32 parameter (gathered from the ZeRO-1 partitions), and the bf16 weight
        # the model computes with is their rounding.
        assert master.dtype == torch.float32, name
        assert master.shape == param.shape, name
        torch.testing.assert_close(master.to(torch.bfloat16), param.detach(), rtol=0, atol=0, msg=name)
        exp_avg = safe_get_full_optimizer_state(param, "exp_avg")
        assert exp_avg is not None, name
        assert exp_avg.isfinite().all(), name
        assert exp_avg.abs().sum() > 0, name
    assert losses[-1] < losses[0], f"bf16 ZeRO-1 did not train: {losses}"
