"""ZeRO-3 before 0.15.4: a forward whose submodules are not all in the same train/eval mode fails, the
``INFLIGHT`` assertion of ``fetch_sub_module`` (an eval pass with a submodule left in training mode) or "backward
pass is invalid for module in evaluation mode" (training with a submodule kept in eval mode).

ZeRO-3 fetched each submodule's parameters through one of two parameter coordinators, the training one or the
evaluation one, picked by the submodule's own ``training`` flag, each with its own registry of in-flight
all-gathers (PR #3884, 0.10.0, to keep leftovers of an eval pass out of training). A forward whose submodules
disagree (``model.eval()`` for validation while a submodule stays in training mode: Monte-Carlo dropout, a module
whose ``train()`` is overridden, a wrapper that switches a part back) drives both over one pass: the coordinator of
the majority prefetches, from its trace, parameters of the submodule that the other coordinator fetches; that one
finds them ``INFLIGHT`` but absent from its own registry, and asserts with the parameter's summary
(deepspeedai/DeepSpeed#5381: the first validation pass, under ``no_grad``, in eval mode). The other way round
(training with a submodule kept in eval mode, a frozen part), the backward hooks refuse the submodule outright.
PR #6662 (first released in 0.15.4) keeps one coordinator and one registry for both modes, resets its step at the
start of every forward, and drops the backward assertion.
"""

import pytest
from _zero3 import ZERO3

from pytest_dsrepro.inrank.devices import precision_dtype
from pytest_dsrepro.inrank.models import make_batch

pytestmark = [
    pytest.mark.ds_repro(
        id="zero3-mixed-mode-coordinators",
        title="ZeRO-3: a forward mixing train- and eval-mode submodules fails (INFLIGHT assertion in "
        "fetch_sub_module, or 'backward pass is invalid for module in evaluation mode')",
        upstream="https://github.com/deepspeedai/DeepSpeed/issues/5381",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/6662",
        fixed_in="0.15.4",
        root_cause="ZeRO-3 kept a training and an evaluation parameter coordinator, each with its own in-flight "
        "registry, and picked one per submodule by its training flag: in a mixed forward one coordinator prefetches "
        "what the other fetches, which finds it INFLIGHT outside its registry; backward refused eval-mode submodules.",
    ),
    pytest.mark.ds_premise(
        stage=3,
        sets={
            "zero_optimization.stage3_prefetch_bucket_size": 64,
            "zero_optimization.stage3_max_reuse_distance": 0,
            "zero_optimization.stage3_param_persistence_threshold": 0,
            "zero_force_ds_cpu_optimizer": False,
        },
        because="the body's tiny layers (272 elements) must be partitioned and prefetched a layer or two at a time, "
        "as a real model's layers are with the defaults; and where the config names no optimizer the body trains "
        "with torch's Adam, which DeepSpeed refuses beside an offloaded optimizer unless told",
    ),
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/issues/5381",
        raises="AssertionError",
        frames=(
            "partitioned_param_coordinator.py:fetch_sub_module",
            "parameter_offload.py:pre_sub_module_forward_function",
        ),
        words=("__inflight_param_registry", "ZeroParamStatus.INFLIGHT", "no_grad"),
        gpu=True,
    ),
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/6662",
        raises="AssertionError",
        match=r"backward pass is invalid for module in evaluation mode",
        frames=("parameter_offload.py:pre_sub_module_backward_function",),
    ),
]

#: ZeRO-3, every parameter partitioned, prefetching a layer or two ahead.
PREFETCHING = {
    **ZERO3,
    "zero_optimization": {
        **ZERO3["zero_optimization"],
        "stage3_prefetch_bucket_size": 64,
        "stage3_max_reuse_distance": 0,
    },
}


def one_coordinator(monkeypatch):
    """Backport of PR #6662: one parameter coordinator (the training one, with its registry) whatever the
    submodule's mode, its step reset at the start of every forward, and no mode assertion in the backward hooks."""
    import inspect

    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

    from pytest_dsrepro.inrank.backport import backport

    original = DeepSpeedZeRoOffload.get_param_coordinator
    if "training" not in inspect.signature(original).parameters:
        return  # this release has the fix

    def get_param_coordinator(self, training=True):
        return original(self, True)

    monkeypatch.setattr(DeepSpeedZeRoOffload, "get_param_coordinator", get_param_coordinator)
    backport(
        monkeypatch,
        "deepspeed.runtime.zero.parameter_offload",
        [
            (r'assert sub_module\.training, "backward pass is invalid for module in evaluation mode"', "pass"),
            (r"if not torch\._C\.is_grad_enabled\(\):\n +self\.get_param_coordinator\(training=False\)\.reset_step\(\)",
             "self.get_param_coordinator().reset_step()"),
            (r"self\.module\.register_forward_hook\(_end_of_forward_hook\)",
             "self.module.register_forward_pre_hook(_end_of_forward_hook)"),
        ],
    )  # fmt: skip


def train_and_validate(ds_engine, ds_config, ds_rank, ds_device, *, eval_layer_in_training, train_layer_in_eval):
    """A user's loop on a 7-layer MLP: train steps, each followed by a validation pass of a few batches under
    ``no_grad``, with layer 3 kept in eval mode while the rest trains, or left in training mode during validation."""
    import torch

    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 16) for _ in range(6)] + [torch.nn.Linear(16, 1)]
    engine = ds_engine(model=torch.nn.Sequential(*layers).to(ds_device))
    dtype, micro = precision_dtype(ds_config), ds_config["train_micro_batch_size_per_gpu"]
    for step in range(3):
        engine.train()
        if eval_layer_in_training:
            layers[3].eval()
        for micro_step in range(engine.gradient_accumulation_steps()):
            x, y = make_batch(micro, seed=10 * step + micro_step, rank=ds_rank, dtype=dtype)
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            engine.step()
        engine.eval()
        if train_layer_in_eval:
            layers[3].train()
        with torch.no_grad():
            for batch in range(3):
                x, y = make_batch(micro, seed=100 + batch, rank=ds_rank, dtype=dtype)
                assert torch.isfinite(engine(x)).all()


@pytest.mark.ds_config(pytest.param(PREFETCHING, id="zero3_prefetch"))
@pytest.mark.ds_version(affected="<0.15.4", raises=AssertionError, match=r"'status': 'INFLIGHT'", fix=one_coordinator)
def test_zero3_train_layer_in_eval_pass(ds_engine, ds_config, ds_rank, ds_device):
    train_and_validate(ds_engine, ds_config, ds_rank, ds_device, eval_layer_in_training=False, train_layer_in_eval=True)


@pytest.mark.ds_config(pytest.param(PREFETCHING, id="zero3_prefetch"))
@pytest.mark.ds_version(
    affected="<0.15.4",
    raises=AssertionError,
    match=r"backward pass is invalid for module in evaluation mode",
    fix=one_coordinator,
)
def test_zero3_eval_layer_in_training(ds_engine, ds_config, ds_rank, ds_device):
    train_and_validate(ds_engine, ds_config, ds_rank, ds_device, eval_layer_in_training=True, train_layer_in_eval=False)
