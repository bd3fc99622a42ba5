"""Pipeline parallelism without ZeRO: from 0.18.3, every stage but the last refuses its own backward pass.

PR #7665 (first in 0.18.3, a PyTorch-style ``backward``) registers hooks on the outputs of every engine's
``forward``; their prologue refuses a backward that did not come through ``engine.backward`` whenever the engine cannot
follow one (``_support_torch_style_backward`` is off: no ZeRO optimizer), saying "Direct calls to tensor.backward()
are not supported". The pipeline engine runs the backward of each stage before the last itself, with
``torch.autograd.backward`` on the stage's outputs and the gradient received from the next stage: so the first
``train_batch`` of any pipeline of two or more stages without ZeRO fails there, and the other stages wait on it
(upstream saw its pipeline tests hang). PR #7787 (first in 0.18.5) sets the engine's own-backward flag around that
call. Other pipeline repros carry the fix as a prerequisite on 0.18.3-0.18.4 (``_prerequisites``). With ZeRO-1
the hooks follow the backward (fp32 and bf16 train here); only fp16's loss scaling, which a CPU world cannot run,
would refuse it there too.
"""

import pytest
from _pipeline import PIPELINE, PIPELINE_WORLD, one_batch_errors, pipeline_premise
from _prerequisites import (
    PIPELINE_BACKWARD_RELEASES,
    PIPELINE_GRADIENTS_SCALED_TWICE,
    PIPELINE_GRADIENTS_SUMMED,
    flag_pipeline_backward,
)

pytestmark = [
    PIPELINE_WORLD,
    pytest.mark.ds_repro(
        id="pipeline-nested-backward",
        title="Pipeline parallelism without ZeRO: stages before the last refuse their own backward pass",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/7787",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/7787",
        fixed_in="0.18.5",
        root_cause="The output hooks of PR #7665 refuse a backward not started by engine.backward when there is no "
        "ZeRO optimizer, and the pipeline engine starts each earlier stage's backward with torch.autograd.backward.",
    ),
    pipeline_premise(stage=0),
    # a user's config may accumulate: the accumulation entries' fixes on their releases, as their repros carry
    PIPELINE_GRADIENTS_SUMMED,
    PIPELINE_GRADIENTS_SCALED_TWICE,
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/blob/v0.18.3/deepspeed/runtime/engine.py#L2313",
        frames=("engine.py:_backward_prologue", "engine.py:_exec_backward_pass"),
        words=("PipelineEngine", "pipeline parallel", "train_batch"),
    ),
]

LR = 0.1
TOLERANCE = 1e-6


@pytest.mark.ds_config(pytest.param(PIPELINE, id="pipe2"))
@pytest.mark.ds_version(
    affected=PIPELINE_BACKWARD_RELEASES,
    raises=RuntimeError,
    match=r"Direct calls to tensor\.backward\(\) are not supported",
    fix=flag_pipeline_backward,
)
def test_pipeline_trains_without_zero(ds_config, ds_world_size):
    errors = one_batch_errors(ds_config, ds_world_size, seed=4, lr=LR)

    # Past the refusal, the step must be the right one: every stage's weights as plain SGD's.
    assert all(e < TOLERANCE for _, e in errors), (
        f"pipeline stages differ from plain SGD after one step: (stage, max |w - w_reference|) = {errors}"
    )
