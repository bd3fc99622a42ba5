"""Ulysses sequence parallelism before 0.14.5: with a micro-batch larger than 1 the attention output mixes samples.

``DistributedAttention`` (``[sequence, batch, heads, head_dim]``) scatters heads and gathers the sequence with one
all-to-all, runs the local attention, and goes back with a second one. On the way back ``single_all_to_all`` receives
``[ranks, sequence / ranks, batch, heads / ranks, head_dim]`` and moves the ranks next to the heads with
``transpose(0, 2)``, which swaps them with the batch instead: reshaped to ``[sequence / ranks, batch, heads, ...]``,
each sample's positions then hold heads of other samples. With a batch of 1 the swap changes nothing, so single-sample
tests pass; with 2 samples the output is wrong, silently. PR #5823 (first in 0.14.5) permutes the dimensions in the
right order (and adds ``batch_dim_idx``). The body checks Ulysses' output against plain attention over the whole
sequence (4 heads over 2 ranks: the uneven-heads path of entry ``ulysses-even-heads-uneven-path`` is not taken). On
0.16.3-0.19.6 the same layout meets entry ``ulysses-sequence-first-output-shape`` first: its fix is applied there.
"""

import pytest
from _ulysses import sequence_first_output_shape, sequence_first_ulysses

pytestmark = [
    pytest.mark.ds_repro(
        id="ulysses-batch-all-to-all",
        title="Ulysses sequence parallelism with micro-batch > 1: the returning all-to-all mixes samples",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/5823",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/5823",
        fixed_in="0.14.5",
        root_cause="single_all_to_all's sequence-scatter branch transposes the ranks' dimension with the batch's "
        "(transpose(0, 2)) instead of moving it next to the heads, which only a batch of 1 survives.",
    ),
    pytest.mark.ds_premise(
        precision="fp32", config={"sequence_parallel_size": 2, "train_micro_batch_size_per_gpu": ">=2"}
    ),
    pytest.mark.ds_prerequisite(
        fix=sequence_first_output_shape,
        releases=">=0.16.3,<0.19.7",
        reason="ulysses-sequence-first-output-shape: the sequence-first layout's output comes back in another shape",
    ),
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/5823",
        words=("batch size larger than 1", "sequence parallel"),
    ),
]

#: The body builds no engine: DistributedAttention over a group of the user's own, as Megatron-DeepSpeed does.
CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "sequence_parallel_size": 2,
}
HEADS = 4


def permute_ranks_next_to_heads(monkeypatch):
    """PR #5823's logic for the sequence-first layout: the ranks' dimension goes next to the heads, the batch stays."""
    from deepspeed.sequence import layer

    from pytest_dsrepro.inrank.backport import backport, release_has

    if not release_has(layer.single_all_to_all, "output = output.transpose(0, 2).contiguous()"):
        return
    backport(
        monkeypatch,
        "deepspeed.sequence.layer",
        [
            (
                r"output = output\.transpose\(0, 2\)\.contiguous\(\)",
                "output = output.permute(1, 2, 0, *range(3, output.dim())).contiguous()",
            )
        ],
    )


@pytest.mark.ds_config(pytest.param(CONFIG, id="sp2_mb2"))
@pytest.mark.ds_version(
    affected="<0.14.5",
    raises=AssertionError,
    match="Ulysses attention differs from attention over the whole sequence",
    fix=permute_ranks_next_to_heads,
)
def test_ulysses_attention_with_two_samples(ds_config, ds_device):
    from pytest_dsrepro.inrank.devices import precision_dtype

    out, expected = sequence_first_ulysses(ds_config, ds_device, precision_dtype(ds_config), heads=HEADS, seed=3)
    error = (out - expected).abs().max().item()
    assert error < 1e-5, (
        f"Ulysses attention differs from attention over the whole sequence: max error {error} with "
        f"{ds_config['train_micro_batch_size_per_gpu']} samples"
    )
