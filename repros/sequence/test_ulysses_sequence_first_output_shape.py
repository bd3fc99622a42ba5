"""Ulysses in the sequence-first layout, 0.16.3-0.19.6: the attention's output comes back in the wrong shape.

``DistributedAttention`` takes ``batch_dim_idx``: 1 for Megatron-DeepSpeed's ``[sequence, batch, heads, head_dim]``.
PR #6750 (0.16.3) moved the reshapes around each all-to-all into one table, ``_generate_layout_params``. For that
layout, the all-to-all that brings the output back (scatter the sequence, gather the heads) permutes its result to
``[sequence / ranks, batch, ranks, local heads, head_dim]`` and then reshapes it as ``[batch, ranks * sequence,
local heads / ranks, head_dim]``: the same number of elements, so nothing raises there, but every rank gets its
attention output as a tensor of another shape (2 ranks, 8 positions, 4 heads: ``(1, 16, 1, 4)`` where
``(4, 1, 4, 4)`` is due), its values out of place. The projection after it then fails on the shape or, where a
reshape swallows it, trains on scrambled activations. The batch-first layout (``batch_dim_idx`` 0) is right. No
pull request in the mirror at hand fixes it (its newest master is 0.19.6's); 0.19.7 returns the right shape, observed.
"""

import pytest
from _ulysses import sequence_first_output_shape, sequence_first_ulysses

pytestmark = [
    pytest.mark.ds_repro(
        id="ulysses-sequence-first-output-shape",
        title="Ulysses DistributedAttention with batch_dim_idx=1 (sequence first): the output has the wrong shape",
        upstream="https://github.com/deepspeedai/DeepSpeed/blob/v0.19.5/deepspeed/sequence/layer.py#L53",
        fix_ref=None,
        fixed_in="0.19.7",
        root_cause="_generate_layout_params (PR #6750) gives the sequence-first layout's returning all-to-all the "
        "batch-first result shape, [bs, ranks * seq, local_heads / ranks, head_dim], after a permute to [seq / ranks, "
        "bs, ranks, local_heads, head_dim].",
    ),
    pytest.mark.ds_premise(precision="fp32", config={"sequence_parallel_size": 2}),
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/6750",
        frames=("layer.py:_generate_layout_params", "layer.py:single_all_to_all"),
        words=("batch_dim_idx", "DistributedAttention", "sequence parallel"),
    ),
]

#: The body builds no engine: DistributedAttention over a group of the user's own, as Megatron-DeepSpeed does.
CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "sequence_parallel_size": 2}
HEADS = 4


@pytest.mark.ds_config(pytest.param(CONFIG, id="sp2"))
@pytest.mark.ds_version(
    affected=">=0.16.3,<0.19.7",
    raises=AssertionError,
    match="Ulysses attention returned shape",
    fix=sequence_first_output_shape,
)
def test_sequence_first_attention_keeps_its_shape(ds_config, ds_device):
    from pytest_dsrepro.inrank.devices import precision_dtype

    out, expected = sequence_first_ulysses(ds_config, ds_device, precision_dtype(ds_config), heads=HEADS, seed=5)
    assert out.shape == expected.shape, (
        f"Ulysses attention returned shape {tuple(out.shape)} for a sequence-first input; {tuple(expected.shape)} "
        "is its own layout"
    )
    assert (out - expected).abs().max().item() < 1e-5, "Ulysses attention differs from attention over the sequence"
