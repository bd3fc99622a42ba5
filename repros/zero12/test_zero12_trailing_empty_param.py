"""ZeRO-1/2 with a zero-element trainable parameter at the end of its group: ``KeyError`` in ``average_tensor``.

ZeRO-1/2 maps every parameter to the ranks whose partition holds part of it (``param_to_partition_ids``); a parameter
with no elements that sits at the end of the flat buffer falls in no partition and gets no entry. Its (empty)
gradient still goes through the gradient bucket, and the reduction looks its partition ids up by parameter id:
``KeyError: <id>``. With ``round_robin_gradients`` and the optimizer offloaded to the CPU (LLaMA-Factory's ZeRO-2
offload config), the gradient's copy to the CPU takes its ``max()`` first and fails there on the empty tensor (found
by the corpus scan on 0.16.4). An empty parameter is legal in torch (a ``Linear(4, 0)``, a LoRA of rank 0, a pruned
head).
PR #8280 (first in 0.19.6) skips zero-element parameters before they reach the bucket (deepspeedai/DeepSpeed#8279).
"""

import pytest
from _prerequisites import ZERO12_CPU_FLAT_BUFFER
from _zero12 import TORCH_OPTIMIZER_PREMISE, config, max_difference, tolerance, train, train_reference

from pytest_dsrepro.inrank.devices import rank_device

pytestmark = [
    pytest.mark.ds_repro(
        id="zero12-trailing-empty-param",
        title="ZeRO-1/2 with a trailing zero-element trainable parameter: KeyError in average_tensor",
        upstream="https://github.com/deepspeedai/DeepSpeed/issues/8279",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/8280",
        fixed_in="0.19.6",
        root_cause="A zero-element parameter at the end of the flat buffer belongs to no partition, so it has no "
        "param_to_partition_ids entry, yet its gradient is still bucketed and reduced.",
    ),
    TORCH_OPTIMIZER_PREMISE,
    ZERO12_CPU_FLAT_BUFFER,
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/issues/8279",
        raises="KeyError",
        frames=("stage_1_and_2.py:average_tensor",),
        words=("zero-sized", "param_to_partition_ids", "trailing"),
        gpu=True,
    ),
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/8280",
        words=("zero-sized parameters",),
    ),
]

HIDDEN = 4
STEPS = 3


def model_with_trailing_empty_param(world_size, seed=11):
    """A ``Linear(4, 2 * world_size)`` and, registered after it (last in the flat buffer), a trainable ``Linear(4, 0)``.

    ZeRO-1/2 pads the flat buffer to a multiple of 2 x world size elements; the ``Linear`` has ``5 x 2 x world_size``
    elements, so no padding follows it and the empty weight starts exactly where the last partition ends. Inside a
    partition (any other size) an empty parameter trips a different, newer bug at initialize (#8297).
    """
    import torch

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.main = torch.nn.Linear(HIDDEN, 2 * world_size)
            self.empty = torch.nn.Linear(HIDDEN, 0, bias=False)

        def forward(self, x):
            # the empty weight takes part in autograd, so it gets an (empty) gradient
            return self.main(x).sum(dim=-1, keepdim=True) + self.empty(x).sum() * 0

    torch.manual_seed(seed)
    return Model().to(rank_device())


def skip_empty_params(monkeypatch):
    """PR #8280's fix: a zero-element parameter returns at the top of
    ``reduce_independent_p_g_buckets_and_remove_grads``, before it is put in a gradient bucket (a wrapper does what
    the three added lines do)."""
    import functools

    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from pytest_dsrepro.inrank.backport import release_has

    bucket = DeepSpeedZeroOptimizer.reduce_independent_p_g_buckets_and_remove_grads
    if release_has(bucket, "param.numel() == 0"):
        return  # fixed from 0.19.6

    @functools.wraps(bucket)
    def skip_empty(self, param, i):
        if param.numel() == 0:
            return None
        return bucket(self, param, i)

    monkeypatch.setattr(DeepSpeedZeroOptimizer, "reduce_independent_p_g_buckets_and_remove_grads", skip_empty)


#: The bug's two faces: the reduction's lookup (``KeyError: 2``, the empty parameter's index); with
#: ``round_robin_gradients`` and the optimizer offloaded, the CPU gradient copy's ``max()`` over the empty gradient
#: first. PR #8280's fix (the empty parameter never bucketed) ends both.
EMPTY_PARAM_FAILURE = r"^2$|^max\(\): Expected reduction dim to be specified for input\.numel\(\) == 0"


@pytest.mark.ds_config(config(1), config(2))
@pytest.mark.ds_version(affected="<0.19.6", raises=Exception, match=EMPTY_PARAM_FAILURE, fix=skip_empty_params)
def test_trailing_empty_param(ds_engine, ds_config, ds_rank, ds_world_size):
    import torch

    model = model_with_trailing_empty_param(ds_world_size)
    engine = ds_engine(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2))
    moms: list = []
    lrs = train(engine, ds_rank, STEPS, hidden=HIDDEN, moms=moms)

    # Past the crash the model trains as data parallelism should: plain Adam on every rank's data at once.
    reference = model_with_trailing_empty_param(ds_world_size)
    adam = torch.optim.Adam(reference.parameters(), lr=1e-2)
    accumulation = ds_config["gradient_accumulation_steps"]
    train_reference(reference, adam, ds_world_size, STEPS, HIDDEN, lrs, accumulation, moms)
    error = max_difference(engine.module, reference)
    assert error < tolerance(engine, 1e-6), f"weights differ from plain Adam's by {error:.3e}"
