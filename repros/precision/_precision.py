"""What the bf16/fp16 optimizer repros of this folder share (not a test module): prerequisite fixes.

``BF16_ZERO1_OPTIMIZER``: from 0.17.6 to 0.18.4 a bf16 + ZeRO-1 + ``grad_accum_dtype: fp32`` config never gets its
``BF16_Optimizer`` (entry ``bf16-zero1-fp32-accum-wrong-optimizer``, PR #7788, fixed in 0.18.5): a repro of
``BF16_Optimizer`` itself needs that fix applied there first, or it only sees the wrong optimizer. Imported as
``_precision`` (pytest puts this folder on ``sys.path`` for the test files in it).
"""

from __future__ import annotations

import pytest


def distinct_ddp_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """PR #7788's fix, as entry ``bf16-zero1-fp32-accum-wrong-optimizer`` backports it: ``DDP_BFLOAT16`` gets its own
    value (the engine compares its module globals), and ``BF16_Optimizer`` gets the loss-scaling attributes the base
    class reads, with no loss scaler to call. A no-op before 0.17.6 (no ``DDP_BFLOAT16``) and from 0.18.5."""
    from deepspeed.runtime import base_optimizer, constants, engine
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    from pytest_dsrepro.inrank.backport import backport

    if getattr(constants, "DDP_BFLOAT16", None) != constants.BFLOAT16:
        return
    monkeypatch.setattr(engine, "DDP_BFLOAT16", "ddp_bf16")
    no_loss_scaling = {"custom_loss_scaler": False, "external_loss_scale": None, "torch_autocast_gradscaler": None}
    for name, value in no_loss_scaling.items():
        monkeypatch.setattr(BF16_Optimizer, name, value, raising=False)
    if hasattr(base_optimizer.ZeROOptimizer, "scale_if_loss"):  # 0.18.3 on: engine.backward calls it for ZeRO
        backport(
            monkeypatch,
            "deepspeed.runtime.base_optimizer",
            [
                (
                    r"\n(\s+)return self\.loss_scaler\.scale_loss\(value\)",
                    r'\n\1if getattr(self, "loss_scaler", None) is not None:'
                    r"\n\1    return self.loss_scaler.scale_loss(value)",
                )
            ],
        )


#: For repros of ``BF16_Optimizer`` under ZeRO-1: on 0.17.6-0.18.4 their body runs with ``distinct_ddp_bf16``.
BF16_ZERO1_OPTIMIZER = pytest.mark.ds_prerequisite(
    fix=distinct_ddp_bf16,
    releases=">=0.17.6,<0.18.5",
    reason="bf16-zero1-fp32-accum-wrong-optimizer (PR #7788): the config gets FP16_UnfusedOptimizer there, not "
    "BF16_Optimizer",
)
