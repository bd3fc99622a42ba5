"""ZeRO++ hierarchical partitioning (hpZ): weights loaded through ``GatheredParameters`` are not what the model
computes with (deepspeedai/DeepSpeed#7606).

With ``zero_hpz_partition_size`` every ZeRO-3 parameter keeps a secondary shard (split over a node's ranks) beside
its primary one, and the all-gathers of forward and backward read the secondary shard whenever it exists. Loading
weights into a model built under ``zero.Init``, as transformers' ``from_pretrained`` does (``GatheredParameters(...,
modifier_rank=0)``, rank 0 loads, the exit broadcasts and re-partitions with ``has_been_updated=True``), refreshed
the primary shards only: ``_partition_param`` got the flag, ``_partition_param_sec`` did not, and returns early for a
parameter that already has a secondary shard. The first forward then gathers the random initial weights instead of
the loaded ones, silently (issue #7606: a loss spike in the first steps, until ``step()`` invalidates the secondary
shards). PR #7707 passes the flag on (and invalidates the shards after a ZeRO checkpoint load, a path this repro does
not take); first released in 0.18.3. The world has 4 ranks: hpZ needs a secondary group smaller than the world.
"""

import pytest
from _prerequisites import PERSISTENT_ALLGATHER_RACE
from _zero3 import HPZ_PARTITIONED, ZERO3_HPZ

from pytest_dsrepro.inrank.devices import precision_dtype
from pytest_dsrepro.inrank.models import make_batch

pytestmark = [
    pytest.mark.ds_repro(
        id="zero3-hpz-stale-secondary-after-load",
        title="ZeRO++ hpZ: weights loaded with GatheredParameters after zero.Init are ignored by the next forward "
        "(stale secondary shards)",
        upstream="https://github.com/deepspeedai/DeepSpeed/issues/7606",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/7707",
        fixed_in="0.18.3",
        root_cause="Init._partition calls _partition_param_sec without has_been_updated, so a parameter modified "
        "under GatheredParameters keeps its old secondary (hpZ) shard, which the next all-gather reads.",
    ),
    HPZ_PARTITIONED,
    pytest.mark.ds_world(size=4),
    PERSISTENT_ALLGATHER_RACE,  # its GatheredParameters gathers several parameters at once
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/issues/7606",
        words=("zero_hpz_partition_size", "loss of the first step"),
        frames=("partition_parameters.py:_partition_param_sec",),
        gpu=True,
    ),
]


def refresh_secondary_shards(monkeypatch):
    """PR #7707 (the loading half): re-partitioning a parameter that was modified refreshes its secondary shard
    too."""
    from pytest_dsrepro.inrank.backport import backport, release_has

    module = "deepspeed.runtime.zero.partition_parameters"
    if release_has(module, "self._partition_param_sec(param, has_been_updated=has_been_updated)"):
        return  # this release has the fix
    backport(
        monkeypatch,
        module,
        [
            (
                r"self\._partition_param_sec\(param\)",
                "self._partition_param_sec(param, has_been_updated=has_been_updated)",
            )
        ],
    )


@pytest.mark.ds_config(pytest.param(ZERO3_HPZ, id="zero3_hpz2"))
@pytest.mark.ds_version(
    affected="<0.18.3",
    raises=AssertionError,
    match="the forward ran with the weights from before the load",
    fix=refresh_secondary_shards,
)
def test_forward_after_loading_weights(ds_engine, ds_config, ds_rank, ds_device):
    import deepspeed
    import torch

    def mlp(seed):  # no one-element parameter: hpZ could not set one up before 0.19.5 (zero3-hpz-small-param-secondary)
        torch.manual_seed(seed)
        layers = torch.nn.Linear(16, 16, device=ds_device), torch.nn.ReLU(), torch.nn.Linear(16, 4, device=ds_device)
        return torch.nn.Sequential(*layers)

    dtype = precision_dtype(ds_config)
    pretrained = mlp(seed=31)  # the checkpoint's weights
    with deepspeed.zero.Init(config_dict_or_path=ds_config):  # from_pretrained: built partitioned, random weights
        model = mlp(seed=32)
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        if ds_rank == 0:  # then the checkpoint is loaded on rank 0 and broadcast
            model.load_state_dict(pretrained.state_dict())
    engine = ds_engine(model=model)

    x, _ = make_batch(ds_config["train_micro_batch_size_per_gpu"], seed=33, rank=ds_rank, dtype=dtype)
    with torch.no_grad():
        out = engine(x)
        expected = pretrained.to(dtype)(x)
    assert torch.allclose(out, expected), "the forward ran with the weights from before the load"
