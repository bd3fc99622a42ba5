"""DeepSpeed's Muon without ZeRO (stage 0, the default) never orthogonalizes: the matrices train with plain SGD.

``{"optimizer": {"type": "Muon"}}`` builds ``MuonWithAuxAdam``, which sends matrices (``use_muon``) to Muon and the
rest to Adam. Its ``step`` applies ``p.grad`` to each Muon parameter as the finished update: under ZeRO-1/2/3 the ZeRO
optimizer has already run the momentum and Newton-Schulz orthogonalization (``muon_update``) on the flat partition
by then, but with no ZeRO optimizer nothing has, so each matrix moves by ``-lr * grad``: SGD, without momentum, with
no error and a falling loss. ``zero_optimization.stage`` defaults to 0, so the plainest Muon config meets it. So it has
been since Muon shipped (PR #7509, 0.17.6); issue #8441 measured it, and PR #8442 runs ``muon_update`` in ``step`` for
a parameter that still has its matrix shape (first released in 0.19.7).
"""

import pytest

from pytest_dsrepro.inrank.models import make_batch, tiny_mlp

pytestmark = [
    pytest.mark.ds_repro(
        id="optim-muon-stage0-trains-sgd",
        title="Muon without ZeRO (stage 0): no Newton-Schulz step runs, the matrices are trained with plain SGD",
        upstream="https://github.com/deepspeedai/DeepSpeed/issues/8441",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/8442",
        fixed_in="0.19.7",
        root_cause="MuonWithAuxAdam.step applied p.grad as an update already orthogonalized by the ZeRO optimizer; "
        "at stage 0 no ZeRO optimizer runs muon_update, so the raw gradient was applied.",
    ),
    pytest.mark.ds_premise(
        stage=0,
        config={"optimizer.type": ("Muon", "muon")},
        sets={"gradient_clipping": 0.0, "bf16.enabled": False},
        because="the body compares the matrices with one unclipped fp32 Muon step computed from the same gradients "
        "(bf16 weights, where the bug is the same, would round a step of this size away)",
    ),
    pytest.mark.ds_not_applicable(releases="<0.17.6", reason="DeepSpeed's Muon optimizer arrived in 0.17.6 (PR #7509)"),
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/issues/8441",
        frames=("muon_optimizer.py:step",),
        words=("Muon", "Newton-Schulz", "SGD", "zero_optimization", "MuonWithAuxAdam"),
    ),
]

LR, MOMENTUM = 0.02, 0.95
CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "bf16": {"enabled": False},
    "optimizer": {"type": "Muon", "params": {"lr": LR, "momentum": MOMENTUM, "weight_decay": 0.0}},
}


def run_muon_in_step(monkeypatch):
    """Backport of PR #8442: a Muon parameter that still has its matrix shape gets ``muon_update`` in ``step``."""
    from deepspeed.runtime.zero.muon import muon_optimizer

    from pytest_dsrepro.inrank.backport import backport, release_has

    if release_has(muon_optimizer.MuonWithAuxAdam.step, "update = muon_update("):
        return  # this release has the fix
    backport(
        monkeypatch,
        "deepspeed.runtime.zero.muon.muon_optimizer",
        [
            (
                r"\n([ \t]+)p\.add_\(p\.grad\.reshape\(p\.shape\), alpha=-group\[\"lr\"\]\)",
                r"""
\1update = p.grad  # a flat ZeRO partition: the ZeRO optimizer already ran muon_update
\1if p.dim() >= 2:  # the weight itself: no ZeRO optimizer is in play, so Muon runs here
\1    from deepspeed.runtime.zero.muon.original_muon import muon_update
\1    state = self.state[p]
\1    if "momentum_buffer" not in state:
\1        state["momentum_buffer"] = torch.zeros_like(p)
\1    update = muon_update(p.grad, state["momentum_buffer"], beta=group["momentum"])
\1p.add_(update.reshape(p.shape), alpha=-group["lr"])""",
            )
        ],
    )


@pytest.mark.ds_config(pytest.param(CONFIG, id="zero0_muon"))
@pytest.mark.ds_version(
    affected=">=0.17.6,<0.19.7",
    raises=AssertionError,
    match=r"took a plain SGD step, not Muon's",
    fix=run_muon_in_step,
)
def test_muon_without_zero_orthogonalizes(ds_engine, ds_config, ds_rank):
    import torch
    from deepspeed.runtime.zero.muon.original_muon import muon_update

    engine = ds_engine(model=tiny_mlp(seed=31))  # the config's Muon
    matrices = {name: p for name, p in engine.module.named_parameters() if getattr(p, "use_muon", False)}
    assert matrices, "deepspeed.initialize tagged no parameter for Muon"
    before = {name: p.detach().clone() for name, p in matrices.items()}

    x, y = make_batch(ds_config["train_micro_batch_size_per_gpu"], seed=32, rank=ds_rank)
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    grads = {name: p.grad.detach().clone() for name, p in matrices.items()}  # averaged over the ranks by now
    engine.step()

    for name, p in matrices.items():
        sgd = before[name] - LR * grads[name]
        update = muon_update(grads[name].clone(), torch.zeros_like(grads[name]), beta=MOMENTUM)
        muon = before[name] - LR * update.reshape(p.shape).to(before[name].dtype)  # older releases return bf16
        assert not torch.allclose(p.detach(), sgd, atol=1e-6) or torch.allclose(muon, sgd, atol=1e-6), (
            f"{name} took a plain SGD step, not Muon's: no Newton-Schulz orthogonalization ran (max |w - Muon| "
            f"{(p.detach() - muon).abs().max().item():.3g})"
        )
        torch.testing.assert_close(p.detach(), muon, atol=1e-5, rtol=1e-4, msg=f"{name} is not one Muon step")
