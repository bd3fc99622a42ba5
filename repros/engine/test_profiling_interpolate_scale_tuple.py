"""The flops profiler on a model that upsamples with ``F.interpolate(scale_factor=(...))``: the profiled step dies.

With ``flops_profiler`` enabled the engine patches ``torch.nn.functional.interpolate`` at ``profile_step`` to count
its flops. The counter compared the length of a tuple ``scale_factor`` with ``len(input)`` (the batch size) instead
of the number of spatial dimensions, and when they differ it computed ``scale_factor ** len(input)``: a tuple to a
power, so the profiled forward of a 1-D upsampling (an audio or sequence model; or a 2-D one whose batch is not 2)
raises ``unsupported operand type(s) for ** or pow(): 'tuple' and 'int'`` in rank 0, where the profiler runs, and
training stops at the profile step (issue #4504). A scalar factor was raised to the batch size, giving wrong flops.
PR #7353 (first released in 0.17.2) counts over the spatial dimensions.
"""

import pytest

from pytest_dsrepro.inrank.devices import precision_dtype
from pytest_dsrepro.inrank.models import make_batch

pytestmark = [
    pytest.mark.ds_repro(
        id="profiling-interpolate-scale-tuple",
        title="Flops profiler + F.interpolate with a tuple scale_factor: the profiled forward raises TypeError",
        upstream="https://github.com/deepspeedai/DeepSpeed/issues/4504",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/7353",
        fixed_in="0.17.2",
        root_cause="The profiler's interpolate counter took len(input), the batch size, for the number of spatial "
        "dimensions, and raised the tuple scale_factor to that power when the two differed.",
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
        words=("F.interpolate", "scale_factor", "flops profiler"),
    ),
]

CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "flops_profiler": {"enabled": True, "profile_step": 1, "module_depth": -1, "top_modules": 1, "detailed": False},
}


def count_over_spatial_dims(monkeypatch):
    """Backport of PR #7353: the interpolate counter scales by the factors of the ``input.ndim - 2`` spatial dims."""
    from deepspeed.profiling.flops_profiler import profiler

    from pytest_dsrepro.inrank.backport import release_has

    if not release_has(profiler._upsample_flops_compute, "len(scale_factor) == len(input)"):
        return  # this release has the fix
    upsample = profiler._upsample_flops_compute

    def _upsample_flops_compute(*args, **kwargs):
        input, size = args[0], kwargs.get("size", args[1] if len(args) > 1 else None)
        scale_factor = kwargs.get("scale_factor", args[2] if len(args) > 2 else None)
        if size is not None or scale_factor is None:
            return upsample(*args, **kwargs)
        flops = input.numel()
        if isinstance(scale_factor, (list, tuple)):
            flops *= profiler._prod(scale_factor)
        else:
            flops *= scale_factor ** (input.ndim - 2)
        return int(flops), 0

    monkeypatch.setattr(profiler, "_upsample_flops_compute", _upsample_flops_compute)


@pytest.mark.ds_config(pytest.param(CONFIG, id="flops_profiler_step1"))
@pytest.mark.ds_version(
    affected="<0.17.2",
    raises=TypeError,
    match=r"unsupported operand type\(s\) for \*\* or pow\(\): 'tuple' and 'int'",
    fix=count_over_spatial_dims,
)
def test_profiled_step_with_upsampling(ds_engine, ds_config, ds_rank, ds_device):
    import torch

    class Upsampler(torch.nn.Module):
        """A 1-D upsampling (a sequence of 16 values to 32) under a linear head."""

        def __init__(self):
            super().__init__()
            torch.manual_seed(2)
            self.head = torch.nn.Linear(32, 1)

        def forward(self, x):
            up = torch.nn.functional.interpolate(x.unsqueeze(1), scale_factor=(2.0,), mode="linear")
            return self.head(up.squeeze(1))

    dtype = precision_dtype(ds_config)
    engine = ds_engine(model=Upsampler().to(device=ds_device, dtype=dtype))
    profiled = engine.flops_profiler_profile_step()  # the config's, or DeepSpeed's default where it leaves it out
    # Through the profiled step, each step the config's micro-steps (a config may derive 30 from its batch sizes).
    for micro_step in range((profiled + 1) * engine.gradient_accumulation_steps()):
        x, y = make_batch(ds_config["train_micro_batch_size_per_gpu"], seed=micro_step, rank=ds_rank, dtype=dtype)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    assert engine.global_steps > profiled, f"the body stopped at step {engine.global_steps}, before the profiled one"
