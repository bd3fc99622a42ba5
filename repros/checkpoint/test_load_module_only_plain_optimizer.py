"""``load_checkpoint(load_module_only=True)`` on an engine without ZeRO or fp16 dies with an AttributeError.

Loading only the module's weights must leave the optimizer alone, except that a mixed-precision wrapper has to
copy the new weights into its fp32 masters: ``_load_checkpoint`` called ``self.optimizer.refresh_fp32_params()``
for that. PR #4141 (0.13.0) dropped the ``fp16_enabled()`` guard around the call, so an fp32 engine, whose optimizer
is the user's own torch optimizer, raised (deepspeedai/DeepSpeed#7132). PR #7133 calls it only when the optimizer
has it (first released in 0.16.5).
"""

import pytest

from pytest_dsrepro.inrank.models import make_batch, tiny_mlp

pytestmark = [
    pytest.mark.ds_repro(
        id="load-module-only-plain-optimizer",
        title="load_checkpoint(load_module_only=True) without ZeRO/fp16: AttributeError refresh_fp32_params",
        upstream="https://github.com/deepspeedai/DeepSpeed/issues/7132",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/7133",
        fixed_in="0.16.5",
        root_cause="Loading only the module called the fp16 wrapper's refresh_fp32_params on whatever optimizer the "
        "engine had, including a bare torch optimizer that has no such method.",
    ),
    pytest.mark.ds_premise(stage=0, precision="fp32"),
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/blob/v0.16.4/deepspeed/runtime/engine.py#L3018",
        raises="AttributeError",
        match=r"'\w+' object has no attribute 'refresh_fp32_params'",
        frames=("engine.py:_load_checkpoint",),
        words=("load_module_only",),
    ),
]

FP32_ZERO0 = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "zero_optimization": {"stage": 0},
}


def refresh_only_if_the_optimizer_can(monkeypatch):
    """Backport of PR #7133: refresh the fp32 masters only when the optimizer has them."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    from pytest_dsrepro.inrank.backport import backport, release_has

    if release_has(DeepSpeedEngine._load_checkpoint, "hasattr(self.optimizer, 'refresh_fp32_params')"):
        return  # this release has the fix
    backport(
        monkeypatch,
        "deepspeed.runtime.engine",
        [
            (
                r"if self\.optimizer is not None:\n(\s+)self\.optimizer\.refresh_fp32_params\(\)",
                r"if self.optimizer is not None and hasattr(self.optimizer, 'refresh_fp32_params'):\n"
                r"\1self.optimizer.refresh_fp32_params()",
            )
        ],
    )


def adamw_engine(ds_engine, seed):
    import torch

    model = tiny_mlp(seed=seed)
    return ds_engine(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))


@pytest.mark.ds_config(pytest.param(FP32_ZERO0, id="fp32_zero0"))
@pytest.mark.ds_version(
    affected=">=0.13.0,<0.16.5",
    raises=AttributeError,
    match=r"'AdamW' object has no attribute 'refresh_fp32_params'",
    fix=refresh_only_if_the_optimizer_can,
)
def test_load_module_only_with_torch_optimizer(ds_engine, ds_config, ds_rank, tmp_path):
    import torch

    x, y = make_batch(ds_config["train_micro_batch_size_per_gpu"], seed=10, rank=ds_rank)
    trained = adamw_engine(ds_engine, seed=11)
    for _ in range(2 * trained.gradient_accumulation_steps()):  # two optimizer steps of the config's micro-steps
        trained.backward(torch.nn.functional.mse_loss(trained(x), y))
        trained.step()
    trained.save_checkpoint(str(tmp_path), tag="module")

    fresh = adamw_engine(ds_engine, seed=12)
    fresh.load_checkpoint(
        str(tmp_path), tag="module", load_optimizer_states=False, load_lr_scheduler_states=False, load_module_only=True
    )

    # The weights are the saved ones (the fresh engine started from other weights); the optimizer is untouched.
    for (name, saved), loaded in zip(trained.module.named_parameters(), fresh.module.parameters(), strict=True):
        torch.testing.assert_close(loaded, saved, rtol=0, atol=0, msg=name)
    assert not fresh.optimizer.state, "load_module_only loaded optimizer state"
    for _ in range(fresh.gradient_accumulation_steps()):  # one optimizer step
        fresh.backward(torch.nn.functional.mse_loss(fresh(x), y))
        fresh.step()
    assert len(fresh.optimizer.state) == len(list(fresh.module.parameters()))
