"""ZeRO-2 with the optimizer offloaded to CPU, no accumulation steps, several ``backward()`` before one ``step()``:
only the last backward's gradient is applied.

Accumulating by hand, as Hugging Face Accelerate does, means ``gradient_accumulation_steps: 1``, the boundary
driven with ``engine.set_gradient_accumulation_boundary()`` and one ``step()`` after several backwards. With
``offload_optimizer`` ZeRO-2 keeps a step's running gradient in a CPU buffer only ``if
gradient_accumulation_steps > 1`` (``copy_grads_in_partition``); otherwise nothing is kept between backwards and
the boundary copies (not adds) the last backward's reduced gradient into the fp32 gradient buffer. Silent: the step
uses a fraction of the gradient. PR #7981 (first in 0.19.0) keeps the buffer whenever a step has more than one
backward. Two backwards isolate this bug: with three, entry ``zero2-offload-accumulation`` also drops the middle one
on 0.15.2-0.18.9 (PR #7981's fix relies on PR #7967's). ZeRO-1 is not affected here: it reduces at the boundary
only, after torch has summed the backwards in ``.grad``.
"""

import pytest
from _prerequisites import ZERO12_CPU_FLAT_BUFFER
from _zero12 import MICRO_BATCH, config, global_batch, offloaded_sgd_premise, sgd_step_error

from pytest_dsrepro.inrank.models import make_batch, tiny_mlp

pytestmark = [
    pytest.mark.ds_repro(
        id="zero2-offload-multi-backward",
        title="ZeRO-2 + CPU optimizer offload, accumulation 1, several backward() per step(): all but the last "
        "backward's gradient lost",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/7981",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/7981",
        fixed_in="0.19.0",
        root_cause="The CPU gradient accumulator is used only when gradient_accumulation_steps > 1, so with 1 the "
        "boundary overwrites the fp32 gradient with the last backward's.",
    ),
    offloaded_sgd_premise(gradient_accumulation=1),
    ZERO12_CPU_FLAT_BUFFER,
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/7981",
        words=(
            "set_gradient_accumulation_boundary",
            "offload_optimizer",
            "copy_grads_in_partition",
            "multiple backward",
        ),
        gpu=True,
    ),
]

BACKWARDS = 2
LR = 0.1
TOLERANCE = 1e-6


def accumulate_across_backwards(monkeypatch):
    """Backport of PR #7981: the CPU accumulator is used when the step had an earlier backward or expects more."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from pytest_dsrepro.inrank.backport import backport, release_has

    if not release_has(DeepSpeedZeroOptimizer.copy_grads_in_partition, "if self.gradient_accumulation_steps > 1:"):
        return  # fixed from 0.19.0
    backport(
        monkeypatch,
        "deepspeed.runtime.zero.stage_1_and_2",
        [(r"(def copy_grads_in_partition\(self, param\):\n\s*if self\.cpu_offload:\n\s*)"
          r"if self\.gradient_accumulation_steps > 1:",
          r"\1if self.micro_step_id > 0 or not self.is_gradient_accumulation_boundary:")],
    )  # fmt: skip


@pytest.mark.ds_config(config(2, offload=True))
@pytest.mark.ds_version(
    affected="<0.19.0",
    raises=AssertionError,
    match=r"offloaded ZeRO applied only the last backward",
    fix=accumulate_across_backwards,
)
def test_offload_keeps_every_backward(ds_engine, ds_rank, ds_world_size):
    import torch

    model = tiny_mlp(seed=13)
    engine = ds_engine(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR))
    lr = engine.get_lr()[0]  # what the one optimizer step uses (a config's scheduler may set it)
    assert lr > 0, f"the config's scheduler gives the first step a learning rate of {lr}: it moves no weight"
    for b in range(BACKWARDS):
        x, y = make_batch(MICRO_BATCH, seed=b, rank=ds_rank)
        engine.set_gradient_accumulation_boundary(b == BACKWARDS - 1)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()

    # Reference: plain autograd sums the backwards' gradients (data parallelism averages each over the ranks).
    reference = tiny_mlp(seed=13)
    for b in range(BACKWARDS):
        x, y = global_batch(ds_world_size, seed=b)
        torch.nn.functional.mse_loss(reference(x), y).backward()
    error, moved = sgd_step_error(engine, reference, lr)
    assert error < TOLERANCE, (
        f"offloaded ZeRO applied only the last backward: max |w_offload - w_reference| = {error:.3e} after one step "
        f"(tolerance {TOLERANCE:.0e}; the step itself moves weights by up to {moved:.3e})"
    )
