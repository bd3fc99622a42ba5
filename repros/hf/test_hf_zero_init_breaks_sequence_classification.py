"""After one ``from_pretrained`` under ZeRO-3, transformers' sequence-classification models lose their head
(deepspeedai/DeepSpeed PR #7566).

With a ZeRO-3 config active (``HfDeepSpeedConfig``, which the Trainer and accelerate create), ``from_pretrained``
builds the model inside ``deepspeed.zero.Init``. Entering it wraps the ``__init__`` of every ``nn.Module`` class
that defines one and keeps the original in ``cls._old_init``; leaving it restored ``cls.__init__ = cls._old_init``
for every class where ``hasattr(cls, "_old_init")``, which also holds for classes that only *inherit* it. Since
PR #6388 (0.15.1) the wrapping skips classes without their own ``__init__``, so the restore is asymmetric: such a
class gets its nearest patched ancestor's ``__init__`` as its own. transformers writes its heads that way:
``class LlamaForSequenceClassification(GenericForSequenceClassification, LlamaPreTrainedModel): ...``, where the
mixin (not an ``nn.Module``) builds ``model`` and ``score``. After the first ``zero.Init`` has exited, the class's
``__init__`` is ``PreTrainedModel.__init__``: the reward model an RLHF run loads next has no backbone and no head,
and transformers (5.24 here) stops in ``from_pretrained`` on what ``post_init`` never set: ``AttributeError:
'LlamaForSequenceClassification' object has no attribute 'all_tied_weights_keys'``. PR #7566 restores only the
classes it patched (first released in 0.17.6).
"""

import pytest

from pytest_dsrepro.inrank.devices import precision_dtype
from pytest_dsrepro.inrank.hf import requires_hf, tiny_checkpoint

pytestmark = [
    pytest.mark.ds_repro(
        id="hf-zero-init-sequence-classification",
        title="ZeRO-3 zero.Init exit gives transformers' *ForSequenceClassification the base __init__: the next "
        "model loaded has no backbone and no score head",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/7566",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/7566",
        fixed_in="0.17.6",
        root_cause="zero.Init patches only classes that define __init__ but restores every class that has _old_init, "
        "so a class inheriting __init__ through a non-Module mixin gets its patched ancestor's __init__.",
    ),
    pytest.mark.ds_premise(stage=3),
    requires_hf,
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/modelscope/ms-swift/pull/5820",
        raises="AttributeError",
        match=r"'\w+ForSequenceClassification' object has no attribute '\w+'",
        words=("ForSequenceClassification", "_old_init", "zero.Init", "Zero context manager"),
    ),
]

ZERO3 = {
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
}


def restore_only_patched_classes(monkeypatch):
    """Backport of PR #7566: leaving ``zero.Init`` restores ``__init__`` only on the classes it patched."""
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses

    from pytest_dsrepro.inrank.backport import backport, release_has

    if not release_has(
        InsertPostInitMethodToModuleSubClasses.unpatch_init_and_builtins, "if hasattr(cls, '_old_init'):"
    ):
        return  # fixed (0.17.6), or before PR #6388 (0.15.0 and older), when every class was patched and restored
    backport(
        monkeypatch,
        "deepspeed.runtime.zero.partition_parameters",
        [(r"if hasattr\(cls, '_old_init'\):", "if '__init__' in cls.__dict__ and hasattr(cls, '_old_init'):")],
    )


@pytest.mark.ds_config(pytest.param(ZERO3, id="zero3"))
@pytest.mark.ds_version(
    affected=">=0.15.1,<0.17.6",
    raises=AttributeError,
    match="'LlamaForSequenceClassification' object has no attribute 'all_tied_weights_keys'",
    fix=restore_only_patched_classes,
)
def test_reward_model_loaded_after_policy(ds_config, tmp_path):
    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from transformers.integrations import HfDeepSpeedConfig

    checkpoint, saved = tiny_checkpoint(tmp_path / "tiny-llama", "llama", seed=3)

    zero3 = HfDeepSpeedConfig(ds_config)  # what the Trainer and accelerate set up for a ZeRO-3 run  # noqa: F841
    AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True)  # the policy
    reward = AutoModelForSequenceClassification.from_pretrained(checkpoint, num_labels=1, local_files_only=True)

    built = sorted(name for name, _ in reward.named_children())
    assert built == ["model", "score"], f"the reward model lost its backbone and score head: children {built}"
    # The backbone holds the checkpoint's weights, partitioned by ZeRO-3: gathered, they are the saved tensors, in
    # the dtype zero.Init gives parameters under this config (bf16 or fp16 ones are the saved values rounded).
    # (One parameter per gather: gathering several is racy on gloo before 0.19.8, zero3-persistent-allgather-race.)
    embed, score = reward.model.embed_tokens.weight, reward.score.weight
    expected = saved["model.embed_tokens.weight"].to(precision_dtype(ds_config))
    with deepspeed.zero.GatheredParameters([embed]):
        torch.testing.assert_close(embed.data, expected, rtol=0, atol=0)
    with deepspeed.zero.GatheredParameters([score]):
        assert score.shape == (1, 32)
