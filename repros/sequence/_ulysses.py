"""What the Ulysses repros share (not a test module): plain softmax attention, and the check of DeepSpeed's
``DistributedAttention`` against it on the whole sequence. Imported as ``_ulysses``.
"""

from __future__ import annotations

from typing import Any


def attention(q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> Any:
    """Softmax attention over ``[batch, sequence, heads, head_dim]`` (no mask): the local attention of each rank."""
    import torch

    scores = torch.einsum("bqnh,bknh->bnqk", q, k) / q.shape[-1] ** 0.5
    return torch.einsum("bnqk,bknh->bqnh", torch.softmax(scores, dim=-1), v)


def qkv(batch: int, sequence: int, heads: int, head_dim: int, *, seed: int, device: Any, dtype: Any) -> list[Any]:
    """Queries, keys and values of the whole sequence, ``[batch, sequence, heads, head_dim]``, the same on every rank
    (drawn on the CPU)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(batch, sequence, heads, head_dim, generator=generator, device="cpu").to(device=device, dtype=dtype)
        for _ in range(3)
    ]


def gather_lengths_as_vectors(monkeypatch: Any) -> None:
    """The fix of entry ``ulysses-dataloader-adapter-gloo-seqlen`` (0.19.8's logic): the adapter's ``refill`` gathers
    each rank's sequence length as a one-element tensor, the shape of the tensors it gathers into, which gloo
    requires."""
    from deepspeed.runtime.sequence_parallel import ulysses_sp

    from pytest_dsrepro.inrank.backport import backport, release_has

    adapter = getattr(ulysses_sp, "UlyssesSPDataLoaderAdapter", None)
    if adapter is None or not release_has(adapter.refill, 'seqlen = torch.tensor(batch["input_ids"].shape[1],'):
        return  # no adapter yet, or 0.19.8's torch.full((1, ), ...)
    backport(monkeypatch, "deepspeed.runtime.sequence_parallel.ulysses_sp", [LENGTHS_AS_VECTORS])


#: The edit of ``gather_lengths_as_vectors``: a fix of the adapter's ``refill`` that edits its source again
#: (``backport`` starts from the installed source) carries it along.
LENGTHS_AS_VECTORS = (
    r"seqlen = torch\.tensor\(batch\[\"input_ids\"\]\.shape\[1\], dtype=torch\.int64",
    'seqlen = torch.tensor([batch["input_ids"].shape[1]], dtype=torch.int64',
)


def adapter_epochs(
    ds_config: dict[str, Any], ds_rank: int, ds_device: Any, *, epochs: int = 2
) -> tuple[list[int], int]:
    """A user's loop over ``epochs`` epochs of ``UlyssesSPDataLoaderAdapter`` around a ``DataLoader`` of 4 token
    samples per rank (``input_ids``, ``labels``, ``position_ids``), over the sequence-parallel group ALST sets up
    (``parallel_state_sp``, of the config's ``sequence_parallel_size``): the batches each epoch yielded, and the
    adapter's length."""
    import torch
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

    sp = ds_config["sequence_parallel_size"]
    parallel_state_sp.initialize_sequence_parallel(sequence_parallel_size=sp)
    generator = torch.Generator().manual_seed(ds_rank)
    samples = [
        {
            "input_ids": torch.randint(0, 100, (8,), generator=generator, device="cpu"),
            "labels": torch.randint(0, 100, (8,), generator=generator, device="cpu"),
            "position_ids": torch.arange(8, device="cpu"),
        }
        for _ in range(4)
    ]
    loader = torch.utils.data.DataLoader(samples, batch_size=ds_config["train_micro_batch_size_per_gpu"])
    adapter = UlyssesSPDataLoaderAdapter(
        loader,
        sp_rank=parallel_state_sp.get_sequence_parallel_rank(),
        sp_group=parallel_state_sp.get_sequence_parallel_group(),
        sp_world_size=sp,
        device=ds_device,
    )
    return [sum(1 for _ in adapter) for _ in range(epochs)], len(adapter)


def sequence_first_output_shape(monkeypatch: Any) -> None:
    """The fix of entry ``ulysses-sequence-first-output-shape``: in the sequence-first layout (``batch_dim_idx`` 1),
    the all-to-all that scatters the sequence and gathers the heads reshapes its result to ``[sequence / ranks, batch,
    ranks * local heads, head_dim]``, the order its permute leaves the dimensions in (0.16.3-0.19.6 wrote ``[batch,
    ranks * sequence, local heads / ranks, head_dim]``, as for the other direction)."""
    from deepspeed.sequence import layer

    from pytest_dsrepro.inrank.backport import backport, release_has

    generate = getattr(layer, "_generate_layout_params", None)
    if generate is None or not release_has(generate, SEQUENCE_FIRST_SHAPE[0].replace("\\", "")):
        return  # before 0.16.3 (no layout table), or a release with the right shape
    backport(monkeypatch, "deepspeed.sequence.layer", [SEQUENCE_FIRST_SHAPE])


#: The edit of ``sequence_first_output_shape``, on ``_generate_layout_params``'s sequence-first, scatter-the-sequence
#: branch (the only one that unpacks ``global_seq_len, bs``).
SEQUENCE_FIRST_SHAPE = (
    r"post_all2all_res_shape = \[bs, seq_world_size \* global_seq_len, num_local_head // seq_world_size, head_dim\]",
    "post_all2all_res_shape = [global_seq_len // seq_world_size, bs, seq_world_size * num_local_head, head_dim]",
)


def sequence_first_attention(q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> Any:
    """The local attention in the ``[sequence, batch, heads, head_dim]`` layout of Megatron-DeepSpeed."""
    return attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)).transpose(0, 1)


def sequence_first_ulysses(
    ds_config: dict[str, Any], ds_device: Any, dtype: Any, *, heads: int, seed: int
) -> tuple[Any, Any]:
    """``DistributedAttention`` in the sequence-first layout over a group of the user's own (the world's ranks, as
    Megatron-DeepSpeed makes one), 4-wide heads over 8 positions, the config's micro-batch: this rank's output and
    what plain attention over the whole sequence gives for its positions."""
    import inspect

    import torch
    from deepspeed.sequence.layer import DistributedAttention

    sp, sequence = ds_config["sequence_parallel_size"], 8
    group = torch.distributed.new_group(list(range(sp)))
    rank = torch.distributed.get_rank(group)
    ulysses = DistributedAttention(sequence_first_attention, group, scatter_idx=2, gather_idx=0)
    # From 0.14.5 the caller says where the batch is: dimension 1 here.
    batch_dim = (1,) if "batch_dim_idx" in inspect.signature(ulysses.forward).parameters else ()
    batch = ds_config["train_micro_batch_size_per_gpu"]
    q, k, v = (
        t.transpose(0, 1).contiguous() for t in qkv(batch, sequence, heads, 4, seed=seed, device=ds_device, dtype=dtype)
    )
    mine = slice(rank * sequence // sp, (rank + 1) * sequence // sp)
    out = ulysses(q[mine].contiguous(), k[mine].contiguous(), v[mine].contiguous(), *batch_dim)
    return out, sequence_first_attention(q, k, v)[mine]
