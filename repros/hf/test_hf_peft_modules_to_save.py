"""ZeRO-3 training of a PEFT LoRA model with ``modules_to_save`` fails in the first forward
(deepspeedai/DeepSpeed#7203, #7615).

ZeRO-3 gives every module two ``torch.autograd.Function`` classes that count and run its backward hooks, stored on
the module as ``pre_bwd_fn`` and ``post_bwd_fn`` and bound to that module by closure; it creates them only when
``hasattr(module, ...)`` says the module has none. PEFT's ``ModulesToSaveWrapper`` (what ``modules_to_save=
["lm_head"]`` puts around the head, as LLaMA-Factory and TRL configs do) answers unknown attributes from the module
it wraps. Up to 0.16.4 the classes were created lazily in the first forward, wrapper first, so the wrapper got its
own. PR #7062 (0.16.5) creates them when the hooks are registered, children before parents: the wrapper then finds
its child's classes through delegation and keeps them, and in the forward its ``post_bwd_fn`` counts on the
*child*, whose counter its own hook has not set yet: ``AttributeError: 'Linear' object has no attribute
'ds_grads_remaining'``. PR #8144 checks the module's own ``__dict__`` instead (first released in 0.19.3).
"""

import pytest

from pytest_dsrepro.inrank.devices import precision_dtype
from pytest_dsrepro.inrank.hf import requires_hf, tiny_model, token_batch

pytestmark = [
    pytest.mark.ds_repro(
        id="hf-peft-modules-to-save",
        title="ZeRO-3 + PEFT LoRA with modules_to_save: AttributeError 'Linear' object has no attribute "
        "'ds_grads_remaining' in the first forward",
        upstream="https://github.com/deepspeedai/DeepSpeed/issues/7203",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/8144",
        fixed_in="0.19.3",
        root_cause="ZeRO-3 creates a module's backward-hook classes only if hasattr() finds none; PEFT's "
        "ModulesToSaveWrapper delegates attributes to the wrapped head, so the wrapper uses the head's classes, "
        "which count on the head before its counter exists.",
    ),
    pytest.mark.ds_premise(
        stage=3,
        sets={"zero_force_ds_cpu_optimizer": False},
        because="the body trains the adapters with its own torch AdamW, which DeepSpeed refuses beside an offloaded "
        "optimizer unless told",
    ),
    requires_hf,
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/8144",
        frames=("parameter_offload.py:_post_backward_module_hook",),
        words=("modules_to_save", "ModulesToSaveWrapper", "ds_grads_remaining"),
    ),
]

ZERO3 = {
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "zero_force_ds_cpu_optimizer": False,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
}


def hook_classes_per_module(monkeypatch):
    """Backport of PR #8144: a module's hook classes and counters are looked up in its own ``__dict__``."""
    from deepspeed.runtime.zero import parameter_offload

    from pytest_dsrepro.inrank.backport import backport, release_has

    if not release_has(parameter_offload, 'if not hasattr(module, "post_bwd_fn"):'):
        return  # fixed, or before PR #7062, when the classes were created in the module's own forward
    backport(
        monkeypatch,
        "deepspeed.runtime.zero.parameter_offload",
        [
            (r'if not hasattr\(module, "(pre_bwd_fn|post_bwd_fn)"\):', r'if "\1" not in module.__dict__:'),
            (
                r'if not hasattr\(ctx\.module, "applied_pre_backward_ref_cnt"\):',
                r'if "applied_pre_backward_ref_cnt" not in ctx.module.__dict__:',
            ),
        ],
    )


def lora_with_saved_head(seed):
    """A tiny Llama with LoRA on the attention projections and a fully trained ``lm_head``, as PEFT builds it."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])
    return get_peft_model(tiny_model("llama", seed=seed), config)


def train(model, engine_factory, batch, steps):
    """``steps`` optimizer steps, each over the config's accumulation of micro-steps on ``batch``: every micro-step's
    loss, and the learning rate and betas of the optimizer step it ended (None where it ended none: a config's
    scheduler sets the rate, and OneCycle cycles the betas too)."""
    import torch

    engine = engine_factory(
        model=model, optimizer=torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    )
    losses, steps_taken = [], []
    for _ in range(steps * engine.gradient_accumulation_steps()):
        loss = engine(**batch).loss
        engine.backward(loss)
        group = engine.optimizer.param_groups[0]
        steps_taken.append((group["lr"], group["betas"]) if engine.is_gradient_accumulation_boundary() else None)
        engine.step()
        losses.append(loss.item())
    return losses, steps_taken


@pytest.mark.ds_config(pytest.param(ZERO3, id="zero3"))
@pytest.mark.ds_version(
    affected=">=0.16.5,<0.19.3",
    raises=AttributeError,
    match="object has no attribute 'ds_grads_remaining'",
    fix=hook_classes_per_module,
)
def test_lora_with_modules_to_save_trains(ds_engine, ds_config, ds_rank):
    import torch

    batch = token_batch(ds_config["train_micro_batch_size_per_gpu"], seed=5, rank=ds_rank)
    losses, steps_taken = train(lora_with_saved_head(seed=2), ds_engine, batch, steps=3)

    # Reference: the same adapters and data on every rank's batch, trained by plain torch in the engine's dtype, and
    # data-parallel averaged as DeepSpeed does (the mean of the ranks' losses, over the accumulated micro-steps),
    # each step at the engine's learning rate and betas (a config's scheduler sets them).
    dtype = precision_dtype(ds_config)
    reference = lora_with_saved_head(seed=2).to(dtype)
    optimizer = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
    world, accumulation = torch.distributed.get_world_size(), ds_config["gradient_accumulation_steps"]
    expected = []
    for taken in steps_taken:
        mine = reference(**batch).loss
        (mine / world / accumulation).backward()
        expected.append(mine.item())
        if taken is None:
            continue
        for p in reference.parameters():
            if p.requires_grad:
                torch.distributed.all_reduce(p.grad)
        optimizer.param_groups[0]["lr"], optimizer.param_groups[0]["betas"] = taken
        optimizer.step()
        optimizer.zero_grad()
    rtol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(losses, expected, rtol=rtol, atol=0, msg="ZeRO-3 trained the PEFT model differently")
    # The losses are taken before each step: a step at a rate above 0 before the last loss shows in it.
    lrs = [taken[0] if taken else None for taken in steps_taken]
    assert losses[-1] < losses[0] or not any(lrs[:-1]), f"it did not train: {losses} (learning rates {lrs})"
