"""Tiny Hugging Face models built from a config, for repros of bugs users meet through transformers, PEFT and the
Trainer: no download, no network, the same weights on every rank. Importing this module imports neither torch nor
transformers (the repro's collection stays fast, and works without the ``hf`` extra).

``requires_hf`` is the marker such a repro carries: where the extra (``pip install 'pytest-dsrepro[hf]'``) is not
installed, its tests are collected and listed as usual, and skipped with a reason that names the extra.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from pytest_dsrepro.inrank.devices import rank_device

#: What the ``hf`` extra brings (pyproject.toml), by import name.
HF_PACKAGES = ("transformers", "accelerate", "peft")


def missing_hf_packages() -> list[str]:
    """The packages of the ``hf`` extra this interpreter cannot import (found without importing them)."""
    return [name for name in HF_PACKAGES if importlib.util.find_spec(name) is None]


#: On a repro module (``pytestmark``) or test: skipped, naming what is missing and the extra, without transformers.
requires_hf = pytest.mark.skipif(
    bool(missing_hf_packages()),
    reason=f"needs {', '.join(missing_hf_packages()) or 'nothing'} from the hf extra: pip install 'pytest-dsrepro[hf]'",
)

#: Small configurations of the architectures users fine-tune with DeepSpeed, as DeepSpeed's own tests build them:
#: a decoder (Llama), GPT-2, and a mixture of experts (Mixtral). Sizes are even, so that 2 ranks split them evenly.
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "vocab_size": 32,
        "max_position_embeddings": 64,
    },
    "gpt2": {"n_embd": 8, "n_head": 2, "n_layer": 2, "n_positions": 64, "vocab_size": 32},
    "mixtral": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "vocab_size": 32,
        "max_position_embeddings": 64,
    },
}


def tiny_config(model_type: str, **overrides: Any) -> Any:
    """A transformers config of ``model_type`` (a key of ``TINY_CONFIGS``), with ``overrides`` applied."""
    from transformers import AutoConfig

    if model_type not in TINY_CONFIGS:
        raise ValueError(f"no tiny config for {model_type!r}; known: {', '.join(TINY_CONFIGS)}")
    return AutoConfig.for_model(model_type, **{**TINY_CONFIGS[model_type], **overrides})


def tiny_model(model_type: str, task: str = "causal-lm", seed: int = 0, **overrides: Any) -> Any:
    """A randomly initialised tiny model for ``task`` (``causal-lm`` or ``sequence-classification``), the same on
    every rank for the same ``seed``. Built through the Auto classes, so that a DeepSpeed ZeRO-3 config made active
    by ``HfDeepSpeedConfig`` partitions it as it is built, as ``from_pretrained`` does."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    auto: dict[str, Any] = {
        "causal-lm": AutoModelForCausalLM,
        "sequence-classification": AutoModelForSequenceClassification,
    }
    torch.manual_seed(seed)
    model = auto[task].from_config(tiny_config(model_type, **overrides))
    if is_deepspeed_zero3_enabled():  # type: ignore[no-untyped-call]
        return model  # partitioned as it was built: ZeRO-3 places its shards, and the engine gathers them
    return model.to(rank_device())


def save_tiny(path: Path, model_type: str, seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny causal LM to ``path`` with ``save_pretrained`` (what a Hub download leaves on disk), for repros
    that load it with ``from_pretrained(path, local_files_only=True)``. Call it on one rank, or before the world."""
    tiny_model(model_type, seed=seed, **overrides).save_pretrained(path)
    return path


def tiny_checkpoint(path: Path, model_type: str, seed: int = 0, **overrides: Any) -> tuple[Path, dict[str, Any]]:
    """``save_tiny`` in a world: rank 0 writes, every rank waits for it, and each gets the path and the saved
    tensors (read back with safetensors, on the rank's device: the reference a repro compares loaded or gathered
    weights with)."""
    import torch
    from safetensors.torch import load_file

    if torch.distributed.get_rank() == 0:
        save_tiny(path, model_type, seed=seed, **overrides)
    torch.distributed.barrier()
    return path, load_file(path / "model.safetensors", device=str(rank_device()))


def token_batch(
    batch_size: int, seq_len: int = 8, vocab_size: int = 32, seed: int = 0, rank: int = 0, *, device: Any = None
) -> Any:
    """``{"input_ids", "labels"}`` for a causal-LM step: different per rank, the same on every run and device (drawn
    on the CPU); on the rank's device unless ``device`` says otherwise."""
    import torch

    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator, device="cpu")
    ids = ids.to(device if device is not None else rank_device())
    return {"input_ids": ids, "labels": ids.clone()}


def train_with_trainer(model: Any, ds_config: dict[str, Any], output_dir: Path, steps: int, **arguments: Any) -> Any:
    """Train ``model`` for ``steps`` steps with transformers' ``Trainer`` on DeepSpeed, in this rank's world, as a
    user's script launched by ``deepspeed``/``accelerate launch`` does; return the trainer (``trainer.model_wrapped``
    is the engine). The ranks already carry the launcher's variables (``RANK``, ``LOCAL_RANK``, ...), and
    ``TrainingArguments(deepspeed=...)`` makes accelerate take DeepSpeed's process group, gloo on CPU. The data is
    ``token_batch`` samples (the Trainer's sampler splits them); ``arguments`` go to ``TrainingArguments``."""
    import os

    from transformers import Trainer, TrainingArguments

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # what `accelerate launch --use_deepspeed` exports
    micro = ds_config["train_micro_batch_size_per_gpu"]
    # The batch sizes come from the Trainer's arguments ("auto", as HF users write them) and DeepSpeed's world: the
    # Trainer fills train_batch_size from a world size of 1 when it reads the config before it has set up devices.
    config = {key: value for key, value in ds_config.items() if key != "train_batch_size"}
    config.update(dict.fromkeys(("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"), "auto"))
    # The Trainer refuses a DeepSpeed config whose values differ from its own arguments: take them from the config.
    optimizer = ds_config.get("optimizer", {}).get("params", {})
    defaults = {
        "learning_rate": optimizer.get("lr", 5e-5),
        "max_grad_norm": ds_config.get("gradient_clipping", 1.0),
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": ds_config.get("gradient_accumulation_steps", 1),
        "max_steps": steps,
        "report_to": [],
        "save_strategy": "no",
        "logging_steps": 1,
        "disable_tqdm": True,
    }
    args = TrainingArguments(output_dir=str(output_dir), deepspeed=config, **{**defaults, **arguments})
    # On the CPU: the Trainer's data loader moves each batch to its device.
    rows = token_batch(micro * steps * args.gradient_accumulation_steps * 2, seed=11, device="cpu")
    data = [{key: value[i] for key, value in rows.items()} for i in range(len(rows["input_ids"]))]
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    return trainer
