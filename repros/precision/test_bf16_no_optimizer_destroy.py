"""bf16 without ZeRO and without an optimizer (an inference or evaluation engine): ``engine.destroy()`` raises.

With bf16 on, no ZeRO and no optimizer, ``deepspeed.initialize`` still wraps a ``BF16_Optimizer`` around a
``DummyOptim`` (``_configure_bf16_optimizer(optimizer=None)``). That wrapper builds no bf16 groups for a dummy
optimizer, but its ``destroy()`` walks the dummy's param groups and indexes ``self.bf16_groups[i]``: so
``engine.destroy()``, which frees an engine's optimizer links (trainers call it to release an evaluation engine,
issue #7752), dies with an IndexError. ``BF16_Optimizer.destroy`` came with PR #5643 (0.14.5): 0.14.4 has none,
and its ``engine.destroy()`` passes. PR #7763 (first released in 0.18.4) returns early when the optimizer is not a
real one.
"""

import pytest

from pytest_dsrepro.inrank.devices import precision_dtype
from pytest_dsrepro.inrank.models import make_batch, tiny_mlp

pytestmark = [
    pytest.mark.ds_repro(
        id="bf16-no-optimizer-destroy",
        title="bf16 engine without ZeRO or optimizer: engine.destroy() raises IndexError in BF16_Optimizer.destroy",
        upstream="https://github.com/deepspeedai/DeepSpeed/issues/7752",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/7763",
        fixed_in="0.18.4",
        root_cause="BF16_Optimizer.destroy indexed its bf16 groups by the param groups of the DummyOptim it wraps "
        "when no optimizer is given, but builds no bf16 groups for it.",
    ),
    pytest.mark.ds_premise(stage=0, precision="bf16", optimizer=False),
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/issues/7752",
        raises="IndexError",
        match=r"list index out of range",
        frames=("bf16_optimizer.py:destroy", "engine.py:destroy"),
        words=("DummyOptim", "BF16_Optimizer.destroy"),
    ),
]

BF16_NO_ZERO = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "bf16": {"enabled": True},
}


def no_destroy_without_a_real_optimizer(monkeypatch):
    """Backport of PR #7763: ``BF16_Optimizer.destroy`` does nothing around a dummy optimizer."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    from pytest_dsrepro.inrank.backport import release_has

    destroy = getattr(BF16_Optimizer, "destroy", None)
    if destroy is None or release_has(destroy, "if not self.using_real_optimizer:"):
        return  # before 0.14.5 there is no destroy; from 0.18.4 it has the fix

    def guarded(self):
        if not self.using_real_optimizer:
            return
        destroy(self)

    monkeypatch.setattr(BF16_Optimizer, "destroy", guarded)


@pytest.mark.ds_config(pytest.param(BF16_NO_ZERO, id="bf16_no_optimizer"))
@pytest.mark.ds_version(
    affected=">=0.14.5,<0.18.4",
    raises=IndexError,
    match=r"list index out of range",
    fix=no_destroy_without_a_real_optimizer,
)
def test_destroy_an_engine_without_optimizer(ds_engine, ds_config, ds_rank):
    import torch

    dtype = precision_dtype(ds_config)
    engine = ds_engine(model=tiny_mlp(seed=2).to(dtype), optimizer=None)
    engine.eval()
    x, _ = make_batch(ds_config["train_micro_batch_size_per_gpu"], seed=0, rank=ds_rank, dtype=dtype)
    with torch.no_grad():
        out = engine(x)
    assert out.isfinite().all()
    engine.destroy()  # release the evaluation engine, as a trainer does between evaluations
