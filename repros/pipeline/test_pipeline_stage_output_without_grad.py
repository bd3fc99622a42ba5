"""Pipeline parallelism: a stage that hands the next one a floating-point tensor needing no gradient (a rotary
table, a float attention mask) fails its backward: "element 1 of tensors does not require grad and does not have a
grad_fn" (from 0.18.5 "element 0", one ``backward`` per tensor).

Between stages the pipeline engine treats every floating-point tensor of a stage's output tuple as an activation: the
receiving stage marks each one ``requires_grad`` (``buffer.is_floating_point()``), computes its gradient and sends it
back, and the sending stage backpropagates every floating-point output with the gradient it received
(``_exec_backward_pass``: ``out_tensors = [t for t in outputs if t.is_floating_point()]``). An output the sending stage
computed without gradient (built from constants, or from tensors that need none) has no ``grad_fn``, and the
backward raises. Users meet it by passing rotary ``cos``/``sin`` tables or a float mask through the pipeline
(qlora-pipe#56, DeepSpeed 0.16.2: Llama-3 with LoRA on 2 stages; also deepspeedai/DeepSpeed#3895); Megatron-DeepSpeed
avoids it by sending masks as booleans. The engine has backpropagated every floating output since the pipeline came
(0.3.0), and still does in 0.19.8: open. The fix here backpropagates only the outputs that require grad, dropping
the gradient received for the others (nothing upstream of them can use it).
"""

import pytest
from _pipeline import PIPELINE, PIPELINE_WORLD, STAGES
from _prerequisites import PIPELINE_NESTED_BACKWARD

from pytest_dsrepro.inrank.models import make_batch

pytestmark = [
    pytest.mark.ds_repro(
        id="pipeline-stage-output-without-grad",
        title="Pipeline: a stage output that needs no gradient (rotary table, float mask) fails the stage's "
        "backward: 'element N of tensors does not require grad'",
        upstream="https://github.com/tdrussell/qlora-pipe/issues/56",
        fix_ref=None,
        fixed_in=None,
        root_cause="The pipeline engine backpropagates every floating-point tensor a stage sent with the gradient "
        "the next stage returned, whether or not the tensor requires grad; one that does not has no grad_fn.",
    ),
    pytest.mark.ds_premise(
        stage=(0, 1),
        sets={
            "steps_per_print": 100,
            "wall_clock_breakdown": False,
            "flops_profiler.enabled": False,
            "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": False,
            "bf16.enabled": False,
            "fp16.enabled": False,
        },
        because="the body trains fp32 batches with torch's SGD (which ZeRO-1 must be allowed to wrap, and which "
        "CPU optimizer offload refuses unless told); the pipeline engine's train_batch of 0.15-0.16 takes the step "
        "modulo steps_per_print, whose default there is None; from 0.18.3 a stage's backward under "
        "wall_clock_breakdown (which the flops profiler turns on too) starts a timer twice "
        "(pipeline-backward-timer-started-twice)",
    ),
    PIPELINE_WORLD,
    PIPELINE_NESTED_BACKWARD,  # 0.18.3-0.18.4: every stage before the last fails its backward otherwise
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/tdrussell/qlora-pipe/issues/56",
        raises="RuntimeError",
        match=r"element 1 of tensors does not require grad and does not have a grad_fn",
        frames=("engine.py:_exec_backward_pass",),
        words=("out_tensors", "pipeline_stages"),
        gpu=True,
    ),
]


def backward_only_what_needs_grad(monkeypatch):
    """The stage backpropagates only its floating outputs that require grad, with the gradients received for them
    (the others' are dropped). The schedule runs the method from ``_INSTRUCTION_MAP``, which gets the patched one,
    flagged as the engine's own backward as the prerequisite of 0.18.3-0.18.4 does (harmless elsewhere)."""
    from deepspeed.runtime.pipe import schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from pytest_dsrepro.inrank.backport import backport, release_has

    if release_has(PipelineEngine._exec_backward_pass, "if t.requires_grad"):
        return  # this release has the fix
    backport(
        monkeypatch,
        "deepspeed.runtime.pipe.engine",
        [(r"( +)assert len\(out_tensors\) == len\(grad_tensors\)\n",
          r"\g<0>\1grad_tensors = [g for t, g in zip(out_tensors, grad_tensors) if t.requires_grad]\n"
          r"\1out_tensors = [t for t in out_tensors if t.requires_grad]\n")],
    )  # fmt: skip
    patched = PipelineEngine._exec_backward_pass

    def flagged_backward_pass(self, buffer_id):
        self._running_engine_backward = True
        try:
            patched(self, buffer_id)
        finally:
            self._running_engine_backward = False

    monkeypatch.setitem(PipelineEngine._INSTRUCTION_MAP, schedule.BackwardPass, flagged_backward_pass)


@pytest.mark.ds_config(pytest.param(PIPELINE, id="pipe2"))
@pytest.mark.ds_version(
    affected=">=0.3.0",
    raises=RuntimeError,
    match=r"element [01] of tensors does not require grad and does not have a grad_fn",  # 1 to 0.18.4, 0 after
    fix=backward_only_what_needs_grad,
)
def test_pipeline_stage_passes_a_table_without_grad(ds_config, ds_world_size, ds_device):
    import deepspeed
    import torch
    from deepspeed.pipe import PipelineModule

    class Embed(torch.nn.Module):
        """The first layer: hidden states, and a rotary-like table computed from constants (no gradient)."""

        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(16, 16)

        def forward(self, x):
            positions = torch.arange(16, device=x.device, dtype=x.dtype)
            table = torch.cos(positions / 16).expand(x.shape[0], 16).contiguous()
            return self.linear(x), table

    class Block(torch.nn.Module):
        """A layer that reads the table and passes it on, as decoder layers do."""

        def __init__(self, last=False):
            super().__init__()
            self.linear = torch.nn.Linear(16, 16)
            self.last = last

        def forward(self, inputs):
            hidden, table = inputs
            hidden = torch.tanh(self.linear(hidden) * table)
            return hidden if self.last else (hidden, table)

    torch.manual_seed(0)
    # Two layers a stage (partition_method="uniform"): the table crosses from stage 0 to stage 1.
    layers = [Embed(), Block(), Block(last=True), torch.nn.Linear(16, 1)]
    module = PipelineModule(layers=layers, num_stages=STAGES, loss_fn=torch.nn.MSELoss(), partition_method="uniform")
    micro, accumulation = ds_config["train_micro_batch_size_per_gpu"], ds_config["gradient_accumulation_steps"]
    engine, *_ = deepspeed.initialize(
        model=module,
        optimizer=torch.optim.SGD(module.parameters(), lr=0.1),
        config={**ds_config, "train_batch_size": micro * accumulation * ds_world_size // STAGES},
    )
    data = [make_batch(micro, seed=m) for m in range(accumulation)]
    loss = engine.train_batch(data_iter=iter(data))
    assert torch.isfinite(loss), "the pipeline's loss is not finite"
