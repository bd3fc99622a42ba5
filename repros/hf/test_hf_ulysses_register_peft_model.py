"""Ulysses (ALST) sequence parallelism for Hugging Face, 0.18.1-0.18.3: registering it with a PEFT model crashes.

``UlyssesSPAttentionHF.register_with_transformers(model_name_or_path, ...)`` reads the model's head counts from its
transformers config. From 0.18.1 (PR #7638, the accelerate integration) it also takes the model object itself, but
it recognised one only with ``isinstance(..., PreTrainedModel)``. A PEFT model (``get_peft_model``: a LoRA fine-tune,
the usual way ALST is used on one node) is a ``PeftModel``, no ``PreTrainedModel``, so registration took it for a
Hub name or a path and handed it to ``AutoConfig.from_pretrained``, which fails on an object (``TypeError: expected
str, bytes or os.PathLike object, not PeftModel`` in the report; the wording depends on the transformers release).
PR #7737 (first in 0.18.4) takes any object with a ``config`` for a model. Before 0.18.1 the argument was a name or
path only: there is no model object to pass, so the repro is not applicable there.

The body is a user's LoRA fine-tune under ALST: the PEFT model's logits over the whole sequence are computed first
(plain attention), then Ulysses is registered with the PEFT model and a DeepSpeed engine with the mpu it returns runs
each rank's half of the sequence; its logits must be the reference's for those positions, and the backward must run.
"""

import pytest
from _ulysses_hf import ulysses_step

from pytest_dsrepro.inrank.devices import precision_dtype
from pytest_dsrepro.inrank.hf import requires_hf, tiny_model

pytestmark = [
    pytest.mark.ds_repro(
        id="hf-ulysses-register-peft-model",
        title="UlyssesSPAttentionHF.register_with_transformers with a PEFT model: the model is taken for a path",
        upstream="https://github.com/deepspeedai/DeepSpeed/issues/7729",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/7737",
        fixed_in="0.18.4",
        root_cause="register_with_transformers recognises a model object only with isinstance(PreTrainedModel); a "
        "PeftModel is none, so it is handed to AutoConfig.from_pretrained as a name or path.",
    ),
    pytest.mark.ds_premise(stage=0, config={"sequence_parallel_size": 2}),
    pytest.mark.ds_not_applicable(
        "<0.18.1",
        reason="register_with_transformers takes a model object from 0.18.1 (PR #7638); before, a name or path only",
    ),
    requires_hf,
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/issues/7729",
        raises="TypeError",
        # The report's transformers wrote "expected str, bytes or os.PathLike object"; 5.x "... or integer".
        match=r"os\.PathLike (object|or integer), not PeftModel",
        frames=("ulysses_sp.py:register_with_transformers",),
        words=("PeftModel", "register_with_transformers"),
    ),
]

#: An ALST config as a user writes it (no ZeRO: the body compares the engine's logits with plain attention).
CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "sequence_parallel_size": 2,
}


def model_object_by_its_config(monkeypatch):
    """PR #7737: any object with a ``config`` (a PEFT wrapper too) is taken for the model."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    from pytest_dsrepro.inrank.backport import backport, release_has

    if not release_has(UlyssesSPAttentionHF.register_with_transformers, "if isinstance(model_name_or_path, "):
        return  # a name or path only (before 0.18.1), or fixed
    backport(
        monkeypatch,
        "deepspeed.runtime.sequence_parallel.ulysses_sp",
        [
            (
                r"if isinstance\(model_name_or_path, PreTrainedModel\):",
                'if hasattr(model_name_or_path, "config") or isinstance(model_name_or_path, PreTrainedModel):',
            )
        ],
    )


def lora(seed):
    """A tiny Llama with LoRA adapters on its attention projections, as PEFT builds it for a fine-tune."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(tiny_model("llama", seed=seed), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))


@pytest.mark.ds_config(pytest.param(CONFIG, id="sp2"))
@pytest.mark.ds_version(
    affected=">=0.18.1,<0.18.4",
    raises=TypeError,
    match=r"os\.PathLike or integer, not PeftModel",
    fix=model_object_by_its_config,
)
def test_register_ulysses_with_a_peft_model(ds_config, ds_world_size, ds_device):
    model = lora(seed=3).to(precision_dtype(ds_config))
    ulysses_step(model, model, ds_config, ds_world_size, ds_device, seed=7)  # registered with the PEFT model itself
