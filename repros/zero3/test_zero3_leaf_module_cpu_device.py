"""ZeRO-3 leaf modules on the CPU accelerator: the first forward raises ``Invalid device string: '0'`` (PR #7600).

``stage3_module_granularity_threshold`` (0.16.0) makes every module whose parameters per layer fall under it a ZeRO-3
leaf module, fetched and released whole. PR #6694 (first in 0.16.3) releases such a module's parameters fast: it
points each at one empty buffer made with ``torch.empty(1, device=get_accelerator().current_device())``. The CUDA
accelerator answers ``current_device()`` with an index, which torch takes as a device; the CPU accelerator answers
with the ``LOCAL_RANK`` string, which it does not. So on a CPU (DeepSpeed's CPU accelerator, as on Xeon training
nodes) every ZeRO-3 run with a threshold that makes a leaf module fails when the first leaf module's forward ends.
PR #7600 (first in 0.18.0) names the device by ``current_device_name()``.

The fix on the config's side (``mend``): a threshold of 0. A scan of a config with a threshold on an affected
release says AFFECTED here (on the CPU accelerator) and judges every other ZeRO-3 bug with the mend, said above its
table: their bodies would die of this bug first (LLaMA-Factory's ZeRO-3 bf16 config on 0.16.4).
"""

import pytest
from _zero3 import ZERO3

from pytest_dsrepro.inrank.devices import precision_dtype
from pytest_dsrepro.inrank.models import make_batch

THRESHOLD = "zero_optimization.stage3_module_granularity_threshold"

pytestmark = [
    pytest.mark.ds_repro(
        id="zero3-leaf-module-cpu-device",
        title="ZeRO-3 leaf modules by granularity threshold on the CPU accelerator: Invalid device string at forward",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/7600",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/7600",
        fixed_in="0.18.0",
        root_cause="Releasing a leaf module's parameters made its empty buffer on get_accelerator().current_device(), "
        "which the CPU accelerator returns as the LOCAL_RANK string, not a device torch accepts.",
    ),
    pytest.mark.ds_premise(stage=3, accelerator="cpu", config={THRESHOLD: ">0"}, mend={THRESHOLD: 0}),
    pytest.mark.ds_not_applicable("<0.16.0", reason="stage3_module_granularity_threshold appeared in 0.16.0"),
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/7600",
        raises="RuntimeError",
        match=r"Invalid device string: '\d+'",
        frames=(
            "partitioned_param_coordinator.py:release_sub_module",
            "parameter_offload.py:_post_forward_module_hook",
        ),
        words=("stage3_module_granularity_threshold", "z3_leaf_module"),
    ),
]


def device_by_name(monkeypatch):
    """PR #7600's edit of ``release_sub_module``: the empty buffer on ``torch.device(current_device_name())``."""
    from pytest_dsrepro.inrank.backport import backport, release_has

    module = "deepspeed.runtime.zero.partitioned_param_coordinator"
    if release_has(module, "empty_buffer = torch.empty(1, device=get_accelerator().current_device())"):
        by_name = "device=torch.device(get_accelerator().current_device_name()))"
        backport(monkeypatch, module, [(r"device=get_accelerator\(\)\.current_device\(\)\)", by_name)])


def gained_mlp():
    """A tiny MLP with a learned gain between its layers: a module of one 1x1 linear, whose granularity (parameters
    per layer, 1 // 2) is 0, so that any positive threshold makes it a leaf module."""
    import torch

    class Gain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Linear(1, 1, bias=False)

        def forward(self, x):
            return self.scale(x.unsqueeze(-1)).squeeze(-1)

    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), Gain(), torch.nn.Tanh(), torch.nn.Linear(16, 4))


#: ZeRO-3 with a granularity threshold that makes the gain a leaf module (LLaMA-Factory's configs set 16).
LEAF_BY_THRESHOLD = {**ZERO3, "zero_optimization": {**ZERO3["zero_optimization"], THRESHOLD.rsplit(".", 1)[-1]: 16}}
#: The most optimizer steps the body takes for the gain to move (one in its own config; a scanned config's warm-up
#: may give the first step a rate of 0).
MAX_STEPS = 6


@pytest.mark.ds_config(pytest.param(LEAF_BY_THRESHOLD, id="zero3_leaf_threshold16"))
@pytest.mark.ds_version(
    affected=">=0.16.3,<0.18.0", raises=RuntimeError, match=r"Invalid device string: '\d+'", fix=device_by_name
)
def test_leaf_module_trains_on_cpu(ds_engine, ds_config, ds_rank):
    import torch
    from deepspeed.utils import safe_get_full_fp32_param

    model = gained_mlp()
    engine = ds_engine(model=model)
    gain = model[1].scale.weight
    before = safe_get_full_fp32_param(gain).clone()  # a collective: every rank
    micro, dtype = ds_config["train_micro_batch_size_per_gpu"], precision_dtype(ds_config)
    for step in range(MAX_STEPS):  # whole optimizer steps (the config's micro-steps each) until the gain moved
        for micro_step in range(engine.gradient_accumulation_steps()):
            x, y = make_batch(micro, seed=100 * step + micro_step, rank=ds_rank, dtype=dtype)
            engine.backward(torch.nn.functional.mse_loss(engine(x).float(), y.float()))
            engine.step()
        if not torch.equal(before, safe_get_full_fp32_param(gain)):
            break
    assert engine.global_steps == step + 1, f"{step + 1} optimizer step(s) expected, {engine.global_steps} taken"
    assert not torch.equal(before, safe_get_full_fp32_param(gain)), f"the leaf gain did not train in {step + 1} steps"
