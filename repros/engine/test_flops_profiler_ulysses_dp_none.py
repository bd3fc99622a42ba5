"""The flops profiler crashes the profiled step of a Ulysses (ALST) sequence-parallel run: data-parallel size None.

With the sequence-parallel state of ``deepspeed.runtime.sequence_parallel.parallel_state_sp`` as the engine's
``mpu`` (what ``UlyssesSPAttentionHF.register_with_transformers`` returns for Hugging Face models, new in 0.17.0),
``groups._get_data_parallel_world_size()`` answers None, and so does ``engine.dp_world_size``: the data-parallel
replication lives in the sequence-data-parallel group. At ``profile_step`` the profiler's summary formats
``'data parallel size: '`` with ``'{:<8}'`` and None refuses the format ("unsupported format string passed to
NoneType.__format__"), on the rank that profiles (rank 0; the others then wait on it). PR #8122 (first in 0.19.3)
prints the sequence-data-parallel size there.
"""

import pytest

from pytest_dsrepro.inrank.devices import precision_dtype
from pytest_dsrepro.inrank.models import make_batch, tiny_mlp

pytestmark = [
    pytest.mark.ds_repro(
        id="flops-profiler-ulysses-dp-none",
        title="Flops profiler under Ulysses sequence parallelism: the profiled step crashes on data parallel size None",
        upstream="https://github.com/deepspeedai/DeepSpeed/issues/7483",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/8122",
        fixed_in="0.19.3",
        root_cause="With parallel_state_sp as mpu, engine.dp_world_size is None, and the profiler's summary formats "
        "it with '{:<8}'.",
    ),
    pytest.mark.ds_premise(config={"flops_profiler.enabled": True}),
    pytest.mark.ds_not_applicable("<0.17.0", reason="parallel_state_sp (Ulysses for Hugging Face) appeared in 0.17.0"),
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/issues/7483",
        raises="TypeError",
        match=r"unsupported format string passed to NoneType\.__format__",
        frames=("profiler.py:print_model_profile",),
        words=("flops_profiler", "sequence_parallel_size", "UlyssesSPAttentionHF"),
    ),
]

CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "flops_profiler": {"enabled": True, "profile_step": 1, "detailed": False},
}
SEQUENCE_PARALLEL = 2


def print_sequence_data_parallel_size(monkeypatch):
    """PR #8122: where dp_world_size is None, the summary prints the sequence-data-parallel group's size."""
    from deepspeed.profiling.flops_profiler import profiler

    from pytest_dsrepro.inrank.backport import backport, release_has

    if release_has(profiler.FlopsProfiler.print_model_profile, "if dp_world_size is None:"):
        return
    backport(
        monkeypatch,
        "deepspeed.profiling.flops_profiler.profiler",
        [
            (
                r"\n( +)print\(line_fmt\.format\('data parallel size: ', self\.ds_engine\.dp_world_size\)\)",
                r"\n\1dp_world_size = self.ds_engine.dp_world_size\n\1if dp_world_size is None:\n\1    "
                r"dp_world_size = self.ds_engine.seq_dp_world_size\n\1print(line_fmt.format('data parallel size: ', "
                r"dp_world_size))",
            )
        ],
    )


@pytest.mark.ds_config(pytest.param(CONFIG, id="profile_step1"))
@pytest.mark.ds_version(
    affected=">=0.17.0,<0.19.3",
    raises=TypeError,
    match=r"unsupported format string passed to NoneType\.__format__",
    fix=print_sequence_data_parallel_size,
)
def test_profiled_step_under_ulysses(ds_config, ds_rank, ds_world_size):
    import deepspeed
    import torch
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    # What register_with_transformers sets up and returns: the sequence-parallel state, the engine's mpu.
    parallel_state_sp.initialize_sequence_parallel(sequence_parallel_size=SEQUENCE_PARALLEL)
    # Not ds_engine: its batch size counts every rank as data-parallel; the ranks of a sequence-parallel group share
    # one sample.
    micro, accumulation = ds_config["train_micro_batch_size_per_gpu"], ds_config["gradient_accumulation_steps"]
    config = {**ds_config, "train_batch_size": micro * accumulation * ds_world_size // SEQUENCE_PARALLEL}
    model = tiny_mlp(seed=2)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3), config=config, mpu=parallel_state_sp
    )
    profile_step = ds_config["flops_profiler"].get("profile_step", 1)
    # Through the profiled step, each step the config's micro-steps: the profile is printed at a step's boundary only.
    for micro_step in range((profile_step + 1) * accumulation):
        x, y = make_batch(micro, seed=micro_step, rank=ds_rank, dtype=precision_dtype(ds_config))
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
    assert engine.global_steps > profile_step, f"the body stopped at step {engine.global_steps}, before the profiled"
    assert torch.isfinite(loss).item()
