"""ZeRO-3 with ``reduce_bucket_size: 0``: the config accepts it, and the first backward divides by zero.

The ZeRO-3 side of ``zero12-reduce-bucket-size-zero``: the config validated the bucket size as ``>= 0``, and ZeRO-3's
gradient hook reports the bucket's fill as ``(100.0 * elem_count) // self.reduce_bucket_size`` before it reduces
each parameter's gradient (``report_ipg_memory_usage``: in ``stage3.py`` itself up to 0.17.x, in the optimizers' base
class from 0.18.0), so with 0 the first backward dies with ``ZeroDivisionError: float floor division by zero``. Met
by a ZeRO-3 config that sets the size to 0 (the project's corpus has one: a Hugging Face test config), where every
backward fails before any other bug can show. PR #8266 (first released in 0.19.6) makes the config refuse 0, so the
user learns it at ``deepspeed.initialize``. The body passes either way a healthy release behaves: the config refused
up front, naming ``reduce_bucket_size``, or training that matches plain data-parallel SGD.
A scan that finds a config holding this bug on a release it affects judges every other bug with the config's fix
(``mend``: DeepSpeed's default bucket of 5e8 elements), said above its table.
"""

import pytest
from _prerequisites import PERSISTENT_ALLGATHER_RACE
from _zero12 import PLAIN_SGD_SETS, bucket_of_zero, bucket_of_zero_error, refuse_a_bucket_of_zero

pytestmark = [
    pytest.mark.ds_repro(
        id="zero3-reduce-bucket-size-zero",
        title="ZeRO-3 + reduce_bucket_size 0: accepted by the config, ZeroDivisionError at the first backward",
        upstream="https://github.com/deepspeedai/DeepSpeed/issues/8260",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/8266",
        fixed_in="0.19.6",
        root_cause="ZeRO-3's gradient hook calls report_ipg_memory_usage, which divides by reduce_bucket_size for a "
        "log line, and the config validated the size as >= 0, so 0 got that far.",
    ),
    pytest.mark.ds_premise(
        stage=3,
        config={"zero_optimization.reduce_bucket_size": 0},
        mend={"zero_optimization.reduce_bucket_size": 500_000_000},
        sets={**PLAIN_SGD_SETS, "zero_optimization.stage3_param_persistence_threshold": 0},
        removes=("scheduler",),
        because="the body trains with torch's SGD and compares two steps with plain, unclipped fp32 SGD at the same "
        "rate, every parameter partitioned (the bug raises whatever the precision, the optimizer and the rate)",
    ),
    PERSISTENT_ALLGATHER_RACE,  # the check gathers the trained weights
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/issues/8260",
        raises="ZeroDivisionError",
        match=r"float floor division by zero",
        frames=("report_ipg_memory_usage", "stage3.py:reduce_independent_p_g_buckets_and_remove_grads"),
        words=("reduce_bucket_size",),
    ),
]

TOLERANCE = 1e-5


@pytest.mark.ds_config(bucket_of_zero(3))
@pytest.mark.ds_version(
    affected="<0.19.6", raises=ZeroDivisionError, match=r"float floor division by zero", fix=refuse_a_bucket_of_zero
)
def test_zero3_reduce_bucket_size_trains(ds_engine, ds_config, ds_rank, ds_world_size):
    error = bucket_of_zero_error(ds_engine, ds_config, ds_rank, ds_world_size)
    assert error is None or error < TOLERANCE, f"ZeRO-3 with reduce_bucket_size 0 trained unlike plain SGD: {error:.3e}"
