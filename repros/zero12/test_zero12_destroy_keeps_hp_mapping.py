"""ZeRO-1/2: ``engine.destroy()`` leaves every parameter linked to the optimizer's fp32 partitions (a memory leak).

ZeRO-1/2 links each model parameter to its fragment of the optimizer's flat fp32 master partition
(``param._hp_mapping``, for ``safe_get_full_fp32_param`` and universal checkpoints). ``engine.destroy()``, which
trainers call to release an engine (Hugging Face's Trainer between runs, hyper-parameter sweeps that build one
engine after another on the same model), removed the gradient hooks but not those links: as long as the model lives,
every destroyed engine's fp32 master weights (and what they hold) stay in memory, and building engines repeatedly in
one process grows without bound. PR #5643 (first released in 0.14.5) clears ``_hp_mapping`` in ``destroy()``.
"""

import pytest
from _prerequisites import ZERO12_CPU_FLAT_BUFFER

from pytest_dsrepro.inrank.devices import engine_dtype
from pytest_dsrepro.inrank.models import make_batch, tiny_mlp

pytestmark = [
    pytest.mark.ds_repro(
        id="zero12-destroy-keeps-hp-mapping",
        title="ZeRO-1/2: engine.destroy() leaves parameters linked to the fp32 master partitions, leaking them",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/5643",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/5643",
        fixed_in="0.14.5",
        root_cause="DeepSpeedZeroOptimizer.destroy removed its gradient hooks but left each parameter's _hp_mapping, "
        "which references the optimizer's flat fp32 partition.",
    ),
    pytest.mark.ds_premise(
        stage=(1, 2),
        sets={"zero_force_ds_cpu_optimizer": False},
        because="where the config names no optimizer the body trains with torch's Adam, which DeepSpeed refuses beside "
        "an offloaded optimizer unless told",
    ),
    ZERO12_CPU_FLAT_BUFFER,
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/5643",
        words=("_hp_mapping", "memory leak", "engine.destroy"),
    ),
]


def zero_config(stage):
    return pytest.param(
        {
            "zero_force_ds_cpu_optimizer": False,  # as the premise sets it for a scanned config
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage},
        },
        id=f"zero{stage}",
    )


def unlink_on_destroy(monkeypatch):
    """Backport of PR #5643: ``destroy()`` clears every parameter's ``_hp_mapping``."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from pytest_dsrepro.inrank.backport import release_has

    destroy = DeepSpeedZeroOptimizer.destroy
    if release_has(destroy, "p._hp_mapping = None"):
        return  # this release has the fix

    def unlinking_destroy(self):
        for group in self.bit16_groups:
            for param in group:
                if getattr(param, "_hp_mapping", None):
                    param._hp_mapping = None
        destroy(self)

    monkeypatch.setattr(DeepSpeedZeroOptimizer, "destroy", unlinking_destroy)


@pytest.mark.ds_config(zero_config(1), zero_config(2))
@pytest.mark.ds_version(
    affected="<0.14.5",
    raises=AssertionError,
    match=r"engine\.destroy\(\) left \d+ parameters linked to the optimizer's fp32 master partitions",
    fix=unlink_on_destroy,
)
def test_destroy_releases_the_fp32_partitions(ds_engine, ds_config, ds_rank):
    import torch

    model = tiny_mlp(seed=2)
    engine = ds_engine(model=model)  # torch Adam, which ZeRO supports
    x, y = make_batch(ds_config["train_micro_batch_size_per_gpu"], seed=0, rank=ds_rank, dtype=engine_dtype(engine))
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()
    assert any(getattr(p, "_hp_mapping", None) is not None for p in model.parameters()), "no link to begin with"
    engine.destroy()  # the trainer is done with this engine; the model lives on
    linked = [name for name, p in model.named_parameters() if getattr(p, "_hp_mapping", None) is not None]
    assert not linked, (
        f"engine.destroy() left {len(linked)} parameters linked to the optimizer's fp32 master partitions: {linked}"
    )
