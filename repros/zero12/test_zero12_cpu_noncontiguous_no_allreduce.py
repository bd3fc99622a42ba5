"""ZeRO-1/2 with ``contiguous_gradients: false`` on the CPU accelerator never all-reduces the gradients.

Without contiguous gradients, ZeRO-1/2 reduces a gradient bucket with ``buffered_reduce_fallback``, which first
splits the gradients by type with ``split_half_float_double``. That function names the types it keeps as legacy type
strings built from the accelerator's device name (``torch.cpu.FloatTensor`` on the CPU accelerator, since the
accelerator abstraction, PR #2677), but a CPU tensor's ``type()`` is ``torch.FloatTensor``: nothing matches, every
bucket is dropped, and no all-reduce happens. Each rank then steps on its own gradient, and the replicas drift
apart without a message (on CUDA, ``torch.cuda.FloatTensor`` matches). PR #8382 compares dtypes instead (first
released in 0.19.8).
"""

import pytest
from _prerequisites import ZERO12_CPU_FLAT_BUFFER
from _zero12 import MICRO_BATCH, max_difference, train, train_reference

from pytest_dsrepro.inrank.models import tiny_mlp

pytestmark = [
    pytest.mark.ds_repro(
        id="zero12-cpu-noncontiguous-no-allreduce",
        title="ZeRO-1/2 with contiguous_gradients false on the CPU accelerator: gradients never all-reduced, each "
        "rank steps on its own (silent)",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/8382",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/8382",
        fixed_in="0.19.8",
        root_cause="split_half_float_double keeps tensors whose type() is 'torch.<device>.FloatTensor' (and half, "
        "double, bf16); a CPU tensor's type() has no device part, so every bucket is dropped before the all-reduce.",
    ),
    pytest.mark.ds_premise(
        stage=(1, 2),
        accelerator="cpu",
        offload_optimizer="none",
        config={"zero_optimization.contiguous_gradients": False},
        sets={"gradient_clipping": 0.0},
        because="the body compares the weights with plain torch training, which does not clip gradients",
    ),
    ZERO12_CPU_FLAT_BUFFER,
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/blob/v0.19.2/deepspeed/runtime/zero/stage_1_and_2.py#L62",
        words=("contiguous_gradients", "split_half_float_double", "buffered_reduce_fallback", "torch.cpu.FloatTensor"),
    ),
]

LR = 1e-2
STEPS = 2
TOLERANCE = 1e-6


def noncontiguous(stage, reduce_scatter=False):
    """ZeRO-``stage`` without contiguous gradients (and, as PR #8382's report, without reduce-scatter: its value
    does not matter, as the ``reduce_scatter`` id shows)."""
    return pytest.param(
        {
            "zero_optimization": {"stage": stage, "contiguous_gradients": False, "reduce_scatter": reduce_scatter},
            "train_micro_batch_size_per_gpu": MICRO_BATCH,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,
        },
        id=f"zero{stage}_noncontiguous" + ("_reduce_scatter" if reduce_scatter else ""),
    )


def split_by_dtype(monkeypatch):
    """Backport of PR #8382: ``split_half_float_double`` buckets gradients by dtype, whatever their device."""
    import torch
    from deepspeed.runtime.zero import stage_1_and_2

    from pytest_dsrepro.inrank.backport import release_has

    if not release_has(stage_1_and_2.split_half_float_double, "device_name()"):
        return  # this release has the fix

    def split_half_float_double(tensors):
        dtypes = (torch.half, torch.float, torch.double, torch.bfloat16)
        buckets = ([t for t in tensors if t.dtype == dtype and t.layout == torch.strided] for dtype in dtypes)
        return [bucket for bucket in buckets if bucket]

    monkeypatch.setattr(stage_1_and_2, "split_half_float_double", split_half_float_double)


@pytest.mark.ds_config(noncontiguous(1), noncontiguous(2), noncontiguous(2, reduce_scatter=True))
@pytest.mark.ds_version(
    affected="<0.19.8",
    raises=AssertionError,
    match=r"ZeRO-1/2 stepped without averaging the ranks' gradients",
    fix=split_by_dtype,
)
def test_noncontiguous_gradients_are_averaged(ds_engine, ds_config, ds_rank, ds_world_size):
    import torch

    model = tiny_mlp(seed=6)
    engine = ds_engine(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=LR))
    moms: list = []
    lrs = train(engine, ds_rank, STEPS, moms=moms)

    # Reference: the same Adam steps on every rank's batch at once (what averaging the ranks' gradients amounts to).
    reference = tiny_mlp(seed=6)
    adam = torch.optim.Adam(reference.parameters(), lr=LR)
    train_reference(
        reference, adam, ds_world_size, STEPS, lrs=lrs, accumulation=ds_config["gradient_accumulation_steps"], moms=moms
    )
    error = max_difference(engine.module, reference)
    assert error < TOLERANCE, (
        f"ZeRO-1/2 stepped without averaging the ranks' gradients: max |w - w_reference| = {error:.3e} after "
        f"{STEPS} steps (tolerance {TOLERANCE:.0e})"
    )
