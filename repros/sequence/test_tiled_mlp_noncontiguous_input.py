"""``TiledMLP`` (ALST) fails in backward when its input is not contiguous: ``view`` where a copy is needed.

``deepspeed.runtime.sequence_parallel.ulysses_sp.TiledMLP`` runs an MLP over sequence shards to bound activation
memory, and recomputes the shards in backward. Its backward flattens batch and sequence into one axis with
``x.view(-1, hidden)`` and ``grads[0].view(-1, hidden)``. A model that hands the MLP a transposed activation (a
sequence-first layout turned batch-first, as Megatron-style models keep ``[seq, batch, hidden]``) gives it a
non-contiguous ``x``, which ``view`` cannot flatten: the first backward fails with ``RuntimeError: view size is not
compatible with input tensor's size and stride``. PR #8348 flattens with ``reshape`` (first released in 0.19.7; PR
#8362 did the same for ``TiledFusedLogitsLoss``).
"""

import pytest

from pytest_dsrepro.inrank.devices import precision_dtype

pytestmark = [
    pytest.mark.ds_repro(
        id="ulysses-tiled-mlp-noncontiguous-input",
        title="TiledMLP backward on a non-contiguous (transposed) input: RuntimeError, view size is not compatible",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/8348",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/8348",
        fixed_in="0.19.7",
        root_cause="TiledMLP.backward flattened its saved input and the incoming gradient with view(-1, hidden), "
        "which needs a layout a transposed activation does not have.",
    ),
    # One row per micro-batch: x.view(-1, hidden_size) then merges the sequence with a batch axis of size 1, which any
    # layout allows, so no input can meet the bug.
    pytest.mark.ds_premise(
        config={"train_micro_batch_size_per_gpu": ">=2"},
        sets={"zero_force_ds_cpu_optimizer": False},
        because="where the config names no optimizer the body trains with torch's Adam, which DeepSpeed refuses beside "
        "an offloaded optimizer unless told",
    ),
    pytest.mark.ds_not_applicable(
        releases="<0.17.3",
        reason="TiledMLP arrived in 0.17.0 and fails the same way on a transposed input up to 0.17.2, but its "
        "backward there is also wrong for any batch above 1 (fixed by PR #7422 in 0.17.3, which introduced the "
        "flattening this fix changes), so the body's batch would meet that bug first",
    ),
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/8348",
        raises="RuntimeError",
        match=r"view size is not compatible with input tensor's size and stride",
        frames=("ulysses_sp.py:backward",),
        words=("TiledMLP", "view", "reshape", "non-contiguous"),
    ),
]

SEQLEN, HIDDEN, SHARDS = 8, 16, 2
CONFIG = {
    "zero_force_ds_cpu_optimizer": False,  # as the premise sets it for a scanned config
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
}


def flatten_with_reshape(monkeypatch):
    """Backport of PR #8348: ``TiledMLP.backward`` flattens ``x`` and the incoming gradient with ``reshape``."""
    from deepspeed.runtime.sequence_parallel import ulysses_sp

    from pytest_dsrepro.inrank.backport import backport, release_has

    if not release_has(ulysses_sp.TiledMLP.backward, "x = x.view(-1, hidden_size)"):
        return  # this release has the fix
    backport(
        monkeypatch,
        "deepspeed.runtime.sequence_parallel.ulysses_sp",
        [
            (r"x = x\.view\(-1, hidden_size\)", "x = x.reshape(-1, hidden_size)"),
            (
                r"incoming_grad = grads\[0\]\.view\(-1, hidden_size\)",
                "incoming_grad = grads[0].reshape(-1, hidden_size)",
            ),
        ],
    )


def seq_first_tiled_mlp(seed, device, dtype):
    """A block that keeps activations sequence-first and hands its MLP the batch-first transpose, through TiledMLP."""
    import torch
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    class SeqFirstBlock(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(seed)
            self.up = torch.nn.Linear(HIDDEN, 2 * HIDDEN).to(device=device, dtype=dtype)
            self.down = torch.nn.Linear(2 * HIDDEN, HIDDEN).to(device=device, dtype=dtype)

        def mlp(self, x):
            return self.down(torch.nn.functional.gelu(self.up(x)))

        def forward(self, hidden_seq_first, tiled=True):
            x = hidden_seq_first.transpose(0, 1)  # [batch, seq, hidden], not contiguous
            if not tiled:
                return self.mlp(x)
            params = [*self.up.parameters(), *self.down.parameters()]
            return TiledMLP.apply(lambda module, shard: module.mlp(shard), self, x, SHARDS, params)

    return SeqFirstBlock()


@pytest.mark.ds_config(pytest.param(CONFIG, id="zero0"))
@pytest.mark.ds_version(
    affected=">=0.17.3,<0.19.7",
    raises=RuntimeError,
    match=r"view size is not compatible with input tensor's size and stride",
    fix=flatten_with_reshape,
)
def test_tiled_mlp_accepts_transposed_input(ds_engine, ds_config, ds_rank, ds_device):
    import torch

    dtype = precision_dtype(ds_config)
    engine = ds_engine(model=seq_first_tiled_mlp(seed=61, device=ds_device, dtype=dtype), optimizer="adam")
    generator = torch.Generator().manual_seed(62 + ds_rank)
    batch = ds_config["train_micro_batch_size_per_gpu"]
    hidden = torch.randn(SEQLEN, batch, HIDDEN, generator=generator, device="cpu").to(device=ds_device, dtype=dtype)
    hidden.requires_grad_(True)

    # The untiled MLP on a plain copy of the block: the engine's own module would run ZeRO's gradient hooks twice.
    reference = hidden.detach().clone().requires_grad_(True)
    seq_first_tiled_mlp(seed=61, device=ds_device, dtype=dtype)(reference, tiled=False).float().pow(2).mean().backward()

    loss = engine(hidden).float().pow(2).mean()
    scales = []  # what the engine multiplies the loss by: 1 / its accumulation steps, times an fp16 loss scale
    loss.register_hook(scales.append)
    engine.backward(loss)
    engine.step()
    expected = reference.grad * scales[0].to(reference.grad.dtype)
    torch.testing.assert_close(hidden.grad, expected, msg="TiledMLP's input gradient differs from the untiled MLP's")
