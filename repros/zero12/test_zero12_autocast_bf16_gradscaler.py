"""ZeRO-1/2 with ``torch_autocast`` in bf16: a GradScaler meant for fp16 scales the gradients by 65536, so the logged
gradient norm is 65536 times too large and gradient clipping all but stops training.

ZeRO's ``torch_autocast`` mode (PR #6993, 0.17.2) keeps the parameters in fp32 and runs the forward under
``torch.autocast``. ZeRO-1/2 built a ``torch.amp.GradScaler`` whenever the mode was on, whatever its dtype, scaled
the loss with it in ``backward`` and stepped the torch optimizer through it. The scaler divides the gradients back
only inside its own ``step``, after ZeRO has computed the global gradient norm and clipped: so the norm ZeRO reports
(``engine.get_global_grad_norm()``, what trainers log as ``grad_norm``) is the true norm times the scaler's 65536, and
with ``gradient_clipping`` set the gradients are clipped to that limit while still scaled, then divided by 65536:
updates tens of thousands of times too small, a loss that barely moves. Loss scaling is for fp16's narrow range; bf16
needs none. PR #7534 (first released in 0.17.6) builds the scaler for fp16 only. Among the catalogue's releases,
0.17.5 is the only one with the mode and without the fix.
"""

import pytest
from _prerequisites import ZERO12_CPU_FLAT_BUFFER

from pytest_dsrepro.inrank.models import make_batch, tiny_mlp

pytestmark = [
    pytest.mark.ds_repro(
        id="zero12-autocast-bf16-gradscaler",
        title="ZeRO-1/2 torch_autocast bf16: fp16's GradScaler inflates the grad norm 65536x and clipping stalls "
        "training",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/7534",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/7534",
        fixed_in="0.17.6",
        root_cause="ZeRO-1/2 built and applied a torch.amp.GradScaler for torch_autocast in any dtype; the gradient "
        "norm and clipping saw the scaled gradients, which the scaler unscaled only in its step.",
    ),
    pytest.mark.ds_premise(
        stage=(1, 2),
        config={"torch_autocast.enabled": True, "torch_autocast.dtype": ("torch.bfloat16", "bf16", "bfloat16")},
        sets={"zero_force_ds_cpu_optimizer": False, "zero_allow_untested_optimizer": True},
        removes=("scheduler", "optimizer"),
        because="the body compares one step of torch's SGD at its own rate (which ZeRO must be allowed to wrap, "
        "beside CPU offload too) with plain autocast training, where the config's optimizer or a scheduler's "
        "warm-up would change the step",
    ),
    ZERO12_CPU_FLAT_BUFFER,
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/7534",
        words=("Use GradScaler only for FP16", "torch.autocast"),
    ),
]

ZERO2_AUTOCAST_BF16 = {
    "zero_optimization": {"stage": 2},
    "torch_autocast": {"enabled": True, "dtype": "torch.bfloat16"},
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "zero_force_ds_cpu_optimizer": False,
    "zero_allow_untested_optimizer": True,
}
LR = 0.1


def scaler_for_fp16_only(monkeypatch):
    """PR #7534's ZeRO-1/2 part: no GradScaler unless autocast runs in fp16. Before the fix the optimizer does not
    know the configured autocast dtype; the parameters of the modules autocast runs in lower precision carry it."""
    import functools

    import torch
    from deepspeed.runtime import torch_autocast
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if hasattr(torch_autocast, "get_comm_dtype"):
        return  # PR #7534 is in this release (before 0.17.2 there is no torch_autocast module at all)
    init = DeepSpeedZeroOptimizer.__init__

    @functools.wraps(init)
    def init_without_bf16_scaler(self, *args, **kwargs):
        init(self, *args, **kwargs)
        dtypes = {getattr(p, "autocast_dtype", None) for group in self.bit16_groups for p in group}
        if torch.float16 not in dtypes:
            self.torch_autocast_gradscaler = None

    monkeypatch.setattr(DeepSpeedZeroOptimizer, "__init__", init_without_bf16_scaler)


@pytest.mark.ds_config(
    pytest.param(ZERO2_AUTOCAST_BF16, id="zero2_autocast_bf16"),
    pytest.param({**ZERO2_AUTOCAST_BF16, "zero_optimization": {"stage": 1}}, id="zero1_autocast_bf16"),
)
@pytest.mark.ds_not_applicable(
    releases="<0.17.2", reason="ZeRO's torch_autocast mode arrived in 0.17.2 (PR #6993)"
)  # fmt: skip
@pytest.mark.ds_version(
    affected=">=0.17.2,<0.17.6",
    raises=AssertionError,
    match=r"ZeRO under torch_autocast reports a gradient norm of",
    fix=scaler_for_fp16_only,
)
def test_autocast_bf16_step_matches_plain_autocast(ds_engine, ds_config, ds_rank, ds_world_size, ds_device):
    import torch

    model = tiny_mlp(seed=3)
    reference = tiny_mlp(seed=3)
    engine = ds_engine(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR))
    x, y = make_batch(ds_config["train_micro_batch_size_per_gpu"], seed=1, rank=ds_rank)
    for _ in range(engine.gradient_accumulation_steps()):  # the same micro-batch each time: the reference's gradient
        engine.backward(torch.nn.functional.mse_loss(engine(x).float(), y))
        engine.step()
    norm = float(engine.get_global_grad_norm())

    # Reference: the same forward under torch.autocast in bf16 on the mean of every rank's loss, clipped as the
    # config says, then one SGD step.
    losses = []
    for rank in range(ds_world_size):
        xr, yr = make_batch(ds_config["train_micro_batch_size_per_gpu"], seed=1, rank=rank)
        with torch.autocast(device_type=torch.device(ds_device).type, dtype=torch.bfloat16):
            output = reference(xr)
        losses.append(torch.nn.functional.mse_loss(output.float(), yr))
    torch.stack(losses).mean().backward()
    clipping = ds_config.get("gradient_clipping", 0.0)
    expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), clipping or float("inf")).item()
    with torch.no_grad():
        for p in reference.parameters():
            p -= LR * p.grad

    # Gradients are reduced in bf16 (the autocast communication dtype): a percent covers their rounding.
    assert abs(norm - expected_norm) <= 0.01 * expected_norm, (
        f"ZeRO under torch_autocast reports a gradient norm of {norm:.6g}, plain autocast {expected_norm:.6g} "
        f"({norm / expected_norm:.6g} times)"
    )
    for (name, p), q in zip(engine.module.named_parameters(), reference.parameters(), strict=True):
        step = (LR * q.grad).abs().max().item()
        assert torch.allclose(p.detach(), q.detach(), atol=0.03 * step + 1e-6), (
            f"{name} differs from plain autocast SGD after one step"
        )
