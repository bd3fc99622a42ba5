"""MoE top-k gating (k > 2) with capacity: the 'probs' drop policy drops routed tokens the experts had room for.

``topkgating`` (``deepspeed/moe/sharded_moe.py``, k >= 3, new in 0.15.0) keeps, per expert, the ``capacity`` tokens
with the highest ``topk_masked_gates``: the raw logits of each token's top-k experts, with zeros for the experts a
token is not routed to. A routed token whose logit is negative ranks below every unrouted zero, so wherever an expert
receives fewer tokens than it has room for, but the zeros and the positive logits fill that room, the routed tokens
with negative logits are dropped: their expert never sees them and the layer's output for them loses that expert's
share (or is zero when all its experts dropped it). ``drop_policy='probs'`` is ``topkgating``'s default and
``TopKGate`` never changes it, so every MoE layer with k >= 3 and ``drop_tokens=True`` (the default) is affected.
PR #7986 (first in 0.19.0) ranks on the routed probabilities, which are positive, so routed tokens always rank above
the padding and only tokens beyond an expert's capacity are dropped.

The body routes 64 tokens per rank to 3 of 4 experts with a capacity no expert's load exceeds (it checks that), so
the right gate drops nothing, and compares the MoE layer's output with the top-3 mixture of the experts computed by
hand from the same gate.
"""

import pytest
from _moe import moe_engine, moe_model, tokens
from _prerequisites import ZERO12_CPU_FLAT_BUFFER

from pytest_dsrepro.inrank.devices import precision_dtype

pytestmark = [
    pytest.mark.ds_repro(
        id="moe-topk-probs-drops-routed",
        title="MoE top-k gating (k > 2) drops routed tokens within capacity: ranked on logits padded with zeros",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/7986",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/7986",
        fixed_in="0.19.0",
        root_cause="topkgating's 'probs' drop policy ranks tokens per expert on the raw logits of their top-k experts, "
        "padded with zeros for unrouted ones, so routed tokens with negative logits lose to the padding and are "
        "dropped although the expert has capacity for them.",
    ),
    pytest.mark.ds_premise(stage=(0, 1, 2), precision="fp32"),  # DeepSpeed refuses its MoE layer under ZeRO-3
    pytest.mark.ds_not_applicable("<0.15.0", reason="top-k gating with k > 2 (topkgating) appeared in 0.15.0"),
    ZERO12_CPU_FLAT_BUFFER,  # a user's ZeRO-1/2 config on 0.18.7-0.18.9
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/7986",
        words=("routed experts per token", "topk_masked_gates"),
    ),
]

NUM_EXPERTS, K, TOKENS = 4, 3, 64
#: Room for a quarter more than the mean load (48 per expert): what no expert's load exceeds here (checked).
CAPACITY_FACTOR = 1.25

CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "zero_optimization": {"stage": 0},
}


def rank_on_probabilities(monkeypatch):
    """PR #7986's logic: the tokens of each expert are ranked on the routed probabilities (positive), not on the
    logits, so routed tokens always rank above the zero padding of unrouted ones."""
    from deepspeed.moe import sharded_moe

    from pytest_dsrepro.inrank.backport import backport, release_has

    if not hasattr(sharded_moe, "topkgating") or release_has(
        sharded_moe.topkgating, "top_gate, top_idx = torch.topk(gates, k=k, dim=1)"
    ):
        return
    backport(
        monkeypatch,
        "deepspeed.moe.sharded_moe",
        [
            (
                r"topk_masked_gates = torch\.zeros_like\(logits\)\.scatter\(1, top_idx, top_gate\)",
                "topk_masked_gates = torch.zeros_like(logits).scatter(1, top_idx, gates.gather(1, top_idx))",
            )
        ],
    )


@pytest.mark.ds_config(pytest.param(CONFIG, id="zero0"))
@pytest.mark.ds_version(
    affected=">=0.15.0,<0.19.0",
    raises=AssertionError,
    match="top-3 gate dropped routed tokens",
    fix=rank_on_probabilities,
)
def test_top3_gate_keeps_tokens_within_capacity(ds_engine, ds_config, ds_rank, ds_device):
    import math

    import torch

    model = moe_model(
        NUM_EXPERTS, K, seed=4, device=ds_device, capacity_factor=CAPACITY_FACTOR,
        eval_capacity_factor=CAPACITY_FACTOR, min_capacity=1,
    )  # fmt: skip
    engine = moe_engine(ds_engine, ds_config, model)  # MoE parameter groups, as DeepSpeed's MoE needs under ZeRO
    x, _ = tokens(TOKENS, seed=10 + ds_rank, device=ds_device, dtype=precision_dtype(ds_config))

    module = engine.module
    module.train()
    with torch.no_grad():
        hidden = torch.relu(module.inp(x))
        output, _, _ = module.moe(hidden)

        # By hand: each token's top-3 experts, weighted by their renormalised gate probabilities.
        moe = module.moe.deepspeed_moe
        probabilities = torch.softmax(hidden.float() @ moe.gate.wg.weight.float().t(), dim=1)
        top, chosen = probabilities.topk(K, dim=1)
        weights = top / top.sum(dim=1, keepdim=True)
        experts = moe.experts.deepspeed_experts
        expected = torch.zeros_like(output)
        for slot in range(K):
            for e in range(NUM_EXPERTS):
                rows = chosen[:, slot] == e
                expected[rows] += weights[rows, slot, None].to(output.dtype) * experts[e](hidden[rows])

    loads = torch.bincount(chosen.flatten(), minlength=NUM_EXPERTS)
    capacity = math.ceil(TOKENS / NUM_EXPERTS * CAPACITY_FACTOR * K)
    assert loads.max().item() <= capacity < TOKENS, f"the premise of the check: loads {loads.tolist()}, {capacity=}"

    wrong = (output - expected).abs().amax(dim=1) > 1e-5
    assert not wrong.any(), (
        f"the top-3 gate dropped routed tokens although every expert had room for them (capacity {capacity}, loads "
        f"{loads.tolist()}): {int(wrong.sum())} of {TOKENS} tokens lost an expert's output"
    )
