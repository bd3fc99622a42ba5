"""ZeRO-3 keeps parameters gathered after backward when the model runs a second, ``no_grad`` forward in the step,
as DPO does for its reference pass (DeepSpeed PR #6726).

ZeRO-3 counts, per module, the gradients still to come back through it (``ds_grads_remaining``: one per forward
whose inputs need a gradient) and releases the module's gathered parameters when the count returns to zero in
backward. The forward pre-hook *reset* the count to 0 on every forward, so a second forward under ``no_grad``
between the first forward and ``backward`` (DPO and other preference losses score the batch with the policy under
``no_grad``, or once more for a reference) wipes the first forward's count: in backward it goes to -1, never 0, and
the parameters stay gathered after backward. Every step holds the whole model unpartitioned at once; on real models
that is an out-of-memory error ("I had OOM problem when doing DPO training using zero3"). PR #6726 sets the count
only where a module has none yet (first released in 0.16.0); it also stops the fetch coordinator's count of
available parameters from going negative, a path this repro does not need.
"""

import pytest
from _prerequisites import ZERO3_PARTITIONED
from _zero3 import ZERO3

from pytest_dsrepro.inrank.devices import precision_dtype
from pytest_dsrepro.inrank.models import make_batch

pytestmark = [
    pytest.mark.ds_repro(
        id="zero3-second-forward-keeps-params",
        title="ZeRO-3: a second no_grad forward before backward (DPO) leaves parameters gathered after backward",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/6726",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/6726",
        fixed_in="0.16.0",
        root_cause="The forward pre-hook reset module.ds_grads_remaining to 0 on every forward, so a later no_grad "
        "forward erased the count of the first; backward drove it negative and never ran the post-backward release.",
    ),
    ZERO3_PARTITIONED,
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/6726",
        words=("call module twice in one training step", "OOM problem when doing DPO training using zero3"),
        frames=(
            "parameter_offload.py:_post_backward_module_hook",
            "partitioned_param_coordinator.py:release_and_reset_all",
        ),
        gpu=True,
    ),
]


def count_from_first_forward(monkeypatch):
    """PR #6726 (its module-hook half): a module's count of pending gradients starts at 0 once, and is not reset
    by later forwards."""
    from pytest_dsrepro.inrank.backport import backport, release_has

    module = "deepspeed.runtime.zero.parameter_offload"
    if release_has(module, 'if not hasattr(module, "ds_grads_remaining"):'):
        return  # this release has the fix
    backport(
        monkeypatch,
        module,
        [
            (
                r"(def _post_backward_module_hook\(module, inputs\):\n)( +)module\.ds_grads_remaining = 0",
                r'\1\2if not hasattr(module, "ds_grads_remaining"):\n\2    module.ds_grads_remaining = 0',
            )
        ],
    )


@pytest.mark.ds_config(pytest.param(ZERO3, id="zero3_all_partitioned"))
@pytest.mark.ds_version(
    affected="<0.16.0",
    raises=AssertionError,
    match="parameters still gathered after backward, beyond a plain step",
    fix=count_from_first_forward,
)
def test_params_released_after_backward_with_reference_pass(ds_engine, ds_config, ds_rank):
    import torch
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    torch.manual_seed(41)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
    )
    engine = ds_engine(model=model)
    x, y = make_batch(
        ds_config["train_micro_batch_size_per_gpu"], seed=42, rank=ds_rank, dtype=precision_dtype(ds_config)
    )

    def still_gathered():
        return [name for name, p in engine.module.named_parameters() if p.ds_status != ZeroParamStatus.NOT_AVAILABLE]

    def train_step(with_reference_pass):
        for _ in range(engine.gradient_accumulation_steps()):
            policy = engine(x)
            reference = 0 * policy.detach()
            if with_reference_pass:
                with torch.no_grad():  # the preference loss's second pass over the same model
                    reference = engine(x)
            engine.backward(torch.nn.functional.mse_loss(policy - reference, y - reference))
        held = still_gathered()
        engine.step()
        return held

    # The reference in the same run: what a plain step leaves gathered after backward (this model's first layer,
    # whose input needs no gradient, is released later on some releases).
    plain = train_step(with_reference_pass=False)
    held = [name for name in train_step(with_reference_pass=True) if name not in plain]
    assert not held, f"parameters still gathered after backward, beyond a plain step's: {held}"
