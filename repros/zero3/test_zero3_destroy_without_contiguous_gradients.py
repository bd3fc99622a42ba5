"""``engine.destroy()`` of a ZeRO-3 engine with ``contiguous_gradients`` off raises AttributeError (PR #7160's
"fix leak of z3 buffer", commit 2e7f8e5).

ZeRO-3 allocates its gradient bucket's flat buffer (``__ipg_bucket_flat_buffer``) only when
``zero_optimization.contiguous_gradients`` is on, but ``DeepSpeedZeroOptimizer_Stage3.destroy`` deletes it
unconditionally. With contiguous gradients off, ``engine.destroy()`` (which a script calls to free an engine before
building the next one: a sweep, a second model) raises ``AttributeError`` on every rank, and the engine's hooks stay
half-removed. The ``del`` is in every release this catalogue runs before 0.16.5; the fix releases the buffer through
``_release_ipg_buffers``, which it also corrects to clear the flat buffer instead of an unused ``ipg_buffer``.
"""

import pytest
from _prerequisites import zero3_partitioned_premise
from _zero3 import ZERO3

from pytest_dsrepro.inrank.devices import precision_dtype
from pytest_dsrepro.inrank.models import make_batch, tiny_mlp

pytestmark = [
    pytest.mark.ds_repro(
        id="zero3-destroy-without-contiguous-gradients",
        title="ZeRO-3 engine.destroy() raises AttributeError when contiguous_gradients is off",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/7160",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/commit/2e7f8e580e7088f05008e5211ebf724b480614ad",
        fixed_in="0.16.5",
        root_cause="DeepSpeedZeroOptimizer_Stage3.destroy deletes __ipg_bucket_flat_buffer, which __init__ creates "
        "only when contiguous_gradients is on.",
    ),
    zero3_partitioned_premise(config={"zero_optimization.contiguous_gradients": False}),
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/7160",
        raises="AttributeError",
        match=r"_DeepSpeedZeroOptimizer_Stage3__ipg_bucket_flat_buffer",
        frames=("stage3.py:destroy", "engine.py:destroy"),
    ),
]

ZERO3_NO_CONTIGUOUS_GRADIENTS = {
    **ZERO3,
    "zero_optimization": {**ZERO3["zero_optimization"], "contiguous_gradients": False},
}


def release_buffer_if_any(monkeypatch):
    """The fix (commit 2e7f8e5): ``destroy`` releases the flat buffer through ``_release_ipg_buffers``, which clears
    it only where contiguous gradients created it."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    from pytest_dsrepro.inrank.backport import backport, release_has

    if not release_has(DeepSpeedZeroOptimizer_Stage3.destroy, "del self.__ipg_bucket_flat_buffer"):
        return  # this release has the fix
    backport(
        monkeypatch,
        "deepspeed.runtime.zero.stage3",
        [
            (r"del self\.__ipg_bucket_flat_buffer", "self._release_ipg_buffers()"),
            (
                r"(def _release_ipg_buffers\(self\):\n\s*if self\.contiguous_gradients:\n\s*)self\.ipg_buffer = None",
                r"\1self.__ipg_bucket_flat_buffer = None",
            ),
        ],
    )


@pytest.mark.ds_config(pytest.param(ZERO3_NO_CONTIGUOUS_GRADIENTS, id="zero3_no_contiguous_gradients"))
@pytest.mark.ds_version(
    affected="<0.16.5",
    raises=AttributeError,
    match="_DeepSpeedZeroOptimizer_Stage3__ipg_bucket_flat_buffer",
    fix=release_buffer_if_any,
)
def test_destroy_after_training(ds_engine, ds_config, ds_rank):
    import torch

    engine = ds_engine(model=tiny_mlp(seed=1))
    x, y = make_batch(
        ds_config["train_micro_batch_size_per_gpu"], seed=2, rank=ds_rank, dtype=precision_dtype(ds_config)
    )
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()
    engine.destroy()  # free this engine before the next one
