"""``zero_to_fp32`` turns every buffer into fp32: integer buffers above 2**24 come back changed.

``deepspeed.utils.zero_to_fp32`` (the ``zero_to_fp32.py`` script saved beside every ZeRO checkpoint, and
``get_fp32_state_dict_from_zero_checkpoint`` / ``load_state_dict_from_zero_checkpoint``) rebuilds a plain state dict
from the ZeRO shards. It restores the model's buffers "to fp32 in case they were saved in fp16" by calling
``.float()`` on every one of them, integer and boolean buffers included: an ``int64`` buffer holding an index or
offset above 2**24 loses its low bits (16777217 becomes 16777216), a ``bool`` mask becomes 0.0/1.0, and a model
reloaded from the consolidated weights computes something else than the trained one, with no warning. The cast is as
old as the script; PR #8515 casts floating-point buffers only (first released in 0.19.8; 0.19.7's new ``dtype``
option for the exporter cast them as well, which the same PR also limits to floating-point tensors).
"""

import pytest
from _prerequisites import TORCH_LOAD_WEIGHTS_ONLY, ZERO12_CPU_FLAT_BUFFER

from pytest_dsrepro.inrank.devices import precision_dtype
from pytest_dsrepro.inrank.models import make_batch

pytestmark = [
    pytest.mark.ds_repro(
        id="checkpoint-zero-to-fp32-integer-buffers",
        title="zero_to_fp32 casts integer and bool buffers to fp32: an int64 buffer above 2**24 comes back changed",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/8515",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/8515",
        fixed_in="0.19.8",
        root_cause="parse_model_states restored the saved buffers with v.float() for every buffer, not only the "
        "floating-point ones.",
    ),
    pytest.mark.ds_premise(
        stage=(1, 2, 3),
        sets={"zero_force_ds_cpu_optimizer": False},
        removes=("zero_optimization.stage3_module_granularity_threshold",),
        because="where the config names no optimizer the body trains with torch's Adam, which DeepSpeed refuses beside "
        "an offloaded optimizer unless told; and a granularity threshold would make its one-module model a ZeRO-3 leaf "
        "module whose input needs no gradient, which DeepSpeed refuses (before 0.18.0) or fails in backward",
    ),
    TORCH_LOAD_WEIGHTS_ONLY,  # the consolidation reads the checkpoint
    ZERO12_CPU_FLAT_BUFFER,
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/8515",
        frames=("zero_to_fp32.py:parse_model_states",),
        words=("zero_to_fp32", "buffer", "int64", "get_fp32_state_dict_from_zero_checkpoint"),
    ),
]

HIDDEN = 16
OFFSET = 2**24 + 1  # the first integer fp32 cannot hold


def zero(stage):
    config = {
        "zero_optimization": {"stage": stage},
        "zero_force_ds_cpu_optimizer": False,  # as the premise sets it for a scanned config
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
    }
    if stage == 3:
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    return config


def keep_non_float_buffers(monkeypatch):
    """Backport of PR #8515's reconstruction fix: only floating-point buffers are restored to fp32."""
    from deepspeed.utils import zero_to_fp32

    from pytest_dsrepro.inrank.backport import backport, release_has

    if not release_has(zero_to_fp32, 'buffers = {k: v.float() for k, v in state_dict["module"].items()'):
        return  # this release has the fix
    backport(
        monkeypatch,
        "deepspeed.utils.zero_to_fp32",
        [
            (
                r"buffers = \{k: v\.float\(\) for k, v in",
                "buffers = {k: (v.float() if v.is_floating_point() else v) for k, v in",
            )
        ],
    )


def offset_model(seed, device, dtype):
    """A regression model that adds a position-like int64 buffer (and a bool mask) to its output."""
    import torch

    class OffsetRegressor(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(seed)
            self.proj = torch.nn.Linear(HIDDEN, 1).to(device=device, dtype=dtype)
            self.register_buffer("offset", torch.tensor([OFFSET], dtype=torch.int64, device=device))
            self.register_buffer("keep", torch.tensor([True], device=device))

        def forward(self, x):
            shift = (self.offset - 2**24).to(x.dtype) * self.keep.to(x.dtype)  # 1.0 with the buffers intact
            return self.proj(x) + shift

    return OffsetRegressor()


@pytest.mark.ds_config(
    pytest.param(zero(2), id="zero2"),
    pytest.param(zero(3), id="zero3_all_partitioned"),
)
@pytest.mark.ds_version(
    affected="<0.19.8",
    raises=AssertionError,
    match=r"buffer .* came back from zero_to_fp32 as",
    fix=keep_non_float_buffers,
)
def test_zero_to_fp32_keeps_integer_buffers(ds_engine, ds_config, ds_rank, ds_device, tmp_path):
    import deepspeed.comm as dist
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    dtype = precision_dtype(ds_config)
    engine = ds_engine(model=offset_model(seed=71, device=ds_device, dtype=dtype), optimizer="adam")
    x, y = make_batch(ds_config["train_micro_batch_size_per_gpu"], seed=72, rank=ds_rank, dtype=dtype)
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()

    folder = str(tmp_path / "checkpoint")  # one directory for every rank
    engine.save_checkpoint(folder, tag="step1")
    dist.barrier()

    state = get_fp32_state_dict_from_zero_checkpoint(folder, tag="step1")
    for name, expected in (("offset", engine.module.offset), ("keep", engine.module.keep)):
        got = state[name]
        said = f"buffer {name!r} ({expected.dtype}, {expected.tolist()}) came back from zero_to_fp32 as {got.dtype}"
        assert got.dtype == expected.dtype, f"{said} {got.tolist()}"
        assert torch.equal(got.to(expected.device), expected), f"{said} {got.tolist()}"
