"""WarmupLR without ``warmup_max_lr``: the warm-up ends at DeepSpeed's built-in 0.001, not the optimizer's rate.

A ``WarmupLR`` scheduler section that leaves out ``warmup_max_lr`` (a common config: the optimizer's ``lr`` is the
rate the user means to warm up to) took the argument's default, 0.001, whatever the optimizer's learning rate was
(issue #7303: an AdamW at 1e-5 trained at 1e-3 after the warm-up). Training goes on, silently, at the wrong rate for
as long as it trains, since WarmupLR holds the warm-up's end rate. PR #7360 (first released in 0.17.2) makes a missing
``warmup_max_lr`` inherit the optimizer's rate. The body trains one param group, so the later bug of that fallback
(group 0's rate broadcast to every group, ``sched-warmup-lr-inherited-max``, fixed in 0.19.4) does not show here.
"""

import pytest
from _schedulers import TORCH_OPTIMIZER, linear_warmup_premise

pytestmark = [
    pytest.mark.ds_repro(
        id="sched-warmup-lr-default-max",
        title="WarmupLR without warmup_max_lr warms up to the built-in 0.001 instead of the optimizer's rate",
        upstream="https://github.com/deepspeedai/DeepSpeed/issues/7303",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/7360",
        fixed_in="0.17.2",
        root_cause="WarmupLR's warmup_max_lr argument defaulted to 0.001, so a scheduler section without it ignored "
        "the optimizer's configured learning rate.",
    ),
    linear_warmup_premise({"scheduler.type": "WarmupLR", "scheduler.params.warmup_max_lr": None}),
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/issues/7303",
        words=("overrided by the default", "warmup_max_lr"),
    ),
]

#: The optimizer's own learning rate: what the warm-up should end at (far from 0.001).
LR = 0.1
WARMUP = 4


def inherit_the_optimizers_rate(monkeypatch):
    """Backport of PR #7360: a WarmupLR built without ``warmup_max_lr`` warms up to the optimizer's rate."""
    import inspect

    from deepspeed.runtime.lr_schedules import WarmupLR

    if inspect.signature(WarmupLR.__init__).parameters["warmup_max_lr"].default is None:
        return  # this release has the fix
    original = WarmupLR.__init__

    def __init__(self, optimizer, *args, **kwargs):
        if not args[1:2] and "warmup_max_lr" not in kwargs:
            groups = getattr(optimizer, "optimizer", optimizer).param_groups  # DeepSpeed's wrappers hold the torch one
            kwargs["warmup_max_lr"] = groups[0]["lr"]
        original(self, optimizer, *args, **kwargs)

    monkeypatch.setattr(WarmupLR, "__init__", __init__)


CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    **TORCH_OPTIMIZER,  # what the schedulers' premise sets for the body's torch optimizer
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0.0, "warmup_num_steps": WARMUP, "warmup_type": "linear"},
    },
}


@pytest.mark.ds_config(pytest.param(CONFIG, id="warmup_lr_without_max"))
@pytest.mark.ds_version(
    affected="<0.17.2",
    raises=AssertionError,
    match=r"WarmupLR did not warm up to the optimizer's learning rate 0\.1: 0\.001 after",
    fix=inherit_the_optimizers_rate,
)
def test_warmup_lr_warms_up_to_the_optimizers_rate(ds_engine, ds_config, ds_rank):
    import math

    import torch

    from pytest_dsrepro.inrank.devices import precision_dtype
    from pytest_dsrepro.inrank.models import make_batch, tiny_mlp

    params = ds_config["scheduler"]["params"]
    warmup, low = params.get("warmup_num_steps", 1000), params.get("warmup_min_lr", 0.0)
    model = tiny_mlp(seed=3)
    engine = ds_engine(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR))
    for k in range(warmup + 2):
        x, y = make_batch(
            ds_config["train_micro_batch_size_per_gpu"], seed=k, rank=ds_rank, dtype=precision_dtype(ds_config)
        )
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    # After the warm-up a linear WarmupLR holds its end rate: the optimizer's own, where the config gives no other.
    (got,) = engine.get_lr()
    assert math.isclose(got, LR, rel_tol=1e-9), (
        f"WarmupLR did not warm up to the optimizer's learning rate {LR}: {got} after {warmup + 2} steps "
        f"(warm-up of {warmup} steps from {low})"
    )
