"""ZeRO-1/2 on the CPU accelerator: the first ``step()`` raises autograd's in-place-on-a-view error (PR #7948).

PR #7828 (first in 0.18.7) flattens each parameter group on the accelerator when it has room for the flat buffer,
with ``torch.cat`` over the parameters themselves. They require grad, so the flat buffer has a ``CatBackward0``
history and the per-parameter slices ZeRO cuts from it are views made by a split; the all-gather that writes the
updated partition back into them in ``step()`` is an in-place write on such a view, which autograd refuses
("Output 0 of Split is a view and is being modified inplace"). The CPU accelerator always reports room
(``available_memory()`` is system RAM), so on 0.18.7-0.18.9 every ZeRO-1/2 engine on CPU fails its first step.
PR #7948 (first in 0.19.0) detaches the buffer.

Every other ZeRO-1/2 repro would fail here first on those releases: they carry this fix as a declared
prerequisite (``_prerequisites.ZERO12_CPU_FLAT_BUFFER``).
"""

import pytest
from _prerequisites import FLAT_BUFFER_VIEW_RELEASES, ZERO2_OFFLOAD_ACCUMULATION, detach_flat_buffer
from _zero12 import config, max_difference, tolerance, train, train_reference

from pytest_dsrepro.inrank.models import tiny_mlp

pytestmark = [
    pytest.mark.ds_repro(
        id="zero12-cpu-flat-buffer-view",
        title="ZeRO-1/2 on the CPU accelerator: the first step() writes in place into autograd views of flat buffers",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/7948",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/7948",
        fixed_in="0.19.0",
        root_cause="The on-device flatten (PR #7828) concatenates requires-grad parameters without detaching, so the "
        "parameter views ZeRO writes into in step() carry autograd history; CPU always takes that path.",
    ),
    pytest.mark.ds_premise(
        stage=(1, 2),
        accelerator="cpu",
        sets={"gradient_clipping": 0.0, "zero_force_ds_cpu_optimizer": False},
        because="the body compares the weights with plain torch training, which does not clip gradients, and passes "
        "that torch optimizer to DeepSpeed, which refuses it beside an offloaded optimizer unless allowed",
    ),
    ZERO2_OFFLOAD_ACCUMULATION,
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/blob/v0.18.7/deepspeed/runtime/zero/stage_1_and_2.py#L2087",
        raises="RuntimeError",
        match="is a view and is being modified inplace",
        frames=("stage_1_and_2.py:step",),
        words=("flat buffer", "CPU accelerator"),
    ),
]

STEPS = 3


@pytest.mark.ds_config(config(1), config(2))
@pytest.mark.ds_version(
    affected=FLAT_BUFFER_VIEW_RELEASES,
    raises=RuntimeError,
    match=r"Output 0 of Split is a view and is being modified inplace",
    fix=detach_flat_buffer,
)
def test_zero12_steps_on_cpu(ds_engine, ds_config, ds_rank, ds_world_size):
    import torch

    engine = ds_engine(model=tiny_mlp(seed=5), optimizer="adam")
    moms: list = []
    lrs = train(engine, ds_rank, STEPS, moms=moms)

    # The steps trained as data parallelism should: the same weights as plain Adam on every rank's data at once.
    reference = tiny_mlp(seed=5)
    adam = torch.optim.Adam(reference.parameters(), lr=1e-3)
    train_reference(
        reference, adam, ds_world_size, STEPS, lrs=lrs, accumulation=ds_config["gradient_accumulation_steps"], moms=moms
    )
    error = max_difference(engine.module, reference)
    assert error < tolerance(engine, 1e-6), (
        f"ZeRO-{ds_config['zero_optimization']['stage']} weights differ from plain Adam's by {error:.3e}"
    )
