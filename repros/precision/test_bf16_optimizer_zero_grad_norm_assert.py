"""``BF16_Optimizer`` crashes on a step whose gradients are all zero: a bare ``assert all_groups_norm > 0.``.

bf16 with ZeRO-1 and ``"data_types": {"grad_accum_dtype": "fp32"}`` (and bf16 without ZeRO up to 0.17.5) trains with
``BF16_Optimizer``. Its ``step`` has asserted that the global gradient norm is positive since it was written (PR
#1801, 2022), meaning to stop a non-finite norm (the norm helpers report one as -1) before clipping. But a norm of
exactly 0 is legitimate: a micro-batch whose every target is masked out (padding only, every label ignored) gives a
loss of 0 and all-zero gradients, and the whole run dies there with an ``AssertionError`` that has no message
(deepspeedai/DeepSpeed#5223: "assert all_groups_norm > 0", after a few hundred bf16 steps). 0.19.8 replaces the
assert by a check for an invalid norm (non-finite or negative) that skips the step, so a zero norm steps normally
(its pull request is not in the mirror at hand: ``fix_ref`` is left empty).
"""

import pytest
from _prerequisites import BF16_ZERO1_OPTIMIZER

from pytest_dsrepro.inrank.devices import precision_dtype
from pytest_dsrepro.inrank.models import make_batch, tiny_mlp

pytestmark = [
    pytest.mark.ds_repro(
        id="bf16-optimizer-zero-grad-norm-assert",
        title="BF16_Optimizer: a step with all-zero gradients (fully masked batch) fails 'assert all_groups_norm > 0'",
        upstream="https://github.com/deepspeedai/DeepSpeed/issues/5223",
        fix_ref=None,  # 0.19.8's fix is newer than the mirror; PR #8614 (open when read) proposes another one
        fixed_in="0.19.8",
        root_cause="BF16_Optimizer.step asserted all_groups_norm > 0. to catch the -1 the norm helpers report for a "
        "non-finite norm, which also rejects the legitimate norm 0 of an all-zero gradient.",
    ),
    pytest.mark.ds_premise(
        stage=1,
        precision="bf16",
        config={"data_types.grad_accum_dtype": "fp32"},
        sets={"zero_force_ds_cpu_optimizer": False},
        because="where the config names no optimizer the body trains with torch's Adam",
    ),
    BF16_ZERO1_OPTIMIZER,
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/issues/5223",
        raises="AssertionError",
        frames=("bf16_optimizer.py:step",),
        words=("assert all_groups_norm > 0", "bf16", "BF16_Optimizer"),
    ),
]

BF16_ZERO1_FP32_ACCUM = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "zero_force_ds_cpu_optimizer": False,
    "bf16": {"enabled": True},
    "data_types": {"grad_accum_dtype": "fp32"},
    "zero_optimization": {"stage": 1},
}


def refuse_only_invalid_norms(monkeypatch):
    """0.19.8's handling: a non-finite or negative norm skips the step; a zero norm steps as any other."""
    from deepspeed.runtime import bf16_optimizer

    from pytest_dsrepro.inrank.backport import backport, release_has

    if not release_has(bf16_optimizer.BF16_Optimizer.step, "assert all_groups_norm > 0."):
        return  # this release has the fix
    backport(
        monkeypatch,
        "deepspeed.runtime.bf16_optimizer",
        [
            (
                r"\n([ \t]+)assert all_groups_norm > 0\.\n",
                r"""
\1norm = torch.as_tensor(all_groups_norm, dtype=torch.float64)
\1if not bool(torch.isfinite(norm).all()) or bool((norm < 0).any()):
\1    self._global_grad_norm = float("inf")  # skipped, as an overflowed step is
\1    self.clear_hp_grads()
\1    self.clear_lp_grads()
\1    return
""",
            )
        ],
    )


@pytest.mark.ds_config(pytest.param(BF16_ZERO1_FP32_ACCUM, id="bf16_zero1_fp32_accum"))
@pytest.mark.ds_version(
    affected="<0.19.8",
    raises=AssertionError,
    match=r"^$",  # DeepSpeed's bare assert; the body's own assertions all say something
    fix=refuse_only_invalid_norms,
)
def test_all_masked_batch_steps(ds_engine, ds_config, ds_rank):
    import torch

    engine = ds_engine(model=tiny_mlp(seed=41))  # the config's optimizer, torch's Adam where it names none
    assert type(engine.optimizer).__name__ == "BF16_Optimizer", f"the config built {type(engine.optimizer)}"
    dtype = precision_dtype(ds_config)
    batch = ds_config["train_micro_batch_size_per_gpu"]

    def masked_step(seed, keep):
        """A token-masked regression loss, averaged over the targets kept (as ignore_index-style losses are)."""
        x, y = make_batch(batch, seed=seed, rank=ds_rank, dtype=dtype)
        mask = torch.full_like(y, float(keep))
        loss = ((engine(x) - y).float().pow(2) * mask).sum() / mask.sum().clamp(min=1.0)
        engine.backward(loss)
        engine.step()
        return loss.item()

    masked_step(seed=42, keep=True)
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    assert masked_step(seed=43, keep=False) == 0.0, "a fully masked batch should give a zero loss"
    masked_step(seed=44, keep=True)  # training goes on after it
    moved = [n for n, p in engine.module.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert moved, "no parameter moved in the steps after the fully masked batch"
    assert all(torch.isfinite(p).all() for p in engine.module.parameters()), "a parameter is no longer finite"
