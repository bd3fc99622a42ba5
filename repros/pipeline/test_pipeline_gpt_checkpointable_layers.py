"""A ``PipelineModule`` named ``GPTModelPipe``/``GPT2ModelPipe`` ignores its ``checkpointable_layers``.

``PipelineModule._is_checkpointable`` decides, per chunk of ``activation_checkpoint_interval`` layers, whether the
chunk's forward goes through ``activation_checkpoint_func``. For a module whose class is named ``GPTModelPipe`` or
``GPT2ModelPipe`` (GPT-NeoX's and Megatron-DeepSpeed's pipeline models) it returns early: only chunks of
``ParallelTransformerLayerPipe`` layers, whatever ``checkpointable_layers`` lists. So the extra layer types such a
model asks to checkpoint are run without checkpointing: their activations stay in memory (GPT-NeoX's
``checkpointable_layers``, deepspeedai/DeepSpeed#6881). PR #6881 (first in 0.16.3) checkpoints the listed layers too.
The body counts the calls of the user's own ``activation_checkpoint_func``.
"""

import pytest
from _pipeline import PIPELINE, PIPELINE_WORLD, STAGES, batches, pipeline_premise
from _prerequisites import PIPELINE_GRADIENTS_SCALED_TWICE, PIPELINE_GRADIENTS_SUMMED, PIPELINE_NESTED_BACKWARD

pytestmark = [
    PIPELINE_WORLD,
    pytest.mark.ds_repro(
        id="pipeline-gpt-checkpointable-layers",
        title="GPTModelPipe/GPT2ModelPipe pipelines ignore checkpointable_layers: the listed layers are not "
        "activation-checkpointed",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/6881",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/6881",
        fixed_in="0.16.3",
        root_cause="_is_checkpointable returns early for modules named GPTModelPipe/GPT2ModelPipe, checkpointing "
        "ParallelTransformerLayerPipe chunks only, before it reads checkpointable_layers.",
    ),
    pipeline_premise(stage=(0, 1)),
    PIPELINE_NESTED_BACKWARD,
    PIPELINE_GRADIENTS_SUMMED,
    PIPELINE_GRADIENTS_SCALED_TWICE,
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/6881",
        words=("checkpointable_layers", "GPT2ModelPipe"),
    ),
]


def checkpoint_listed_layers(monkeypatch):
    """PR #6881: GPT pipelines checkpoint the layers checkpointable_layers lists, besides their transformer layers."""
    from deepspeed.runtime.pipe.module import PipelineModule

    from pytest_dsrepro.inrank.backport import backport, release_has

    if release_has(PipelineModule._is_checkpointable, "self.checkpointable_layers is not None and"):
        return
    backport(
        monkeypatch,
        "deepspeed.runtime.pipe.module",
        [
            (
                r"return all\('ParallelTransformerLayerPipe' in f\.__class__\.__name__ for f in funcs\)",
                "return all('ParallelTransformerLayerPipe' in f.__class__.__name__ or (self.checkpointable_layers "
                "is not None and f.__class__.__name__ in self.checkpointable_layers) for f in funcs)",
            )
        ],
    )


@pytest.mark.ds_config(pytest.param(PIPELINE, id="pipe2"))
@pytest.mark.ds_version(
    affected="<0.16.3",
    raises=AssertionError,
    match="checkpointable_layers ignored",
    fix=checkpoint_listed_layers,
)
def test_gpt2_pipe_checkpoints_listed_layers(ds_config, ds_world_size, ds_rank):
    import deepspeed
    import torch
    import torch.utils.checkpoint
    from deepspeed.pipe import LayerSpec, PipelineModule

    # A GPT2ModelPipe's stages pass (hidden states, attention mask), as GPT-NeoX's do: the pipeline engine takes the
    # last tensor such a model sends for a bool mask (has_attention_mask), and would cut a lone tensor into its rows.
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(16, 16)

        def forward(self, inputs):
            if isinstance(inputs, tuple):
                hidden, mask = inputs
            else:  # the first layer makes the mask, as GPT-NeoX's embedding does
                hidden, mask = inputs, torch.ones(len(inputs), 1, dtype=torch.bool, device=inputs.device)
            return torch.tanh(self.linear(hidden)).masked_fill(~mask, 0.0), mask

    class Head(torch.nn.Linear):
        def forward(self, inputs):
            return super().forward(inputs[0])

    class GPT2ModelPipe(PipelineModule):  # the name GPT-NeoX's pipeline model has
        pass

    calls = []

    def checkpoint(function, *args):  # the user's checkpointing function, counted
        calls.append(function)
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)

    torch.manual_seed(8)
    module = GPT2ModelPipe(
        layers=[LayerSpec(Block), LayerSpec(Block), LayerSpec(Block), LayerSpec(Head, 16, 1)],
        num_stages=STAGES,
        loss_fn=torch.nn.MSELoss(),
        partition_method="uniform",
        activation_checkpoint_interval=1,
        activation_checkpoint_func=checkpoint,
        checkpointable_layers=["Block"],
    )
    blocks = sum(isinstance(f, Block) for f in module.forward_funcs)
    micro, accumulation = ds_config["train_micro_batch_size_per_gpu"], ds_config["gradient_accumulation_steps"]
    config = {**ds_config, "train_batch_size": micro * accumulation * ds_world_size // STAGES}
    engine, *_ = deepspeed.initialize(
        model=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.1), config=config
    )
    engine.train_batch(data_iter=iter(batches(ds_config)))

    # Each micro-batch's forward on this stage goes through the user's function once per Block of the stage.
    assert len(calls) == blocks * accumulation, (
        f"checkpointable_layers ignored: stage {engine.stage_id} checkpointed {len(calls)} layer forwards of "
        f"{blocks * accumulation} (its {blocks} Block layers, listed in checkpointable_layers, x {accumulation} "
        "micro-batches)"
    )
