"""ZeRO++ hierarchical partitioning (hpZ) cannot set up a model with a parameter smaller than its secondary shard
(deepspeedai/DeepSpeed#6659).

With ``zero_hpz_partition_size`` ZeRO-3 keeps a second, coarser copy of each parameter, split over the ranks of a
node. A parameter is padded to a multiple of the world size and cut into ``zero_hpz_partition_size`` secondary
shards; a small one (a bias of one element: 4 padded elements, two shards of two) has ranks whose shard starts past
its real end. Their share is then ``sec_numel == 0``, but the code still calls
``narrow(0, secondary_start, 0)`` on the parameter, which torch refuses for a start beyond the tensor:
``IndexError: start out of range``, at ``deepspeed.initialize``, on those ranks. The zero-length case dates from the
fix of issue #5642 (before 0.14.4); PR #8210 skips the copy when there is nothing to copy (first released in 0.19.5).
The world has 4 ranks: hpZ needs a secondary group smaller than the world.
"""

import pytest
from _zero3 import HPZ_PARTITIONED, ZERO3_HPZ

from pytest_dsrepro.inrank.devices import precision_dtype
from pytest_dsrepro.inrank.models import make_batch, tiny_mlp

pytestmark = [
    pytest.mark.ds_repro(
        id="zero3-hpz-small-param-secondary",
        title="ZeRO++ hpZ: a parameter smaller than its secondary shard fails initialize with IndexError in narrow",
        upstream="https://github.com/deepspeedai/DeepSpeed/issues/6659",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/8210",
        fixed_in="0.19.5",
        root_cause="_partition_param_sec copies one_dim_param.narrow(0, secondary_start, sec_numel) also when "
        "sec_numel is 0 because the secondary shard starts past the parameter's end, which torch refuses.",
    ),
    HPZ_PARTITIONED,
    pytest.mark.ds_world(size=4),
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/8210",
        raises="IndexError",
        match=r"start out of range",
        frames=("partition_parameters.py:_partition_param_sec", "_convert_to_zero_parameters"),
        words=("zero_hpz_partition_size",),
        gpu=True,
    ),
]


def skip_empty_secondary_copy(monkeypatch):
    """PR #8210: the secondary shard is zeroed, and the copy from the parameter runs only when the shard covers part
    of it."""
    from pytest_dsrepro.inrank.backport import backport, release_has

    if release_has("deepspeed.runtime.zero.partition_parameters", "if sec_numel > 0:"):
        return  # this release has the fix
    backport(
        monkeypatch,
        "deepspeed.runtime.zero.partition_parameters",
        [
            (
                r"( +)param\.ds_secondary_tensor\.narrow\(0, 0,\s*sec_numel\)\.copy_\("
                r"one_dim_param\.narrow\(0, secondary_start, sec_numel\)\)",
                r"\1param.ds_secondary_tensor.zero_()\n\1if sec_numel > 0:\n"
                r"\1    param.ds_secondary_tensor.narrow(0, 0, sec_numel).copy_("
                r"one_dim_param.narrow(0, secondary_start, sec_numel))",
            )
        ],
    )


@pytest.mark.ds_config(pytest.param(ZERO3_HPZ, id="zero3_hpz2"))
@pytest.mark.ds_version(
    affected="<0.19.5",
    raises=IndexError,
    match="start out of range",
    fix=skip_empty_secondary_copy,
)
def test_hpz_with_a_one_element_bias(ds_engine, ds_config, ds_rank):
    import torch

    model = tiny_mlp(seed=6)  # its output layer's bias has one element
    assert model[2].bias.numel() == 1
    engine = ds_engine(model=model)
    x, y = make_batch(
        ds_config["train_micro_batch_size_per_gpu"], seed=7, rank=ds_rank, dtype=precision_dtype(ds_config)
    )
    for _ in range(2):
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
    assert torch.isfinite(loss)
