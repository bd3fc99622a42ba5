"""Curriculum learning (seqlen) hands the model a sequence length of 0 on the first steps.

With ``"curriculum_learning": {"curriculum_type": "seqlen", "schedule_type": "fixed_linear" | "fixed_root"}`` the
engine passes ``curriculum_seqlen`` to the model's forward on every training step, from the scheduler's difficulty:
interpolated between ``min_difficulty`` and ``max_difficulty``, then rounded down to a multiple of
``schedule_config.difficulty_step``. When ``min_difficulty`` is not itself a multiple of the step (8 and 16, the step
advised for INT8 kernels) the rounding goes below the configured start: the first steps get difficulty 0, a
zero-length sequence, and a model that truncates to it computes its loss over nothing (NaN) or fails on an empty
tensor. The rounding is older than the releases this catalogue runs; PR #8334 rounds up to the first multiple of
the step at or above ``min_difficulty`` instead (first released in 0.19.7).
"""

import pytest

from pytest_dsrepro.inrank.devices import precision_dtype

pytestmark = [
    pytest.mark.ds_repro(
        id="curriculum-first-difficulty-zero",
        title="Curriculum learning: the first steps get curriculum_seqlen 0 when min_difficulty is not a multiple of "
        "difficulty_step",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/8334",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/8334",
        fixed_in="0.19.7",
        root_cause="CurriculumScheduler's fixed_linear/fixed_root schedule floors the interpolated difficulty to a "
        "multiple of difficulty_step with no lower bound, which is 0 while the interpolation is below the step.",
    ),
    pytest.mark.ds_premise(
        config={
            "curriculum_learning.enabled": True,
            "curriculum_learning.curriculum_type": "seqlen",
            "curriculum_learning.schedule_type": ("fixed_linear", "fixed_root"),
        }
    ),
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/8334",
        frames=("curriculum_scheduler.py:__fixed_root_get_difficulty",),
        words=("curriculum_learning", "curriculum_seqlen", "min_difficulty", "difficulty_step"),
    ),
]

SEQLEN, HIDDEN = 64, 8
CURRICULUM = {
    "enabled": True,
    "curriculum_type": "seqlen",
    "min_difficulty": 8,
    "max_difficulty": SEQLEN,
    "schedule_type": "fixed_linear",
    "schedule_config": {"total_curriculum_step": 100, "difficulty_step": 16},
}
CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "curriculum_learning": CURRICULUM,
}


def floor_at_min_difficulty(monkeypatch):
    """Backport of PR #8334: the rounded difficulty is at least the first multiple of the step >= min_difficulty."""
    from deepspeed.runtime.data_pipeline import curriculum_scheduler

    from pytest_dsrepro.inrank.backport import backport, release_has

    if release_has(curriculum_scheduler, "-(-self.state[CURRICULUM_LEARNING_MIN_DIFFICULTY] // step) * step"):
        return  # this release has the fix
    backport(
        monkeypatch,
        "deepspeed.runtime.data_pipeline.curriculum_scheduler",
        [
            (
                r"(\n([ \t]+)next_difficulty -= \(next_difficulty % "
                r"s_state\[CURRICULUM_LEARNING_SCHEDULE_DIFFICULTY_STEP\]\))",
                r"\1\n\2step = s_state[CURRICULUM_LEARNING_SCHEDULE_DIFFICULTY_STEP]"
                r"\n\2next_difficulty = max(next_difficulty, "
                r"-(-self.state[CURRICULUM_LEARNING_MIN_DIFFICULTY] // step) * step)",
            )
        ],
    )


def seqlen_model(seed, device, dtype):
    """A model that reads the engine's ``curriculum_seqlen`` as Megatron's GPT does: it trains on that prefix."""
    import torch

    class PrefixRegressor(torch.nn.Module):
        def __init__(self):
            super().__init__()
            generator = torch.Generator().manual_seed(seed)
            self.proj = torch.nn.Linear(HIDDEN, 1).to(device=device, dtype=dtype)
            with torch.no_grad():
                self.proj.weight.copy_(torch.randn(1, HIDDEN, generator=generator, device="cpu") * 0.1)
            self.seqlens = []

        def forward(self, x, y, curriculum_seqlen=None):
            if curriculum_seqlen is not None:
                self.seqlens.append(curriculum_seqlen)
                x, y = x[:, :curriculum_seqlen], y[:, :curriculum_seqlen]
            return torch.nn.functional.mse_loss(self.proj(x).float(), y.float())

    return PrefixRegressor()


@pytest.mark.ds_config(pytest.param(CONFIG, id="zero0_curriculum_seqlen"))
@pytest.mark.ds_not_applicable(
    releases=">=0.19.8",
    reason="0.19.8 refuses the legacy top-level curriculum_learning section (issue #8489); the scheduler it drove "
    "is the one data_efficiency.data_sampling.curriculum_learning uses, fixed in 0.19.7",
)
@pytest.mark.ds_version(
    affected="<0.19.7",
    raises=AssertionError,
    match=r"curriculum_seqlen .* below min_difficulty",
    fix=floor_at_min_difficulty,
)
def test_curriculum_starts_at_min_difficulty(ds_engine, ds_config, ds_rank, ds_device):
    import math

    import torch

    dtype = precision_dtype(ds_config)
    curriculum = ds_config["curriculum_learning"]
    engine = ds_engine(model=seqlen_model(seed=51, device=ds_device, dtype=dtype), optimizer="adam")
    generator = torch.Generator().manual_seed(52 + ds_rank)
    batch = ds_config["train_micro_batch_size_per_gpu"]
    losses = []
    for _ in range(3):
        x = torch.randn(batch, SEQLEN, HIDDEN, generator=generator, device="cpu").to(device=ds_device, dtype=dtype)
        y = x.sum(dim=-1, keepdim=True) * 0.1
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())

    seqlens = engine.module.seqlens
    assert seqlens, "the engine passed no curriculum_seqlen: curriculum learning is not in effect"
    assert min(seqlens) >= curriculum["min_difficulty"], (
        f"the model got curriculum_seqlen {seqlens} on its first steps, below min_difficulty "
        f"{curriculum['min_difficulty']} (losses {losses})"
    )
    assert all(math.isfinite(loss) for loss in losses), f"a loss is not finite: {losses}"
