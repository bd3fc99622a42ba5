"""ZeRO-1/2 with ``reduce_bucket_size: 0``: the config accepts it, and the first backward divides by zero.

``zero_optimization.reduce_bucket_size`` was validated as ``ge=0``, so 0 passed the config (a user's way to turn
bucketing down, or a templated value left at 0). But before reducing a parameter's gradient, ZeRO-1/2 reports the
bucket's fill as ``(100.0 * elem_count) // self.reduce_bucket_size`` (``report_ipg_memory_usage``), a percentage
computed for a debug log, on every gradient: with a bucket of 0 elements the first backward dies with
``ZeroDivisionError: float floor division by zero`` (issue #8260, found by fuzzing configs; the project's own corpus
found it too). PR #8266 (first released in 0.19.6) makes the config refuse 0 (``gt=0``), so the user learns it at
``deepspeed.initialize``, where the mend (a positive size) is obvious. The body passes either way a healthy release
behaves: the config refused up front, naming ``reduce_bucket_size``, or training that matches plain data-parallel
SGD.
A scan that finds a config holding this bug on a release it affects judges every other bug with the config's fix
(``mend``: DeepSpeed's default bucket of 5e8 elements), said above its table.
"""

import pytest
from _prerequisites import ZERO12_CPU_FLAT_BUFFER
from _zero12 import PLAIN_SGD_SETS, bucket_of_zero, bucket_of_zero_error, refuse_a_bucket_of_zero

pytestmark = [
    pytest.mark.ds_repro(
        id="zero12-reduce-bucket-size-zero",
        title="ZeRO-1/2 + reduce_bucket_size 0: accepted by the config, ZeroDivisionError at the first backward",
        upstream="https://github.com/deepspeedai/DeepSpeed/issues/8260",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/8266",
        fixed_in="0.19.6",
        root_cause="report_ipg_memory_usage divides by reduce_bucket_size for a log line on every gradient "
        "reduced, and the config validated the size as >= 0, so 0 got that far.",
    ),
    pytest.mark.ds_premise(
        stage=(1, 2),
        config={"zero_optimization.reduce_bucket_size": 0},
        mend={"zero_optimization.reduce_bucket_size": 500_000_000},
        sets=PLAIN_SGD_SETS,
        removes=("scheduler",),
        because="the body trains with torch's SGD and compares two steps with plain, unclipped fp32 SGD at the same "
        "rate (the bug raises whatever the precision, the optimizer and the rate)",
    ),
    ZERO12_CPU_FLAT_BUFFER,
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/issues/8260",
        raises="ZeroDivisionError",
        match=r"float floor division by zero",
        frames=("report_ipg_memory_usage", "stage_1_and_2.py:reduce_independent_p_g_buckets_and_remove_grads"),
        words=("reduce_bucket_size",),
    ),
]

TOLERANCE = 1e-5


@pytest.mark.ds_config(bucket_of_zero(1), bucket_of_zero(2))
@pytest.mark.ds_version(
    affected="<0.19.6", raises=ZeroDivisionError, match=r"float floor division by zero", fix=refuse_a_bucket_of_zero
)
def test_zero_reduce_bucket_size_trains(ds_engine, ds_config, ds_rank, ds_world_size):
    error = bucket_of_zero_error(ds_engine, ds_config, ds_rank, ds_world_size)
    assert error is None or error < TOLERANCE, f"ZeRO with reduce_bucket_size 0 trained unlike plain SGD: {error:.3e}"
