"""ZeRO-1/2 with the optimizer offloaded to CPU: one infinite gradient crashes ``step()`` ("... Got Long").

With ``offload_optimizer``, ZeRO-1/2 takes each group's gradient norm in
``complete_grad_norm_calculation_for_cpu_offload``, which marks a norm that is not finite with the integer ``-1``;
``scaled_global_norm`` wraps it in ``torch.tensor(...)``, a Long tensor, and takes ``torch.linalg.vector_norm`` of
the stacked group norms, which refuses integers. So the first step after an infinite
or NaN gradient (a ``sqrt`` at 0, a bf16 overflow, a bad batch) dies with "linalg.vector_norm: Expected a floating
point or complex tensor as input. Got Long" instead of skipping the clip (issue #5241; users meet it in fine-tuning
scripts with offload, e.g. transformers #34573). Only fp16 checks for overflow before the norm and skips the step;
fp32 and bf16 reach it. PR #6976 (first released in 0.17.1) marks the norm with ``-1.0`` in a float tensor. Without
offload the same gradient meets ``zero12-inf-grad-norm-nan`` on releases before 0.16.6.
"""

import pytest
from _prerequisites import ZERO12_CPU_FLAT_BUFFER
from _zero12 import sqrt_gain_config, step_with_one_infinite_gradient

pytestmark = [
    pytest.mark.ds_repro(
        id="zero12-offload-inf-grad-norm-long",
        title="ZeRO-1/2 + CPU optimizer offload: one infinite gradient crashes step() (vector_norm ... Got Long)",
        upstream="https://github.com/deepspeedai/DeepSpeed/issues/5241",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/6976",
        fixed_in="0.17.1",
        root_cause="The offloaded norm marks a non-finite norm with the integer -1, which becomes a Long tensor "
        "whose vector_norm torch refuses, so step() raises where it should skip clipping.",
    ),
    pytest.mark.ds_premise(
        stage=(1, 2),
        precision=("fp32", "bf16"),
        offload_optimizer="cpu",
        sets={"zero_force_ds_cpu_optimizer": False, "zero_allow_untested_optimizer": True},
        because="the body steps its own torch optimizer (no DeepSpeed CPU Adam to build), which ZeRO must be "
        "allowed to wrap beside an offloaded optimizer (the crash comes before any optimizer runs)",
    ),
    ZERO12_CPU_FLAT_BUFFER,
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/XiangTodayEatsWhat/EagleVision/issues/10",
        raises="RuntimeError",
        match=r"linalg\.vector_norm: Expected a floating point or complex tensor as input\. Got Long",
        frames=("stage_1_and_2.py:scaled_global_norm", "stage_1_and_2.py:step"),
        words=("offload_optimizer",),
    ),
]


def float_sentinel(monkeypatch):
    """Backport of PR #6976's norm: a non-finite offloaded gradient norm is marked with -1.0, a float."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from pytest_dsrepro.inrank.backport import backport, release_has

    if not release_has(DeepSpeedZeroOptimizer.complete_grad_norm_calculation_for_cpu_offload, "total_norm = -1\n"):
        return  # this release has the fix
    backport(
        monkeypatch,
        "deepspeed.runtime.zero.stage_1_and_2",
        [(r"\n(\s+)total_norm = -1\n", r"\n\1total_norm = -1.0\n")],
    )


@pytest.mark.ds_config(sqrt_gain_config(2, "fp32", offload=True), sqrt_gain_config(1, "bf16", offload=True))
@pytest.mark.ds_version(
    affected="<0.17.1",
    raises=RuntimeError,
    match=r"linalg\.vector_norm: Expected a floating point or complex tensor as input\. Got Long",
    fix=float_sentinel,
)
def test_offloaded_step_survives_an_infinite_gradient(ds_engine, ds_config, ds_rank, ds_device):
    engine = step_with_one_infinite_gradient(ds_engine, ds_config, ds_rank, ds_device)

    # The step clips nothing when the norm is not finite: the gain's own weight cannot survive its infinite
    # gradient, the layer's weights, whose gradients are finite, must.
    for name, param in engine.module.linear.named_parameters():
        assert param.isfinite().all(), (
            f"linear.{name} is not finite after a step with one infinite gradient elsewhere "
            f"(reported gradient norm {engine.get_global_grad_norm()})"
        )
