"""``UlyssesSPDataLoaderAdapter`` (ALST) on gloo (the CPU accelerator): the first batch fails, gloo refusing the
gather of the sequence lengths.

To shard samples of different lengths, the adapter's ``refill`` all-gathers each rank's sequence length:
``torch.tensor(seqlen)``, a 0-dim tensor, into a list of one-element tensors (``torch.zeros(1)``). NCCL only compares
the element counts; gloo requires the shapes to match and refuses: "ProcessGroupGloo::allgather: invalid tensor size
at index 0 (expected (), got (1))". So no ALST run can take a batch through the adapter on a CPU (gloo) world, from the
adapter's first release (0.17.0) to 0.19.7 (and master at edaa722). 0.19.8 gathers ``torch.full((1, ), seqlen)``,
a one-element tensor as the list holds (its pull request is not in the mirror at hand: ``fix_ref`` is left empty);
the fix below does the same, and entry ``ulysses-dataloader-adapter-one-epoch`` carries it as a prerequisite.
"""

import pytest
from _ulysses import adapter_epochs, gather_lengths_as_vectors

pytestmark = [
    pytest.mark.ds_repro(
        id="ulysses-dataloader-adapter-gloo-seqlen",
        title="UlyssesSPDataLoaderAdapter on gloo: gathering the sequence lengths fails (0-dim into 1-element)",
        upstream="https://github.com/deepspeedai/DeepSpeed/blob/v0.17.0/deepspeed/runtime/sequence_parallel/ulysses_sp.py#L480",
        fix_ref=None,
        fixed_in="0.19.8",
        root_cause="refill all-gathers a 0-dim tensor into one-element tensors; gloo requires equal shapes.",
    ),
    pytest.mark.ds_premise(config={"sequence_parallel_size": 2}, accelerator="cpu"),
    pytest.mark.ds_not_applicable("<0.17.0", reason="UlyssesSPDataLoaderAdapter appeared in 0.17.0"),
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/blob/v0.17.0/deepspeed/runtime/sequence_parallel/ulysses_sp.py#L480",
        raises="RuntimeError",
        match=r"ProcessGroupGloo::allgather: invalid tensor size",
        frames=("ulysses_sp.py:refill",),
        words=("UlyssesSPDataLoaderAdapter",),
    ),
]

#: The body builds no engine: the adapter over the sequence-parallel group that ALST sets up (``_ulysses``).
CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "sequence_parallel_size": 2,
}


@pytest.mark.ds_config(pytest.param(CONFIG, id="sp2"))
@pytest.mark.ds_version(
    affected=">=0.17.0,<0.19.8",
    raises=RuntimeError,
    match=r"ProcessGroupGloo::allgather: invalid tensor size",
    fix=gather_lengths_as_vectors,
)
def test_adapter_takes_a_batch_on_gloo(ds_config, ds_rank, ds_device):
    per_epoch, batches = adapter_epochs(ds_config, ds_rank, ds_device, epochs=1)
    assert per_epoch == [batches], f"the adapter yielded {per_epoch[0]} of {batches} batches"
