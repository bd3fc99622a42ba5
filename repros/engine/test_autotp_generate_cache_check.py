"""AutoTP training, 0.16.4-0.19.2: generating with the model being trained fails the tensor-parallel input check
(AssertionError "Data inconsistency within the TP group").

In AutoTP training the engine checks, in the first forward of the model, that every rank of a tensor-parallel group
was given the same inputs: the group's first rank broadcasts its arguments and the others compare them with their own
(``compare_tensors_in_structures``), tensors by value, anything else with ``!=``. Training methods that let the model
generate before it learns (on-policy distillation, RL fine-tuning: ``model.generate`` first) pass the forward a
transformers ``Cache`` (``past_key_values``). A cache object has no value equality: the copy broadcast from the first
rank is never equal to the rank's own, and the check fails the run with "Data inconsistency within the TP group.
Please check the Dataloader implementation to ensure consistency." although every rank has the same inputs. PR #8125
(first in 0.19.3) skips transformers caches of the same class in the comparison. The check came with AutoTP training
in 0.16.4.

The body lets a tiny Llama sharded by AutoTP over the two ranks generate a few tokens greedily before its first
training step, as an on-policy loop does: the tokens must be those the same model generates unsharded, and the
training step on them must run. Before 0.18.0 AutoTP training needs PR #7600 on a CPU at all (the prerequisite,
``_autotp.AUTOTP_CPU_DEVICE``).
"""

import pytest
from _autotp import AUTOTP_TRAINING, engine_by_name, utils_edits_by_name

from pytest_dsrepro.inrank.devices import precision_dtype
from pytest_dsrepro.inrank.hf import requires_hf, tiny_model, token_batch

pytestmark = [
    pytest.mark.ds_repro(
        id="autotp-generate-cache-check",
        title="AutoTP training: generating first fails the TP group's input check on the transformers Cache",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/8125",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/8125",
        fixed_in="0.19.3",
        root_cause="The first forward's tensor-parallel input check compares non-tensor arguments with !=; a "
        "transformers Cache broadcast from the group's first rank is never equal to the rank's own.",
    ),
    *AUTOTP_TRAINING,
    requires_hf,
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/8125",
        raises="AssertionError",
        match=r"Data inconsistency within the TP group",
        frames=("check_dataloader_inputs_same_across_ranks", "broadcast_and_check", "generate"),
        words=("on-policy distillation", "past_key_values", "DynamicCache"),
    ),
]

CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "zero_optimization": {"stage": 0},
    "tensor_parallel": {"autotp_size": 2},
}
NEW_TOKENS = 4


def skip_caches_in_the_check(monkeypatch):
    """PR #8125: in the tensor-parallel input check, two transformers caches of the same class count as equal."""
    from deepspeed.runtime import engine, utils

    from pytest_dsrepro.inrank.backport import backport, release_has

    compare = getattr(utils, "compare_tensors_in_structures", None)
    if compare is None or release_has(utils, "def is_transformers_cache(obj):"):
        return
    skip = (
        r"\1if isinstance(val1, Cache) and isinstance(val2, Cache):\n"
        r"\1    if type(val1) is not type(val2):\n\1        return False\n\1    continue\n\1\2"
    )
    backport(
        monkeypatch,
        "deepspeed.runtime.utils",
        [
            (
                r"( +)(if isinstance\(val1, torch\.Tensor\) and isinstance\(val2, torch\.Tensor\):)",
                "\\1from transformers.cache_utils import Cache\n" + skip,
            ),
            *utils_edits_by_name(),  # the prerequisite's edit of the same function, before 0.18.0
        ],
    )
    # The engine calls it by the name it imported (and, before 0.18.0, through the prerequisite's recompiled check).
    monkeypatch.setattr(engine, "compare_tensors_in_structures", utils.compare_tensors_in_structures)
    engine_by_name(monkeypatch)


@pytest.mark.ds_config(pytest.param(CONFIG, id="autotp2"))
@pytest.mark.ds_version(
    affected=">=0.16.4,<0.19.3",
    raises=AssertionError,
    match=r"Data inconsistency within the TP group",
    fix=skip_caches_in_the_check,
)
def test_autotp_model_generates_before_training(ds_config, ds_rank):
    import deepspeed
    import torch

    dtype = precision_dtype(ds_config)
    tp = ds_config["tensor_parallel"]["autotp_size"]
    micro = ds_config["train_micro_batch_size_per_gpu"]
    prompt = token_batch(micro, seq_len=4, seed=3, rank=ds_rank // tp)["input_ids"]  # the same within a TP group
    plain = tiny_model("llama", seed=6).to(dtype)
    with torch.no_grad():
        expected = plain.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)

    model = deepspeed.tp_model_init(tiny_model("llama", seed=6), tp_size=tp, dtype=dtype)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-2), config=ds_config
    )
    # The on-policy step: the model being trained writes the completions it then learns from.
    with torch.no_grad():
        completions = engine.module.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert torch.equal(completions, expected), "the tensor-parallel model generated other tokens"
    for _ in range(ds_config["gradient_accumulation_steps"]):
        loss = engine(input_ids=completions, labels=completions).loss
        engine.backward(loss)
        engine.step()
    assert torch.isfinite(loss).item()
