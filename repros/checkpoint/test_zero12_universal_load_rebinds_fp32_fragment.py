"""ZeRO-1/2 resumed from a universal checkpoint: each parameter's fp32 fragment points at an Adam moment.

ZeRO-1/2 links every model parameter to its slice of the optimizer's flat fp32 master partition
(``param._hp_mapping.hp_fragment``): ``deepspeed.utils.safe_get_full_fp32_param``/``safe_set_full_fp32_param``
read and write the master weights through it, and optimizer states have their own slices (``optim_fragment``). When
a universal checkpoint is loaded (``"checkpoint": {"load_universal": true}``), ``map_to_flat_opt_states`` rebuilds
each optimizer state as a flat buffer and, since PR #5263 (0.14.1), re-pointed the parameter's ``hp_fragment``, the
master-weight slice, at its piece of that buffer instead of the state's own ``optim_fragment``. After the resume, the
fp32 weights the API hands out are one of Adam's moments (``exp_avg`` or ``exp_avg_sq``), and a write through
``safe_set_full_fp32_param`` lands in that moment rather than in the weights. PR #8474 rebinds ``optim_fragment[key]``
(first released in 0.19.7).
"""

import pytest
from _prerequisites import TORCH_LOAD_WEIGHTS_ONLY, ZERO12_CPU_FLAT_BUFFER

from pytest_dsrepro.inrank.devices import precision_dtype
from pytest_dsrepro.inrank.models import make_batch, tiny_mlp

pytestmark = [
    pytest.mark.ds_repro(
        id="zero12-universal-load-rebinds-fp32-fragment",
        title="ZeRO-1/2 after loading a universal checkpoint: safe_get_full_fp32_param returns an Adam moment",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/8474",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/8474",
        fixed_in="0.19.7",
        root_cause="map_to_flat_opt_states set lp._hp_mapping.hp_fragment (the fp32 master-weight slice) to the "
        "flattened optimizer-state buffer of each key, instead of lp._hp_mapping.optim_fragment[key].",
    ),
    pytest.mark.ds_premise(
        stage=(1, 2),
        config={"checkpoint.load_universal": True},
        sets={"zero_force_ds_cpu_optimizer": False},
        because="where the config names no optimizer the body trains with torch's Adam",
    ),
    TORCH_LOAD_WEIGHTS_ONLY,  # the converter and the universal load read checkpoints
    ZERO12_CPU_FLAT_BUFFER,
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/8474",
        frames=("tensor_fragment.py:map_to_flat_opt_states",),
        words=("load_universal", "safe_get_full_fp32_param", "hp_fragment", "ds_to_universal"),
    ),
]


def zero12(stage):
    return {
        "zero_optimization": {"stage": stage},
        "zero_force_ds_cpu_optimizer": False,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "checkpoint": {"load_universal": True},
    }


def rebind_optim_fragment(monkeypatch):
    """Backport of PR #8474's loader fix: the flattened state's slice becomes ``optim_fragment[key]``."""
    import sys

    from pytest_dsrepro.inrank.backport import backport, release_has

    tensor_fragment = sys.modules["deepspeed.utils.tensor_fragment"]  # deepspeed.utils.tensor_fragment is a class

    if release_has(tensor_fragment.map_to_flat_opt_states, "lp._hp_mapping.optim_fragment[key] = hp_fragment"):
        return  # this release has the fix
    backport(
        monkeypatch,
        "deepspeed.utils.tensor_fragment",
        [(r"lp\._hp_mapping\.hp_fragment = hp_fragment", "lp._hp_mapping.optim_fragment[key] = hp_fragment")],
    )
    # The optimizers imported the function by name: they must call the new one.
    from deepspeed.runtime import base_optimizer

    if hasattr(base_optimizer, "map_to_flat_opt_states"):
        monkeypatch.setattr(base_optimizer, "map_to_flat_opt_states", tensor_fragment.map_to_flat_opt_states)


@pytest.mark.ds_config(pytest.param(zero12(1), id="zero1_universal"), pytest.param(zero12(2), id="zero2_universal"))
@pytest.mark.ds_version(
    affected="<0.19.7",
    raises=AssertionError,
    match=r"fp32 master weight read after the universal load is not the weight",
    fix=rebind_optim_fragment,
)
def test_universal_resume_keeps_fp32_weights_linked(ds_engine, ds_config, ds_rank, tmp_path):
    import sys

    import deepspeed.comm as dist
    import torch
    from deepspeed.checkpoint import ds_to_universal
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    trained = ds_engine(model=tiny_mlp(seed=21))  # the config's optimizer, torch's Adam where it names none
    x, y = make_batch(
        ds_config["train_micro_batch_size_per_gpu"], seed=22, rank=ds_rank, dtype=precision_dtype(ds_config)
    )
    for _ in range(2 * trained.gradient_accumulation_steps()):
        trained.backward(torch.nn.functional.mse_loss(trained(x), y))
        trained.step()
    weights = {name: safe_get_full_fp32_param(p).clone() for name, p in trained.module.named_parameters()}
    # A model of the user's own (not Megatron's) declares no special layout: an empty universal_checkpoint_info,
    # which the converter requires, as DeepSpeed's universal-checkpoint tutorial and tests pass it.
    trained.save_checkpoint(str(tmp_path / "checkpoint"), tag="step2", client_state={"universal_checkpoint_info": {}})
    dist.barrier()

    # The converter is a command users run once; every rank runs it here (one worker, in-process) into its own folder.
    universal = tmp_path / f"universal-{ds_rank}"
    argv, sys.argv = sys.argv, ["ds_to_universal", "--input_folder", str(tmp_path / "checkpoint" / "step2"),
                                "--output_folder", str(universal / "step2"), "--num_extract_workers", "1",
                                "--num_merge_workers", "1"]  # fmt: skip
    try:
        ds_to_universal.main(ds_to_universal.parse_arguments())
    finally:
        sys.argv = argv
    (universal / "latest").write_text("step2")
    dist.barrier()

    resumed = ds_engine(model=tiny_mlp(seed=23))  # other initial weights: only the load can make them the trained
    resumed.load_checkpoint(str(universal), tag="step2")

    for name, param in resumed.module.named_parameters():
        read = safe_get_full_fp32_param(param)
        exp_avg_sq = safe_get_full_optimizer_state(param, "exp_avg_sq")
        assert torch.allclose(read, weights[name]), (
            f"{name}: the fp32 master weight read after the universal load is not the weight saved (max diff "
            f"{(read - weights[name]).abs().max().item():.3g}; equals exp_avg_sq: {torch.equal(read, exp_avg_sq)})"
        )
