"""ZeRO-1/2 with gradient clipping: one infinite gradient makes the norm NaN, and the clip turns every weight NaN.

``get_grad_norm_direct`` means to replace a non-finite gradient norm with the sentinel -1 (the step then clips
nothing), but writes it as ``inf_or_nan * -1 + inf_or_nan.logical_not() * total_norm``: with an infinite norm the
second term is ``0 * inf``, NaN, so the "masked" norm is NaN. ``unscale_and_clip_grads`` then computes a NaN clip
factor (``torch.clamp`` keeps NaN) and multiplies every gradient of the partition by it: one parameter's infinite
gradient (a ``sqrt`` at 0, a bf16 overflow) turns every weight NaN at that step, and the loss and the reported
grad norm are NaN from then on (issue #5242). Only fp16 checks for overflow and skips the step; fp32 and bf16
step on. PR #7171 (first released in 0.16.6) writes the sentinel with a branch; later releases mask in place.
With the optimizer offloaded to the CPU the norm is taken by another method, whose bug is another entry
(``zero12-offload-inf-grad-norm-long``).
"""

import pytest
from _prerequisites import ZERO12_CPU_FLAT_BUFFER
from _zero12 import sqrt_gain_config, step_with_one_infinite_gradient

pytestmark = [
    pytest.mark.ds_repro(
        id="zero12-inf-grad-norm-nan",
        title="ZeRO-1/2 + gradient clipping: an infinite gradient norm becomes NaN and every weight turns NaN",
        upstream="https://github.com/deepspeedai/DeepSpeed/issues/5242",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/7171",
        fixed_in="0.16.6",
        root_cause="The non-finite norm was masked arithmetically (0 * inf is NaN), so the -1 sentinel became NaN "
        "and the clip factor computed from it scaled every gradient to NaN.",
    ),
    pytest.mark.ds_premise(
        stage=(1, 2),
        precision=("fp32", "bf16"),
        offload_optimizer="none",
        config={"gradient_clipping": ">0"},
        sets={"zero_force_ds_cpu_optimizer": False, "zero_allow_untested_optimizer": True},
        removes=("scheduler",),
        because="the body steps its own torch optimizer (which ZeRO must be allowed to wrap) at its own rate, where a "
        "scheduler's warm-up from 0 would move no weight; an offloaded optimizer takes the norm elsewhere "
        "(zero12-offload-inf-grad-norm-long)",
    ),
    ZERO12_CPU_FLAT_BUFFER,
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/issues/5242",
        words=("grad_norm and loss is nan", "loss and grad_norm will be nan"),
        frames=("stage_1_and_2.py:get_grad_norm_direct", "stage_1_and_2.py:unscale_and_clip_grads"),
    ),
]


def sentinel_for_a_non_finite_norm(monkeypatch):
    """Backport of PR #7171: a non-finite gradient norm becomes -1 (no clipping), never NaN."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from pytest_dsrepro.inrank.backport import backport, release_has

    if not release_has(DeepSpeedZeroOptimizer.get_grad_norm_direct, "inf_or_nan.logical_not() * total_norm"):
        return  # this release has the fix
    backport(
        monkeypatch,
        "deepspeed.runtime.zero.stage_1_and_2",
        [
            (
                r"\n(\s+)total_norm = inf_or_nan \* err \+ inf_or_nan\.logical_not\(\) \* total_norm",
                r"\n\1if inf_or_nan:\n\1    total_norm = err",
            )
        ],
    )


@pytest.mark.ds_config(sqrt_gain_config(2, "fp32"), sqrt_gain_config(1, "bf16"))
@pytest.mark.ds_version(
    affected="<0.16.6",
    raises=AssertionError,
    match=r"one infinite gradient turned weights with finite gradients NaN",
    fix=sentinel_for_a_non_finite_norm,
)
def test_infinite_gradient_leaves_other_weights_finite(ds_engine, ds_config, ds_rank, ds_device):
    engine = step_with_one_infinite_gradient(ds_engine, ds_config, ds_rank, ds_device)

    # The gain's own weight cannot survive an infinite gradient; the layer's weights, whose gradients are finite,
    # must (the step clips nothing when the norm is not finite).
    for name, param in engine.module.linear.named_parameters():
        assert param.isfinite().all(), (
            f"one infinite gradient turned weights with finite gradients NaN: linear.{name} after one step "
            f"(reported gradient norm {engine.get_global_grad_norm()})"
        )
