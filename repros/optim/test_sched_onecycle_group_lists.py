"""OneCycle with per-param-group lists: the whole list becomes every group's learning rate.

``OneCycle`` documents ``cycle_min_lr``, ``cycle_max_lr``, ``cycle_min_mom`` and ``cycle_max_mom`` as "float or
list", one value per param group, and a config can give them as JSON lists (the engine passes the ``scheduler``
section's params to the class as they are). ``_initialize_lr`` and ``_initialize_momentum`` only ever broadcast a
scalar (``[cycle_min_lr] * len(optimizer.param_groups)``), so a list is written whole into every group:
``deepspeed.initialize`` leaves each group's ``lr`` holding the list, and the first ``engine.step()`` raises a
``TypeError`` inside the optimizer (the momentum lists do the same to ``betas``). It is so in v0.3.0 already, and in
every release the catalogue covers. PR #8201 formats each of the four with ``_format_param`` (one value per group,
the length checked), as WarmupLR already did (first released in 0.19.6).
"""

import pytest
from _schedulers import TORCH_OPTIMIZER, TORCH_OPTIMIZER_BECAUSE, check_schedule, config

pytestmark = [
    pytest.mark.ds_repro(
        id="sched-onecycle-group-lists",
        title="OneCycle: per-param-group cycle_min_lr/cycle_max_lr lists become every group's learning rate",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/8201",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/8201",
        fixed_in="0.19.6",
        root_cause="OneCycle's _initialize_lr and _initialize_momentum broadcast their argument to every param group "
        "without reading a list as one value per group.",
    ),
    pytest.mark.ds_premise(  # per-group lists (a scalar is broadcast as it should be); the maximum's list alike
        config={"scheduler.type": "OneCycle", "scheduler.params.cycle_min_lr": list},
        sets={"scheduler.params.cycle_momentum": False, **TORCH_OPTIMIZER},
        because=f"the body checks the learning rates, not the momentum OneCycle would cycle; {TORCH_OPTIMIZER_BECAUSE}",
    ),
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/8201",
        raises="TypeError",
        match=r"unsupported operand type\(s\) for [-+*/]: '\w+' and 'list'",
        words=("OneCycle", "cycle_min_lr", "cycle_max_lr", "cycle_min_mom", "cycle_max_mom"),
    ),
]


def one_value_per_group(monkeypatch):
    """Backport of PR #8201: each of the four bounds is one value per param group (``WarmupLR._format_param``,
    which the fix moves to the module; the fix's checking of both bounds before touching the optimizer matters only
    for a list of the wrong length, which raises before any step either way)."""
    from deepspeed.runtime.lr_schedules import OneCycle

    from pytest_dsrepro.inrank.backport import backport, release_has

    if not release_has(OneCycle._initialize_lr, "[cycle_min_lr] * len"):
        return  # this release has the fix
    per_group = r'WarmupLR._format_param(self, optimizer, \1, "\1")'
    backport(
        monkeypatch,
        "deepspeed.runtime.lr_schedules",
        [
            (r"\[(cycle_m(?:in|ax)_lr)\] \* len\(optimizer\.param_groups\)", per_group),
            (r"\[\((cycle_m(?:in|ax)_mom), 0\.99\)\] \* len\(optimizer\.param_groups\)",
             rf"[(mom, 0.99) for mom in {per_group}]"),
        ],
    )  # fmt: skip


@pytest.mark.ds_config(
    config(
        "onecycle_group_lists", "OneCycle", cycle_min_lr=[0.001, 0.002], cycle_max_lr=[0.01, 0.02],
        cycle_first_step_size=4, cycle_momentum=False,
    )
)  # fmt: skip
@pytest.mark.ds_version(
    affected="<0.19.6",
    raises=AssertionError,
    match=r"OneCycle did not give each param group its own learning rate: learning rates \[\[",  # a group's: a list
    fix=one_value_per_group,
)
def test_onecycle_lists_are_per_group(ds_engine, ds_config, ds_rank):
    params = ds_config["scheduler"]["params"]
    low, high = params["cycle_min_lr"], params["cycle_max_lr"]
    up = params["cycle_first_step_size"]
    down = params.get("cycle_second_step_size", up)

    def cycle_rates(k):
        """The first cycle, continuous: each group from its own ``cycle_min_lr`` up to its ``cycle_max_lr`` over
        ``up`` steps and back over ``down`` (OneCycle's scale is that of iteration ``k``, one ahead of its own
        count)."""
        scale = k / up if k <= up else (up + down - k) / down
        return [a + (b - a) * scale for a, b in zip(low, high, strict=True)]

    bug = "OneCycle did not give each param group its own learning rate"
    check_schedule(ds_engine, ds_config, ds_rank, cycle_rates, up + 2, bug=bug)
