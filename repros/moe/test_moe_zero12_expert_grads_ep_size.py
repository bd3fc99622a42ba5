"""MoE with expert parallelism under ZeRO-1/2, before 0.15.4: expert gradients are ``ep_size`` times too large.

ZeRO-1/2's ``average_tensor`` divides each gradient bucket by the data-parallel size, except a bucket that holds an
expert parameter: there each parameter is divided by the size of its own reduction group, which for an expert is the
expert-data-parallel group (``world / ep_size``). But an expert's gradient already sums the tokens every rank of its
expert-parallel group sent it (the all-to-all), so it must be divided by the whole data-parallel size as the dense
ones are. With ``ep_size`` 2 on 2 ranks the expert-data-parallel group is one rank: nothing is divided, and every
expert's update is twice what the same model trains with ``ep_size`` 1 (deepspeedai/DeepSpeed#5618: "4 times bigger"
with ep 4). PR #6546 (first in 0.15.4) divides every bucket by the data-parallel size. The body trains one step of
the same model and data with ``ep_size`` 1 and 2 and compares each expert's update.
"""

import pytest
from _moe import moe_groups, moe_model, tokens
from _prerequisites import ZERO12_CPU_FLAT_BUFFER

from pytest_dsrepro.inrank.devices import precision_dtype

pytestmark = [
    pytest.mark.ds_repro(
        id="moe-zero12-expert-grads-ep-size",
        title="MoE expert parallelism under ZeRO-1/2: expert gradients ep_size times too large",
        upstream="https://github.com/deepspeedai/DeepSpeed/issues/6545",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/6546",
        fixed_in="0.15.4",
        root_cause="average_tensor divides an expert parameter's gradient by its expert-data-parallel group's size "
        "(world / ep_size), although the all-to-all already summed the tokens of the expert-parallel ranks into it.",
    ),
    pytest.mark.ds_premise(
        stage=(1, 2),
        precision="fp32",
        sets={"gradient_clipping": 0.0, "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False},
        removes=("scheduler",),
        because="the body compares one SGD step of two engines, unclipped and at its own rate (plain SGD, which ZeRO "
        "must be allowed to wrap, beside an offloaded optimizer too)",
    ),
    ZERO12_CPU_FLAT_BUFFER,
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/issues/6545",
        words=("ep_size times larger",),
    ),
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/issues/5618",
        words=("4 times bigger",),
    ),
]

CONFIG = {
    "zero_force_ds_cpu_optimizer": False,  # as the premise sets it for a scanned config
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "zero_allow_untested_optimizer": True,
    "zero_optimization": {"stage": 2},
}
LR = 0.5


def divide_by_data_parallel_size(monkeypatch):
    """PR #6546: every bucket, expert parameters' too, is divided by the data-parallel size."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from pytest_dsrepro.inrank.backport import backport, release_has

    if not release_has(DeepSpeedZeroOptimizer.average_tensor, "if not self.ipg_bucket_has_moe_params:"):
        return
    backport(
        monkeypatch,
        "deepspeed.runtime.zero.stage_1_and_2",
        [
            (
                r"\n +grad_reduc\.data\.div_\(dist\.get_world_size\(group=process_group\) / "
                r"float\(self\.sequence_parallel_size\)\)",
                "",
            ),
            (r"if not self\.ipg_bucket_has_moe_params:\n", "if True:\n"),
        ],
    )


def one_step(ds_config, model, x, y):
    """One SGD step of ``model`` on ``(x, y)``; the experts of this rank before and after it."""
    import deepspeed
    import torch

    experts = model.moe.deepspeed_moe.experts.deepspeed_experts
    before = [e.weight.detach().clone() for e in experts]
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(moe_groups(model), lr=LR), config=ds_config
    )
    output, _ = engine(x)
    engine.backward(torch.nn.functional.mse_loss(output, y))  # the gate's auxiliary loss left out: experts only
    engine.step()
    return before, [e.weight.detach().clone() for e in experts]


@pytest.mark.ds_config(
    pytest.param(CONFIG, id="zero2"), pytest.param({**CONFIG, "zero_optimization": {"stage": 1}}, id="zero1")
)
@pytest.mark.ds_version(
    affected="<0.15.4",
    raises=AssertionError,
    match="expert updates with ep_size 2 differ from ep_size 1",
    fix=divide_by_data_parallel_size,
)
def test_expert_updates_do_not_depend_on_ep_size(ds_config, ds_rank, ds_world_size, ds_device):
    import torch

    # Top-1 routing without random token selection, and room for every token: the same routing for both engines.
    gate = {"use_rts": False, "capacity_factor": 2.0, "eval_capacity_factor": 2.0, "min_capacity": 1}
    experts = ds_world_size
    whole = moe_model(experts, 1, ep_size=1, seed=5, device=ds_device, **gate)
    split = moe_model(experts, 1, ep_size=ds_world_size, seed=5, device=ds_device, **gate)
    # The expert this rank holds with ep_size = world size starts as that expert of the other model.
    mine = split.moe.deepspeed_moe.experts.deepspeed_experts[0]
    mine.load_state_dict(whole.moe.deepspeed_moe.experts.deepspeed_experts[ds_rank].state_dict())

    x, y = tokens(ds_config["train_micro_batch_size_per_gpu"], seed=20 + ds_rank, device=ds_device,
                  dtype=precision_dtype(ds_config))  # fmt: skip
    before, after = one_step(ds_config, whole, x, y)
    expected = after[ds_rank] - before[ds_rank]
    before, after = one_step(ds_config, split, x, y)
    update = after[0] - before[0]

    ratio = (update.norm() / expected.norm()).item()
    assert torch.allclose(update, expected, rtol=1e-4, atol=1e-6), (
        f"expert updates with ep_size 2 differ from ep_size 1: expert {ds_rank}'s update is {ratio:.3f} times as large"
    )
