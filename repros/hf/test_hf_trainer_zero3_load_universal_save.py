"""A ZeRO-3 Trainer run with ``"checkpoint": {"load_universal": true}`` saves the model states of rank 0 only
(deepspeedai/DeepSpeed#7546).

``load_universal`` says that checkpoints are *loaded* from the universal format (``ds_to_universal``'s output, which
has one model-states file). Since ZeRO-3 universal checkpoints arrived (PR #5475, 0.14.5), ``_get_ckpt_name`` named
the ZeRO-3 model-states file ``zero_pp_rank_0_...`` whenever the flag was set, on *save* too: every rank writes its
model states to rank 0's file (concurrently: the last writer wins, a torn file is possible), and the other ranks'
files never exist. The Trainer saves its ``checkpoint-N`` that way, and both ``zero_to_fp32`` and ``ds_to_universal``
then fail on the missing files. PR #7585 names files by rank again and takes the first file only when loading a
universal checkpoint (first released in 0.18.0; issue #7546 itself was left open).
"""

import pytest
from _prerequisites import TORCH_LOAD_WEIGHTS_ONLY

from pytest_dsrepro.inrank.hf import requires_hf, tiny_model, train_with_trainer

pytestmark = [
    pytest.mark.ds_repro(
        id="hf-trainer-zero3-load-universal-save",
        title="ZeRO-3 with checkpoint.load_universal: save_checkpoint (Trainer checkpoints) writes rank 0's "
        "model-states file only",
        upstream="https://github.com/deepspeedai/DeepSpeed/issues/7546",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/7585",
        fixed_in="0.18.0",
        root_cause="With load_universal set, _get_ckpt_name gave every rank the name zero_pp_rank_0 for its ZeRO-3 "
        "model states, when saving as well as loading.",
    ),
    pytest.mark.ds_premise(stage=3, config={"checkpoint.load_universal": True}),
    requires_hf,
    TORCH_LOAD_WEIGHTS_ONLY,  # zero_to_fp32 reads the checkpoint
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/issues/7546",
        words=("load_universal", "model_states", "zero_pp_rank_0_mp_rank_00_model_states"),
    ),
]

ZERO3_LOAD_UNIVERSAL = {
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
    "checkpoint": {"load_universal": True},
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
}


def name_model_states_by_rank(monkeypatch):
    """Backport of PR #7585's engine part: ZeRO-3 model states are saved under each rank's own name; only loading a
    universal checkpoint reads the first file."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    from pytest_dsrepro.inrank.backport import backport, release_has

    if not release_has(DeepSpeedEngine._get_ckpt_name, 'filename = "zero_pp_rank_0"'):
        return  # fixed (0.18.0), or before ZeRO-3 universal checkpoints (0.14.4 and older)
    backport(
        monkeypatch,
        "deepspeed.runtime.engine",
        [
            (
                r'if self\.load_universal_checkpoint\(\):\n\s+filename = "zero_pp_rank_0"\n\s+else:\n\s+(filename = )',
                r"\1",
            ),
            (
                r"(ckpt_files\.sort\(\)\n)(\s+)return ckpt_files",
                r"\1\2if self.load_universal_checkpoint():\n\2    return [ckpt_files[0]]\n\2return ckpt_files",
            ),
        ],
    )


@pytest.mark.ds_config(pytest.param(ZERO3_LOAD_UNIVERSAL, id="zero3_load_universal"))
@pytest.mark.ds_version(
    affected=">=0.14.5,<0.18.0",
    raises=AssertionError,
    match="model states of rank 0 only",
    fix=name_model_states_by_rank,
)
def test_trainer_checkpoint_has_every_ranks_model_states(ds_config, ds_rank, tmp_path):
    import deepspeed
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    trainer = train_with_trainer(
        tiny_model("llama", seed=12), ds_config, tmp_path / "run", steps=2, save_strategy="steps", save_steps=2
    )
    checkpoint = tmp_path / "run" / "checkpoint-2"
    torch.distributed.barrier()
    (step_dir,) = [p for p in checkpoint.iterdir() if p.is_dir() and p.name.startswith("global_step")]
    saved = sorted(p.name for p in step_dir.glob("*_model_states.pt"))
    expected = [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(torch.distributed.get_world_size())]
    assert saved == expected, f"ZeRO-3 saved the model states of rank 0 only: {saved}"

    # The checkpoint is whole: zero_to_fp32 rebuilds the trained weights from it.
    recovered = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint))
    module = trainer.model_wrapped.module
    names = ["model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight"]
    params = dict(module.named_parameters())
    # One parameter per gather: gathering several is racy on gloo before 0.19.8 (zero3-persistent-allgather-race).
    for name in names:
        with deepspeed.zero.GatheredParameters([params[name]]):
            torch.testing.assert_close(recovered[name], params[name].data.float(), msg=name)
