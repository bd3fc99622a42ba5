"""Ulysses (ALST) sequence parallelism for Hugging Face, 0.17.0-0.19.0: registering it for a multimodal model fails,
the head counts are looked for on the wrong config.

``UlyssesSPAttentionHF.register_with_transformers`` sizes its all-to-all from the model's attention geometry (heads,
key-value heads, head size, layers), read from the top level of the model's transformers config. A multimodal model
(Gemma 3 and 4, Llava, Mistral 3, Qwen2-VL: a vision tower beside a language model) has a composite config that
keeps the language model's geometry in ``text_config``; its top level has no ``num_attention_heads``, and the
registration fails with ``AttributeError: 'Gemma4Config' object has no attribute 'num_attention_heads'`` before any
training. PR #7990 (first in 0.19.1) reads the geometry from ``get_text_config()``, which is the config itself for a
text-only model. Registration exists from 0.17.0 (its first release).

The body fine-tunes a tiny Llava (a Llama language model and a CLIP vision tower) on text, as a user's ALST script
does with a checkpoint on disk: the logits over the whole sequence are computed first (plain attention), then Ulysses
is registered with the checkpoint's path, and a DeepSpeed engine with the mpu it returns runs each rank's half of the
sequence; its logits must be the reference's for those positions, and the backward must run.
"""

import pytest
from _ulysses_hf import ulysses_step

from pytest_dsrepro.inrank.devices import precision_dtype
from pytest_dsrepro.inrank.hf import TINY_CONFIGS, requires_hf

pytestmark = [
    pytest.mark.ds_repro(
        id="hf-ulysses-multimodal-head-counts",
        title="UlyssesSPAttentionHF.register_with_transformers on a multimodal model: AttributeError "
        "num_attention_heads (the heads are in text_config)",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/7990",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/7990",
        fixed_in="0.19.1",
        root_cause="register_with_transformers reads num_attention_heads, num_key_value_heads, head_dim and "
        "num_hidden_layers from the top-level config; a multimodal config keeps them in text_config.",
    ),
    pytest.mark.ds_premise(stage=0, config={"sequence_parallel_size": 2}),
    pytest.mark.ds_not_applicable("<0.17.0", reason="UlyssesSPAttentionHF (ALST) appeared in 0.17.0"),
    requires_hf,
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/7990",
        raises="AttributeError",
        # The PR's Gemma4Config; any composite (multimodal) config says the same with its own class name.
        match=r"Config' object has no attribute 'num_attention_heads'",
        frames=("ulysses_sp.py:register_with_transformers",),
        words=("'Gemma4Config' object has no attribute 'num_attention_heads'", "text_config", "get_text_config"),
    ),
]

#: An ALST config as a user writes it (no ZeRO: the body compares the engine's logits with plain attention).
CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "sequence_parallel_size": 2,
}
IMAGE_TOKEN = 31  # the last id of the tiny vocabulary: ulysses_step feeds ids below it


def geometry_from_the_text_config(monkeypatch):
    """PR #7990: the attention geometry is read from ``get_text_config()`` (the config itself for a text model)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    from pytest_dsrepro.inrank.backport import backport, release_has

    register = UlyssesSPAttentionHF.register_with_transformers
    if release_has(register, "arch_cfg = hf_model_config.get_text_config()"):
        return
    backport(
        monkeypatch,
        "deepspeed.runtime.sequence_parallel.ulysses_sp",
        [
            (
                r"\n( +)uattn = UlyssesSPAttentionHF\(",
                r"\n\1hf_model_config = hf_model_config.get_text_config()\n\1uattn = UlyssesSPAttentionHF(",
            )
        ],
    )


def tiny_llava(seed):
    """A tiny Llava: the tiny Llama of ``inrank.hf`` as its language model, beside a one-layer CLIP vision tower."""
    import torch
    from transformers import AutoModelForImageTextToText, CLIPVisionConfig, LlamaConfig, LlavaConfig

    vision = CLIPVisionConfig(
        hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=8, patch_size=4
    )
    config = LlavaConfig(
        text_config=LlamaConfig(**TINY_CONFIGS["llama"]), vision_config=vision, image_token_index=IMAGE_TOKEN
    )
    torch.manual_seed(seed)
    return AutoModelForImageTextToText.from_config(config)


@pytest.mark.ds_config(pytest.param(CONFIG, id="sp2"))
@pytest.mark.ds_version(
    affected=">=0.17.0,<0.19.1",
    raises=AttributeError,
    match=r"Config' object has no attribute 'num_attention_heads'",
    fix=geometry_from_the_text_config,
)
def test_register_ulysses_for_a_multimodal_model(ds_config, ds_rank, ds_world_size, ds_device, tmp_path):
    import torch
    from transformers import AutoModelForImageTextToText

    path = tmp_path / "tiny-llava"  # the checkpoint a user fine-tunes: rank 0 writes, all load
    if ds_rank == 0:
        tiny_llava(seed=3).save_pretrained(path)
    torch.distributed.barrier()
    model = AutoModelForImageTextToText.from_pretrained(path, local_files_only=True)
    model = model.to(ds_device, precision_dtype(ds_config))
    ulysses_step(model, str(path), ds_config, ds_world_size, ds_device, seed=7)  # registered with the path
