"""Pipeline parallelism with gradient accumulation: every stage but the last divides its gradients by the
accumulation steps a second time.

PR #7665 (first in 0.18.3, a PyTorch-style ``backward``) moved the scaling by ``gradient_accumulation_steps`` from
the loss into a backward hook that ``DeepSpeedEngine.forward`` registers on the module's outputs. The pipeline
engine runs that ``forward`` on every stage: the last stage's hook scales the gradient it sends upstream, and the hook
on each earlier stage's outputs divides the received, already scaled gradient again. With 2 stages and 2 accumulation
steps, stage 0 learns at half the rate: silently, the loss still falls. PR #8154 (first in 0.19.3) keeps the scaling
on the last stage only. A bug of pipelines with at least two stages (a ``PipelineModule``'s ``num_stages``, not a
config key): a single stage is its own last stage and is scaled once. On 0.18.3-0.18.4 those stages fail before
that (entry ``pipeline-nested-backward``), and on 0.16.0-0.18.2 every stage sums its micro-batches' gradients (entry
``pipeline-gradient-accumulation-summed``): their fixes are applied there first.
"""

import pytest
from _pipeline import ACCUMULATION_PREMISE, PIPELINE_ACCUMULATION, PIPELINE_WORLD, one_batch_errors
from _prerequisites import (
    PIPELINE_GRADIENTS_SUMMED,
    PIPELINE_NESTED_BACKWARD,
    PIPELINE_SCALED_TWICE_RELEASES,
    ZERO12_CPU_FLAT_BUFFER,
    scale_on_last_stage_only,
)

pytestmark = [
    PIPELINE_WORLD,
    pytest.mark.ds_repro(
        id="pipeline-gradient-scaled-twice",
        title="Pipeline parallelism + gradient accumulation: stages before the last scale their gradients twice",
        upstream="https://github.com/deepspeedai/DeepSpeed/issues/8152",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/8154",
        fixed_in="0.19.3",
        root_cause="The output hook that divides gradients by the accumulation steps (PR #7665) is registered on "
        "every pipeline stage, so gradients the last stage already scaled are divided again upstream.",
    ),
    ACCUMULATION_PREMISE,
    PIPELINE_NESTED_BACKWARD,
    PIPELINE_GRADIENTS_SUMMED,
    ZERO12_CPU_FLAT_BUFFER,
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/blob/v0.18.3/deepspeed/runtime/pipe/engine.py",
        words=("PipelineEngine", "pipeline parallel", "gradient_accumulation_steps", "scaled twice"),
    ),
]

LR = 0.1
TOLERANCE = 1e-6


@pytest.mark.ds_config(
    pytest.param(PIPELINE_ACCUMULATION, id="pipe2_ga2"),
    pytest.param({**PIPELINE_ACCUMULATION, "zero_optimization": {"stage": 1}}, id="pipe2_ga2_zero1"),
)
@pytest.mark.ds_version(
    affected=PIPELINE_SCALED_TWICE_RELEASES,
    raises=AssertionError,
    match=r"pipeline stages differ from plain SGD",
    fix=scale_on_last_stage_only,
)
def test_pipeline_stages_match_plain_sgd(ds_config, ds_world_size):
    errors = one_batch_errors(ds_config, ds_world_size, seed=3, lr=LR)
    assert all(e < TOLERANCE for _, e in errors), (
        f"pipeline stages differ from plain SGD after one step: (stage, max |w - w_reference|) = {errors} "
        f"(tolerance {TOLERANCE:.0e}, {ds_config['gradient_accumulation_steps']} accumulation steps)"
    )
