"""A ``torch.func`` transform over a linear layer of a model built under ZeRO-3 dies (deepspeedai/DeepSpeed#7913).

``deepspeed.zero.Init`` (what ``from_pretrained`` enters under a ZeRO-3 config) replaces
``torch.nn.functional.linear`` with ``zero3_linear_wrap`` and leaves it so after the context ("This will persist
unless manually reset"). Its autograd function, ``LinearFunctionForZeroStage3``, is written in the old
``forward(ctx, ...)`` style without ``setup_context``, which torch's functorch transforms refuse. So any loss that
takes ``torch.func.grad_and_value`` over ``F.linear`` (Liger-Kernel's chunked losses do, issue #7323) fails in the
forward of the first step, on every rank. The function dates from the first ZeRO-3 releases; every release before
0.19.1 runs into it with the torch pinned here. PR #7916 gives the function (and ZeRO-3's module backward hooks) a
``setup_context``.
"""

import pytest
from _prerequisites import PERSISTENT_ALLGATHER_RACE, ZERO3_PARTITIONED
from _zero3 import ZERO3

from pytest_dsrepro.inrank.devices import precision_dtype

pytestmark = [
    pytest.mark.ds_repro(
        id="zero3-func-transform-setup-context",
        title="torch.func.grad_and_value over F.linear after zero.Init raises: ZeRO-3's linear lacks setup_context",
        upstream="https://github.com/deepspeedai/DeepSpeed/issues/7913",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/7916",
        fixed_in="0.19.1",
        root_cause="zero.Init leaves torch.nn.functional.linear replaced by zero3_linear_wrap, whose autograd "
        "function LinearFunctionForZeroStage3 saves its tensors in forward(ctx, ...) and has no setup_context, which "
        "torch.func transforms require.",
    ),
    ZERO3_PARTITIONED,
    PERSISTENT_ALLGATHER_RACE,  # its GatheredParameters gathers several parameters at once
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/issues/7323",
        raises="RuntimeError",
        match=r"must override the setup_context staticmethod",
        frames=("linear.py:zero3_linear_wrap",),
        gpu=True,
    ),
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/issues/7913",
        words=("LinearFunctionForZeroStage3", "torch.func", "setup_context"),
    ),
]


def add_setup_context(monkeypatch):
    """PR #7916's change to ZeRO-3's linear, for releases without it: the same forward and backward, with the
    tensors saved in ``setup_context`` (the module backward hooks are not on this repro's path). A no-op where
    the release's function has ``setup_context``."""
    import torch
    from deepspeed.runtime.zero import linear

    if "setup_context" in vars(linear.LinearFunctionForZeroStage3):
        return  # this release has the fix

    class LinearFunctionForZeroStage3(torch.autograd.Function):
        @staticmethod
        def forward(input, weight, bias=None):
            ret = input.matmul(weight.t())
            return ret if bias is None else ret + bias

        @staticmethod
        def setup_context(ctx, inputs, output):
            input, weight = inputs[0], inputs[1]
            ctx.save_for_backward(input, weight, inputs[2] if len(inputs) > 2 else None)

        @staticmethod
        def backward(ctx, grad_output):
            input, weight, bias = ctx.saved_tensors
            grad_input = grad_weight = grad_bias = None
            if ctx.needs_input_grad[0]:
                grad_input = grad_output.matmul(weight)
            if ctx.needs_input_grad[1]:
                grad_weight = (
                    grad_output.reshape(-1, grad_output.shape[-1]).t().matmul(input.reshape(-1, input.shape[-1]))
                )
            if bias is not None and ctx.needs_input_grad[2]:
                grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0)
            return grad_input, grad_weight, grad_bias

    monkeypatch.setattr(linear, "LinearFunctionForZeroStage3", LinearFunctionForZeroStage3)


def chunked_linear_loss(hidden, weight, targets):
    """Liger-Kernel's pattern: the head's loss and its gradients in one ``torch.func.grad_and_value`` call, handed
    back to autograd by a function of its own (the logits are never kept)."""
    import torch

    def loss_of(h, w):
        return torch.nn.functional.mse_loss(torch.nn.functional.linear(h, w), targets)

    class ChunkedLoss(torch.autograd.Function):
        @staticmethod
        def forward(ctx, h, w):
            (grad_h, grad_w), loss = torch.func.grad_and_value(loss_of, argnums=(0, 1))(h, w)
            ctx.save_for_backward(grad_h, grad_w)
            return loss

        @staticmethod
        def backward(ctx, grad):
            grad_h, grad_w = ctx.saved_tensors
            return grad_h * grad, grad_w * grad

    return ChunkedLoss.apply(hidden, weight)


@pytest.mark.ds_config(pytest.param(ZERO3, id="zero3_all_partitioned"))
@pytest.mark.ds_version(
    affected="<0.19.1",
    raises=RuntimeError,
    match="must override the setup_context staticmethod",
    fix=add_setup_context,
)
def test_func_transform_over_zero3_linear(ds_engine, ds_config, ds_rank, ds_device):
    import deepspeed
    import torch

    dtype = precision_dtype(ds_config)

    class WithChunkedLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(8, 16)
            self.head = torch.nn.Linear(16, 4, bias=False)

        def forward(self, x, y):
            hidden = torch.relu(self.body(x))
            return chunked_linear_loss(hidden, self.head.weight, y)

    torch.manual_seed(5)
    plain = WithChunkedLoss()  # the reference: the same weights, plain autograd, torch's own linear
    state = {name: tensor.clone() for name, tensor in plain.state_dict().items()}
    with deepspeed.zero.Init(config_dict_or_path=ds_config):  # as from_pretrained does under a ZeRO-3 config
        model = WithChunkedLoss()
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        if ds_rank == 0:
            model.load_state_dict(state)
    engine = ds_engine(model=model)

    generator = torch.Generator().manual_seed(11 + ds_rank)
    batch = ds_config["train_micro_batch_size_per_gpu"]
    x = torch.randn(batch, 8, generator=generator, device="cpu").to(ds_device, dtype)
    y = torch.randn(batch, 4, generator=generator, device="cpu").to(ds_device, dtype)

    loss = engine(x, y)  # the first forward: zero3_linear_wrap under torch.func.grad_and_value
    reference = plain.to(ds_device, dtype)
    hidden = torch.relu(reference.body(x))
    expected = torch.nn.functional.mse_loss(hidden.matmul(reference.head.weight.t()), y)
    torch.testing.assert_close(loss, expected, msg="the chunked loss differs from plain autograd's")
    engine.backward(loss)
    engine.step()
