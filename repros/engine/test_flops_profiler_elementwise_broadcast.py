"""The flops profiler counts a broadcast elementwise op over a shape the result never has (too many FLOPs).

``FlopsProfiler`` counts ``torch.mul``/``torch.add`` (and their tensor methods) by the size of the broadcast
result, which ``_elementwise_flops_compute`` worked out by pairing the two shapes from their first dimension and
padding the shorter one on the right. Broadcasting aligns shapes from the last dimension, so whenever the operands
differ in rank (the everyday case of scaling or shifting an activation by a per-feature vector) the shape is wrong:
``[2, 3, 16] * [16]`` is counted as ``[16, 3, 16]``, eight times the elements it touches, and the profile's FLOPs
and FLOPS figures are inflated by it. The pairing dates from PR #1591 (2021); PR #8324 takes the shape from
``torch.broadcast_shapes`` (first released in 0.19.7).
"""

import pytest

from pytest_dsrepro.inrank.devices import precision_dtype
from pytest_dsrepro.inrank.models import make_batch

pytestmark = [
    pytest.mark.ds_repro(
        id="flops-profiler-elementwise-broadcast",
        title="Flops profiler: an elementwise op between tensors of different rank is counted over a wrong, larger "
        "broadcast shape",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/8324",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/8324",
        fixed_in="0.19.7",
        root_cause="_elementwise_flops_compute paired the operands' dimensions from the first one instead of the last, "
        "so a lower-rank operand was matched against the wrong dimensions.",
    ),
    pytest.mark.ds_premise(config={"flops_profiler.enabled": True}),
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/8324",
        frames=("profiler.py:_elementwise_flops_compute",),
        words=("flops_profiler", "broadcast", "torch.mul", "get_total_flops"),
    ),
]

HIDDEN, SEQLEN = 16, 3
CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    # The engine's own profile step is left out of reach: every rank profiles in the body.
    "flops_profiler": {"enabled": True, "profile_step": 1000, "detailed": False},
}


def broadcast_from_the_last_dimension(monkeypatch):
    """Backport of PR #8324: the counted shape is ``torch.broadcast_shapes`` of the operands."""
    from deepspeed.profiling.flops_profiler import profiler

    from pytest_dsrepro.inrank.backport import backport, release_has

    if not release_has(profiler._elementwise_flops_compute, "final_shape = []"):
        return  # this release has the fix
    backport(
        monkeypatch,
        "deepspeed.profiling.flops_profiler.profiler",
        [
            (
                r"(def _elementwise_flops_compute\(input, other\):\n(?:.*\n)*?[ \t]+else:\n)"
                r"([ \t]+)dim_input = len\(input\.shape\)\n(?:.*\n)*?[ \t]+return flops, 0\n",
                r"\1\2return _prod(torch.broadcast_shapes(input.shape, other.shape)), 0\n",
            )
        ],
    )


def per_feature_scale(seed, device, dtype):
    """A model whose forward is one broadcast product: activations [batch, seq, hidden] times a [hidden] scale."""
    import torch

    class FeatureScale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            generator = torch.Generator().manual_seed(seed)
            scale = torch.randn(HIDDEN, generator=generator, device="cpu").to(device=device, dtype=dtype)
            self.scale = torch.nn.Parameter(scale)

        def forward(self, x):
            return torch.mul(x, self.scale)

    return FeatureScale()


@pytest.mark.ds_config(pytest.param(CONFIG, id="zero0_flops_profiler"))
@pytest.mark.ds_version(
    affected="<0.19.7",
    raises=AssertionError,
    match=r"counted .* FLOPs for a broadcast product of .* elements",
    fix=broadcast_from_the_last_dimension,
)
def test_broadcast_product_flops(ds_engine, ds_config, ds_rank, ds_device):
    import torch

    dtype = precision_dtype(ds_config)
    engine = ds_engine(model=per_feature_scale(seed=81, device=ds_device, dtype=dtype), optimizer="adam")
    batch = ds_config["train_micro_batch_size_per_gpu"]
    x, _ = make_batch(batch * SEQLEN, HIDDEN, seed=82, rank=ds_rank, dtype=dtype)
    x = x.view(batch, SEQLEN, HIDDEN)

    engine.flops_profiler.start_profile()
    with torch.no_grad():
        out = engine(x)
    flops = engine.flops_profiler.get_total_flops()
    engine.flops_profiler.end_profile()

    engine.backward(engine(x).float().pow(2).mean())  # and training goes on
    engine.step()
    assert flops == out.numel(), (
        f"the profiler counted {flops} FLOPs for a broadcast product of {out.numel()} elements "
        f"({list(x.shape)} * {list(engine.module.scale.shape)})"
    )
