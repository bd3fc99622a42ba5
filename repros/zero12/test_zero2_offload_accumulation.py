"""ZeRO-2 with the optimizer offloaded to CPU and more than two accumulation steps: micro-batch gradients vanish.

With ``offload_optimizer``, ZeRO-2 keeps the running sum of a step's gradients in a CPU buffer
(``async_accumulate_grad_in_cpu_via_gpu``): each micro-step adds the buffer to its own gradient, and the sum should
go back to the buffer. Since PR #6550 (0.15.2) the sum goes back only on micro-step 0 (``else:
copy_gradients_to_cpu()``), so the buffer keeps micro-batch 0's gradient alone and every micro-batch between the
first and the last is dropped: with 2 accumulation steps nothing is lost, with 3 the middle one is. The loss of
training signal is silent (a smaller gradient norm, different weights). PR #7967 (first in 0.19.0) copies the sum
back on every micro-step. ZeRO-1 with the same config is not affected: it reduces gradients at the boundary
only, after torch has summed them in ``.grad``, so its CPU buffer is never used.
"""

import pytest
from _prerequisites import OFFLOAD_ACCUMULATION_RELEASES, ZERO12_CPU_FLAT_BUFFER, keep_the_running_sum
from _zero12 import config, global_batch, offloaded_sgd_premise, sgd_step_error, train

from pytest_dsrepro.inrank.models import tiny_mlp

pytestmark = [
    pytest.mark.ds_repro(
        id="zero2-offload-accumulation",
        title="ZeRO-2 + CPU optimizer offload + gradient accumulation > 2: middle micro-batches' gradients dropped",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/6550#issuecomment-2419308783",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/7967",
        fixed_in="0.19.0",
        root_cause="The CPU accumulation buffer is written back only on micro-step 0 (PR #6550), so later "
        "micro-steps add to micro-batch 0's gradient alone and the running sum is lost.",
    ),
    offloaded_sgd_premise(gradient_accumulation=">=3"),
    ZERO12_CPU_FLAT_BUFFER,
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/7967",
        words=(
            "micro_step_id",
            "offload_optimizer",
            "gradient accumulation",
            "async_accumulate_grad_in_cpu_via_gpu",
            "copy_gradients_to_cpu",
        ),
    ),
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/6550#issuecomment-2419308783",
        words=("Z2+offload", "zero2 offload"),
    ),
]

ACCUMULATION = 3
LR = 0.1
TOLERANCE = 1e-6


@pytest.mark.ds_config(config(2, offload=True, accumulation=ACCUMULATION))
@pytest.mark.ds_version(
    affected=OFFLOAD_ACCUMULATION_RELEASES,
    raises=AssertionError,
    match=r"offloaded ZeRO dropped micro-batch gradients",
    fix=keep_the_running_sum,
)
def test_offload_accumulates_every_micro_batch(ds_engine, ds_config, ds_rank, ds_world_size):
    import torch

    accumulation = ds_config["gradient_accumulation_steps"]  # the config's (a scan's: the user's, 3 or more)
    model = tiny_mlp(seed=9)
    engine = ds_engine(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR))
    # One optimizer step over the config's micro-batches (step() after each: DeepSpeed counts micro-steps there), at
    # the learning rate the config's scheduler, if any, gives it.
    (lr,) = train(engine, ds_rank, steps=1)
    assert lr > 0, f"the config's scheduler gives the first step a learning rate of {lr}: it moves no weight"

    # Reference: one plain SGD step on the mean gradient over every micro-batch of every rank.
    reference = tiny_mlp(seed=9)
    for m in range(accumulation):
        x, y = global_batch(ds_world_size, seed=m)
        (torch.nn.functional.mse_loss(reference(x), y) / accumulation).backward()
    error, moved = sgd_step_error(engine, reference, lr)
    assert error < TOLERANCE, (
        f"offloaded ZeRO dropped micro-batch gradients: max |w_offload - w_reference| = {error:.3e} after one step "
        f"(tolerance {TOLERANCE:.0e}; the step itself moves weights by up to {moved:.3e})"
    )
