"""Training only the biases of a model built under ZeRO-3 crashes in the backward of its first linear
(deepspeedai/DeepSpeed#7435).

``deepspeed.zero.Init`` replaces ``torch.nn.functional.linear`` with ZeRO-3's memory-efficient
``LinearFunctionForZeroStage3`` (``zero_optimization.memory_efficient_linear``, on by default). Its backward set
``dim = grad_output.dim()`` only inside the branch that computes the weight's gradient, and the bias branch reads it.
With the weights frozen and the biases trained (BitFit, or a bias-only fine-tune) the weight branch is skipped and
the first backward raises ``UnboundLocalError`` on every rank. The code is as old as the function; PR #7449 moves the
assignment before the branches (first released in 0.17.4).
"""

import pytest
from _prerequisites import ZERO3_PARTITIONED
from _zero3 import ZERO3

from pytest_dsrepro.inrank.devices import precision_dtype
from pytest_dsrepro.inrank.models import make_batch

pytestmark = [
    pytest.mark.ds_repro(
        id="zero3-linear-bias-only-dim",
        title="ZeRO-3 memory-efficient linear: training only biases raises UnboundLocalError 'dim' in backward",
        upstream="https://github.com/deepspeedai/DeepSpeed/issues/7435",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/7449",
        fixed_in="0.17.4",
        root_cause="LinearFunctionForZeroStage3.backward assigns dim only when the weight needs a gradient, and "
        "reads it to reduce the bias gradient; with frozen weights and trainable biases it is unbound.",
    ),
    ZERO3_PARTITIONED,
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/issues/7435",
        raises="UnboundLocalError",
        match=r"local variable 'dim'",
        frames=("linear.py:backward",),
        gpu=True,
    ),
]

#: The most optimizer steps the body takes for every bias to move (one in its own fp32 config).
MAX_STEPS = 6


def assign_dim_first(monkeypatch):
    """PR #7449's one-line move: ``dim`` is assigned before the gradient branches."""
    import inspect

    from deepspeed.runtime.zero.linear import LinearFunctionForZeroStage3

    from pytest_dsrepro.inrank.backport import backport

    source = inspect.getsource(LinearFunctionForZeroStage3.backward)
    if source.index("dim = grad_output.dim()") < source.index("if ctx.needs_input_grad[0]:"):
        return  # this release has the fix
    backport(
        monkeypatch,
        "deepspeed.runtime.zero.linear",
        [
            (r"(\n(\s*)if ctx\.needs_input_grad\[0\]:)", r"\n\2dim = grad_output.dim()\1"),
        ],
    )


@pytest.mark.ds_config(pytest.param(ZERO3, id="zero3_all_partitioned"))
@pytest.mark.ds_version(
    affected="<0.17.4",
    raises=UnboundLocalError,
    match="local variable 'dim'",
    fix=assign_dim_first,
)
def test_train_only_biases(ds_engine, ds_config, ds_rank):
    import deepspeed
    import torch
    from deepspeed.utils import safe_get_full_fp32_param

    with deepspeed.zero.Init(config_dict_or_path=ds_config):  # F.linear becomes ZeRO-3's memory-efficient linear
        torch.manual_seed(3)
        model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name.endswith("bias"))  # a bias-only fine-tune (BitFit)
    biases = [p for p in model.parameters() if p.requires_grad]
    engine = ds_engine(model=model, optimizer=torch.optim.Adam(biases, lr=1e-2))

    def gathered():
        """The biases' fp32 masters (what the optimizer steps: a bf16 bias moves only once its master has moved by
        half a bf16 unit, which a small rate takes many steps to do) and the frozen weights, which have none, as the
        model holds them; one parameter at a time (a coalesced gather of several races on gloo before 0.19.8)."""
        values = {}
        for name, parameter in model.named_parameters():
            if parameter.requires_grad:
                values[name] = safe_get_full_fp32_param(parameter).clone()  # a collective: every rank, in order
            else:
                with deepspeed.zero.GatheredParameters([parameter]):
                    values[name] = parameter.detach().clone()
        return values

    before = gathered()
    micro = ds_config["train_micro_batch_size_per_gpu"]
    dtype = precision_dtype(ds_config)
    # Optimizer steps of the config's accumulation steps each, until every bias moved: a config's warm-up may give
    # the first step a rate of 0.
    for step in range(MAX_STEPS):
        for micro_step in range(engine.gradient_accumulation_steps()):
            x, y = make_batch(micro, seed=1 + 100 * step + micro_step, rank=ds_rank, dtype=dtype)
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            engine.step()
        after = gathered()
        if all(not torch.equal(before[name], after[name]) for name in before if name.endswith("bias")):
            break
    for name in before:
        moved = not torch.equal(before[name], after[name])
        assert moved == name.endswith("bias"), f"{name}: moved={moved} after {step + 1} bias-only step(s)"
