"""The flops profiler crashes the profiled step of a model that calls ``F.interpolate`` with a tuple
``scale_factor``.

While it profiles (the engine's ``flops_profiler`` section, at ``profile_step``; or ``get_model_profile``) the
profiler wraps ``torch.nn.functional.interpolate`` with ``_upsample_flops_compute``, which tests a tuple
``scale_factor`` against ``len(input)`` (the batch size) instead of the number of spatial dimensions. A tuple whose
length is not the batch size falls through to ``scale_factor ** len(input)``: "unsupported operand type(s) for ** or
pow(): 'tuple' and 'int'", raised from the model's forward at the profiled step on the rank that profiles (rank 0;
the others then wait on it). A number ``scale_factor`` is raised to the batch size instead of the spatial rank
(wrong flops, no error). PR #7353 (first in 0.17.2) counts over ``input.ndim - 2`` spatial dimensions.
"""

import pytest

from pytest_dsrepro.inrank.devices import precision_dtype
from pytest_dsrepro.inrank.models import make_batch

pytestmark = [
    pytest.mark.ds_repro(
        id="flops-profiler-interpolate-scale-tuple",
        title="Flops profiler: a model calling F.interpolate with a tuple scale_factor crashes at the profiled step",
        upstream="https://github.com/deepspeedai/DeepSpeed/issues/4504",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/7353",
        fixed_in="0.17.2",
        root_cause="_upsample_flops_compute compares a tuple scale_factor's length with len(input), the batch size, "
        "and otherwise raises the tuple to that power.",
    ),
    pytest.mark.ds_premise(config={"flops_profiler.enabled": True}),
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/7353",
        raises="TypeError",
        match=r"unsupported operand type\(s\) for \*\* or pow\(\): 'tuple' and 'int'",
        frames=("profiler.py:_upsample_flops_compute",),
        words=("flops_profiler", "interpolate"),
    ),
]

#: The micro-batch is not 2: a 2-tuple scale_factor of a batch of 2 takes the profiler's other branch.
CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "flops_profiler": {"enabled": True, "profile_step": 1, "detailed": False},
}


def count_spatial_dimensions(monkeypatch):
    """PR #7353: a scale_factor counts over the input's spatial dimensions (its last ndim - 2)."""
    from deepspeed.profiling.flops_profiler import profiler

    from pytest_dsrepro.inrank.backport import backport, release_has

    if release_has(profiler._upsample_flops_compute, "flops *= scale_factor**(input.ndim - 2)"):
        return
    backport(
        monkeypatch,
        "deepspeed.profiling.flops_profiler.profiler",
        [
            (r"if isinstance\(scale_factor, tuple\) and len\(scale_factor\) == len\(input\):",
             "if isinstance(scale_factor, (list, tuple)):"),
            (r"flops \*= int\(_prod\(scale_factor\)\)", "flops *= int(_prod(scale_factor))"),
            (r"flops \*= scale_factor\*\*len\(input\)\n( +)return flops, 0",
             r"flops *= scale_factor**(input.ndim - 2)\n\1return int(flops), 0"),
        ],
    )  # fmt: skip


def upsampler():
    import torch

    class Upsampler(torch.nn.Module):
        """16 features as a 4x4 image, upsampled 2x2 (as a decoder or a vision model does), to one output."""

        def __init__(self) -> None:
            super().__init__()
            self.inp = torch.nn.Linear(16, 16)
            self.head = torch.nn.Linear(64, 1)

        def forward(self, x):
            image = self.inp(x).view(x.shape[0], 1, 4, 4)
            image = torch.nn.functional.interpolate(image, scale_factor=(2.0, 2.0), mode="nearest")
            return self.head(image.flatten(1))

    torch.manual_seed(3)
    return Upsampler()


@pytest.mark.ds_config(pytest.param(CONFIG, id="profile_step1"))
@pytest.mark.ds_version(
    affected="<0.17.2",
    raises=TypeError,
    match=r"unsupported operand type\(s\) for \*\* or pow\(\): 'tuple' and 'int'",
    fix=count_spatial_dimensions,
)
def test_profiled_step_with_interpolate(ds_engine, ds_config, ds_rank, ds_device):
    import torch

    engine = ds_engine(model=upsampler().to(ds_device))
    profile_step = ds_config["flops_profiler"].get("profile_step", 1)
    for step in range(profile_step + 1):  # through the profiled step
        x, y = make_batch(
            ds_config["train_micro_batch_size_per_gpu"], seed=step, rank=ds_rank, dtype=precision_dtype(ds_config)
        )
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
    assert torch.isfinite(loss).item()
