"""``fp16.auto_cast: true`` in a config whose fp16 is off: the engine still casts every input to half.

``fp16.auto_cast`` asks the engine to cast floating-point inputs to fp16 in ``forward``, for an fp16 model. Up to
0.17.0 the config read it only when ``fp16.enabled`` was true. PR #6976 (0.17.1) moved the fp16 settings into
``DeepSpeedFP16Config`` and ``engine.fp16_auto_cast()`` returns ``float16_config.auto_cast`` whatever ``enabled``
says. So a config that turns fp16 off (to train in fp32, or in bf16 with a ``bf16`` section) and keeps the fp16
section's other keys, a common edit of a shared config, gets its inputs cast to half while the model computes in
fp32 or bf16: the first forward dies with a dtype mismatch (``mat1 and mat2 must have the same dtype``). Unfixed
upstream at the time of writing; the fix here is our own: ``auto_cast`` counts only when fp16 is enabled, as before
0.17.1.

The fix on the config's side (``mend``): ``auto_cast`` false where fp16 is off. Every step of every body dies of this
bug first, so a scan that finds a config meeting the premise on a release from 0.17.1 says AFFECTED here and judges
every other bug with the mend, said above its table (LLaMA-Factory's ZeRO-3 config, fp16 and bf16 ``"auto"`` with
``auto_cast`` true, resolved for an fp32 or bf16 run).
"""

import pytest

from pytest_dsrepro.inrank.devices import precision_dtype
from pytest_dsrepro.inrank.models import make_batch, tiny_mlp

pytestmark = [
    pytest.mark.ds_repro(
        id="precision-fp16-auto-cast-while-disabled",
        title="fp16.auto_cast true with fp16 disabled: the engine casts fp32/bf16 inputs to half",
        upstream="https://github.com/deepspeedai/DeepSpeed/blob/v0.19.5/deepspeed/runtime/engine.py#L1342",
        fix_ref=None,
        fixed_in=None,
        root_cause="engine.fp16_auto_cast() returns the fp16 section's auto_cast without asking whether fp16 is "
        "enabled (PR #6976 dropped the config's check), so forward casts inputs to half for non-fp16 models.",
    ),
    pytest.mark.ds_premise(
        precision=("fp32", "bf16"),
        config={"fp16.enabled": False, "fp16.auto_cast": True},
        mend={"fp16.auto_cast": False},
    ),
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/6976",
        raises="RuntimeError",
        match=r"must have the same dtype",
        frames=("engine.py:_cast_inputs_half",),
        words=("auto_cast",),
    ),
]


def auto_cast_config(precision):
    extra = {"bf16": {"enabled": True}} if precision == "bf16" else {}
    return pytest.param(
        {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "fp16": {"enabled": False, "auto_cast": True},
            **extra,
        },
        id=f"{precision}_fp16_off_auto_cast",
    )


def auto_cast_only_with_fp16(monkeypatch):
    """Our fix: ``auto_cast`` is read only when fp16 is enabled (what the config did up to 0.17.0)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    fp16_auto_cast = DeepSpeedEngine.fp16_auto_cast
    monkeypatch.setattr(
        DeepSpeedEngine, "fp16_auto_cast", lambda self: bool(self.fp16_enabled() and fp16_auto_cast(self))
    )


@pytest.mark.ds_config(auto_cast_config("fp32"), auto_cast_config("bf16"))
@pytest.mark.ds_version(
    affected=">=0.17.1", raises=RuntimeError, match=r"must have the same dtype", fix=auto_cast_only_with_fp16
)
def test_inputs_keep_the_models_dtype(ds_engine, ds_config, ds_rank):
    import torch

    dtype = precision_dtype(ds_config)
    engine = ds_engine(model=tiny_mlp(seed=4).to(dtype))
    x, y = make_batch(ds_config["train_micro_batch_size_per_gpu"], seed=0, rank=ds_rank, dtype=dtype)
    loss = torch.nn.functional.mse_loss(engine(x).float(), y.float())
    engine.backward(loss)
    engine.step()
    assert loss.isfinite()
