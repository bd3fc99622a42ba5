"""ZeRO-2 with DeepSpeed's ``TiledMLP``: the MLP's gradients are reduced from the wrong part of the bucket
(deepspeedai/DeepSpeed PR #7829).

``TiledMLP`` (ALST, ``deepspeed.runtime.sequence_parallel.ulysses_sp``, 0.17.0) runs an MLP's backward over the
sequence in shards; before the last shard it marks the MLP's parameters ``ds_grad_is_ready = False``, so that ZeRO
does not take their partial gradients. ZeRO-2's gradient hook honoured the mark only half: with
``contiguous_gradients`` (the default) it still copied each partial gradient into the reduction bucket, pointed the
parameter's ``.grad`` there and advanced the bucket's fill, and only then skipped listing the parameter. The bucket's
reduce-scatter (``reduce_scatter``, the default) walks the listed parameters as if they lay back to back from its
start, so every gradient listed after such a gap is reduced from the wrong elements, and the gradients the optimizer
then reads are some ranks' own (only divided by the world size) instead of the average: the model trains on wrong
gradients, silently. PR #7829 (first released in 0.18.6) returns before the copy. The body trains one SGD step of a
model whose MLP is tiled and compares every weight with plain data-parallel SGD of the same model untiled.
"""

import pytest
from _prerequisites import ZERO12_CPU_FLAT_BUFFER
from _zero12 import PLAIN_SGD_SETS

from pytest_dsrepro.inrank.devices import precision_dtype

pytestmark = [
    pytest.mark.ds_repro(
        id="zero2-tiled-mlp-transient-grads",
        title="ZeRO-2 + TiledMLP: partial gradients of the tiled shards fill the bucket, the MLP trains on wrong "
        "gradients",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/7829",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/7829",
        fixed_in="0.18.6",
        root_cause="reduce_independent_p_g_buckets_and_remove_grads checked ds_grad_is_ready only after copying the "
        "partial gradient into the contiguous bucket and counting its elements, so the bucket's reduction offsets "
        "no longer matched where the listed gradients lay.",
    ),
    pytest.mark.ds_premise(
        stage=2,
        # Without reduce_scatter the whole bucket is all-reduced, gaps included: space is wasted, nothing is wrong.
        config={"zero_optimization.contiguous_gradients": True, "zero_optimization.reduce_scatter": True},
        sets=PLAIN_SGD_SETS,
        removes=("scheduler",),
        because="the body trains with torch's SGD and compares one step with plain, unclipped fp32 SGD at the same "
        "rate (the bug mixes up gradients whatever the precision, the optimizer and the rate)",
    ),
    ZERO12_CPU_FLAT_BUFFER,
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/7829",
        frames=("stage_1_and_2.py:reduce_independent_p_g_buckets_and_remove_grads",),
        words=("ds_grad_is_ready", "TiledMLP"),
    ),
]

HIDDEN = 8
SEQUENCE = 8
SHARDS = 4
LR = 0.1

ZERO2 = {
    "zero_optimization": {"stage": 2, "contiguous_gradients": True, "reduce_scatter": True},
    "zero_force_ds_cpu_optimizer": False,
    "zero_allow_untested_optimizer": True,
    "bf16": {"enabled": False},
    "fp16": {"enabled": False},
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
}


def tiled_model(tiled, seed=0, device=None):
    """An input projection, an MLP (through ``TiledMLP`` over ``SHARDS`` sequence shards when ``tiled``) and a head,
    the same weights on every rank."""
    import torch

    class TiledModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(HIDDEN, HIDDEN)
            self.up = torch.nn.Linear(HIDDEN, 2 * HIDDEN)
            self.down = torch.nn.Linear(2 * HIDDEN, HIDDEN)
            self.head = torch.nn.Linear(HIDDEN, 1)

        def mlp(self, x):
            return self.down(torch.relu(self.up(x)))

        def forward(self, x):
            from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

            hidden = torch.tanh(self.inp(x))
            if tiled:
                params = [*self.up.parameters(), *self.down.parameters()]
                hidden = TiledMLP.apply(lambda module, shard: module.mlp(shard), self, hidden, SHARDS, params)
            else:
                hidden = self.mlp(hidden)
            return self.head(hidden)

    torch.manual_seed(seed)
    return TiledModel().to(device)


def batch(micro, rank, device, dtype):
    """Rank ``rank``'s tokens (``micro`` sequences of ``SEQUENCE``) and their targets, drawn on the CPU, as one packed
    sequence: ``TiledMLP`` of 0.17.0 mis-sliced batches of several sequences (mended by 0.17.5), another bug."""
    import torch

    generator = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(1, micro * SEQUENCE, HIDDEN, generator=generator, device="cpu")
    y = torch.randn(1, micro * SEQUENCE, 1, generator=generator, device="cpu")
    return x.to(device=device, dtype=dtype), y.to(device=device, dtype=dtype)


def skip_partial_gradients(monkeypatch):
    """Backport of PR #7829: a gradient not marked ready returns before it is copied into the bucket (past that
    return every gradient is ready, so the release's own later test of the mark, which upstream removes, holds)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from pytest_dsrepro.inrank.backport import backport, release_has

    hook = DeepSpeedZeroOptimizer.reduce_independent_p_g_buckets_and_remove_grads
    if not release_has(hook, 'if getattr(param, "ds_grad_is_ready", True):'):
        return  # fixed (0.18.6), or before TiledMLP (0.16.x)
    backport(
        monkeypatch,
        "deepspeed.runtime.zero.stage_1_and_2",
        [
            (
                r"(\n([ \t]+)param_id = self\.get_param_id\(param\)\n\s+assert self\.params_already_reduced)",
                r'\n\2if not getattr(param, "ds_grad_is_ready", True):\n\2    return\n\1',
            ),
        ],
    )


@pytest.mark.ds_config(pytest.param(ZERO2, id="zero2_contiguous"))
@pytest.mark.ds_not_applicable(releases="<0.17.0", reason="TiledMLP and ds_grad_is_ready arrived in 0.17.0")
@pytest.mark.ds_version(
    affected=">=0.17.0,<0.18.6",
    raises=AssertionError,
    match="ZeRO-2 trained the tiled MLP on wrong gradients",
    fix=skip_partial_gradients,
)
def test_zero2_tiled_mlp_matches_plain_sgd(ds_engine, ds_config, ds_rank, ds_world_size, ds_device):
    import torch

    micro = ds_config["train_micro_batch_size_per_gpu"]
    dtype = precision_dtype(ds_config)
    model = tiled_model(tiled=True, seed=3, device=ds_device)
    engine = ds_engine(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR))
    x, y = batch(micro, ds_rank, ds_device, dtype)
    # One optimizer step over the config's accumulation steps, the same tokens each time (the mean gradient is theirs).
    for _ in range(engine.gradient_accumulation_steps()):
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        lr = engine.get_lr()[0]
        engine.step()

    # Plain data parallelism: the mean loss over every rank's sequences, untiled, one SGD step at the engine's rate.
    reference = tiled_model(tiled=False, seed=3, device=ds_device).to(dtype)
    losses = []
    for rank in range(ds_world_size):
        rx, ry = batch(micro, rank, ds_device, dtype)
        losses.append(torch.nn.functional.mse_loss(reference(rx), ry))
    torch.stack(losses).mean().backward()
    wrong = {}
    with torch.no_grad():
        for (name, param), expected in zip(engine.module.named_parameters(), reference.parameters(), strict=True):
            expected -= lr * expected.grad
            error = (param.detach().float() - expected.float()).abs().max().item()
            if error > 1e-5:
                wrong[name] = error
    assert not wrong, f"ZeRO-2 trained the tiled MLP on wrong gradients: {wrong}"
