"""ZeRO-1/2 ``save_checkpoint`` with ``elastic_checkpoint: true`` dies slicing the optimizer's 0-dim ``step``.

An elastic checkpoint stores the base optimizer's state without the alignment padding, so that it can be loaded at
another data-parallel size. ``DeepSpeedZeroOptimizer._get_state_without_padding`` trimmed every tensor of that
state with ``value[:numel - padding]``, including torch Adam/AdamW's ``state["step"]``, a 0-dim tensor that cannot
be sliced. Every ``save_checkpoint`` of a ZeRO-1/2 engine with a torch Adam-family optimizer therefore raised
(deepspeedai/DeepSpeed#7650). PR #7659 slices only tensors with a dimension (first released in 0.18.2).
"""

import pytest
from _prerequisites import ZERO12_CPU_FLAT_BUFFER
from _zero12 import config, train

from pytest_dsrepro.inrank.models import tiny_mlp

pytestmark = [
    pytest.mark.ds_repro(
        id="zero12-elastic-checkpoint-0dim-state",
        title="ZeRO-1/2 save_checkpoint with elastic_checkpoint raises IndexError on the optimizer's 0-dim step",
        upstream="https://github.com/deepspeedai/DeepSpeed/issues/7650",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/7659",
        fixed_in="0.18.2",
        root_cause="Removing the alignment padding from the optimizer state for an elastic checkpoint sliced every "
        "state tensor, including torch Adam's 0-dim step counter.",
    ),
    pytest.mark.ds_premise(
        stage=(1, 2),
        config={"zero_optimization.elastic_checkpoint": True},
        sets={"zero_force_ds_cpu_optimizer": False},
        because="the body trains with torch's AdamW: a torch optimizer beside CPU optimizer offload needs "
        "zero_force_ds_cpu_optimizer off",
    ),
    ZERO12_CPU_FLAT_BUFFER,  # the body trains ZeRO-1/2 steps: on 0.18.7-0.18.9 (CPU) they need that fix first
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/ssbuild/chatglm_finetuning/issues/32",
        raises="IndexError",
        frames=("stage_1_and_2.py:_get_state_without_padding",),
    ),
    pytest.mark.ds_seen(
        "https://github.com/hiyouga/ChatGLM-Efficient-Tuning/issues/184",
        words=("elastic_checkpoint",),
    ),
]


def elastic(stage):
    """The ZeRO-1/2 repros' config for ``stage``, saving elastic checkpoints."""
    (values,) = config(stage).values
    values["zero_optimization"]["elastic_checkpoint"] = True
    return pytest.param(values, id=f"zero{stage}_elastic")


def skip_0dim_state_when_unpadding(monkeypatch):
    """Backport of PR #7659: only tensors with a dimension carry padding."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from pytest_dsrepro.inrank.backport import backport, release_has

    if release_has(DeepSpeedZeroOptimizer._get_state_without_padding, "value.dim() > 0"):
        return  # this release has the fix
    backport(
        monkeypatch,
        "deepspeed.runtime.zero.stage_1_and_2",
        [(r"if torch\.is_tensor\(value\):\n(\s+lean_length)", r"if torch.is_tensor(value) and value.dim() > 0:\n\1")],
    )


@pytest.mark.ds_config(elastic(1), elastic(2))
@pytest.mark.ds_version(
    affected="<0.18.2",
    raises=IndexError,
    match=r"slice\(\) cannot be applied to a 0-dim tensor",
    fix=skip_0dim_state_when_unpadding,
)
def test_elastic_checkpoint_saves_unpadded_state(ds_engine, ds_rank, ds_world_size, tmp_path):
    import torch

    model = tiny_mlp(seed=5)
    engine = ds_engine(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))
    train(engine, ds_rank, steps=2)
    engine.save_checkpoint(str(tmp_path), tag="elastic")

    # What the checkpoint holds is this rank's Adam state without padding, and the ranks' pieces add up to the
    # model. (Loading it back is not checked: elastic loading of a torch Adam state fails on every release, for a
    # different reason; see docs/repros.md.)
    torch.distributed.barrier()
    live = engine.optimizer.optimizer.state[engine.optimizer.optimizer.param_groups[0]["params"][0]]
    pieces = []
    for rank in range(ds_world_size):
        (path,) = (tmp_path / "elastic").glob(f"*zero_pp_rank_{rank}_mp_rank_*optim_states.pt")
        saved = torch.load(path, weights_only=False)["optimizer_state_dict"]["base_optimizer_state"][0]
        assert saved["step"].dim() == 0, "the step counter lost its shape"
        assert saved["step"].item() == 2, f"saved Adam step {saved['step'].item()}, trained 2 steps"
        pieces.append(saved["exp_avg"].numel())
        if rank == ds_rank:
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(saved[key], live[key][: saved[key].numel()], msg=key)
    assert sum(pieces) == sum(p.numel() for p in model.parameters()), (pieces, "padding left in the checkpoint")
