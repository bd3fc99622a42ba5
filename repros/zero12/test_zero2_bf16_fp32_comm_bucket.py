"""ZeRO-2 with bf16 and ``communication_data_type: fp32``: a full gradient bucket raises ``KeyError: torch.bfloat16``.

PR #6993 (first in 0.17.2, torch.autocast with ZeRO) keyed the gradient buckets by communication dtype. When a
parameter's gradient does not fit in the bucket, ``reduce_independent_p_g_buckets_and_remove_grads`` reports the
bucket's memory with ``report_ipg_memory_usage(tag, numel, param.dtype)``, which looks the bucket up under the
parameter's dtype; with bf16 parameters reduced in fp32 the only bucket is ``torch.float32``, so the lookup fails in
the middle of the backward. PR #7636 (first in 0.18.1) drops the dtype argument, so every bucket is reported.
"""

import math

import pytest
from _prerequisites import COMM_BUCKET_RELEASES, ZERO12_CPU_FLAT_BUFFER, report_every_bucket

from pytest_dsrepro.inrank.models import make_batch, tiny_mlp

pytestmark = [
    pytest.mark.ds_repro(
        id="zero2-bf16-fp32-comm-bucket",
        title="ZeRO-2 bf16 with communication_data_type fp32: KeyError torch.bfloat16 when a gradient bucket fills",
        upstream="https://github.com/deepspeedai/DeepSpeed/issues/7607",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/7636",
        fixed_in="0.18.1",
        root_cause="The bucket-full path reports the bucket keyed by the parameter's dtype, but buckets are keyed by "
        "the communication dtype (PR #6993), so bf16 parameters reduced in fp32 find no bucket.",
    ),
    pytest.mark.ds_premise(
        stage=2,
        precision="bf16",
        config={"communication_data_type": "fp32"},
        sets={"zero_optimization.reduce_bucket_size": 256, "zero_force_ds_cpu_optimizer": False},
        because="the tiny model's gradients must overflow a bucket during the backward, as a real model's overflow "
        "a bucket of the configured size; and the body trains with torch's Adam: a torch optimizer beside CPU "
        "optimizer offload needs zero_force_ds_cpu_optimizer off",
    ),
    ZERO12_CPU_FLAT_BUFFER,
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/7636",
        raises="KeyError",
        match=r"torch\.bfloat16",
        frames=(
            "base_optimizer.py:report_ipg_memory_usage",
            "stage_1_and_2.py:reduce_independent_p_g_buckets_and_remove_grads",
        ),
        words=("seq_parallel_communication_data_type", "report_ipg_memory_usage"),
        gpu=True,
    ),
]

#: tiny_mlp's gradients reach the bucket as 1 + 16 + 16 elements, then 256: the fourth one overflows 256. (A bucket
#: smaller than one parameter fails differently on 0.18.1-0.18.2: "start (0) + length (256) exceeds dimension size".)
ZERO2_BF16_FP32_COMM = {
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 256, "overlap_comm": False},
    "bf16": {"enabled": True},
    "communication_data_type": "fp32",
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "zero_force_ds_cpu_optimizer": False,
}


@pytest.mark.ds_config(pytest.param(ZERO2_BF16_FP32_COMM, id="zero2_bf16_fp32comm"))
@pytest.mark.ds_version(
    affected=COMM_BUCKET_RELEASES, raises=KeyError, match=r"torch\.bfloat16", fix=report_every_bucket
)
def test_bucket_flush_with_fp32_comm(ds_engine, ds_config, ds_rank):
    import torch

    model = tiny_mlp(seed=7)
    engine = ds_engine(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2))
    losses = []
    x, y = make_batch(ds_config["train_micro_batch_size_per_gpu"], seed=4, rank=ds_rank)
    for _ in range(5):
        loss = torch.nn.functional.mse_loss(engine(x.bfloat16()).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())

    # Past the crash, the reduction in fp32 must really train: finite, falling loss.
    assert all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < losses[0], f"bf16 ZeRO-2 with fp32 communication did not train: {losses}"
