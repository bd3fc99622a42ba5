"""What the Ulysses-for-Hugging-Face (ALST) repros share (not a test module): a user's first sequence-parallel
training step of a transformers model, checked against the model's own attention over the whole sequence. Imported
as ``_ulysses_hf``.
"""

from __future__ import annotations

import inspect
from typing import Any

#: The sequence the body feeds: 8 tokens, 4 per rank of a 2-rank sequence-parallel group.
SEQUENCE = 8


def ulysses_step(
    model: Any, model_name_or_path: Any, ds_config: dict[str, Any], ds_world_size: int, ds_device: Any, *, seed: int
) -> None:
    """Register Ulysses with transformers for ``model_name_or_path`` (the model object, or its checkpoint's path),
    build an engine over ``model`` with the mpu registration returns, and run one step on this rank's half of one
    sample of ``SEQUENCE`` tokens (``token_batch(seed=seed)``, below the vocabulary's last id): its logits must be
    those ``model`` gives for those positions over the whole sequence before Ulysses is registered."""
    import deepspeed
    import torch
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    from pytest_dsrepro.inrank.devices import precision_dtype
    from pytest_dsrepro.inrank.hf import token_batch

    dtype = precision_dtype(ds_config)
    sp, micro = ds_config["sequence_parallel_size"], ds_config["train_micro_batch_size_per_gpu"]
    vocabulary = model.get_output_embeddings().weight.shape[0] - 1
    ids = token_batch(micro, seq_len=SEQUENCE, vocab_size=vocabulary, seed=seed)["input_ids"]  # one sample, all ranks
    positions = torch.arange(SEQUENCE, device=ds_device).expand(micro, SEQUENCE)
    with torch.no_grad():
        reference = model(input_ids=ids, position_ids=positions).logits

    register = UlyssesSPAttentionHF.register_with_transformers
    # The sequence length was max_length up to 0.18.1, seq_length from 0.18.2.
    length = "seq_length" if "seq_length" in inspect.signature(register).parameters else "max_length"
    mpu = register(
        model_name_or_path=model_name_or_path,
        core_attn_implementation="sdpa",
        sequence_parallel_size=sp,
        micro_batch_size=micro,
        seq_length_is_variable=True,
        **{length: SEQUENCE},
    )
    accumulation = ds_config["gradient_accumulation_steps"]
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3),
        config={**ds_config, "train_batch_size": micro * accumulation * ds_world_size // sp},
        mpu=mpu,
    )
    rank, local = mpu.get_sequence_parallel_rank(), SEQUENCE // sp
    mine = slice(rank * local, (rank + 1) * local)
    logits = engine(input_ids=ids[:, mine], position_ids=positions[:, mine]).logits
    rtol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(
        logits, reference[:, mine], rtol=rtol, atol=1e-5, msg="Ulysses logits differ from the whole sequence's"
    )
    engine.backward(logits.float().pow(2).mean())
    engine.step()
