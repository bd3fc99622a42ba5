"""Ulysses sequence parallelism, 0.15.4-0.16.1: evenly divisible heads take the uneven-heads path on the way back,
and the all-to-all fails.

``single_all_to_all`` (``deepspeed/sequence/layer.py``) sends a tensor to the uneven-heads path (new in 0.15.4)
whenever its head dimension does not divide by the sequence-parallel size. On the way back (the context's all-to-all,
``scatter_idx`` 1) that dimension holds the local heads, not all of them: 6 heads over 2 ranks leave 3 per rank, and
3 % 2 != 0, so a model whose heads divide evenly goes down the uneven path there, records 3 as the model's number of
heads (``set_num_kv_heads``) and splits the context as if 3 heads were shared out over the ranks (2 and 1): the
split sizes disagree with the tensors the ranks exchange, and gloo refuses the first attention's all-to-all
("inLengthPerRank[myRank] == outLengthPerRank[myRank]"). PR #6797 (first in 0.16.2) takes the uneven path there only
for the first all-to-all's direction. With it the body also checks that the attention is right: Ulysses' output
against plain attention over the whole sequence, for two layers.
"""

import pytest
from _ulysses import attention, qkv

from pytest_dsrepro.inrank.devices import precision_dtype

pytestmark = [
    pytest.mark.ds_repro(
        id="ulysses-even-heads-uneven-path",
        title="Ulysses with evenly divisible heads takes the uneven-heads all-to-all: wrong attention from the "
        "second call",
        upstream="https://github.com/deepspeedai/DeepSpeed/issues/6774",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/6797",
        fixed_in="0.16.2",
        root_cause="single_all_to_all tests the head count of the tensor it is given against the sequence-parallel "
        "size; on the context's all-to-all that is the local head count, so 6 heads over 2 ranks take the uneven "
        "path, which takes 3 for the model's head count and splits the context to match.",
    ),
    pytest.mark.ds_premise(precision="fp32", config={"sequence_parallel_size": 2}),
    pytest.mark.ds_not_applicable("<0.15.0", reason="DistributedAttention takes batch_dim_idx from 0.14.5"),
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/6797",
        raises="RuntimeError",
        match=r"inLengthPerRank\[myRank\] == outLengthPerRank\[myRank\]",
        frames=("layer.py:uneven_heads_all2all",),
    ),
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/issues/6774",
        frames=("layer.py:uneven_heads_all2all", "layer.py:single_all_to_all"),
        words=("uneven head", "sequence parallel"),
    ),
]

#: The body builds no engine: DistributedAttention over a group of the user's own, as Megatron-DeepSpeed does.
CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "sequence_parallel_size": 2,
}
HEADS, HEAD_DIM, SEQUENCE = 6, 4, 8


def uneven_path_for_uneven_heads_only(monkeypatch):
    """PR #6797: the local head count of the way back (scatter_idx < 2) does not send a tensor to the uneven path."""
    from deepspeed.sequence import layer

    from pytest_dsrepro.inrank.backport import backport, release_has

    if not hasattr(layer, "uneven_heads_all2all") or release_has(layer.single_all_to_all, "not scatter_idx < 2"):
        return
    if not release_has(layer.single_all_to_all, "get_num_kv_heads() is not None or num_heads % seq_world_size != 0:"):
        return  # 0.19.7 rewrote the choice (only an indivisible kv head count takes the uneven path)
    backport(
        monkeypatch,
        "deepspeed.sequence.layer",
        [
            (
                r"if get_num_kv_heads\(\) is not None or num_heads % seq_world_size != 0:",
                "if get_num_kv_heads() is not None or (num_heads % seq_world_size != 0 and not scatter_idx < 2):",
            )
        ],
    )


@pytest.mark.ds_config(pytest.param(CONFIG, id="sp2"))
@pytest.mark.ds_version(
    affected=">=0.15.4,<0.16.2",
    raises=RuntimeError,
    match=r"inLengthPerRank\[myRank\] == outLengthPerRank\[myRank\]",
    fix=uneven_path_for_uneven_heads_only,
)
def test_ulysses_attention_with_six_heads_on_two_ranks(ds_config, ds_rank, ds_device):
    import torch
    from deepspeed.sequence.layer import DistributedAttention

    sp = ds_config["sequence_parallel_size"]
    # The sequence-parallel group of the user's own framework: here the world's ranks.
    group = torch.distributed.new_group(list(range(sp)))
    rank = torch.distributed.get_rank(group)
    ulysses = DistributedAttention(attention, group, scatter_idx=2, gather_idx=1)
    dtype = precision_dtype(ds_config)
    local = SEQUENCE // sp
    errors = []
    for layer in range(2):  # two attention layers of one forward
        q, k, v = qkv(2, SEQUENCE, HEADS, HEAD_DIM, seed=layer, device=ds_device, dtype=dtype)
        mine = slice(rank * local, (rank + 1) * local)
        out = ulysses(q[:, mine].contiguous(), k[:, mine].contiguous(), v[:, mine].contiguous(), 0)
        errors.append((out - attention(q, k, v)[:, mine]).abs().max().item())
    assert max(errors) < 1e-5, (
        f"Ulysses attention differs from attention over the whole sequence: max error per layer {errors}"
    )
