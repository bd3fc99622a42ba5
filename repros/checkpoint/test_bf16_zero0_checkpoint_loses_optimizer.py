"""bf16 without ZeRO (stage 0): a checkpoint round trip loses the optimizer state, or crashes on load.

The engine decided that optimizer state lives in ZeRO checkpoint files with ``zero_optimization() or
bfloat16_enabled()``: true for bf16 because, until 0.17.5, bf16 always meant ``BF16_Optimizer``, which saves its
state in ``bf16_zero_*`` files. PR #7515 (0.17.6) sent bf16 + stage 0 to the fp16 wrapper instead, which writes no
such file: the model-states file got ``optimizer=None``, and on load the engine took the ZeRO path with the fp16
wrapper, which has none of ZeRO's attributes: a full load asks it for ``dp_process_group``, a load without optimizer
states calls its ``_restore_from_bit16_weights`` (deepspeedai/DeepSpeed#7571). PR #7586 (0.18.0) removed the ZeRO
path from loading, so from then on the load succeeds with the freshly initialised Adam state. PR #7786 drops the bf16
condition from saving too (first released in 0.18.5).
"""

import pytest

from pytest_dsrepro.inrank.models import make_batch, tiny_mlp

pytestmark = [
    pytest.mark.ds_repro(
        id="bf16-zero0-checkpoint-loses-optimizer",
        title="bf16 + ZeRO stage 0: load_checkpoint crashes (0.17.6) or silently resets the optimizer state",
        upstream="https://github.com/deepspeedai/DeepSpeed/issues/7571",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/7786",
        fixed_in="0.18.5",
        root_cause="Checkpointing treated every bf16 engine as keeping its optimizer state in ZeRO files; bf16 without "
        "ZeRO writes none, so the state was saved nowhere and never loaded.",
    ),
    pytest.mark.ds_premise(stage=0, precision="bf16"),
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/blob/v0.17.6/deepspeed/runtime/engine.py#L3274",
        raises="AttributeError",
        match="'FP16_(?:Unfused)?Optimizer' object has no attribute '(?:dp_process_group|_restore_from_bit16_weights)'",
        frames=("engine.py:_load_zero_checkpoint",),
    ),
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/blob/v0.18.0/deepspeed/runtime/engine.py",
        words=("load_checkpoint", "optimizer state", "bf16_zero"),
    ),
]


def load_checkpoints_unrestricted(monkeypatch):
    """PR #6751 (0.16.0): DeepSpeed's checkpoint engine loads with ``weights_only=False``. Before it, torch >= 2.6
    (``weights_only`` on by default) refuses the ``BF16_Optimizer`` state those releases save for bf16."""
    from deepspeed.runtime.checkpoint_engine import torch_checkpoint_engine

    from pytest_dsrepro.inrank.backport import backport, release_has

    if release_has(torch_checkpoint_engine, "weights_only"):
        return
    backport(
        monkeypatch,
        "deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine",
        [
            (
                r"torch\.load\(path, map_location=map_location\)",
                "torch.load(path, map_location=map_location, weights_only=False)",
            )
        ],
    )


BF16_ZERO0 = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 0},
}


def optimizer_state_only_for_zero(monkeypatch):
    """Backport of PRs #7586 and #7786: only ZeRO keeps optimizer state in ZeRO files."""
    from deepspeed.runtime import constants, engine

    from pytest_dsrepro.inrank.backport import backport, release_has

    if not hasattr(constants, "DDP_BFLOAT16"):
        return  # up to 0.17.5 bf16 meant BF16_Optimizer, whose state does live in (bf16_)zero files
    if not release_has(engine, "self.zero_optimization() or self.bfloat16_enabled()"):
        return  # this release has the fix
    backport(
        monkeypatch,
        "deepspeed.runtime.engine",
        [(r"\(?self\.zero_optimization\(\) or self\.bfloat16_enabled\(\)\)?", "self.zero_optimization()")],
    )


def adam_state(engine):
    """The torch AdamW's state under DeepSpeed's wrapper, by parameter index."""
    return engine.optimizer.optimizer.state_dict()["state"]


def bf16_adamw_engine(ds_engine):
    import torch

    model = tiny_mlp(seed=9).to(torch.bfloat16)
    return ds_engine(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))


def train_step(engine, x, y):
    """One optimizer step: the config's accumulation steps of micro-steps (the optimizer steps at the boundary only,
    and a config may derive its accumulation from the batch sizes)."""
    import torch

    for _ in range(engine.gradient_accumulation_steps()):
        loss = torch.nn.functional.mse_loss(engine(x).float(), y)
        engine.backward(loss)
        engine.step()


@pytest.mark.ds_prerequisite(
    fix=load_checkpoints_unrestricted,
    releases="<0.16.0",
    reason="PR #6751: before 0.16.0 DeepSpeed cannot load its bf16 optimizer checkpoints under torch >= 2.6",
)
@pytest.mark.ds_config(pytest.param(BF16_ZERO0, id="bf16_zero0"))
@pytest.mark.ds_version(
    affected=">=0.17.6,<0.18.0",
    raises=AttributeError,
    match=r"'FP16_UnfusedOptimizer' object has no attribute 'dp_process_group'",
    fix=optimizer_state_only_for_zero,
)
@pytest.mark.ds_version(
    affected=">=0.18.0,<0.18.5",
    raises=AssertionError,
    match=r"the checkpoint round trip lost the Adam state",
)
def test_bf16_zero0_checkpoint_keeps_adam_state(ds_engine, ds_config, ds_rank, tmp_path):
    import torch

    x, y = make_batch(ds_config["train_micro_batch_size_per_gpu"], seed=8, rank=ds_rank)
    x = x.to(torch.bfloat16)
    engine = bf16_adamw_engine(ds_engine)
    for _ in range(3):
        train_step(engine, x, y)
    engine.save_checkpoint(str(tmp_path), tag="bf16")

    restored = bf16_adamw_engine(ds_engine)
    restored.load_checkpoint(str(tmp_path), tag="bf16")

    # Reference: the state of the engine that was saved (Adam step 4: DeepSpeed's initial step and 3 trained). The
    # bug leaves the new engine's own state instead: step 1, zero moments.
    saved, loaded = adam_state(engine), adam_state(restored)
    saved_steps = [float(s["step"]) for s in saved.values()]
    loaded_steps = [float(s["step"]) for s in loaded.values()]
    assert loaded_steps == saved_steps, f"the checkpoint round trip lost the Adam state: step {loaded_steps}"
    for index, state in saved.items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(loaded[index][key], state[key], msg=f"param {index}: {key}")

    # Resuming is indistinguishable from not stopping: one more step on each gives the same weights. (Gradients are
    # cleared first: up to 0.18.5 bf16 stage 0 never clears them, repro bf16-zero0-grads-unscaled, so the saved
    # engine would carry its old ones into the step.)
    for eng in (engine, restored):
        eng.module.zero_grad(set_to_none=True)
        train_step(eng, x, y)
    for (name, kept), resumed in zip(engine.module.named_parameters(), restored.module.parameters(), strict=True):
        torch.testing.assert_close(resumed, kept, rtol=0, atol=0, msg=f"{name}: resumed training diverged")
