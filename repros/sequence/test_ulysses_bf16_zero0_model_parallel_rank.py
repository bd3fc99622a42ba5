"""Ulysses (ALST) sequence parallelism with bf16 and no ZeRO, 0.17.0-0.18.1: the first ``engine.step()`` fails
with ``AttributeError``: the Ulysses mpu ``parallel_state_sp`` has no ``get_model_parallel_rank`` (or ``_group``).

ALST hands ``deepspeed.initialize`` its slim mpu, ``parallel_state_sp``, which until 0.18.2 answered only for the
sequence-parallel and sequence-data-parallel groups. ZeRO stages 1-3 never ask it about model parallelism, but the
bf16 wrappers of stage 0 do, when they compute the gradient norm. Up to 0.17.5 that wrapper is ``BF16_Optimizer``
(stage 0 accumulates bf16 gradients in fp32 by default): ``get_grads_for_norm`` asks
``bwc_tensor_model_parallel_rank(mpu)``, which falls back to ``mpu.get_model_parallel_rank()``, the user's traceback
(deepspeedai/DeepSpeed#7833, DeepSpeed 0.17.5; stages 1-3 trained). From 0.17.6 (PR #7515) bf16 without ZeRO goes
through the fp16 wrapper, whose overflow check all-reduces over ``mpu.get_model_parallel_group()``: the same missing
API, one call later. The issue is still open and its proposed fix (PR #7888) unmerged; what ended the crash is
PR #7649 (first released in 0.18.2), which aliased ``get_model_parallel_rank/_world_size/_group`` to the
sequence-parallel ones for ``save_checkpoint``'s sake. The body trains a step of the user's config and checks the
weights stay finite.
"""

import pytest

from pytest_dsrepro.inrank.devices import precision_dtype
from pytest_dsrepro.inrank.models import make_batch, tiny_mlp

pytestmark = [
    pytest.mark.ds_repro(
        id="ulysses-bf16-zero0-model-parallel-rank",
        title="Ulysses sequence parallelism + bf16 without ZeRO: step() fails, parallel_state_sp has no "
        "get_model_parallel_rank",
        upstream="https://github.com/deepspeedai/DeepSpeed/issues/7833",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/7649",
        fixed_in="0.18.2",
        root_cause="The bf16 wrappers of stage 0 ask the mpu about model parallelism for the gradient norm "
        "(BF16_Optimizer: get_model_parallel_rank through bwc_tensor_model_parallel_rank; from 0.17.6 the fp16 "
        "wrapper: get_model_parallel_group), which the Ulysses mpu (parallel_state_sp) lacked until PR #7649 aliased "
        "them to its sequence-parallel group.",
    ),
    pytest.mark.ds_premise(
        stage=0,
        precision="bf16",
        config={"sequence_parallel_size": ">=2"},
    ),
    pytest.mark.ds_not_applicable(
        "<0.17.0",
        reason="the Ulysses mpu of ALST (deepspeed.runtime.sequence_parallel.parallel_state_sp) came in 0.17.0",
    ),
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/issues/7833",
        raises="AttributeError",
        frames=("bf16_optimizer.py:get_grads_for_norm", "bwc.py:bwc_tensor_model_parallel_rank"),
        words=("Ulysses", "Stage 0"),
        gpu=True,
    ),
]

#: The ALST config of the user: bf16 without ZeRO, two sequence-parallel ranks (one group in a 2-rank world).
ZERO0 = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 0},
    "sequence_parallel_size": 2,
}


def model_parallel_aliases(monkeypatch):
    """Backport of PR #7649: the Ulysses mpu answers the model-parallel questions with its sequence-parallel group
    (rank, world size, group), so the sequence-parallel rank stands in for a tensor-parallel one.

    Where bf16 without ZeRO still goes through ``BF16_Optimizer`` (before 0.17.6), that is not enough: every rank
    but the first of a sequence-parallel group then hands the norm no gradient at all, and the norm of an empty list
    fails (``IndexError``). No release mends that path (0.17.6 stopped using it here); this backport lets such a
    rank add a zero, which the norm's sum over the sequence-parallel group leaves as the first rank's norm. The fix
    the issue's thread proposes (PR #7888, open: a tensor-parallel rank of 0 for an mpu without any rank function)
    is not enough either: the norm's all-reduce then asks the same mpu for ``get_model_parallel_group``."""
    from deepspeed.runtime import bf16_optimizer
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    if hasattr(parallel_state_sp, "get_model_parallel_rank"):
        return  # this release has the fix
    for what in ("rank", "world_size", "group"):
        alias = getattr(parallel_state_sp, f"get_sequence_parallel_{what}")
        monkeypatch.setattr(parallel_state_sp, f"get_model_parallel_{what}", alias, raising=False)
    norm = bf16_optimizer.get_global_norm_of_tensors

    def norm_of_none_is_zero(input_tensors, *args, **kwargs):
        if not input_tensors:
            import torch
            from deepspeed.accelerator import get_accelerator

            input_tensors = [torch.zeros(1, device=get_accelerator().current_device_name())]
        return norm(input_tensors, *args, **kwargs)

    monkeypatch.setattr(bf16_optimizer, "get_global_norm_of_tensors", norm_of_none_is_zero)


@pytest.mark.ds_config(pytest.param(ZERO0, id="bf16_zero0_sp2"))
@pytest.mark.ds_version(
    affected=">=0.17.0,<0.18.2",
    raises=AttributeError,
    match=r"parallel_state_sp' has no attribute 'get_model_parallel_(rank|group)'",  # to 0.17.5 | from 0.17.6
    fix=model_parallel_aliases,
)
def test_ulysses_bf16_step(ds_config, ds_rank, ds_world_size):
    import deepspeed
    import torch
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    sp = ds_config["sequence_parallel_size"]
    micro, accumulation = ds_config["train_micro_batch_size_per_gpu"], ds_config["gradient_accumulation_steps"]
    parallel_state_sp.initialize_sequence_parallel(sequence_parallel_size=sp)
    model = tiny_mlp(seed=7)
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        config={**ds_config, "train_batch_size": micro * accumulation * ds_world_size // sp},
        mpu=parallel_state_sp,
    )
    # Every rank of a sequence-parallel group holds the same sample (Ulysses splits its sequence inside attention,
    # which a tiny MLP has none of): the same batch for the group's ranks.
    group = ds_rank // sp
    for micro_step in range(accumulation):
        x, y = make_batch(micro, seed=100 + micro_step, rank=group, dtype=precision_dtype(ds_config))
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    for name, parameter in engine.module.named_parameters():
        assert torch.isfinite(parameter).all(), f"{name} is not finite after the step"
