"""The Muon optimizer ignores the param groups the caller passes: crashes on them, later drops their settings.

With an ``optimizer`` section of type ``Muon`` the engine builds Muon's param groups itself, because whether a
parameter goes to Muon or to its auxiliary AdamW is the parameter's ``use_muon`` tag, not the caller's choice. It
took ``model_parameters`` to be a flat list of tensors: the usual recipe of two groups, decay for the matrices and
none (and another learning rate) for biases and norms, reached ``p.use_muon`` on a dict, an ``AttributeError``,
from Muon's arrival in 0.17.6 (PR #7509). AutoEP (PR #7938, 0.19.2) made it flatten dict groups first, for the
groups MoE builds, and from then the caller's groups are silently merged into Muon's two: every parameter trains
with the config's ``lr`` and ``weight_decay``, the biases the user kept out of weight decay are decayed. PR #8440
splits each incoming group into its Muon and AdamW halves, a group's own settings over the config's (first released
in 0.19.7; 0.19.6 still flattens).

The fix applies PR #8440's rule around the stock code: each of the caller's groups is put through the release's own
Muon grouping alone, and its settings are laid over the halves that come back.
"""

import pytest
from _prerequisites import ZERO12_CPU_FLAT_BUFFER

from pytest_dsrepro.inrank.devices import precision_dtype
from pytest_dsrepro.inrank.engine import master_weights
from pytest_dsrepro.inrank.models import make_batch, tiny_mlp

pytestmark = [
    pytest.mark.ds_repro(
        id="optim-muon-param-groups-flattened",
        title="Muon with the caller's param groups: AttributeError on the dicts, then their lr/weight_decay dropped",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/8440",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/8440",
        fixed_in="0.19.7",
        root_cause="The engine built Muon's two groups from model_parameters as if it were a flat list of tensors: "
        "dict groups first failed on p.use_muon, then (0.19.2) were flattened, so their own settings were lost.",
    ),
    pytest.mark.ds_premise(
        stage=(0, 1, 2),
        config={"optimizer.type": "Muon"},
        sets={"zero_allow_untested_optimizer": True, "zero_optimization.reduce_scatter": False},
        removes=("scheduler",),
        because="the body compares each group's lr with the one it set (a scheduler sets its own at initialize); "
        "before 0.18.5 ZeRO takes Muon for an untested optimizer (PR #7802) and from 0.19.3 ZeRO-1/2 refuses it "
        "with reduce_scatter on (PR #8090): neither plays a part in this bug",
    ),
    ZERO12_CPU_FLAT_BUFFER,
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/8440",
        words=("Muon", "param groups", "weight_decay", "muon-params", "adam-params"),
    ),
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/blob/v0.18.3/deepspeed/runtime/engine.py#L1637",
        raises="AttributeError",
        match=r"'dict' object has no attribute 'use_muon'",
        frames=("engine.py:_configure_basic_optimizer", "engine.py:_configure_optimizer"),
    ),
]

MUON_ZERO0 = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "zero_allow_untested_optimizer": True,
    "zero_optimization": {"stage": 0, "reduce_scatter": False},
    "optimizer": {"type": "Muon", "params": {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.01}},
}

#: The settings each half of Muon takes from a group (PR #8440's ``_MUON_HALF_KEYS``, ``_ADAM_HALF_KEYS``).
MUON_KEYS = ("lr", "momentum", "weight_decay", "ns_method")
ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")


def split_each_group(monkeypatch):
    """Backport of PR #8440: each incoming group is split into its Muon and AdamW halves, a group's own settings over
    the config's. The release's grouping is run on each group's tensors alone (it takes a flat list); the halves it
    hands ``MuonWithAuxAdam`` are collected, given the group's settings (and, where they are named, a name of their
    own), and built into one optimizer."""
    from deepspeed.runtime import engine

    if not hasattr(engine, "MuonWithAuxAdam") or hasattr(engine.DeepSpeedEngine, "_muon_param_groups"):
        return  # no Muon (before 0.17.6), or this release has the fix
    stock, muon = engine.DeepSpeedEngine._configure_basic_optimizer, engine.MuonWithAuxAdam

    def configure_basic_optimizer(self, model_parameters):
        groups = [item for item in model_parameters if isinstance(item, dict)]
        if self.optimizer_name() != engine.MUON_OPTIMIZER or not groups:
            return stock(self, model_parameters)
        loose = [item for item in model_parameters if not isinstance(item, dict)]
        if loose:
            groups.append({"params": loose})
        built, options = [], {}

        def collect(param_groups, **kwargs):  # 0.19.6 also hands over the auxiliary Adam's class and settings
            built.append(param_groups)
            options.update(kwargs)

        monkeypatch.setattr(engine, "MuonWithAuxAdam", collect)
        try:
            for index, group in enumerate(groups):
                stock(self, list(group["params"]))
                for half in built[-1]:
                    keys = MUON_KEYS if half["use_muon"] else ADAM_KEYS
                    half.update({key: value for key, value in group.items() if key in keys})
                    if "name" in half:  # 0.19.2: MoE's regrouping keys its buckets by name
                        half["name"] = f"group{index}-{half['name']}"
        finally:
            monkeypatch.setattr(engine, "MuonWithAuxAdam", muon)
        return muon([half for halves in built for half in halves], **options)

    monkeypatch.setattr(engine.DeepSpeedEngine, "_configure_basic_optimizer", configure_basic_optimizer)


@pytest.mark.ds_config(
    pytest.param(MUON_ZERO0, id="zero0_muon"),
    pytest.param({**MUON_ZERO0, "zero_optimization": {"stage": 1, "reduce_scatter": False}}, id="zero1_muon"),
)
@pytest.mark.ds_not_applicable(releases="<0.17.6", reason="Muon first shipped in 0.17.6 (PR #7509)")
@pytest.mark.ds_version(
    affected=">=0.17.6,<0.19.2",
    raises=AttributeError,
    match=r"'dict' object has no attribute 'use_muon'",
    fix=split_each_group,
)
@pytest.mark.ds_version(
    affected=">=0.19.2,<0.19.7",
    raises=AssertionError,
    match=r"Muon dropped the settings of the caller's param groups",
    fix=split_each_group,
)
def test_muon_keeps_the_callers_groups(ds_engine, ds_config, ds_rank):
    import torch

    model = tiny_mlp(seed=6).to(precision_dtype(ds_config))
    for param in model.parameters():
        param.use_muon = param.ndim > 1
    # The common recipe: matrices decayed, biases not, and at a learning rate of their own.
    matrices = [p for p in model.parameters() if p.ndim > 1]
    vectors = [p for p in model.parameters() if p.ndim <= 1]
    groups = [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0, "lr": 1e-3}]
    config_lr = ds_config["optimizer"]["params"]["lr"]
    wanted = sorted((group.get("lr", config_lr), group["weight_decay"]) for group in groups)
    engine = ds_engine(model=model, optimizer=None, model_parameters=groups)

    # What the parameters train with: the settings of the groups of the optimizer the engine built (one group per
    # caller's group here, as each holds one half of Muon; ZeRO keeps the groups and flattens their tensors).
    got = sorted((float(group["lr"]), float(group["weight_decay"])) for group in engine.basic_optimizer.param_groups)
    assert got == wanted, f"Muon dropped the settings of the caller's param groups (lr, weight_decay): {got}"

    x, y = make_batch(
        ds_config["train_micro_batch_size_per_gpu"], seed=3, rank=ds_rank, dtype=precision_dtype(ds_config)
    )
    before = master_weights(engine)  # fp32 masters: a bf16 weight need not move at a config's small rate
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()
    moved = [not torch.equal(p, b) for p, b in zip(master_weights(engine), before, strict=True)]
    assert all(moved), f"a step left parameters unchanged: {moved}"
