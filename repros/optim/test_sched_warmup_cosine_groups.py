"""WarmupCosineLR with several param groups: before the first step only group 0 starts the warm-up.

Since PR #6597 (0.15.3) the schedulers set each group's learning rate when they are built (``deepspeed.initialize``
builds the config's ``scheduler``), with ``update_lr(param_groups, self.get_lr())``, which zips the groups with the
rates. Before its first step ``WarmupCosineLR.get_lr`` returns ``[0.0]``, one rate whatever the number of groups, so
the zip sets group 0 to 0 and leaves every later group at its base learning rate: the first optimizer step trains
them at full rate instead of the warm-up's start, silently (from the first ``engine.step()`` every group follows
the schedule again). PR #7969 returns one 0 per group (first released in 0.19.0). Before 0.15.3 the scheduler set no
rate at construction at all (every group kept its base rate for the first step: the bug PR #6597 fixed), so the
check of the initial rates does not apply there.
"""

import pytest
from _schedulers import BASE_LRS, check_schedule, config, linear_warmup_premise

pytestmark = [
    pytest.mark.ds_repro(
        id="sched-warmup-cosine-groups",
        title="WarmupCosineLR: before the first step, param groups after the first keep their base learning rate",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/7969",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/7969",
        fixed_in="0.19.0",
        root_cause="Before it has started, WarmupCosineLR.get_lr returns a one-element list, and the initial "
        "update_lr zips it with the param groups, so only group 0 is set to the warm-up's start.",
    ),
    linear_warmup_premise({"scheduler.type": "WarmupCosineLR"}),
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/7969",
        words=("WarmupCosineLR", "param groups", "multi-group"),
    ),
]


def zero_for_every_group(monkeypatch):
    """Backport of PR #7969: before the first step the ratio is 0.0 and the rates are one 0 per param group."""
    from deepspeed.runtime.lr_schedules import WarmupCosineLR

    from pytest_dsrepro.inrank.backport import backport, release_has

    if not release_has(WarmupCosineLR.get_lr, "return [0.0]"):
        return  # this release has the fix
    backport(
        monkeypatch,
        "deepspeed.runtime.lr_schedules",
        [
            (r"return \[0\.0\](\s+if self\.last_batch_iteration < self\.warmup_num_steps)", r"return 0.0\1"),
            (r"return \[0\.0\](\s+lr_ratio = self\.get_lr_ratio\(\))", r"return [0.0 for _ in self.org_lrs]\1"),
        ],
    )


@pytest.mark.ds_config(
    config(
        "warmup_cosine_linear", "WarmupCosineLR", total_num_steps=8, warmup_num_steps=4,
        warmup_type="linear", warmup_min_ratio=0.0, cos_min_ratio=0.0,
    )
)  # fmt: skip
@pytest.mark.ds_not_applicable(
    releases="<0.15.3", reason="WarmupCosineLR sets no learning rate before its first step before PR #6597 (0.15.3)"
)
@pytest.mark.ds_version(
    affected=">=0.15.3,<0.19.0",
    raises=AssertionError,
    match=r"WarmupCosineLR did not start every param group's warm-up: learning rates \[0\.0, 0\.2\] after 0 step",
    fix=zero_for_every_group,
)
def test_warmup_cosine_starts_every_group(ds_engine, ds_config, ds_rank):
    params = ds_config["scheduler"]["params"]
    warmup, start = params["warmup_num_steps"], params.get("warmup_min_ratio", 0.0)

    def warmup_rates(k):
        """Each group's base rate times the warm-up's ratio: 0 before the first step, then from
        ``warmup_min_ratio`` at iteration 0 linearly towards 1."""
        ratio = start + (1.0 - start) * (k - 1) / warmup if k else 0.0
        return [base * ratio for base in BASE_LRS]

    bug = "WarmupCosineLR did not start every param group's warm-up"
    check_schedule(ds_engine, ds_config, ds_rank, warmup_rates, warmup, bug=bug)
