"""bf16 without ZeRO (stage 0): ``step()`` never clears the gradients, and from 0.18.3 divides them by 65536.

PR #7515 (0.17.6) routed bf16 + ZeRO stage 0 to the fp16 wrapper (``FP16_UnfusedOptimizer``, or ``FP16_Optimizer``
for fused Adam). ``_take_model_step`` cleared gradients for bf16 only when ZeRO was on, so ``.grad`` survived each
step and was applied again in the next. ``FP16_UnfusedOptimizer`` (the one a torch optimizer gets) also kept fp16's
dynamic loss scale (``cur_scale`` 65536) in bf16 mode; that was harmless while ``engine.backward`` went through the
wrapper's ``backward`` (which multiplies the loss by the scale), but from PR #7665 (0.18.3) the engine scales the
loss only for fp16, so ``step()`` divides unscaled gradients by 65536: updates lost below bf16's resolution
(deepspeedai/DeepSpeed#7837). PR #7839 turns loss scaling off for bf16 and clears gradients after every bf16 step
(first released in 0.18.6).
"""

import pytest

from pytest_dsrepro.inrank.devices import rank_device

pytestmark = [
    pytest.mark.ds_repro(
        id="bf16-zero0-grads-unscaled",
        title="bf16 + ZeRO stage 0: gradients never cleared after step(), and divided by 65536 from 0.18.3",
        upstream="https://github.com/deepspeedai/DeepSpeed/issues/7837",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/7839",
        fixed_in="0.18.6",
        root_cause="bf16 without ZeRO went through the fp16 wrapper: the engine skipped zero_grad for bf16 without "
        "ZeRO, and the wrapper divided gradients by a dynamic loss scale the bf16 backward stopped applying in 0.18.3.",
    ),
    pytest.mark.ds_premise(
        stage=0,
        precision="bf16",
        sets={"gradient_clipping": 0.0},
        removes=("scheduler",),
        because="the body compares the weights with plain torch SGD at a fixed rate, which does not clip gradients, "
        "where a scheduler's warm-up from 0 would give the compared steps a rate of about 0",
    ),
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/issues/7837",
        words=("ZeRO-0", "gradient norm"),
    ),
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/7839",
        words=("FP16_UnfusedOptimizer", "cur_scale", "65536", "dynamic_loss_scale"),
    ),
    pytest.mark.ds_seen(
        "https://github.com/modelscope/ms-swift/issues/6815",
        words=("ZeRO-0",),
        gpu=True,
    ),
]

BF16_ZERO0 = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 0},
}
LR = 0.25


def unscaled_bf16_with_zero_grad(monkeypatch):
    """Backport of PR #7839: the fp16 wrapper built for bf16 keeps a static scale of 1, and every bf16 step clears
    the gradients (the upstream fix does both through a new loss-scale config; the effect is the same)."""
    import torch
    from deepspeed.runtime import constants
    from deepspeed.runtime.engine import DeepSpeedEngine

    from pytest_dsrepro.inrank.backport import backport

    if not hasattr(constants, "DDP_BFLOAT16"):
        return  # before 0.17.6 bf16 without ZeRO used BF16_Optimizer: no fp16 wrapper, no bug
    if hasattr(DeepSpeedEngine, "_get_optimizer_loss_scale"):
        return  # PR #7839 is in this release
    configure = DeepSpeedEngine._configure_fp16_optimizer

    def configure_without_bf16_scaling(self, optimizer, low_precision_dtype):
        wrapper = configure(self, optimizer, low_precision_dtype)
        if low_precision_dtype == torch.bfloat16:
            wrapper.dynamic_loss_scale = False
            wrapper.cur_scale = 1.0
        return wrapper

    monkeypatch.setattr(DeepSpeedEngine, "_configure_fp16_optimizer", configure_without_bf16_scaling)
    backport(
        monkeypatch,
        "deepspeed.runtime.engine",
        [
            (
                r"if self\.zero_optimization\(\) and hasattr\(self\.optimizer, \"zero_grad\"\):",
                r'if hasattr(self.optimizer, "zero_grad"):',
            )
        ],
    )


def rank_input(rank, device):
    """Small integers times (rank + 1): every gradient, mean and update below is exact in bf16."""
    import torch

    return torch.tensor([[1.0, 2.0, 3.0, 4.0]], device=device) * (rank + 1)


@pytest.mark.ds_config(pytest.param(BF16_ZERO0, id="bf16_zero0"))
@pytest.mark.ds_version(
    affected=">=0.17.6,<0.18.3",
    raises=AssertionError,
    match=r"bf16 ZeRO-0 weights differ from plain SGD after step 2",
    fix=unscaled_bf16_with_zero_grad,
)
@pytest.mark.ds_version(
    affected=">=0.18.3,<0.18.6",
    raises=AssertionError,
    match=r"bf16 ZeRO-0 weights differ from plain SGD after step 1",
)
def test_bf16_zero0_sgd_matches_plain_sgd(ds_engine, ds_rank, ds_world_size):
    import torch

    device = rank_device()  # ds_device's value (the scripts dsrepro export writes provide no ds_device fixture)
    model = torch.nn.Linear(4, 1, bias=False)
    torch.nn.init.ones_(model.weight)
    engine = ds_engine(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR))
    x = rank_input(ds_rank, device).to(torch.bfloat16)

    # Reference: plain fp32 SGD on the mean of every rank's loss (what data-parallel training computes).
    reference = torch.nn.Linear(4, 1, bias=False, device=device)
    torch.nn.init.ones_(reference.weight)
    sgd = torch.optim.SGD(reference.parameters(), lr=LR)

    # An optimizer step is the config's accumulation steps of micro-steps (derived from the batch sizes where the
    # config gives no gradient_accumulation_steps): engine.step() steps the optimizer at the boundary only. Each
    # micro-step's loss is divided by the steps, so the accumulated gradient is the reference's.
    accumulation = engine.gradient_accumulation_steps()
    # Exact arithmetic in bf16 where the accumulation is a power of two, so any difference is the bug; otherwise
    # each micro-step's share of the gradient is rounded to bf16, a few hundredths at most here. Unscaled gradients
    # (0.18.3-0.18.5) leave the weight at 1.0, at least 0.375 off after step 1; a stale gradient (0.17.6-0.18.2)
    # adds step 1's update again to step 2, at least 0.375 off.
    tolerance = 1e-3 if accumulation & (accumulation - 1) == 0 else 0.05
    for step in (1, 2):
        for _ in range(accumulation):
            engine.backward(engine(x).float().sum())
            engine.step()
        sgd.zero_grad()
        torch.stack([reference(rank_input(r, device)).sum() for r in range(ds_world_size)]).mean().backward()
        sgd.step()
        trained, expected = engine.module.weight.detach().float(), reference.weight.detach()
        assert engine.global_steps == step, f"the engine took {engine.global_steps} optimizer steps, not {step}"
        assert torch.allclose(trained, expected, atol=tolerance), (
            f"bf16 ZeRO-0 weights differ from plain SGD after step {step}: {trained.tolist()} vs {expected.tolist()} "
            f"({type(engine.optimizer).__name__}, loss scale {getattr(engine.optimizer, 'cur_scale', None)})"
        )
