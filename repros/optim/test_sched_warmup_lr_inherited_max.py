"""WarmupLR without ``warmup_max_lr``: every param group warms up to group 0's learning rate.

Since PR #7360 (0.17.2) a ``WarmupLR`` whose config leaves out ``warmup_max_lr`` warms each group up to the
optimizer's own learning rate (issue #7303: it had used a fixed 0.001). The fallback took
``[group['lr'] for group in self.optimizer.param_groups][0]``: the trailing ``[0]`` keeps group 0's rate alone, and
``_format_param`` broadcasts that scalar to every group, so a model whose groups have different learning rates (a
head or embeddings trained faster, layer-wise rates) trains every group at group 0's, silently, for as long as it
trains (the warm-up ends at that rate and stays there). PR #8171 drops the ``[0]`` (first released in 0.19.4).
Before 0.17.2 the optimizer's rates were not read at all, so the inherited rate this bug breaks does not exist
there. ``WarmupDecayLR`` keeps its own 0.001 default and is not affected.
"""

import pytest
from _schedulers import BASE_LRS, check_schedule, config, linear_warmup_premise

pytestmark = [
    pytest.mark.ds_repro(
        id="sched-warmup-lr-inherited-max",
        title="WarmupLR without warmup_max_lr: every param group warms up to group 0's learning rate",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/8171",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/8171",
        fixed_in="0.19.4",
        root_cause="The fallback for a missing warmup_max_lr indexed the per-group list of the optimizer's learning "
        "rates with [0], and the scalar was then broadcast to every param group.",
    ),
    linear_warmup_premise({"scheduler.type": "WarmupLR", "scheduler.params.warmup_max_lr": None}),
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/8171",
        words=("WarmupLR", "warmup_max_lr", "group 0"),
    ),
]


def every_groups_own_rate(monkeypatch):
    """Backport of PR #8171: without ``warmup_max_lr`` each group warms up to its own learning rate."""
    from deepspeed.runtime.lr_schedules import WarmupLR

    from pytest_dsrepro.inrank.backport import backport, release_has

    if not release_has(WarmupLR.__init__, "param_groups][0]"):
        return  # this release has the fix
    backport(
        monkeypatch,
        "deepspeed.runtime.lr_schedules",
        [(r"(warmup_max_lr = \[group\['lr'\] for group in self\.optimizer\.param_groups\])\[0\]", r"\1")],
    )


@pytest.mark.ds_config(
    config("warmup_lr_linear", "WarmupLR", warmup_min_lr=0.0, warmup_num_steps=4, warmup_type="linear")
)
@pytest.mark.ds_not_applicable(
    releases="<0.17.2", reason="WarmupLR reads no learning rate from the optimizer before PR #7360 (0.17.2)"
)
@pytest.mark.ds_version(
    affected=">=0.17.2,<0.19.4",
    raises=AssertionError,
    match=r"WarmupLR did not warm every param group up to its own rate: learning rates \[0\.025, 0\.025\] after 2 ",
    fix=every_groups_own_rate,
)
def test_warmup_lr_inherits_every_groups_rate(ds_engine, ds_config, ds_rank):
    params = ds_config["scheduler"]["params"]
    warmup, low = params["warmup_num_steps"], params.get("warmup_min_lr", 0.0)

    def warmup_rates(k):
        """From ``warmup_min_lr`` (before the first step and at iteration 0) linearly up to each group's own rate,
        reached at iteration ``warmup_num_steps`` and kept."""
        gamma = min(max(k - 1, 0) / warmup, 1.0)
        return [low + (base - low) * gamma for base in BASE_LRS]

    bug = "WarmupLR did not warm every param group up to its own rate"
    check_schedule(ds_engine, ds_config, ds_rank, warmup_rates, warmup + 2, bug=bug)
