"""``TiledFusedLogitsLoss`` (ALST) fails on a transposed hidden-state input: ``view`` where a copy is needed.

``deepspeed.runtime.sequence_parallel.ulysses_sp.TiledFusedLogitsLoss`` computes the logits and the loss shard by
shard, so the full logits tensor never exists, running each shard's backward inside its forward. Its forward flattens
batch and sequence with ``x.view(-1, *x.shape[2:])``; a model that keeps its hidden states sequence-first and hands
the loss their batch-first transpose gives a non-contiguous ``x``, and the loss fails at once with ``RuntimeError:
view size is not compatible with input tensor's size and stride``. It came with the class (PR #7437, 0.17.4); PR
#8362 flattens with ``reshape`` (first released in 0.19.7), following PR #8348's change to ``TiledMLP``.
"""

import pytest

from pytest_dsrepro.inrank.devices import precision_dtype

pytestmark = [
    pytest.mark.ds_repro(
        id="ulysses-tiled-logits-loss-noncontiguous-input",
        title="TiledFusedLogitsLoss on a non-contiguous (transposed) hidden state: RuntimeError, view size is not "
        "compatible",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/8362",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/8362",
        fixed_in="0.19.7",
        root_cause="TiledFusedLogitsLoss.forward flattened x, y and mask with view(-1, ...), which needs a layout a "
        "transposed activation does not have.",
    ),
    # One row per micro-batch: x.view(-1, *x.shape[2:]) then merges the sequence with a batch axis of size 1, which any
    # layout allows, so no input can meet the bug.
    pytest.mark.ds_premise(
        config={"train_micro_batch_size_per_gpu": ">=2"},
        sets={"zero_force_ds_cpu_optimizer": False},
        because="where the config names no optimizer the body trains with torch's Adam, which DeepSpeed refuses beside "
        "an offloaded optimizer unless told",
    ),
    pytest.mark.ds_not_applicable(releases="<0.17.4", reason="TiledFusedLogitsLoss arrived in 0.17.4 (PR #7437)"),
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/8362",
        raises="RuntimeError",
        match=r"view size is not compatible with input tensor's size and stride",
        frames=("ulysses_sp.py:forward",),
        words=("TiledFusedLogitsLoss", "view", "reshape", "transposed"),
    ),
]

SEQLEN, HIDDEN, VOCAB, SHARDS = 8, 16, 32, 2
CONFIG = {
    "zero_force_ds_cpu_optimizer": False,  # as the premise sets it for a scanned config
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
}


def flatten_with_reshape(monkeypatch):
    """Backport of PR #8362: ``TiledFusedLogitsLoss.forward`` flattens ``x``, ``y`` and ``mask`` with ``reshape``."""
    from deepspeed.runtime.sequence_parallel import ulysses_sp

    from pytest_dsrepro.inrank.backport import backport, release_has

    if not release_has(ulysses_sp.TiledFusedLogitsLoss.forward, "x = x.view(-1, *x.shape[2:])"):
        return  # this release has the fix
    backport(
        monkeypatch,
        "deepspeed.runtime.sequence_parallel.ulysses_sp",
        [
            (r"x = x\.view\(-1, \*x\.shape\[2:\]\)", "x = x.reshape(-1, *x.shape[2:])"),
            (r"y = y\.view\(-1, \*y\.shape\[2:\]\)", "y = y.reshape(-1, *y.shape[2:])"),
            (r"mask = mask\.view\(-1\)", "mask = mask.reshape(-1)"),
        ],
    )


def seq_first_lm_head(seed, device, dtype):
    """A sequence-first block whose LM head and loss run through TiledFusedLogitsLoss on the batch-first transpose."""
    import torch
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    class SeqFirstHead(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(seed)
            self.body = torch.nn.Linear(HIDDEN, HIDDEN).to(device=device, dtype=dtype)
            self.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False).to(device=device, dtype=dtype)

        def loss(self, x, y):
            logits = self.lm_head(x).float()
            return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))

        def forward(self, hidden_seq_first, labels, tiled=True):
            x = self.body(hidden_seq_first).transpose(0, 1)  # [batch, seq, hidden], not contiguous
            if not tiled:
                return self.loss(x, labels)
            params = [self.lm_head.weight]
            return TiledFusedLogitsLoss.apply(
                lambda module, xs, ys: module.loss(xs, ys), self, x, labels, None, SHARDS, params, "mean"
            )

    return SeqFirstHead()


@pytest.mark.ds_config(pytest.param(CONFIG, id="zero0"))
@pytest.mark.ds_version(
    affected=">=0.17.4,<0.19.7",
    raises=RuntimeError,
    match=r"view size is not compatible with input tensor's size and stride",
    fix=flatten_with_reshape,
)
def test_tiled_logits_loss_accepts_transposed_input(ds_engine, ds_config, ds_rank, ds_device):
    import torch

    dtype = precision_dtype(ds_config)
    engine = ds_engine(model=seq_first_lm_head(seed=91, device=ds_device, dtype=dtype), optimizer="adam")
    generator = torch.Generator().manual_seed(92 + ds_rank)
    batch = ds_config["train_micro_batch_size_per_gpu"]
    hidden = torch.randn(SEQLEN, batch, HIDDEN, generator=generator, device="cpu").to(device=ds_device, dtype=dtype)
    labels = torch.randint(0, VOCAB, (batch, SEQLEN), generator=generator, device="cpu").to(ds_device)

    with torch.no_grad():
        expected = engine.module(hidden, labels, tiled=False)
    loss = engine(hidden, labels)
    engine.backward(loss)
    engine.step()
    torch.testing.assert_close(loss.detach(), expected, msg="the tiled loss differs from the untiled one")
