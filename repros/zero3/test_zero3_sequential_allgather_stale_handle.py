"""ZeRO-3 with ``stage3_allgather_sequential``, forward-only: a released parameter is marked available over empty
storage, and the next forward's matmul meets a zero-length weight (deepspeedai/DeepSpeed#8486).

ZeRO-3's coordinator registers the handle of one all-gather under every parameter it gathers, and waits on it once
per parameter as each module comes to use its own. Handles over several parameters remember that they completed;
the single-parameter ``AllGatherHandle`` did not, and each wait marks its parameter ``AVAILABLE`` again. With
``stage3_allgather_sequential`` (PR #7661, 0.18.5) a gather of several parameters is a list of single-parameter
handles. An engine with an optimizer has its prefetch cut to one parameter under that option, but an engine without
one (the frozen reference or teacher model that DPO, RLHF and distillation trainers wrap in ZeRO-3) prefetches the
next modules' parameters in one gather: the first of those modules waits the whole list, runs and releases its
weights (their storage becomes an empty placeholder), and the next module's wait marks them ``AVAILABLE`` again. The
next forward trusts that flag, gathers nothing, and the matmul fails: ``size mismatch, got input (...), mat (...),
vec (0)``. PR #8487 (first released in 0.19.7) makes ``AllGatherHandle.wait`` and ``NoGatherHandle.wait`` return
once done.
"""

import pytest
from _zero3 import ZERO3

from pytest_dsrepro.inrank.devices import precision_dtype
from pytest_dsrepro.inrank.models import make_batch

pytestmark = [
    pytest.mark.ds_repro(
        id="zero3-sequential-allgather-stale-handle",
        title="ZeRO-3 with stage3_allgather_sequential marks a released parameter AVAILABLE over empty storage: "
        "RuntimeError 'size mismatch ... vec (0)'",
        upstream="https://github.com/deepspeedai/DeepSpeed/issues/8486",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/8487",
        fixed_in="0.19.7",
        root_cause="One gather's handle is waited once per gathered parameter, and AllGatherHandle.wait, not "
        "idempotent, set its parameter AVAILABLE again after the parameter had been released.",
    ),
    pytest.mark.ds_premise(
        stage=3,
        config={
            "zero_optimization.stage3_allgather_sequential": True,
            "zero_optimization.stage3_prefetch_bucket_size": ">0",
        },
        sets={
            "zero_optimization.stage3_param_persistence_threshold": 0,
            "zero_optimization.stage3_max_reuse_distance": 0,
        },
        removes=("optimizer", "scheduler"),
        because="the body runs a frozen model forward-only in an engine without an optimizer (with one, DeepSpeed "
        "cuts the prefetch to one parameter under this option), every parameter of the tiny model partitioned and "
        "released after its module runs, as a large model's are",
    ),
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/issues/8486",
        raises="RuntimeError",
        match=r"size mismatch, got input \(\d+\), mat \(\d+x\d+\), vec \(0\)",
        frames=("linear.py:forward", "linear.py:zero3_linear_wrap"),
        words=("AllGatherHandle", "NoGatherHandle", "not idempotent"),
        gpu=True,
    ),
]

ZERO3_SEQUENTIAL = {
    **ZERO3,
    "zero_optimization": {
        **ZERO3["zero_optimization"],
        "stage3_allgather_sequential": True,
        "stage3_prefetch_bucket_size": 50_000_000,  # DeepSpeed's default, written out for the premise
        "stage3_max_reuse_distance": 0,
    },
}
HIDDEN = 8
LAYERS = 4
FORWARDS = 3


def frozen_stack(seed=9):
    """A few bias-free linear layers (as in Llama-style blocks), each fetched, used and released in turn."""
    import torch

    torch.manual_seed(seed)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(HIDDEN, HIDDEN, bias=False), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers).requires_grad_(False)


def wait_once(monkeypatch):
    """PR #8487's fix: ``AllGatherHandle.wait`` and ``NoGatherHandle.wait`` do their work once; a second wait on a
    completed handle returns."""
    import functools

    from deepspeed.runtime.zero import partition_parameters

    from pytest_dsrepro.inrank.backport import release_has

    for handle_class in (partition_parameters.AllGatherHandle, partition_parameters.NoGatherHandle):
        wait = handle_class.wait
        if release_has(wait, "if self.__complete:"):
            continue  # this release has the fix

        @functools.wraps(wait)
        def wait_if_not_done(self, *args, _wait=wait, **kwargs):
            if getattr(self, "_completed_once", False):
                return None
            result = _wait(self, *args, **kwargs)
            self._completed_once = True
            return result

        monkeypatch.setattr(handle_class, "wait", wait_if_not_done)


@pytest.mark.ds_config(pytest.param(ZERO3_SEQUENTIAL, id="zero3_allgather_sequential"))
@pytest.mark.ds_not_applicable(releases="<0.18.5", reason="stage3_allgather_sequential arrived in 0.18.5 (PR #7661)")
@pytest.mark.ds_version(
    affected=">=0.18.5,<0.19.7",
    raises=RuntimeError,
    match=r"size mismatch, got input \(\d+\), mat \(\d+x\d+\), vec \(0\)",
    fix=wait_once,
)
def test_frozen_model_forwards_under_sequential_allgather(ds_engine, ds_config, ds_rank, ds_device):
    import torch

    dtype = precision_dtype(ds_config)
    micro = ds_config["train_micro_batch_size_per_gpu"]
    engine = ds_engine(model=frozen_stack(), optimizer=None)  # a reference model: no optimizer
    engine.eval()
    reference = frozen_stack().to(ds_device, dtype)
    for step in range(FORWARDS):  # from the second forward on, the recorded trace drives prefetching
        x, _ = make_batch(micro, hidden=HIDDEN, seed=step, rank=ds_rank, dtype=dtype)
        with torch.no_grad():
            torch.testing.assert_close(engine(x), reference(x), msg=lambda m, step=step: f"forward {step}: {m}")
