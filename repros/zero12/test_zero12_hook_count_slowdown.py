"""ZeRO-1/2 recounts the backward graph's parameters in every gradient hook: a backward step costs O(n^2) in the
number of parameter tensors (PR #7780 in 0.18.5; fixed by PR #7886 in 0.18.7; reported in PR #7882 and #7885).

PR #7780 (reentrant checkpointing) moved ``count_used_parameters_in_backward`` (a walk over every parameter's
gradient node) from once per backward into ``grad_handling_hook``, which runs once per parameter tensor: n hooks
times n nodes. Nothing fails; a step is slower, the more so the more parameter tensors a model has (upstream: a
24-layer transformer of 147 tensors on 8 GPUs, 0.1265 s/iter before the fix, 0.0505 s after).

What the repro measures, and against what, in the same run: one training step (forward, backward, ``step()``) of a
ZeRO-2 model of 256 parameter tensors, against 8 steps of one of 32 tensors. Both train the same number of tensors
of the same shape, so per-tensor work is equal; linear code takes about as long for both (less for the one model:
it pays the per-step overhead once instead of 8 times), while a per-hook walk over every tensor costs the big model
8 times what it costs the small ones. ``pytest_dsrepro.slowdown`` times the two on each rank's thread CPU time (what a
busy machine or a wait in a collective takes is not counted), interleaved, keeps the least of 5 each, and the ranks
agree on the slowest rank's; the limit sits between what healthy and affected releases measure here, with margins
said in every verdict (see docs/repros.md for the figures). ZeRO-3 has the same per-hook count (PR #7886 fixes
both); this repro measures ZeRO-2, whose own per-tensor costs are the smallest, so the quadratic part stands out.
"""

import pytest
from _prerequisites import ZERO2_OFFLOAD_ACCUMULATION, ZERO12_CPU_FLAT_BUFFER
from _zero12 import tolerance

from pytest_dsrepro.inrank.devices import engine_dtype, rank_device
from pytest_dsrepro.inrank.perf import Slowdown, slowdown

pytestmark = [
    pytest.mark.ds_repro(
        id="zero12-hook-count-slowdown",
        title="ZeRO-1/2 counts the backward graph's parameters in every gradient hook: a step O(n^2) in tensors",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/7886",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/7886",
        fixed_in="0.18.7",
        root_cause="PR #7780 calls count_used_parameters_in_backward (a walk over every parameter's gradient node) in "
        "each parameter's gradient hook instead of once per backward phase.",
    ),
    pytest.mark.ds_premise(
        stage=(1, 2),
        sets={"gradient_clipping": 0.0, "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False},
        because="the body compares the trained weights with plain data-parallel SGD, which does not clip gradients, "
        "and passes that SGD to DeepSpeed, which ZeRO refuses as untested, and beside an offloaded optimizer, "
        "unless allowed",
    ),
    ZERO12_CPU_FLAT_BUFFER,
    ZERO2_OFFLOAD_ACCUMULATION,
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/7886",
        words=("count_used_parameters_in_backward", "hook count", "performance regression", "s/iter"),
        gpu=True,
    ),
]

#: 256 parameter tensors (weights and biases of 128 layers) in the measured model; the reference trains the same
#: tensors as 8 models of 32.
LAYERS, SPLIT = 128, 8
#: The ratio from which a step is the slowdown: between what affected releases measure (4.7-5.5x of CPU time) and
#: healthy ones (0.55-0.75x), well over 2x from each (docs/repros.md has the figures per release).
LIMIT = 2.0
ZERO2 = {
    "zero_optimization": {"stage": 2},
    "zero_allow_untested_optimizer": True,
    "zero_force_ds_cpu_optimizer": False,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
}


def count_once_per_backward(monkeypatch):
    """Backport of PR #7886 for ZeRO-1/2: count the parameters in the backward graph at the first hook of a backward
    phase only (DeepSpeed's own predicate, inlined), the other hooks reuse the count. A no-op before 0.18.5 (the
    count was once per backward there, or the hooks had no count at all) and from 0.18.7 (fixed)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from pytest_dsrepro.inrank.backport import backport, release_has

    hooks = getattr(DeepSpeedZeroOptimizer, "create_gradient_handling_hooks", None)  # from 0.16.5 on
    if (
        hooks is None
        or not release_has(hooks, "update_hook_state_and_maybe_run_epilogue")
        or release_has(hooks, "refresh_expected")
    ):
        return
    backport(
        monkeypatch,
        "deepspeed.runtime.zero.stage_1_and_2",
        [
            (
                r"(def grad_handling_hook\(\*notneeded\):\n)(\s+)(self\.reenter_backward_if_needed\(\)\n\s+"
                r"self\.process_gradients\(param, i\)\n)\s+(current_expected = count_used_parameters_in_backward\("
                r"all_params_requiring_grad\))",
                r"\1\2state = self._backward_hook_state\n\2refresh_expected = state.hooks_fired_this_backward == 0 or ("
                r"state.remaining_grad_acc_hooks == 0 and state.backward_active_depth == 0 and "
                r"state.backward_seen_this_step)\n\2\3\2if refresh_expected:\n\2    \4\n\2else:\n\2    "
                r"current_expected = self._max_expected_hooks_seen",
            )
        ],
    )


def chain(layers):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(layers)))


def batch(rank, device):
    """This rank's inputs, drawn on the CPU (the same on every device), on ``device``."""
    import torch

    generator = torch.Generator().manual_seed(rank)
    return torch.randn(ZERO2["train_micro_batch_size_per_gpu"], 4, generator=generator, device="cpu").to(device)


@pytest.mark.ds_config(pytest.param(ZERO2, id="zero2"))
@pytest.mark.ds_version(
    affected=">=0.18.5,<0.18.7", raises=Slowdown, match="a training step of 256", fix=count_once_per_backward
)
def test_backward_hooks_take_linear_time(ds_engine, ds_rank, ds_world_size):
    import torch

    device = rank_device()  # ds_device's value (the scripts dsrepro export writes provide no ds_device fixture)

    def engine(layers):
        model = chain(layers)
        return ds_engine(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))

    big, small = engine(LAYERS), engine(LAYERS // SPLIT)
    x, big_lrs = batch(ds_rank, device).to(engine_dtype(big)), []

    def train(model):
        model.backward(model(x).pow(2).mean())
        if model is big and model.is_gradient_accumulation_boundary():
            big_lrs.append(model.get_lr()[0])  # an optimizer step, at the rate a config's scheduler gives it
        model.step()

    measured = slowdown(
        lambda: train(big),
        lambda: [train(small) for _ in range(SPLIT)],
        what=f"a training step of {2 * LAYERS} parameter tensors",
        against=f"{SPLIT} steps of {2 * LAYERS // SPLIT}",
        limit=LIMIT,
    )
    assert measured.ratio < LIMIT
    # The steps trained as data-parallel SGD does (so a count reused across hooks never ran the reduction early or
    # late): the big model's weights are plain SGD's on every rank's batch at once.
    reference = chain(LAYERS).to(device)
    sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
    everyone = torch.cat([batch(r, device) for r in range(ds_world_size)])
    for lr in big_lrs:  # accumulated micro-steps on the same batch average to the same gradient
        sgd.zero_grad()
        reference(everyone).pow(2).mean().backward()
        sgd.param_groups[0]["lr"] = lr
        sgd.step()
    pairs = zip(big.module.parameters(), reference.parameters(), strict=True)
    worst = max((a.float() - b).abs().max().item() for a, b in pairs)
    assert worst < tolerance(big, 1e-5), (
        f"the big model trained differently from plain SGD: max |difference| {worst:.3g}"
    )
