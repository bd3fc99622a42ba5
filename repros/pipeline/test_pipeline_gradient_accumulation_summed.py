"""Pipeline parallelism with gradient accumulation, 0.16.0-0.18.2: the micro-batches' gradients are summed, not
averaged.

PR #6675 (first in 0.16.0, ``no_sync``) divides the loss by ``gradient_accumulation_steps`` in ``backward`` only when
the engine reduces gradients there (``enable_backward_allreduce``, and not inside ``no_sync``). The pipeline engine
turns that flag off, because it reduces gradients itself after the last micro-batch: so from 0.16.0 its loss is
never scaled, and every stage's gradient is the sum over the micro-batches, ``gradient_accumulation_steps`` times the
mean a step should take (deepspeedai/DeepSpeed#7773: the same global batch, 4 times the gradient norm with 4 times
the accumulation steps). PR #7665 (first in 0.18.3) moved the scaling into output hooks that no longer ask, which
ends it, and left stages before the last scaled twice (entry ``pipeline-gradient-scaled-twice``, applied as a
prerequisite on 0.18.3-0.19.2, as ``pipeline-nested-backward`` is on 0.18.3-0.18.4).
"""

import pytest
from _pipeline import ACCUMULATION_PREMISE, PIPELINE_ACCUMULATION, PIPELINE_WORLD, one_batch_errors
from _prerequisites import (
    PIPELINE_GRADIENTS_SCALED_TWICE,
    PIPELINE_NESTED_BACKWARD,
    PIPELINE_SUMMED_RELEASES,
    scale_pipeline_loss,
)

pytestmark = [
    PIPELINE_WORLD,
    pytest.mark.ds_repro(
        id="pipeline-gradient-accumulation-summed",
        title="Pipeline parallelism + gradient accumulation: micro-batch gradients summed instead of averaged",
        upstream="https://github.com/deepspeedai/DeepSpeed/issues/7773",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/7665",
        fixed_in="0.18.3",
        root_cause="The loss is divided by the accumulation steps only when backward reduces gradients (PR #6675), "
        "and the pipeline engine, which reduces them itself, turns that off.",
    ),
    ACCUMULATION_PREMISE,
    PIPELINE_NESTED_BACKWARD,
    PIPELINE_GRADIENTS_SCALED_TWICE,
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/blob/v0.16.0/deepspeed/runtime/pipe/engine.py",
        words=("PipelineEngine", "pipeline parallel", "gradient_accumulation_steps", "micro-batches"),
    ),
]

LR = 0.1
TOLERANCE = 1e-6


@pytest.mark.ds_config(pytest.param(PIPELINE_ACCUMULATION, id="pipe2_ga2"))
@pytest.mark.ds_version(
    affected=PIPELINE_SUMMED_RELEASES,
    raises=AssertionError,
    match=r"pipeline stages differ from plain SGD",
    fix=scale_pipeline_loss,
)
def test_pipeline_averages_micro_batches(ds_config, ds_world_size):
    errors = one_batch_errors(ds_config, ds_world_size, seed=5, lr=LR)
    assert all(e < TOLERANCE for _, e in errors), (
        f"pipeline stages differ from plain SGD after one step: (stage, max |w - w_reference|) = {errors} "
        f"(tolerance {TOLERANCE:.0e}, {ds_config['gradient_accumulation_steps']} accumulation steps)"
    )
