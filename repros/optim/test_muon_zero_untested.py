"""ZeRO with DeepSpeed's own Muon optimizer is refused as "an untested ZeRO Optimizer".

Muon shipped in 0.17.6 (PR #7509) with its module under ``deepspeed.runtime.zero.muon``, but ZeRO's list of
supported optimizers imported ``MuonWithAuxAdam`` from ``deepspeed.runtime.muon_optimizer``, a path that does not
exist: the ``ImportError`` was swallowed and Muon never joined the list. So a config with ``"optimizer": {"type":
"Muon"}`` and ZeRO, DeepSpeed's documented way to use Muon, dies in ``deepspeed.initialize`` with ``You are using an
untested ZeRO Optimizer`` unless the user also sets ``zero_allow_untested_optimizer`` (the mend). PR #7802 (first
released in 0.18.5) imports it from its real path.

From 0.19.3 ZeRO-1/2 refuses Muon with ``reduce_scatter`` on (PR #8090, a guard of another bug), so the repro's
config turns it off; it plays no part in this bug.
"""

import pytest
from _prerequisites import ZERO12_CPU_FLAT_BUFFER

from pytest_dsrepro.inrank.devices import precision_dtype
from pytest_dsrepro.inrank.models import make_batch

pytestmark = [
    pytest.mark.ds_repro(
        id="optim-muon-zero-untested",
        title="ZeRO + the Muon optimizer section: initialize refuses Muon as an untested ZeRO optimizer",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/7802",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/7802",
        fixed_in="0.18.5",
        root_cause="ZeRO's supported-optimizer list imported MuonWithAuxAdam from a module path that did not exist "
        "and swallowed the ImportError, so Muon was never on the list.",
    ),
    pytest.mark.ds_premise(
        stage=(1, 2),
        config={"optimizer.type": "Muon", "zero_allow_untested_optimizer": False},
        sets={"zero_optimization.reduce_scatter": False},
        because="from 0.19.3 ZeRO-1/2 refuses Muon with reduce_scatter on (PR #8090), which plays no part here",
        mend={"zero_allow_untested_optimizer": True},
    ),
    ZERO12_CPU_FLAT_BUFFER,
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/7802",
        raises="AssertionError",
        match=r"You are using an untested ZeRO Optimizer",
        frames=("engine.py:_do_optimizer_sanity_check", "engine.py:_configure_optimizer"),
        words=("MuonWithAuxAdam", "zero_allow_untested_optimizer"),
    ),
]


def muon_config(stage):
    return pytest.param(
        {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,
            "zero_allow_untested_optimizer": False,
            "optimizer": {"type": "Muon", "params": {"lr": 0.02, "momentum": 0.95}},
            "zero_optimization": {"stage": stage, "reduce_scatter": False},
        },
        id=f"zero{stage}_muon",
    )


def muon_is_supported(monkeypatch):
    """Backport of PR #7802: ``MuonWithAuxAdam`` joins ZeRO's supported optimizers, from its real module."""
    from deepspeed.runtime.zero import utils
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    if MuonWithAuxAdam in utils.ZERO_SUPPORTED_OPTIMIZERS:
        return  # this release has the fix
    monkeypatch.setattr(utils, "ZERO_SUPPORTED_OPTIMIZERS", [*utils.ZERO_SUPPORTED_OPTIMIZERS, MuonWithAuxAdam])


@pytest.mark.ds_config(muon_config(1), muon_config(2))
@pytest.mark.ds_not_applicable(releases="<0.17.6", reason="Muon first shipped in 0.17.6 (PR #7509)")
@pytest.mark.ds_version(
    affected=">=0.17.6,<0.18.5",
    raises=AssertionError,
    match=r"You are using an untested ZeRO Optimizer",
    fix=muon_is_supported,
)
def test_zero_accepts_deepspeeds_muon(ds_engine, ds_config, ds_rank, ds_device):
    import torch

    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model = model.to(device=ds_device, dtype=precision_dtype(ds_config))
    for param in model.parameters():
        param.use_muon = param.ndim > 1  # Muon for the matrices, its auxiliary Adam for the vectors
    engine = ds_engine(model=model)
    before = model[0].weight.detach().float().clone()
    x, y = make_batch(
        ds_config["train_micro_batch_size_per_gpu"], seed=0, rank=ds_rank, dtype=precision_dtype(ds_config)
    )
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()
    assert not torch.equal(engine.module[0].weight.detach().float(), before), "Muon did not move the weights"
