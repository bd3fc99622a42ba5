"""ZeRO-1/2 with the Muon optimizer and a partly frozen model: ``deepspeed.initialize`` dies in ``torch.cat``.

With an ``optimizer`` section of type ``Muon`` the engine splits the model's parameters into a Muon group
(``use_muon``) and an AdamW group (the rest), both taken from every parameter, frozen or not. ZeRO-1/2 then keeps
each group's trainable parameters only, and flattens them: a group that holds only frozen parameters (a frozen
backbone's biases beside a trainable, bias-free head; a frozen embedding) is an empty list, and flattening it raises
``torch.cat(): expected a non-empty list of Tensors`` before the first step. PR #7869 (first released in 0.18.7)
builds the two groups from the trainable parameters only.

Muon came in 0.17.6 (PR #7509), so the repro is not applicable before it. From 0.19.3 ZeRO-1/2 refuses Muon with
``reduce_scatter`` on (PR #8090), so the repro's config turns it off; it plays no part in this bug.
"""

import pytest
from _prerequisites import ZERO12_CPU_FLAT_BUFFER

from pytest_dsrepro.inrank.devices import precision_dtype
from pytest_dsrepro.inrank.engine import master_weights
from pytest_dsrepro.inrank.models import make_batch

pytestmark = [
    pytest.mark.ds_repro(
        id="optim-muon-frozen-group-empty",
        title="ZeRO-1/2 + Muon with a partly frozen model: initialize fails with torch.cat() of an empty list",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/7869",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/7869",
        fixed_in="0.18.7",
        root_cause="The engine built Muon's and AdamW's param groups from every parameter, frozen ones too, so a "
        "group of frozen parameters alone reached ZeRO-1/2 as an empty list of trainable tensors to flatten.",
    ),
    pytest.mark.ds_premise(
        stage=(1, 2),
        optimizer=True,
        config={"optimizer.type": "Muon"},
        sets={"zero_optimization.reduce_scatter": False, "zero_allow_untested_optimizer": True},
        because="from 0.19.3 ZeRO-1/2 refuses Muon with reduce_scatter on (PR #8090), and before 0.18.5 it takes "
        "Muon for an untested optimizer (PR #7802); neither setting plays a part in this bug",
    ),
    ZERO12_CPU_FLAT_BUFFER,
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/7869",
        raises="ValueError",
        match=r"torch\.cat\(\): expected a non-empty list of Tensors",
        frames=(
            "engine.py:_configure_optimizer",
            "engine.py:_configure_zero_optimizer",
            "stage_1_and_2.py:__init__",
            "stage_1_and_2.py:flatten_dense_tensors_aligned",
        ),
        words=("Muon", "frozen"),
    ),
]

MUON_ZERO = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "zero_allow_untested_optimizer": True,
    "optimizer": {"type": "Muon", "params": {"lr": 0.02, "momentum": 0.95}},
}


def muon_config(stage):
    return pytest.param(
        {**MUON_ZERO, "zero_optimization": {"stage": stage, "reduce_scatter": False}}, id=f"zero{stage}_muon"
    )


def trainable_groups_only(monkeypatch):
    """Backport of PR #7869: Muon's and AdamW's groups hold the trainable parameters only."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    from pytest_dsrepro.inrank.backport import backport, release_has

    if not release_has(DeepSpeedEngine._configure_basic_optimizer, "if p.use_muon]"):
        return  # this release has the fix
    backport(
        monkeypatch,
        "deepspeed.runtime.engine",
        [
            (r"if p\.use_muon\]", "if p.use_muon and p.requires_grad]"),
            (r"if not p\.use_muon\]", "if (not p.use_muon) and p.requires_grad]"),
        ],
    )


@pytest.mark.ds_config(muon_config(1), muon_config(2))
@pytest.mark.ds_not_applicable(releases="<0.17.6", reason="Muon first shipped in 0.17.6 (PR #7509)")
@pytest.mark.ds_version(
    affected=">=0.17.6,<0.18.7",
    raises=ValueError,
    match=r"torch\.cat\(\): expected a non-empty list of Tensors",
    fix=trainable_groups_only,
)
def test_muon_trains_a_partly_frozen_model(ds_engine, ds_config, ds_rank, ds_device):
    import torch

    # A frozen backbone (weight and bias) under a trainable, bias-free head: Muon takes the matrices, AdamW the
    # vectors, and every vector is frozen.
    torch.manual_seed(5)
    backbone, head = torch.nn.Linear(16, 16), torch.nn.Linear(16, 1, bias=False)
    model = torch.nn.Sequential(backbone, torch.nn.Tanh(), head).to(device=ds_device, dtype=precision_dtype(ds_config))
    backbone.requires_grad_(False)
    for param in model.parameters():
        param.use_muon = param.ndim > 1
    engine = ds_engine(model=model)

    before = master_weights(engine)[-1]  # the head's fp32 master: bf16 need not move at a config's small rate
    frozen = backbone.weight.detach().clone()
    for step in range(2):
        x, y = make_batch(
            ds_config["train_micro_batch_size_per_gpu"], seed=step, rank=ds_rank, dtype=precision_dtype(ds_config)
        )
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    assert not torch.equal(master_weights(engine)[-1], before), "Muon did not train the head"
    assert torch.equal(engine.module[0].weight.detach(), frozen), "the frozen backbone moved"
