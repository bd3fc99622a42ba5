"""``ds_to_universal`` cannot convert a ZeRO-3 checkpoint whose optimizer has several sub-groups
(deepspeedai/DeepSpeed PR #7585, issue #7584).

ZeRO-3 splits its flat fp32 partition and optimizer state into sub-groups of ``sub_group_size`` elements (1e9 by
default: big models have several, small ``sub_group_size`` values too). The ZeRO-3 converter of
``deepspeed.checkpoint.ds_to_universal`` (PR #5475, 0.14.5) read only sub-group 0 of each rank's optimizer file and
walked every parameter through it: past its end, ``narrow`` fails with ``RuntimeError: start (...) + length (...)
exceeds dimension size (...)``, and no universal checkpoint is written. PR #7585 walks each sub-group's own
parameters (first released in 0.18.0).
"""

import pytest
from _prerequisites import TORCH_LOAD_WEIGHTS_ONLY
from _universal import to_universal

from pytest_dsrepro.inrank.devices import precision_dtype
from pytest_dsrepro.inrank.models import make_batch, tiny_mlp

pytestmark = [
    pytest.mark.ds_repro(
        id="zero3-universal-subgroups",
        title="ds_to_universal on a ZeRO-3 checkpoint with several optimizer sub-groups: RuntimeError in narrow "
        "(only sub-group 0 was read)",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/7585",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/7585",
        fixed_in="0.18.0",
        root_cause="extract_zero_shards_stage3 took the fp32 and Adam state of optimizer sub-group 0 only and walked "
        "every parameter's offset through it.",
    ),
    pytest.mark.ds_premise(
        stage=3,
        sets={"zero_optimization.sub_group_size": 100, "zero_force_ds_cpu_optimizer": False},
        because="the repro's small model spans several optimizer sub-groups only with small ones, as a real model "
        "does under the configured size; and where the config names no optimizer the body trains with torch's "
        "Adam, which DeepSpeed refuses beside an offloaded optimizer unless told",
    ),
    TORCH_LOAD_WEIGHTS_ONLY,  # the converter reads the checkpoint
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/blob/v0.17.6/deepspeed/checkpoint/ds_to_universal.py#L152",
        raises="RuntimeError",
        frames=("ds_to_universal.py:extract_zero_shards_stage3",),
        words=("ds_to_universal", "sub_group_size", "extract_zero_shards_stage3"),
    ),
]

#: 16x16 MLP (256 + 16 + 16 + 1 elements): with sub_group_size 100, ZeRO-3 makes several sub-groups.
ZERO3_SUBGROUPS = {
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 100},
    "zero_force_ds_cpu_optimizer": False,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
}


def walk_every_subgroup(monkeypatch):
    """PR #7585's effect on the converter: each rank's parameters are read from the sub-group that holds them. The
    converter hands this function the parameters in partition order, so it moves to the next sub-group's flat
    tensors when the current one is used up (upstream passes the per-sub-group shapes through instead)."""
    import torch
    from deepspeed.checkpoint import ds_to_universal as converter

    from pytest_dsrepro.inrank.backport import release_has

    extract = getattr(converter, "extract_zero_shards_stage3", None)
    if extract is None or not release_has(extract, "['state'][0]"):
        return  # fixed, or before ZeRO-3 universal checkpoints (0.14.4 and older)

    def extract_by_subgroup(optim_files, param_shapes, dp_degree, temp_dir, dp_index):
        optimizer = torch.load(optim_files[dp_index], map_location="cpu", weights_only=False)
        optimizer = optimizer[converter.OPTIMIZER_STATE_DICT]
        groups = [
            {
                "fp32": fp32,
                **{key: optimizer["optimizer_state_dict"]["state"][i][key] for key in ("exp_avg", "exp_avg_sq")},
            }
            for i, fp32 in enumerate(optimizer["fp32_flat_groups"])
        ]
        group, offset = 0, 0
        for name, shape in param_shapes.items():
            partitioned, _ = converter._zero_partitioned_param_info(shape.numel(), dp_degree)
            if offset == groups[group]["fp32"].numel():
                group, offset = group + 1, 0
            unpadded = min(partitioned, abs(shape.numel() - dp_index * partitioned))
            for key, flat in groups[group].items():
                converter.dump_param_fragment(temp_dir, 0, dp_index, key, flat, name, offset, unpadded)
            offset += partitioned

    monkeypatch.setattr(converter, "extract_zero_shards_stage3", extract_by_subgroup)


@pytest.mark.ds_config(pytest.param(ZERO3_SUBGROUPS, id="zero3_sub_groups"))
@pytest.mark.ds_not_applicable(releases="<0.14.5", reason="ds_to_universal converts ZeRO-3 checkpoints from 0.14.5")
@pytest.mark.ds_version(
    affected=">=0.14.5,<0.18.0",
    raises=RuntimeError,
    match=r"exceeds dimension size",
    fix=walk_every_subgroup,
)
def test_ds_to_universal_converts_every_subgroup(ds_engine, ds_config, ds_rank, tmp_path):
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    engine = ds_engine(model=tiny_mlp(seed=13))  # the config's optimizer, torch's Adam where it names none
    assert len(engine.optimizer.fp16_groups) > 1, "the config should give ZeRO-3 several sub-groups"
    x, y = make_batch(
        ds_config["train_micro_batch_size_per_gpu"], seed=14, rank=ds_rank, dtype=precision_dtype(ds_config)
    )
    # Two optimizer steps, each over the config's accumulation steps: the checkpoint then holds Adam's moments.
    for _ in range(2 * engine.gradient_accumulation_steps()):
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    engine.save_checkpoint(str(tmp_path / "checkpoint"), tag="step2")

    torch.distributed.barrier()  # every rank's files are written
    universal = tmp_path / f"universal-{ds_rank}"
    to_universal(tmp_path / "checkpoint" / "step2", universal)

    # Every parameter's fp32 weight and Adam moments in the universal checkpoint are the trained ones.
    for name, param in engine.module.named_parameters():
        expected = {
            "fp32": safe_get_full_fp32_param(param),
            "exp_avg": safe_get_full_optimizer_state(param, "exp_avg"),
            "exp_avg_sq": safe_get_full_optimizer_state(param, "exp_avg_sq"),
        }
        for key, value in expected.items():
            stored = torch.load(universal / "zero" / name / f"{key}.pt", map_location=value.device, weights_only=False)
            stored = stored["param"] if isinstance(stored, dict) else stored
            torch.testing.assert_close(stored.flatten(), value.flatten(), msg=f"{name} {key}")
