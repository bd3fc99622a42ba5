"""Sequence parallelism up to 0.16.4: the documented ``seq_parallel_communication_data_type`` is never read, so the
gradients of a sequence-parallel run are all-reduced in fp32 whatever the user set.

When the engine's ``mpu`` reports a sequence-parallel size above 1 (Megatron-DeepSpeed's Ulysses runs), the engine
replaces its communication dtype by the config's sequence-parallel one. The config reader looked that setting up
under the constant ``SEQ_PARALLEL_COMMUNICATION_DATA_TYPE``, whose value was the misspelled key
``"seq_parallel_comm_data_type"``: the key the docs (and the constant's own help text) name was ignored without a
word, and the default, fp32, was used. A user who asked for bf16 gradient communication to halve its volume kept
paying for fp32. PR #7175 (first in 0.16.5) corrects the constant. The key and the misspelling date back to the
first sequence-parallel engine support (#4530, 2023), before every release the catalogue runs.

The body trains a step of a tiny model under a Megatron-style ``mpu`` that puts the two ranks in one sequence-parallel
group, and records the dtype of every tensor the engine's gradient all-reduce sends: it must be the one configured.
"""

import pytest

from pytest_dsrepro.inrank.devices import precision_dtype
from pytest_dsrepro.inrank.models import make_batch, tiny_mlp

pytestmark = [
    pytest.mark.ds_repro(
        id="sequence-comm-dtype-key-ignored",
        title="seq_parallel_communication_data_type is ignored: sequence-parallel gradients are all-reduced in fp32",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/7175",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/7175",
        fixed_in="0.16.5",
        root_cause="The config reader looks the setting up under the constant SEQ_PARALLEL_COMMUNICATION_DATA_TYPE, "
        "whose value was the misspelled key 'seq_parallel_comm_data_type', so the documented key is never read and "
        "the fp32 default is used.",
    ),
    pytest.mark.ds_premise(
        stage=0,
        config={"seq_parallel_communication_data_type": ("bf16", "fp16")},
    ),
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/7175",
        frames=("config.py:_initialize_params",),
        words=("couldn't override `seq_parallel_communication_data_type`", "seq_parallel_comm_data_type"),
    ),
]

CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "bf16": {"enabled": True},
    "seq_parallel_communication_data_type": "bf16",
}


def read_the_documented_key(monkeypatch):
    """PR #7175: the constant names the documented key. The config reader reads it when the config is built, so
    patching the constants module and the config module's copy is enough."""
    from deepspeed.runtime import config, constants

    if constants.SEQ_PARALLEL_COMMUNICATION_DATA_TYPE == "seq_parallel_communication_data_type":
        return
    for module in (constants, config):
        monkeypatch.setattr(module, "SEQ_PARALLEL_COMMUNICATION_DATA_TYPE", "seq_parallel_communication_data_type")


class SequenceParallelMpu:
    """A Megatron-style mpu: every rank of the world in one sequence-parallel group, no tensor parallelism, each rank
    its own data-parallel group (the gradients are reduced over the sequence-data-parallel group, the world)."""

    def __init__(self):
        import torch

        world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
        self.world = torch.distributed.new_group(list(range(world)))
        singles = [torch.distributed.new_group([r]) for r in range(world)]  # every rank takes part in every new_group
        self.single = singles[rank]

    def get_model_parallel_rank(self):
        return 0

    def get_model_parallel_world_size(self):
        return 1

    def get_model_parallel_group(self):
        return self.single

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_data_parallel_rank(self):
        return 0

    def get_data_parallel_world_size(self):
        return 1

    def get_data_parallel_group(self):
        return self.single

    def get_sequence_parallel_rank(self):
        import torch

        return torch.distributed.get_rank(self.world)

    def get_sequence_parallel_world_size(self):
        import torch

        return torch.distributed.get_world_size(self.world)

    def get_sequence_parallel_group(self):
        return self.world

    get_sequence_data_parallel_rank = get_sequence_parallel_rank
    get_sequence_data_parallel_world_size = get_sequence_parallel_world_size
    get_sequence_data_parallel_group = get_sequence_parallel_group


@pytest.mark.ds_config(pytest.param(CONFIG, id="bf16_comm"))
@pytest.mark.ds_version(
    affected="<0.16.5",
    raises=AssertionError,
    match="sequence-parallel gradients were all-reduced in",
    fix=read_the_documented_key,
)
def test_sequence_parallel_gradients_use_the_configured_dtype(ds_config, ds_rank, monkeypatch):
    import deepspeed
    import deepspeed.comm
    import torch

    wanted = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[
        ds_config["seq_parallel_communication_data_type"]
    ]
    mpu = SequenceParallelMpu()
    model = tiny_mlp(seed=2)
    # Not ds_engine: its batch size counts every rank as data-parallel; the ranks of a sequence-parallel group share
    # one sample.
    micro, accumulation = ds_config["train_micro_batch_size_per_gpu"], ds_config["gradient_accumulation_steps"]
    config = {**ds_config, "train_batch_size": micro * accumulation}
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3), config=config, mpu=mpu
    )

    sent = []
    all_reduce = deepspeed.comm.all_reduce

    def recording_all_reduce(tensor, *args, **kwargs):
        if tensor.numel() > 1:  # gradient buckets; the gradient norm's scalar goes in fp32 on every release
            sent.append(tensor.dtype)
        return all_reduce(tensor, *args, **kwargs)

    monkeypatch.setattr(deepspeed.comm, "all_reduce", recording_all_reduce)
    for step in range(accumulation):
        x, y = make_batch(micro, seed=step, rank=0, dtype=precision_dtype(ds_config))  # one sample for the group
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    assert sent, "the engine reduced no gradients"
    assert set(sent) == {wanted}, (
        f"sequence-parallel gradients were all-reduced in {sorted(map(str, set(sent)))}, not the configured {wanted}"
    )
