"""Ulysses (ALST) sequence parallelism, 0.18.2-0.19.4: loading a checkpoint fails on every sequence-parallel rank
above 0 (IndexError).

Ulysses does not shard the model: the engine records a model-parallel size of 1, and one model-state file per
checkpoint (``mp_rank_00_model_states.pt``). From 0.18.2 (PR #7649) the Ulysses mpu (``parallel_state_sp``) answers
``get_model_parallel_rank()`` with the sequence-parallel rank, and ``load_checkpoint`` picks the model-state file by
that rank from the list of one: sequence-parallel rank 1 asks for the second file of one, "list index out of range".
So a Ulysses run cannot load the checkpoint of a run without sequence parallelism (fine-tuning a model saved by
plain data parallelism, the regression PR #8226 tests), nor its own. PR #8226 reads and writes checkpoints with
model-parallel rank 0 whenever the model-parallel size is 1. It was merged a day after v0.19.5 was tagged: 0.19.5
still fails here, and the first release with it is 0.19.6 (the fix ledger's "0.19.5" is one release early).
"""

import pytest

from pytest_dsrepro.inrank.models import tiny_mlp

pytestmark = [
    pytest.mark.ds_repro(
        id="ulysses-checkpoint-rank",
        title="Ulysses sequence parallelism: load_checkpoint fails with IndexError on sequence-parallel ranks > 0",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/8226",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/8226",
        fixed_in="0.19.6",
        root_cause="parallel_state_sp aliases get_model_parallel_rank to the sequence-parallel rank (PR #7649, "
        "0.18.2), and load_checkpoint indexes the list of model-state files, one for a model-parallel size of 1, "
        "with it.",
    ),
    pytest.mark.ds_premise(stage=0, config={"sequence_parallel_size": 2}),
    pytest.mark.ds_not_applicable(
        "<0.18.2",
        reason="parallel_state_sp answers get_model_parallel_rank from 0.18.2 (PR #7649); before, DeepSpeed's "
        "checkpointing cannot take it for an mpu at all (AttributeError), and before 0.17.0 there is none",
    ),
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/8226",
        raises="IndexError",
        match=r"list index out of range",
        frames=("state_dict_factory.py:load", "engine.py:_load_checkpoint", "load_checkpoint"),
    ),
]

#: The Ulysses engine: what a user's ALST config has (``sequence_parallel_size`` read by the body); no ZeRO.
CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "sequence_parallel_size": 2,
}


def checkpoint_with_rank_zero(monkeypatch):
    """PR #8226's logic: with a model-parallel size of 1 (Ulysses), checkpoints are written and read as
    model-parallel rank 0. Done here by giving save/load_checkpoint an mpu whose model-parallel rank is 0."""
    import functools

    from deepspeed.runtime.engine import DeepSpeedEngine

    from pytest_dsrepro.inrank.backport import release_has

    if release_has(DeepSpeedEngine, "self.checkpoint_mp_rank = 0"):
        return

    class RankZero:
        def __init__(self, mpu):
            self._mpu = mpu

        def get_model_parallel_rank(self):
            return 0

        def __getattr__(self, name):
            return getattr(self._mpu, name)

    for name in ("save_checkpoint", "load_checkpoint"):
        original = getattr(DeepSpeedEngine, name)

        def as_rank_zero(self, *args, _original=original, **kwargs):
            mpu = self.mpu
            if mpu is not None and self.mp_world_size == 1:
                self.mpu = RankZero(mpu)
            try:
                return _original(self, *args, **kwargs)
            finally:
                self.mpu = mpu

        monkeypatch.setattr(DeepSpeedEngine, name, functools.wraps(original)(as_rank_zero))


@pytest.mark.ds_config(pytest.param(CONFIG, id="sp2"))
@pytest.mark.ds_version(
    affected=">=0.18.2,<0.19.6",
    raises=IndexError,
    match=r"list index out of range",
    fix=checkpoint_with_rank_zero,
)
def test_ulysses_loads_a_data_parallel_checkpoint(ds_config, ds_world_size, tmp_path):
    import deepspeed
    import torch
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    micro, accumulation = ds_config["train_micro_batch_size_per_gpu"], ds_config["gradient_accumulation_steps"]
    plain = {k: v for k, v in ds_config.items() if k != "sequence_parallel_size"}
    model = tiny_mlp(seed=4)
    saved, *_ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
        config={**plain, "train_batch_size": micro * accumulation * ds_world_size},
    )
    saved.save_checkpoint(str(tmp_path), tag="pretrained")  # the data-parallel run's checkpoint
    weights = {n: p.detach().clone() for n, p in saved.module.named_parameters()}

    # The Ulysses run that fine-tunes it: the mpu register_with_transformers returns, one sample per SP group.
    sp = ds_config["sequence_parallel_size"]
    parallel_state_sp.initialize_sequence_parallel(sequence_parallel_size=sp)
    model = tiny_mlp(seed=5)
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
        config={**ds_config, "train_batch_size": micro * accumulation * ds_world_size // sp},
        mpu=parallel_state_sp,
    )
    engine.load_checkpoint(str(tmp_path), tag="pretrained", load_optimizer_states=False)
    for name, parameter in engine.module.named_parameters():
        assert torch.equal(parameter.detach(), weights[name]), f"{name} was not loaded"
