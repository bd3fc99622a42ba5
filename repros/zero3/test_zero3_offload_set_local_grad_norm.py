"""ZeRO-3 + CPU optimizer offload: gradients changed with ``safe_set_local_grad`` are clipped by the old norm.

``deepspeed.utils.safe_set_local_grad`` (PR #6590, 0.15.3) lets a user rewrite a ZeRO-3 parameter's local gradient
partition between ``backward`` and ``step``, e.g. to clip or clamp gradients their own way. With
``offload_optimizer``, ZeRO-3 computes each parameter's gradient norm once, when it moves the reduced gradient to
the CPU (``norm_for_param_grads``), and ``step()`` builds the global norm from those: ``set_local_grad_for_param``
wrote the new values but left the stored norm alone. So ``gradient_clipping`` scaled the new gradients by the old
norm's factor and ``get_global_grad_norm()`` reported the old norm (deepspeedai/DeepSpeed#7292). Without offload the
norm is computed from the gradients themselves at ``step()``, and is right. PR #7302 stores the new value's norm in
``set_local_grad_for_param`` (first released in 0.17.0).
"""

import pytest
from _zero12 import MICRO_BATCH, global_batch

from pytest_dsrepro.inrank.devices import precision_dtype
from pytest_dsrepro.inrank.models import make_batch, tiny_mlp

pytestmark = [
    pytest.mark.ds_repro(
        id="zero3-offload-set-local-grad-norm",
        title="ZeRO-3 + CPU optimizer offload: gradients set with safe_set_local_grad are clipped and reported with "
        "the old gradient norm (silent)",
        upstream="https://github.com/deepspeedai/DeepSpeed/issues/7292",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/7302",
        fixed_in="0.17.0",
        root_cause="With offload_optimizer, step() takes the global norm from per-parameter norms stored when the "
        "gradients were reduced; set_local_grad_for_param overwrote the gradient without updating its stored norm.",
    ),
    pytest.mark.ds_premise(
        stage=3,
        offload_optimizer="cpu",
        sets={
            "zero_optimization.stage3_param_persistence_threshold": 0,
            "zero_force_ds_cpu_optimizer": False,
            "zero_allow_untested_optimizer": True,
        },
        because="the body trains with torch's SGD (no DeepSpeed CPU Adam to build) and reads every parameter after "
        "step(), each partitioned (persistent ones race on gloo before 0.19.8: zero3-persistent-allgather-race)",
    ),
    pytest.mark.ds_not_applicable("<0.15.3", reason="safe_set_local_grad appeared in 0.15.3 (PR #6590)"),
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/blob/v0.16.3/deepspeed/runtime/zero/stage3.py#L2409",
        words=("safe_set_local_grad", "set_local_grad_for_param", "get_global_grad_norm"),
    ),
]

#: Below the gradient's norm before and after the clamp (0.39 and 0.13 for this model and data), so both are clipped.
CLIP = 0.1
#: The user's own clipping: every gradient element into [-CLAMP, CLAMP] (most elements are larger).
CLAMP = 0.01
LR = 0.1
SEED = 5

ZERO3_OFFLOAD = {
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu"},
        "stage3_param_persistence_threshold": 0,
    },
    "zero_force_ds_cpu_optimizer": False,
    "zero_allow_untested_optimizer": True,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": CLIP,
}


def store_the_new_norm(monkeypatch):
    """Backport of PR #7302: with offload, ``set_local_grad_for_param`` also stores the new gradient's norm, where
    ``step()`` reads it."""
    import functools

    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    from pytest_dsrepro.inrank.backport import release_has

    set_local_grad = getattr(DeepSpeedZeroOptimizer_Stage3, "set_local_grad_for_param", None)
    if set_local_grad is None or release_has(set_local_grad, "norm_for_param_grads"):
        return  # before 0.15.3 (no such API) or from 0.17.0 (fixed)

    @functools.wraps(set_local_grad)
    def set_local_grad_and_norm(self, value, param):
        set_local_grad(self, value, param)
        if self.offload_optimizer and param.requires_grad:
            self.norm_for_param_grads[self.get_param_id(param)] = self._constant_buffered_norm2(value)

    monkeypatch.setattr(DeepSpeedZeroOptimizer_Stage3, "set_local_grad_for_param", set_local_grad_and_norm)


@pytest.mark.ds_config(pytest.param(ZERO3_OFFLOAD, id="zero3_offload_optimizer"))
@pytest.mark.ds_version(
    affected=">=0.15.3,<0.17.0",
    raises=AssertionError,
    match=r"the norm of the gradients before safe_set_local_grad",
    fix=store_the_new_norm,
)
def test_clipping_sees_gradients_set_by_the_user(ds_engine, ds_config, ds_rank, ds_world_size):
    import deepspeed
    import torch
    from deepspeed.utils import safe_get_local_grad, safe_set_local_grad

    half = precision_dtype(ds_config) != torch.float32  # a bf16/fp16 engine: inputs in its dtype, looser checks
    model = tiny_mlp(seed=SEED)
    engine = ds_engine(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR))
    # This rank's part of the reference's batch (``global_batch``): the same rows whatever the config's micro-batch
    # size, which the engine's forward does not read (a config's 8 would train on other data than the reference's).
    x, y = make_batch(MICRO_BATCH, seed=0, rank=ds_rank, dtype=precision_dtype(ds_config))
    accumulation = engine.gradient_accumulation_steps()  # the config's: micro-steps on the same batch, one step
    for micro in range(accumulation):
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        if micro < accumulation - 1:
            engine.step()
    for param in engine.module.parameters():  # the user's own clipping, on this rank's partition
        safe_set_local_grad(param, safe_get_local_grad(param).clamp(-CLAMP, CLAMP))
    lr = engine.get_lr()[0]  # what this step uses: a config's scheduler may have set it (a warm-up starts at 0)
    engine.step()
    reported = float(engine.get_global_grad_norm())

    # Reference: plain fp32 torch on every rank's data at once, the same clamp, torch's clipping, one SGD step.
    reference = tiny_mlp(seed=SEED)
    x_all, y_all = global_batch(ds_world_size, seed=0)
    torch.nn.functional.mse_loss(reference(x_all), y_all).backward()
    for param in reference.parameters():
        param.grad.clamp_(-CLAMP, CLAMP)
    clip = engine.gradient_clipping() or float("inf")  # DeepSpeed's 0 is no clipping (torch's would zero them)
    norm = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), clip))
    torch.optim.SGD(reference.parameters(), lr=lr).step()

    # The bug's own evidence first: the norm step() clipped with (and reports) is the one before the clamp, about
    # 3x the set gradients' (0.39 against 0.13), far outside half precision's rounding.
    clipped_by = f"get_global_grad_norm() = {reported:.4f}, the set gradients' norm = {norm:.4f}"
    assert reported == pytest.approx(norm, rel=5e-2 if half else 1e-4), (
        f"the norm of the gradients before safe_set_local_grad is reported and clipped with: {clipped_by}"
    )
    errors = []
    for param, expected in zip(engine.module.parameters(), reference.parameters(), strict=True):
        with deepspeed.zero.GatheredParameters(param):  # one at a time (see _prerequisites)
            errors.append((param.detach().float() - expected.detach()).abs().max().item())
    error = max(errors)
    # Not this bug's signature (its norm was right): a difference here is another failure, which the scan says.
    assert error < (1e-2 if half else 1e-6), (
        f"the weights differ from plain torch's one clipped SGD step (lr {lr:g}): max |w - w_reference| = "
        f"{error:.3e}; {clipped_by}"
    )
