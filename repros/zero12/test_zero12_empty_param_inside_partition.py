"""ZeRO-1/2 with a zero-element trainable parameter inside a rank's partition: ``AssertionError`` at ``initialize``
(deepspeedai/DeepSpeed#8297).

ZeRO-1/2 links each rank's fp32 partition to the parameters it overlaps (``_link_all_hp_params``): walking the flat
buffer, a parameter overlaps when it starts before the partition's end and ends after its start. A parameter with no
elements that starts strictly inside a partition passes that test, although it covers nothing; the fragment built
for it is empty, and ``get_hp_fragment_mapping`` asserts ``fragment start N should be < fragment_end N`` on the rank
that holds it, before the first step. An empty trainable parameter is legal in torch (a gate or scale over zero
pruned channels, a LoRA of rank 0) and costs nothing in plain training. The overlap test dates from the first
releases; PR #8298 (first released in 0.19.6, merged after the commit the issue names as still failing) links no
fragment for a zero-element parameter. The sibling bug of an empty parameter at the very end of the buffer
(``zero12-trailing-empty-param``) fails later, in the backward, and was fixed by PR #8280 in the same release.
"""

import pytest
from _prerequisites import ZERO12_CPU_FLAT_BUFFER
from _zero12 import TORCH_OPTIMIZER_PREMISE, config, max_difference, tolerance, train, train_reference

from pytest_dsrepro.inrank.devices import rank_device

pytestmark = [
    pytest.mark.ds_repro(
        id="zero12-empty-param-inside-partition",
        title="ZeRO-1/2 with a zero-element trainable parameter inside a partition: AssertionError 'fragment start "
        "N should be < fragment_end N' at initialize",
        upstream="https://github.com/deepspeedai/DeepSpeed/issues/8297",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/8298",
        fixed_in="0.19.6",
        root_cause="_init_lp_to_hp_mapping counts a zero-element parameter that starts inside a partition as "
        "overlapping it, and the empty fragment then fails get_hp_fragment_mapping's assertion.",
    ),
    TORCH_OPTIMIZER_PREMISE,
    ZERO12_CPU_FLAT_BUFFER,
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/issues/8297",
        raises="AssertionError",
        match=r"fragment start \d+ should be < fragment_end \d+",
        frames=("stage_1_and_2.py:_link_all_hp_params", "tensor_fragment.py:get_hp_fragment_mapping"),
        words=("zero-sized trainable parameter", "strictly inside a data-parallel partition"),
        gpu=True,
    ),
]

HIDDEN = 16
STEPS = 3


def model_with_empty_gate(seed=11):
    """The tiny MLP with, between its layers, a trainable gate over zero channels (an empty 1-D parameter).

    In the flat buffer the gate starts after the first layer's ``16 x 16 + 16`` elements, strictly inside the last
    rank's partition for 2 and 4 ranks.
    """
    import torch

    class ChannelGate(torch.nn.Module):
        """A learnable scale per extra channel; every extra channel pruned, so it holds none."""

        def __init__(self, channels):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(channels, device="cpu"))

        def forward(self, x):
            # the empty scale takes part in autograd, so it gets an (empty) gradient
            return x + self.scale.sum()

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first = torch.nn.Linear(HIDDEN, HIDDEN)
            self.gate = ChannelGate(0)
            self.last = torch.nn.Linear(HIDDEN, 1)

        def forward(self, x):
            return self.last(self.gate(torch.relu(self.first(x))))

    torch.manual_seed(seed)
    return Model().to(rank_device())


def skip_empty_params_in_mapping(monkeypatch):
    """PR #8298's fix: a zero-element parameter overlaps no partition in ``_init_lp_to_hp_mapping``."""
    from deepspeed.utils import mixed_precision_linkage

    from pytest_dsrepro.inrank.backport import backport, release_has

    if release_has(mixed_precision_linkage._init_lp_to_hp_mapping, "lp_param.numel() > 0"):
        return  # this release has the fix
    backport(
        monkeypatch,
        "deepspeed.utils.mixed_precision_linkage",
        [
            (
                r"if current_offset < partition_end and lp_param_end > partition_start:",
                "if lp_param.numel() > 0 and current_offset < partition_end and lp_param_end > partition_start:",
            )
        ],
    )


@pytest.mark.ds_config(config(1), config(2))
@pytest.mark.ds_version(
    affected="<0.19.6",
    raises=AssertionError,
    match=r"fragment start \d+ should be < fragment_end \d+",
    fix=skip_empty_params_in_mapping,
)
def test_empty_param_inside_partition(ds_engine, ds_config, ds_rank, ds_world_size):
    import torch

    model = model_with_empty_gate()
    engine = ds_engine(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2))
    moms: list = []
    lrs = train(engine, ds_rank, STEPS, hidden=HIDDEN, moms=moms)

    # Past the crash the model trains as data parallelism should: plain Adam on every rank's data at once.
    reference = model_with_empty_gate()
    adam = torch.optim.Adam(reference.parameters(), lr=1e-2)
    accumulation = ds_config["gradient_accumulation_steps"]
    train_reference(reference, adam, ds_world_size, STEPS, HIDDEN, lrs, accumulation, moms)
    error = max_difference(engine.module, reference)
    assert error < tolerance(engine, 1e-6), f"weights differ from plain Adam's by {error:.3e}"
