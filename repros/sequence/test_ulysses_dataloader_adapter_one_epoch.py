"""``UlyssesSPDataLoaderAdapter`` (ALST) yields nothing after its first epoch: multi-epoch training ends silently.

The adapter wraps a user's ``DataLoader`` for Ulysses sequence parallelism: ``__iter__`` returns the adapter itself
and ``refill`` takes the next batch from one iterator of the loader, made once in ``__init__``. When the first epoch
exhausts it, the ``StopIteration`` ends that epoch, as it should, but the iterator is never made again: every later
``for batch in adapter`` stops at once. A training loop over epochs then runs its first epoch only and finishes
without an error. PR #7472 (first in 0.17.5) makes a fresh iterator of the loader when the old one is exhausted.
"""

import pytest
from _ulysses import LENGTHS_AS_VECTORS, adapter_epochs, gather_lengths_as_vectors

pytestmark = [
    pytest.mark.ds_repro(
        id="ulysses-dataloader-adapter-one-epoch",
        title="UlyssesSPDataLoaderAdapter stops after one epoch: later epochs yield no batch",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/7472",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/7472",
        fixed_in="0.17.5",
        root_cause="The adapter's refill takes batches from one iterator of the wrapped DataLoader, made in __init__ "
        "and never made again once exhausted.",
    ),
    pytest.mark.ds_premise(config={"sequence_parallel_size": 2}),
    pytest.mark.ds_not_applicable("<0.17.0", reason="UlyssesSPDataLoaderAdapter appeared in 0.17.0"),
    # on gloo (a CPU world) the adapter's first refill fails before any epoch ends: that entry's fix, everywhere
    pytest.mark.ds_prerequisite(
        ">=0.17.0,<0.19.8",
        fix=gather_lengths_as_vectors,
        reason="ulysses-dataloader-adapter-gloo-seqlen (fixed in 0.19.8): gloo refuses the adapter's gather of "
        "the sequence lengths",
    ),
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/7472",
        words=("UlyssesSPDataLoaderAdapter", "one epoch"),
    ),
]

#: The body builds no engine: the adapter over the sequence-parallel group that ALST sets up (``_ulysses``).
CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "sequence_parallel_size": 2,
}


def restart_exhausted_iterator(monkeypatch):
    """PR #7472: an exhausted iterator of the wrapped DataLoader is made again, and the epoch still ends. The
    prerequisite's edit of the same method goes along (``backport`` edits the installed source, not the patched)."""
    from deepspeed.runtime.sequence_parallel import ulysses_sp

    from pytest_dsrepro.inrank.backport import backport, release_has

    adapter = getattr(ulysses_sp, "UlyssesSPDataLoaderAdapter", None)
    if adapter is None or release_has(adapter.refill, "self.iter = iter(self.dl)"):
        return
    backport(
        monkeypatch,
        "deepspeed.runtime.sequence_parallel.ulysses_sp",
        [
            (
                r"\n( +)batch = next\(self\.iter\)\n",
                r"\n\1try:\n\1    batch = next(self.iter)\n\1except StopIteration:\n\1    self.iter = iter(self.dl)\n"
                r"\1    raise StopIteration\n",
            ),
            LENGTHS_AS_VECTORS,
        ],
    )


@pytest.mark.ds_config(pytest.param(CONFIG, id="sp2"))
@pytest.mark.ds_version(
    affected=">=0.17.0,<0.17.5",
    raises=AssertionError,
    match="the adapter yielded no batch after its first epoch",
    fix=restart_exhausted_iterator,
)
def test_adapter_yields_every_epoch(ds_config, ds_rank, ds_device):
    per_epoch, batches = adapter_epochs(ds_config, ds_rank, ds_device)
    assert per_epoch[0] == batches, f"the first epoch yielded {per_epoch[0]} of {batches} batches"
    assert per_epoch[1] == batches, (
        f"the adapter yielded no batch after its first epoch: {per_epoch} batches per epoch, {batches} expected"
    )
