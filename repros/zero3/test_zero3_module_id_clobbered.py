"""ZeRO-3 initialize overwrites the ``id`` attribute users set on their modules (deepspeedai/DeepSpeed#6772).

Up to 0.16.3, ``DeepSpeedZeRoOffload._register_hooks_recursively`` numbered every submodule by assigning
``module.id = <counter>``, and ZeRO-3's parameter coordinator keyed its trace and its active-submodule sets on that
attribute. Mixture-of-experts code that keeps its own expert ids in ``module.id`` (for expert placement) silently
got DeepSpeed's counters back. PR #6847 moved DeepSpeed's number to ``module.ds_id`` (first released in 0.16.4).
"""

import math

import pytest
from _prerequisites import ZERO3_PARTITIONED

from pytest_dsrepro.inrank.devices import precision_dtype
from pytest_dsrepro.inrank.engine import master_weights
from pytest_dsrepro.inrank.models import make_batch, tiny_moe

pytestmark = [
    pytest.mark.ds_repro(
        id="zero3-module-id-clobbered",
        title="ZeRO-3 initialize overwrites user-set module.id attributes",
        upstream="https://github.com/deepspeedai/DeepSpeed/issues/6772",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/6847",
        fixed_in="0.16.4",
        root_cause="ZeRO-3 stored its own submodule counter in module.id, replacing any value the user kept there; "
        "its parameter coordinator then keyed prefetch traces and active-submodule sets on it.",
    ),
    ZERO3_PARTITIONED,
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/issues/6772",
        words=("module.id", "expert placement", "_register_hooks_recursively", ".id attribute"),
    ),
]

#: ZeRO-3 with every parameter partitioned: persistent parameters take a separate all-gather path that is not
#: deterministic on gloo before 0.19.8 (see docs/repros.md), and this bug does not depend on them.
ZERO3 = {
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "zero_force_ds_cpu_optimizer": False,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
}


def use_deepspeed_module_ids(monkeypatch):
    """Backport of PR #6847: ZeRO-3 numbers modules in ``ds_id``; every reader in the two files moves with it."""
    from deepspeed.runtime.zero import parameter_offload

    from pytest_dsrepro.inrank.backport import backport, release_has

    if release_has(parameter_offload, "module.ds_id = my_count"):
        return  # this release has the fix
    backport(monkeypatch, "deepspeed.runtime.zero.parameter_offload", [(r"\b(module|sub_module)\.id\b", r"\1.ds_id")])
    backport(
        monkeypatch,
        "deepspeed.runtime.zero.partitioned_param_coordinator",
        [
            (r"\b(sub_module|submodule|current_submodule|m)\.id\b", r"\1.ds_id"),
            (r"(self\.__submodule_order\[self\.__step_id\])\.id\b", r"\1.ds_id"),
        ],
    )


@pytest.mark.ds_config(pytest.param(ZERO3, id="zero3_all_partitioned"))
@pytest.mark.ds_version(
    affected="<0.16.4",
    raises=AssertionError,
    match=r"ZeRO-3 initialize replaced the user's expert ids",
    fix=use_deepspeed_module_ids,
)
def test_expert_ids_survive_zero3_initialize(ds_engine, ds_config, ds_rank, ds_world_size):
    import torch

    model = tiny_moe(num_experts=4)
    ids = [expert.id for expert in model.experts]
    placement = model.placement(ds_world_size)

    engine = ds_engine(model=model)  # the config's optimizer where it has one, else torch's Adam

    after = [expert.id for expert in model.experts]
    assert after == ids, f"ZeRO-3 initialize replaced the user's expert ids: {ids} -> {after}"
    assert model.placement(ds_world_size) == placement

    # ZeRO-3's own bookkeeping must still work: trace recording, prefetch and release over several steps.
    x, y = make_batch(
        ds_config["train_micro_batch_size_per_gpu"], seed=1, rank=ds_rank, dtype=precision_dtype(ds_config)
    )
    before = master_weights(engine)  # a collective, in order
    losses = []
    for _ in range(5):  # optimizer steps, each over the config's accumulation of micro-steps
        for _ in range(engine.gradient_accumulation_steps()):
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses), losses
    # It trained: the optimizer's fp32 weights moved (a bf16 loss may not show steps at a small rate), unless a
    # config's warm-up kept every step at a rate of 0.
    after = master_weights(engine)
    moved = sum(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert moved or engine.get_lr()[0] == 0, f"ZeRO-3 did not train: none of {len(before)} fp32 weights moved"
