"""ZeRO-3 with a zero-element trainable parameter: the forward that uses it dies on an ``AssertionError`` naming the
parameter ``NOT_AVAILABLE`` (deepspeedai/DeepSpeed PR #8375, open).

Before a module runs, ZeRO-3's coordinator gathers its partitioned parameters, then asserts that each is
``AVAILABLE``. Whether it gathers at all is decided by the number of *elements* still to fetch: a module whose only
parameter has no elements (an ``nn.Linear(d, 0)``: a head over zero extra classes, a LoRA of rank 0, a pruned
projection) has nothing to fetch by that count, so nothing is gathered, its parameter stays ``NOT_AVAILABLE``, and
the assertion fails on every rank in the first forward. A persistent parameter fares no better (Qwen-VL issue #103
shows the same summary with ``'persist': True``). The gate is as old as the catalogue's releases and no release
fixes it: PR #8375 gathers a module's parameters whenever one of them is not available, whatever their size.
"""

import pytest
from _prerequisites import ZERO3_PARTITIONED
from _zero3 import ZERO3

from pytest_dsrepro.inrank.devices import precision_dtype
from pytest_dsrepro.inrank.models import make_batch

#: The fetch gate's assertion for a parameter with no elements whose full shape has a zero dimension (a
#: ``Linear(8, 0)``): a partitioned copy with ``ds_shape`` ``(0,)`` is another cause (PEFT's deepcopy, zero.Init).
NOT_AVAILABLE_EMPTY = (
    r"'status': 'NOT_AVAILABLE', 'numel': 0, 'ds_numel': 0, 'shape': \(0,\), 'ds_shape': \((?:\d+, )*0(?:, \d+)+\)"
)

pytestmark = [
    pytest.mark.ds_repro(
        id="zero3-empty-param-fetch",
        title="ZeRO-3 with a zero-element trainable parameter: AssertionError, the parameter is NOT_AVAILABLE in "
        "the forward that uses it",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/8375",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/8375",
        fixed_in=None,
        root_cause="fetch_sub_module starts the all-gather only when the elements left to fetch are more than "
        "zero, so a module whose parameters have no elements is never gathered and fails the AVAILABLE assertion.",
    ),
    ZERO3_PARTITIONED,
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/8375",
        raises="AssertionError",
        match=NOT_AVAILABLE_EMPTY,
        frames=("partitioned_param_coordinator.py:fetch_sub_module",),
        words=("zero-sized trainable parameter", "fetch_numel"),
    ),
]

HIDDEN = 8


def model_with_empty_head(seed=3):
    """A regression body and an auxiliary head over zero extra classes (``Linear(8, 0)``), both in the loss."""
    import torch

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(HIDDEN, HIDDEN)
            self.out = torch.nn.Linear(HIDDEN, HIDDEN)
            self.extra = torch.nn.Linear(HIDDEN, 0, bias=False)  # no extra classes in this run

        def forward(self, x, y):
            hidden = torch.relu(self.body(x))
            extra_logits = self.extra(hidden)  # (batch, 0): an empty term of the loss
            return torch.nn.functional.mse_loss(self.out(hidden), y) + extra_logits.sum()

    torch.manual_seed(seed)
    return Model()


def gather_when_any_is_missing(monkeypatch):
    """PR #8375's fix: ``fetch_sub_module`` starts the gather when any parameter of the module is not available,
    not only when their elements add up to more than zero."""
    from deepspeed.runtime.zero import partitioned_param_coordinator

    from pytest_dsrepro.inrank.backport import backport, release_has

    coordinator = partitioned_param_coordinator.PartitionedParameterCoordinator
    if not release_has(coordinator, "if fetch_numel > 0:"):
        return  # this release has the fix
    backport(
        monkeypatch,
        "deepspeed.runtime.zero.partitioned_param_coordinator",
        [
            (
                r"if fetch_numel > 0:",
                "if fetch_numel > 0 or any(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in params_to_fetch):",
            )
        ],
    )


@pytest.mark.ds_config(pytest.param(ZERO3, id="zero3_all_partitioned"))
@pytest.mark.ds_version(
    affected=">=0.14.4",
    raises=AssertionError,
    match=NOT_AVAILABLE_EMPTY,
    fix=gather_when_any_is_missing,
)
def test_zero_element_head_in_the_loss(ds_engine, ds_config, ds_rank, ds_device):
    import torch
    from deepspeed import zero

    dtype = precision_dtype(ds_config)
    model = model_with_empty_head()
    engine = ds_engine(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2))
    reference = model_with_empty_head().to(ds_device, dtype)
    x, y = make_batch(ds_config["train_micro_batch_size_per_gpu"], hidden=HIDDEN, seed=2, rank=ds_rank, dtype=dtype)

    loss = engine(x, y)  # the first forward
    torch.testing.assert_close(loss, reference(x, y), msg="the loss differs from the same model's without ZeRO-3")
    engine.backward(loss)
    engine.step()
    engine.backward(engine(x, y))  # and training goes on: the head is fetched again, in forward and backward
    engine.step()
    with zero.GatheredParameters([engine.module.extra.weight]):
        assert engine.module.extra.weight.shape == (0, HIDDEN), "the empty head lost its shape"
