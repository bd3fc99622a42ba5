"""ZeRO-3 forward fails on a sub-module attached after ``deepspeed.initialize`` (deepspeedai/DeepSpeed#6961).

ZeRO-3 initialize replaces every sub-module's ``_parameters`` with a ``ZeROOrderedDict``, which can carry the
``_in_forward`` flag that lets it gather parameters used outside their own module. The engine's forward prologue
then sets ``module._parameters._in_forward = True`` on *every* sub-module, including ones attached later (PEFT
adapters, heads added after the engine exists). Since torch 2.5 a module's own ``_parameters`` is a plain ``dict``,
which takes no attributes, so the first forward raises ``AttributeError`` on every rank. The write dates from
ZeRO-Infinity; with the torch this project pins (2.13) every release up to 0.19.0 is affected. PR #8009 wraps such
dicts in the prologue and skips them in the epilogue (first released in 0.19.1).
"""

import pytest
from _prerequisites import ZERO3_PARTITIONED

from pytest_dsrepro.inrank.devices import precision_dtype
from pytest_dsrepro.inrank.models import make_batch, tiny_mlp

pytestmark = [
    pytest.mark.ds_repro(
        id="zero3-late-module-attach",
        title="ZeRO-3 forward raises AttributeError on a sub-module attached after initialize (torch >= 2.5)",
        upstream="https://github.com/deepspeedai/DeepSpeed/issues/6961",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/8009",
        fixed_in="0.19.1",
        root_cause="The forward prologue sets _in_forward on every sub-module's _parameters, but only modules present "
        "at initialize got a ZeROOrderedDict; torch >= 2.5 keeps a plain dict there, which rejects the attribute.",
    ),
    ZERO3_PARTITIONED,
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/issues/6961",
        frames=("engine.py:_forward_prologue", "engine.py:_forward_epilogue"),
        words=("_in_forward", "torch 2.5", "OrderedDict"),
    ),
]

#: Every parameter partitioned: persistent parameters are gathered by a racy path before 0.19.8 (see
#: test_zero3_persistent_allgather_race.py), and this bug does not depend on them.
ZERO3 = {
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "zero_force_ds_cpu_optimizer": False,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
}


class FlaggableParameters(dict):
    """A module's ``_parameters`` that takes the prologue's ``_in_forward`` flag, as torch's plain dict does not."""


def wrap_late_parameters(monkeypatch):
    """PR #8009's idea for releases without it: before each forward, a sub-module whose ``_parameters`` is still
    torch's plain dict gets one that can carry the flag. PR #8009 uses a ``ZeROOrderedDict``; in older releases
    (0.14.4, 0.15.0) that class reads ``ds_status`` from every parameter it hands out, which a late, unpartitioned
    parameter lacks, so the late modules get a dict that only takes the flag (all the prologue and epilogue ask)."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero import parameter_offload

    if hasattr(parameter_offload, "ensure_zero_ordered_dict"):
        return  # this release has the fix
    forward = DeepSpeedEngine.forward

    def forward_with_late_modules_wrapped(self, *inputs, **kwargs):
        if self.zero_optimization_partition_weights():
            for module in self.module.modules():
                if type(module._parameters) is dict:
                    module._parameters = FlaggableParameters(module._parameters)
        return forward(self, *inputs, **kwargs)

    monkeypatch.setattr(DeepSpeedEngine, "forward", forward_with_late_modules_wrapped)


@pytest.mark.ds_config(pytest.param(ZERO3, id="zero3_all_partitioned"))
@pytest.mark.ds_version(
    affected="<0.19.1",
    raises=AttributeError,
    match="'dict' object has no attribute '_in_forward'",
    fix=wrap_late_parameters,
)
def test_forward_with_module_attached_after_initialize(ds_engine, ds_config, ds_rank):
    import torch

    reference = tiny_mlp(seed=4).to(precision_dtype(ds_config))  # computes as the engine does
    model = tiny_mlp(seed=4)  # the same weights
    head = model[2]
    del model[2]  # the body goes to DeepSpeed; the head comes later, as an adapter would
    engine = ds_engine(model=model)  # the config's optimizer where it has one, else torch's Adam
    engine.module.add_module("head", head.to(precision_dtype(ds_config)))  # as a user casts it to the engine's dtype

    x, y = make_batch(
        ds_config["train_micro_batch_size_per_gpu"], seed=6, rank=ds_rank, dtype=precision_dtype(ds_config)
    )
    out = engine(x)

    # The late head really takes part: output and its (local, unpartitioned) gradient equal plain autograd's.
    expected = reference(x)
    torch.testing.assert_close(out, expected, msg="output differs from the same model without DeepSpeed")
    engine.backward(torch.nn.functional.mse_loss(out, y))
    # engine.backward scales the loss by 1/gradient_accumulation_steps (the config's), as DeepSpeed averages micro-steps
    (torch.nn.functional.mse_loss(expected, y) / engine.gradient_accumulation_steps()).backward()
    torch.testing.assert_close(head.weight.grad, reference[2].weight.grad, msg="late head's gradient differs")
    # A second forward (the epilogue reset the flag on every module, late ones included) gives the same output.
    # No engine.step(): ZeRO-3's step expects every parameter under the module to be partitioned, on fixed releases
    # too; training a late module is out of this bug's scope.
    with torch.no_grad():
        torch.testing.assert_close(engine(x), expected, msg="second forward differs")
