"""MoE top-k gating with k > 2 and ``drop_tokens=False``: the gate's forward dies on an unbound ``locations``.

``topkgating`` (``deepspeed/moe/sharded_moe.py``, k >= 3; new in 0.15.0) computes the token locations in each
expert's buffer only in its ``drop_tokens`` branches; the ``drop_tokens=False`` branch sizes the capacity from the
busiest expert and falls through to ``locations * mask`` without ever setting ``locations``. So the first forward of
any model whose MoE layer routes each token to three or more experts without dropping fails, on every rank. PR #7163
(first in 0.17.1) computes ``locations`` there too. Before 0.15.0 ``TopKGate`` accepts k of 1 or 2 only.
"""

import pytest
from _moe import moe_engine, moe_model, tokens
from _prerequisites import ZERO12_CPU_FLAT_BUFFER

from pytest_dsrepro.inrank.devices import precision_dtype

pytestmark = [
    pytest.mark.ds_repro(
        id="moe-topk-no-drop-locations",
        title="MoE top-k gating (k > 2) with drop_tokens=False crashes on an unbound 'locations'",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/7163",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/7163",
        fixed_in="0.17.1",
        root_cause="topkgating sets the tokens' buffer locations only where it drops tokens; its drop_tokens=False "
        "branch leaves 'locations' unbound before the dispatch mask reads it.",
    ),
    pytest.mark.ds_premise(
        stage=(0, 1, 2),
        sets={"zero_force_ds_cpu_optimizer": False},
        because="where the config names no optimizer the body trains with torch's Adam, which DeepSpeed refuses beside "
        "an offloaded optimizer unless told",
    ),
    pytest.mark.ds_not_applicable("<0.15.0", reason="top-k gating with k > 2 (topkgating) appeared in 0.15.0"),
    ZERO12_CPU_FLAT_BUFFER,  # a user's ZeRO-1/2 config on 0.18.7-0.18.9
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/7163",
        raises="UnboundLocalError",
        match=r"local variable 'locations'",
        frames=("sharded_moe.py:topkgating", "sharded_moe.py:forward"),
    ),
]

CONFIG = {
    "zero_force_ds_cpu_optimizer": False,  # as the premise sets it for a scanned config
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "zero_optimization": {"stage": 0},
}


def locate_without_dropping(monkeypatch):
    """PR #7163: the drop_tokens=False branch computes the locations as the drop branches do."""
    from deepspeed.moe import sharded_moe

    from pytest_dsrepro.inrank.backport import backport, release_has

    if not hasattr(sharded_moe, "topkgating") or release_has(
        sharded_moe.topkgating, "capacity = new_capacity\n        locations = torch.cumsum(mask, dim=0) - 1"
    ):
        return
    backport(
        monkeypatch,
        "deepspeed.moe.sharded_moe",
        [
            (
                r"(\n( +)capacity = new_capacity\n)(\n +# normalize gates)",
                r"\1\2locations = torch.cumsum(mask, dim=0) - 1\n\3",
            )
        ],
    )


@pytest.mark.ds_config(
    pytest.param(CONFIG, id="zero0"), pytest.param({**CONFIG, "zero_optimization": {"stage": 2}}, id="zero2")
)
@pytest.mark.ds_version(
    affected=">=0.15.0,<0.17.1",
    raises=UnboundLocalError,
    match=r"local variable 'locations'",
    fix=locate_without_dropping,
)
def test_top3_moe_trains_without_dropping_tokens(ds_engine, ds_config, ds_rank, ds_device):
    import torch

    model = moe_model(num_experts=4, k=3, drop_tokens=False, seed=1, device=ds_device)
    engine = moe_engine(ds_engine, ds_config, model)  # MoE parameter groups, as DeepSpeed's MoE needs under ZeRO
    x, y = tokens(
        ds_config["train_micro_batch_size_per_gpu"] * 4,
        seed=ds_rank,
        device=ds_device,
        dtype=precision_dtype(ds_config),
    )
    output, l_aux = engine(x)
    loss = torch.nn.functional.mse_loss(output, y) + 0.01 * l_aux
    engine.backward(loss)
    engine.step()
    assert torch.isfinite(loss).item(), "the top-3 MoE model's loss is not finite"
