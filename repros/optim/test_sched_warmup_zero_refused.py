"""A warm-up of 0 steps, what Hugging Face's Trainer filled ``"auto"`` with by default, is refused since 0.19.3.

A DeepSpeed config written for the Trainer leaves the scheduler's warm-up to it (``"warmup_num_steps": "auto"``, as
every Hugging Face ZeRO template does), and with no warm-up asked for (the Trainer's defaults: ``warmup_steps`` and
``warmup_ratio`` 0) its DeepSpeed integration filled ``"auto"`` with 0. ``WarmupLR`` (and ``WarmupDecayLR``, its
subclass) took 0 and warmed up over two steps (``max(2, warmup_num_steps)``). PR #8126 (first released in 0.19.3)
added input validation to ``WarmupLR`` and ``WarmupCosineLR``: a ``warmup_num_steps`` that is not a positive integer
raises ``ValueError: warmup_num_steps must be a positive integer, got 0`` when ``deepspeed.initialize`` builds the
scheduler. Found on the releases: 0.19.2 accepts 0, 0.19.3 and 0.19.8 refuse it, and DeepSpeed's master of 2026-08
(edaa72212) still does. So on 0.19.3 and later every such config, as the Trainer filled it, stops before training.

The fix on each side. The config's: a ``warmup_num_steps`` of at least 1; transformers' integration now fills
``max(1, warmup steps)`` (the transformers 5.24 pinned here does), and a config can write 1. Either way DeepSpeed
warms up over ``max(2, 1)`` = 2 steps, the schedule 0 gave before 0.19.3. DeepSpeed's (the repro's ``fix``): take
a warm-up of 0 as before. A scan that finds a config holding this bug on a release that refuses it says so here and
judges every other bug with the config's fix (``mend``), said above its table.
"""

import pytest
from _prerequisites import ZERO12_CPU_FLAT_BUFFER

from pytest_dsrepro.inrank.devices import precision_dtype
from pytest_dsrepro.inrank.engine import ConfigRejected
from pytest_dsrepro.inrank.models import make_batch

pytestmark = [
    pytest.mark.ds_repro(
        id="sched-warmup-zero-refused",
        title="A warm-up of 0 steps (Hugging Face's Trainer's default fill of \"auto\") is refused by DeepSpeed",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/8126",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/8126",
        root_cause="WarmupLR and WarmupCosineLR raise ValueError for a warmup_num_steps that is not a positive "
        "integer (since 0.19.3), where they had warmed up over max(2, warmup_num_steps) steps; Hugging Face's "
        'Trainer filled warmup_num_steps "auto" with its warmup steps, 0 by default.',
    ),
    pytest.mark.ds_premise(
        config={
            "scheduler.type": ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"),
            "scheduler.params.warmup_num_steps": 0,
        },
        mend={"scheduler.params.warmup_num_steps": 1},
    ),
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/8126",
        frames=("lr_schedules.py:__init__",),
        words=("warmup_num_steps",),
    ),
    ZERO12_CPU_FLAT_BUFFER,
]


def template(scheduler):
    """A ZeRO-2 config as Hugging Face's templates write it: the batch, the optimizer and the scheduler ``"auto"``,
    filled as the Trainer fills them without a warm-up."""
    return pytest.param(
        {
            "train_micro_batch_size_per_gpu": "auto",
            "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
            "scheduler": {
                "type": scheduler,
                "params": {
                    "warmup_min_lr": "auto",
                    "warmup_max_lr": "auto",
                    "warmup_num_steps": "auto",
                    **({"total_num_steps": "auto"} if scheduler == "WarmupDecayLR" else {}),
                },
            },
            "zero_optimization": {"stage": 2},
        },
        id=f"hf_{scheduler.lower()}_auto",
    )


def warm_up_from_zero_as_before(monkeypatch):
    """DeepSpeed's side: a warm-up of 0 steps accepted again (``WarmupLR`` and ``WarmupCosineLR`` then warm up over
    ``max(2, 0)`` steps, as before 0.19.3); a negative or fractional one is still refused."""
    import inspect

    from deepspeed.runtime import lr_schedules

    from pytest_dsrepro.inrank.backport import backport

    if "warmup_num_steps <= 0" not in inspect.getsource(lr_schedules):
        return  # a release before the check
    relaxed = [(r"or warmup_num_steps <= 0:", "or warmup_num_steps < 0:")]
    backport(monkeypatch, "deepspeed.runtime.lr_schedules", relaxed)


@pytest.mark.ds_config(template("WarmupLR"), template("WarmupDecayLR"))
@pytest.mark.ds_version(
    affected=">=0.19.3",
    raises=ConfigRejected,
    match="warmup_num_steps must be a positive integer, got 0",
    fix=warm_up_from_zero_as_before,
)
def test_trainer_default_warmup_is_accepted(ds_engine, ds_config, ds_rank):
    import torch

    assert ds_config["scheduler"]["params"]["warmup_num_steps"] == 0, "the Trainer's fill of a warm-up of 0 steps"
    engine = ds_engine()
    assert engine.lr_scheduler.warmup_num_steps == 2, "a warm-up of 0 steps runs over 2 (max(2, 0))"
    x, y = make_batch(ds_config["train_micro_batch_size_per_gpu"], rank=ds_rank, dtype=precision_dtype(ds_config))
    for _ in range(engine.gradient_accumulation_steps()):
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()  # and it trains
