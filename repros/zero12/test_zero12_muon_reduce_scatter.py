"""ZeRO-1/2 with the Muon optimizer and ``reduce_scatter`` (DeepSpeed's default): a weight matrix split across two
ranks' partitions is orthogonalized from a gradient no rank has fully reduced (deepspeedai/DeepSpeed#7807).

Muon's update is a whole-matrix operation: ``get_flat_partition`` runs ``muon_update`` (Newton-Schulz) on each
parameter's gradient at its full 2-D shape, then keeps this rank's slice. With ``reduce_scatter`` on, the gradient
reduction hands each rank the averaged values of its own partition only; for a matrix that crosses a partition
boundary the rest of it is still the rank's local, unreduced gradient. So every rank orthogonalizes a different
matrix and keeps a slice of a wrong update: silent, rank-divergent training. A config that leaves ``reduce_scatter``
out has it on (each release's default), which is how users meet it. Muon came in 0.17.6 (PR #7509); 0.19.3 carries
PR #8090 (refuse the combination) and then PR #8141 (each owner of a split matrix gets its fully reduced gradient),
so no release refuses it. The check needs no hand-made reference: the same engine with ``reduce_scatter`` off
(every rank all-reduces the whole gradient, the combination's known workaround) is one.
"""

import copy

import pytest
from _prerequisites import ZERO12_CPU_FLAT_BUFFER

from pytest_dsrepro.inrank.devices import engine_dtype
from pytest_dsrepro.inrank.engine import EngineFactory
from pytest_dsrepro.inrank.models import make_batch

pytestmark = [
    pytest.mark.ds_repro(
        id="zero12-muon-reduce-scatter",
        title="ZeRO-1/2 + Muon + reduce_scatter (the default): a matrix split across partitions gets a wrong, "
        "rank-divergent update",
        upstream="https://github.com/deepspeedai/DeepSpeed/issues/7807",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/8141",
        fixed_in="0.19.3",
        root_cause="get_flat_partition orthogonalizes each Muon matrix whole, but reduce-scatter reduces only the "
        "rank's own partition of it; the rest is the rank's local gradient.",
    ),
    pytest.mark.ds_premise(
        stage=(1, 2),
        offload_optimizer="none",
        config={"optimizer.type": "Muon", "zero_optimization.reduce_scatter": True},
        sets={"zero_allow_untested_optimizer": True},
        because="before 0.18.5 ZeRO takes Muon for an untested optimizer and refuses it (its support list imported "
        "Muon from a path it had left: PR #7802)",
    ),
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/issues/7807",
        words=("Muon", "reduce_scatter"),
    ),
    ZERO12_CPU_FLAT_BUFFER,
]

HIDDEN, STEPS, TOLERANCE = 16, 2, 1e-2

MUON_ZERO = {
    "zero_allow_untested_optimizer": True,  # what 0.17.6-0.18.4 ask of any Muon config (see the premise)
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "optimizer": {"type": "Muon", "params": {"lr": 0.02, "momentum": 0.95}},
}


def muon_config(stage):
    """ZeRO-``stage`` with Muon, ``reduce_scatter`` written out (every release's default: a scan finds it there)."""
    return pytest.param(
        {**MUON_ZERO, "zero_optimization": {"stage": stage, "reduce_scatter": True}}, id=f"zero{stage}_muon"
    )


def muon_model(seed):
    """Two weight matrices of 16x16 and 8x16: their group's flat buffer (384 elements) splits at 192 on two ranks,
    inside the first; the biases go to Muon's Adam (``use_muon`` off), as Muon wants for vectors."""
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, HIDDEN // 2))
    for param in model.parameters():
        param.use_muon = param.ndim > 1
    return model


def all_reduce_instead(monkeypatch):
    """The combination's workaround in place of PR #8141's reduction: ZeRO-1/2 all-reduces whole gradients (as with
    ``reduce_scatter`` off) when its optimizer is Muon, so every owner of a split matrix has it fully reduced."""
    import functools

    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    init = DeepSpeedZeroOptimizer.__init__

    @functools.wraps(init)
    def with_all_reduce(self, init_optimizer, *args, **kwargs):
        if "muon" in type(init_optimizer).__name__.lower():
            kwargs["reduce_scatter"] = False
        init(self, init_optimizer, *args, **kwargs)

    monkeypatch.setattr(DeepSpeedZeroOptimizer, "__init__", with_all_reduce)


def update(engine, ds_rank):
    """What ``STEPS`` optimizer steps (each over the config's accumulation, on this rank's batches) did to each fp32
    master weight: the step itself, so that a small learning rate or a bf16 model hides nothing. The ranks' targets
    have opposite signs, so a rank's own gradient is far from the reduced one (with alike data it can be close)."""
    import torch
    from deepspeed.utils import safe_get_full_fp32_param

    masters = list(engine.module.parameters())
    before = [safe_get_full_fp32_param(p).float().clone() for p in masters]  # a bf16 model's, rounded: its own
    batch = engine.train_micro_batch_size_per_gpu()
    # DeepSpeed's muon_update is torch.compile'd, and dynamo saves torch.cuda's RNG state wherever CUDA is there: a
    # CPU rank on a GPU host (a gloo world) would touch CUDA. On the rank's CPU it runs eagerly (the bug is in the
    # partitioning, not in the compiled update), as every repro follows its rank's device.
    stance = "force_eager" if engine.device.type == "cpu" else "default"
    with torch.compiler.set_stance(stance):
        for micro in range(STEPS * engine.gradient_accumulation_steps()):
            x, y = make_batch(batch, hidden=HIDDEN, seed=micro, rank=ds_rank, dtype=engine_dtype(engine))
            target = y.expand(-1, HIDDEN // 2) * (1 - 2 * (ds_rank % 2))  # the ranks' gradients pull apart
            engine.backward(torch.nn.functional.mse_loss(engine(x), target))
            engine.step()
    return [safe_get_full_fp32_param(p).float() - b for p, b in zip(masters, before, strict=True)]


@pytest.mark.ds_config(muon_config(1), muon_config(2))
@pytest.mark.ds_not_applicable(releases="<0.17.6", reason="Muon first shipped in 0.17.6 (PR #7509)")
@pytest.mark.ds_version(
    affected=">=0.17.6,<0.19.3",
    raises=AssertionError,
    match="Muon's update differs with reduce_scatter",
    fix=all_reduce_instead,
)
def test_muon_update_is_the_same_with_reduce_scatter(ds_engine, ds_config, ds_rank):
    steps = update(ds_engine(model=muon_model(seed=3)), ds_rank)
    reference = copy.deepcopy(ds_config)
    reference["zero_optimization"]["reduce_scatter"] = False
    expected = update(EngineFactory(reference, "reduce_scatter off")(model=muon_model(seed=3)), ds_rank)
    pairs = zip(steps, expected, strict=True)
    worst = max((s - e).abs().max().item() / max(e.abs().max().item(), 1e-30) for s, e in pairs)
    assert worst < TOLERANCE, (
        f"Muon's update differs with reduce_scatter from the all-reduced one by {worst:.3g} of its size after "
        f"{STEPS} steps (tolerance {TOLERANCE:g})"
    )
