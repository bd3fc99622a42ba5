"""Pipeline parallelism with tied layers whose weights are frozen (PEFT LoRA's base): every ``train_batch`` crashes.

After each backward the pipeline engine all-reduces the gradient of every tied weight over the stages that share it
(``_exec_reduce_tied_grads``). A tied weight the user froze (``requires_grad=False``: the embedding a LoRA model shares
between its first and last stage, with adapters only on the attention) has no gradient, and the engine hands that
``None`` to ``all_reduce``, which refuses it: "Invalid function argument. Expected parameter `tensor` of type
torch.Tensor" (a TypeError in this torch; a RuntimeError, "to be of type", in the issue's). PR #5477 (first in
0.15.4) skips the tied weights without a gradient.
"""

import pytest
from _pipeline import PIPELINE, PIPELINE_WORLD, STAGES, batches, pipeline_premise
from _prerequisites import PIPELINE_GRADIENTS_SCALED_TWICE, PIPELINE_GRADIENTS_SUMMED, PIPELINE_NESTED_BACKWARD

pytestmark = [
    PIPELINE_WORLD,
    pytest.mark.ds_repro(
        id="pipeline-tied-frozen-weights",
        title="Pipeline with frozen tied weights (PEFT LoRA): the tied-gradient all-reduce is handed None and fails",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/5477",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/5477",
        fixed_in="0.15.4",
        root_cause="_exec_reduce_tied_grads all-reduces every tied weight's gradient, and a frozen tied weight has "
        "none: all_reduce(None) raises.",
    ),
    pipeline_premise(stage=(0, 1)),
    # a user's config may accumulate, and 0.18.3-0.18.4 refuse a pipeline's own backward without ZeRO: those
    # entries' fixes on their releases, as their repros carry
    PIPELINE_NESTED_BACKWARD,
    PIPELINE_GRADIENTS_SUMMED,
    PIPELINE_GRADIENTS_SCALED_TWICE,
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/5477",
        raises="RuntimeError",
        match=r"Invalid function argument\. Expected parameter `tensor` (?:to be )?of type torch\.Tensor",
        frames=("engine.py:_exec_reduce_tied_grads",),
        words=("tied", "lora"),
    ),
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/blob/v0.14.4/deepspeed/runtime/pipe/engine.py#L280",
        raises="TypeError",
        match=r"Invalid function argument\. Expected parameter `tensor` of type torch\.Tensor",
        frames=("engine.py:_exec_reduce_tied_grads",),
    ),
]


def skip_tied_weights_without_gradient(monkeypatch):
    """PR #5477: a tied weight without a gradient (frozen) is left out of the tied all-reduce. The schedule finds the
    method in ``_INSTRUCTION_MAP``, not by name: the patched method goes there too."""
    from deepspeed.runtime.pipe import schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from pytest_dsrepro.inrank.backport import backport, release_has

    if release_has(PipelineEngine._exec_reduce_tied_grads, "if grad is not None:"):
        return
    backport(
        monkeypatch,
        "deepspeed.runtime.pipe.engine",
        [
            (
                r"\n( +)dist\.all_reduce\(grad, group=group\)",
                r"\n\1if grad is not None:\n\1    dist.all_reduce(grad, group=group)",
            )
        ],
    )
    monkeypatch.setitem(
        PipelineEngine._INSTRUCTION_MAP, schedule.ReduceTiedGrads, PipelineEngine._exec_reduce_tied_grads
    )


@pytest.mark.ds_config(pytest.param(PIPELINE, id="pipe2"))
@pytest.mark.ds_version(
    affected="<0.15.4",
    raises=TypeError,  # RuntimeError in the torch of the issue, which said "to be of type"
    match=r"Invalid function argument\. Expected parameter `tensor` of type torch\.Tensor",
    fix=skip_tied_weights_without_gradient,
)
def test_train_batch_with_frozen_tied_layer(ds_config, ds_world_size):
    import deepspeed
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    torch.manual_seed(7)
    # The first and the third layer share one frozen weight (stages 0 and 1 of the uniform partition); the others
    # train, as a LoRA model's adapters do around its frozen, tied embedding.
    specs = [
        TiedLayerSpec("shared", torch.nn.Linear, 16, 16),
        LayerSpec(torch.nn.Linear, 16, 16),
        TiedLayerSpec("shared", torch.nn.Linear, 16, 16),
        LayerSpec(torch.nn.Linear, 16, 1),
    ]
    module = PipelineModule(layers=specs, num_stages=STAGES, loss_fn=torch.nn.MSELoss(), partition_method="uniform")
    for name, parameter in module.named_parameters():
        if "tied_modules" in name:
            parameter.requires_grad_(False)
    frozen = {n: p.detach().clone() for n, p in module.named_parameters() if not p.requires_grad}
    trained = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    assert frozen, "the tied layer is on this stage"

    micro, accumulation = ds_config["train_micro_batch_size_per_gpu"], ds_config["gradient_accumulation_steps"]
    config = {**ds_config, "train_batch_size": micro * accumulation * ds_world_size // STAGES}
    trainable = [p for p in module.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=module, optimizer=torch.optim.SGD(trainable, lr=0.1), config=config)
    loss = engine.train_batch(data_iter=iter(batches(ds_config)))

    assert torch.isfinite(loss).item()
    for name, parameter in engine.module.named_parameters():
        if name in frozen:
            assert torch.equal(parameter.detach(), frozen[name]), f"frozen tied weight {name} changed"
    after = dict(engine.module.named_parameters())
    changed = [n for n in trained if not torch.equal(after[n].detach(), trained[n])]
    assert changed, "no trainable weight of this stage changed"
