"""ZeRO-1/2 with ``communication_data_type`` other than the parameters' dtype: a parameter larger than
``reduce_bucket_size`` breaks the gradient reduction.

PR #6993 (first in 0.17.2, torch.autocast with ZeRO) keyed the gradient buckets, and the parameter too large for any
bucket that is reduced on its own (``extra_large_param_to_reduce``), by communication dtype; but
``reduce_independent_p_g_buckets_and_remove_grads`` records that parameter under ``param.dtype``. With fp32
parameters reduced in bf16 (or bf16 ones in fp32) the reducer looks under the communication dtype, finds nothing, and
reduces the bucket's buffer instead, for as many elements as the large gradient has: more than the buffer holds, so
``narrow`` raises "start (0) + length (N) exceeds dimension size (M)" (deepspeedai/DeepSpeed#7653, ZeRO-1 with
``communication_data_type: bf16``). PR #7660 (first in 0.18.2) records it under the communication dtype. On
0.17.2-0.18.0 the bucket-full report raises first (entry ``zero2-bf16-fp32-comm-bucket``), whose fix is applied there.
"""

import pytest
from _prerequisites import COMM_DTYPE_BUCKET, ZERO12_CPU_FLAT_BUFFER
from _zero12 import MICRO_BATCH, max_difference, train, train_reference

from pytest_dsrepro.inrank.models import tiny_mlp

pytestmark = [
    pytest.mark.ds_repro(
        id="zero12-extra-large-param-comm-dtype",
        title="ZeRO-1/2 with a communication dtype other than the parameters': a parameter larger than a bucket "
        "breaks the gradient reduction",
        upstream="https://github.com/deepspeedai/DeepSpeed/issues/7653",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/7660",
        fixed_in="0.18.2",
        root_cause="A parameter larger than reduce_bucket_size is recorded under its own dtype, but the reducer looks "
        "it up under the communication dtype (PR #6993), so it reduces the bucket's too small buffer instead.",
    ),
    pytest.mark.ds_premise(
        stage=(1, 2),
        precision="fp32",
        config={"communication_data_type": "bf16"},
        sets={
            "zero_optimization.reduce_bucket_size": 200,
            "gradient_clipping": 0.0,
            "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": False,
        },
        because="a tiny-model parameter (256 elements) must be larger than a bucket, as a real model's largest are "
        "larger than the configured size; and the body compares the weights with plain, unclipped SGD (which ZeRO "
        "must be allowed to wrap; a torch optimizer beside CPU optimizer offload needs zero_force_ds_cpu_optimizer "
        "off)",
    ),
    ZERO12_CPU_FLAT_BUFFER,
    COMM_DTYPE_BUCKET,
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/issues/7653",
        frames=("stage_1_and_2.py:reduce_ipg_grads", "stage_1_and_2.py:reduce_gradients"),
        words=("communication_data_type", "extra_large_param_to_reduce"),
        gpu=True,
    ),
]

STEPS = 3
LR = 0.1
#: bf16 reduction rounds each averaged gradient to 8 bits of mantissa; 3 SGD steps stay within 1e-3 of fp32.
TOLERANCE = 1e-3


def config(stage):
    """tiny_mlp's first weight (16 x 16) is larger than the 200-element bucket, its other gradients fit."""
    return pytest.param(
        {
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 200, "overlap_comm": False},
            "communication_data_type": "bf16",
            "train_micro_batch_size_per_gpu": MICRO_BATCH,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,
            "zero_force_ds_cpu_optimizer": False,
            "zero_allow_untested_optimizer": True,
        },
        id=f"zero{stage}_fp32_bf16comm",
    )


def record_under_comm_dtype(monkeypatch):
    """Backport of PR #7660: the extra-large parameter is recorded under its communication dtype. A no-op before
    0.17.2 (one parameter, no dtype key) and from 0.18.2 (fixed)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from pytest_dsrepro.inrank.backport import backport, release_has

    stale = r"self\.extra_large_param_to_reduce\[param\.dtype\] = param"
    bucket = DeepSpeedZeroOptimizer.reduce_independent_p_g_buckets_and_remove_grads
    if not release_has(bucket, "extra_large_param_to_reduce[param.dtype]"):
        return
    backport(
        monkeypatch,
        "deepspeed.runtime.zero.stage_1_and_2",
        [(stale, "self.extra_large_param_to_reduce[self.get_param_comm_dtype(param)] = param")],
    )


@pytest.mark.ds_config(config(1), config(2))
@pytest.mark.ds_version(
    affected=">=0.17.2,<0.18.2",
    raises=RuntimeError,
    match=r"start \(0\) \+ length \(\d+\) exceeds dimension size",
    fix=record_under_comm_dtype,
)
def test_large_parameter_reduced_in_bf16(ds_engine, ds_config, ds_rank, ds_world_size):
    import torch

    model = tiny_mlp(seed=6)
    engine = ds_engine(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR))
    moms: list = []
    lrs = train(engine, ds_rank, STEPS, moms=moms)

    # Past the crash, the reduction must be right: the weights of plain SGD on every rank's data, to bf16's precision.
    reference = tiny_mlp(seed=6)
    sgd = torch.optim.SGD(reference.parameters(), lr=LR)
    train_reference(
        reference, sgd, ds_world_size, STEPS, lrs=lrs, accumulation=ds_config["gradient_accumulation_steps"], moms=moms
    )
    error = max_difference(engine.module, reference)
    assert error < TOLERANCE, f"ZeRO with bf16 communication is {error:.3e} from plain SGD (tolerance {TOLERANCE})"
