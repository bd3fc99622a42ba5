"""``deepspeed.init_inference(model, moe=True)``: the old boolean form of ``moe`` is refused by config validation.

``DeepSpeedInferenceConfig.moe`` takes a ``DeepSpeedMoEConfig`` or, for scripts written against the older keyword
interface, a bool. A field validator is meant to turn the bool into a MoE config, but it passed the bool as a field
named ``moe``, which ``DeepSpeedMoEConfig`` does not have (its switch is ``enabled``), and DeepSpeed's config models
forbid unknown fields. So ``moe=True`` and ``moe=False`` alike end ``init_inference`` with a pydantic
``ValidationError`` about ``moe.moe`` before any engine exists. The validator is older than every release this
catalogue runs (it came with PR #2516), and the pydantic 2 port (PR #5167, 0.15.0) kept it: 0.14.4 raises pydantic
1's wording (``moe -> moe``, "extra fields not permitted"), later releases pydantic 2's (``moe.moe``, "Extra inputs
are not permitted"). PR #8145 builds the MoE config with ``enabled=`` (first released in 0.19.3).
"""

import pytest

from pytest_dsrepro.inrank.devices import precision_dtype
from pytest_dsrepro.inrank.models import make_batch, tiny_mlp

pytestmark = [
    pytest.mark.ds_repro(
        id="engine-inference-moe-bool-config",
        title="init_inference(model, moe=True/False) fails config validation: the bool becomes an unknown 'moe' field",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/8145",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/8145",
        fixed_in="0.19.3",
        root_cause="DeepSpeedInferenceConfig's moe validator turned a bool into DeepSpeedMoEConfig(moe=value); that "
        "model has no 'moe' field (it is 'enabled') and forbids extra fields.",
    ),
    pytest.mark.ds_premise(),
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/8145",
        raises="ValidationError",
        match=r"1 validation error for DeepSpeedInferenceConfig",
        frames=("__init__.py:init_inference",),
        words=("moe_backward_compat", "DeepSpeedMoEConfig", "Extra inputs are not permitted"),
    ),
]

CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}


def moe_bool_enables(monkeypatch):
    """Backport of PR #8145: the validator's bool becomes ``DeepSpeedMoEConfig(enabled=value)``. The validator is
    compiled into the pydantic model when the class is made, so its source cannot be swapped afterwards; it looks up
    ``DeepSpeedMoEConfig`` in its module when it runs, and that name is given a builder that passes the bool as
    ``enabled``, the field PR #8145 names."""
    from deepspeed.inference import config

    from pytest_dsrepro.inrank.backport import release_has

    if not release_has(config, "DeepSpeedMoEConfig(moe=field_value)"):
        return  # this release has the fix
    moe_config = config.DeepSpeedMoEConfig

    def build(**fields):
        if "moe" in fields:
            fields["enabled"] = fields.pop("moe")
        return moe_config(**fields)

    monkeypatch.setattr(config, "DeepSpeedMoEConfig", build)


@pytest.mark.ds_config(pytest.param(CONFIG, id="fp32"))
@pytest.mark.ds_version(
    affected="<0.19.3",
    raises=ValueError,  # pydantic's ValidationError, of pydantic 1 (0.14.4) or 2: both are ValueErrors
    match=r"1 validation error for DeepSpeedInferenceConfig\s+moe(?:\.| -> )moe",
    fix=moe_bool_enables,
)
def test_init_inference_takes_bool_moe(ds_config, ds_rank):
    import deepspeed
    import torch

    dtype = precision_dtype(ds_config)
    model = tiny_mlp(seed=5).to(dtype).eval()
    x, _ = make_batch(ds_config["train_micro_batch_size_per_gpu"], seed=2, rank=ds_rank, dtype=dtype)
    with torch.no_grad():
        expected = model(x)

    # A script written against the older interface: MoE switched on, then off, with a bool.
    for enabled in (True, False):
        engine = deepspeed.init_inference(model, moe=enabled, dtype=dtype)
        assert engine._config.moe.enabled is enabled, f"moe={enabled} gave {engine._config.moe!r}"
        with torch.no_grad():
            torch.testing.assert_close(engine(x), expected, msg=f"moe={enabled}: the engine's output differs")
