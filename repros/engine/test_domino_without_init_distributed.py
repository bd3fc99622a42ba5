"""Domino, 0.16.0-0.16.2: a Domino transformer built without ``deepspeed.init_distributed()`` fails in its first
forward ("'NoneType' object has no attribute 'all_reduce'").

Domino (``deepspeed.runtime.domino``, new in 0.16.0) overlaps the tensor-parallel all-reduces of a Megatron
transformer layer with the computation of the other half of the batch; it issues them through
``deepspeed.comm.all_reduce``. A Megatron-DeepSpeed training script sets up ``torch.distributed`` and its
tensor-parallel groups itself, and nothing else in a Domino run calls ``deepspeed.init_distributed()``: DeepSpeed's
comm layer then has no backend, and the layer's first all-reduce fails with "AttributeError: 'NoneType' object has no
attribute 'all_reduce'" (DeepSpeedExamples#940, deepspeedai/DeepSpeed#6851). PR #6880 (first in 0.16.3) initialises
DeepSpeed's comm layer when a Domino layer is built and none is set up. 0.17.0 rewrote Domino's layers (PR #7178: they
build their own parallel linears instead of taking Megatron's classes), with the same initialisation in the model's
constructor; the stand-ins for Megatron's classes this repro passes fit only the 0.16 constructor, so it is not
applicable there.

The body does what a Megatron-DeepSpeed script does: ``torch.distributed.init_process_group`` (no
``deepspeed.init_distributed``), a tensor-parallel group of the two ranks, and a one-layer ``DominoTransformer`` built
from tiny stand-ins for Megatron's layer norm and parallel linears; it runs a forward over the two half-batches and a
backward: the outputs must be finite and every parameter must get a gradient. (The outputs are not compared across the
ranks: Domino's overlapped asynchronous all-reduces gave the two ranks different outputs in some runs on gloo, with
and without the fix, on 0.16.0 and 0.16.3 alike; a matter apart from this bug.)
"""

import types

import pytest

from pytest_dsrepro.inrank.devices import precision_dtype

pytestmark = [
    pytest.mark.ds_repro(
        id="domino-without-init-distributed",
        title="Domino transformer without deepspeed.init_distributed(): 'NoneType' object has no attribute "
        "'all_reduce' in the first forward",
        upstream="https://github.com/deepspeedai/DeepSpeed/issues/6851",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/6880",
        fixed_in="0.16.3",
        root_cause="Domino's layers all-reduce through deepspeed.comm, whose backend only deepspeed.init_distributed "
        "sets up, and a Megatron-DeepSpeed Domino run never calls it.",
    ),
    pytest.mark.ds_premise(),  # Domino is built by the user's Megatron-DeepSpeed script, whatever the config
    pytest.mark.ds_world(process_group=False),
    pytest.mark.ds_not_applicable("<0.16.0", reason="Domino appeared in 0.16.0"),
    pytest.mark.ds_not_applicable(
        ">=0.17.0",
        reason="0.17.0 rewrote Domino's constructors (PR #7178: no Megatron layer classes passed in); the model "
        "initialises deepspeed.comm itself there",
    ),
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeedExamples/issues/940",
        raises="AttributeError",
        match=r"'NoneType' object has no attribute 'all_reduce'",
        frames=("comm.py:all_reduce", "transformer.py:forward"),
        words=("Domino", "DominoTransformerLayer"),
    ),
]

#: No engine: Domino's layers are built and run by the user's Megatron-DeepSpeed script.
CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}
HIDDEN, HEADS, SEQUENCE = 8, 2, 4


def init_comm_in_the_layer(monkeypatch):
    """PR #6880: a Domino layer initialises deepspeed.comm when it is built and it is not initialised yet."""
    from deepspeed.runtime.domino import transformer

    from pytest_dsrepro.inrank.backport import backport, release_has

    if release_has(transformer.DominoTransformerLayer.__init__, "dist.init_distributed()"):
        return
    backport(
        monkeypatch,
        "deepspeed.runtime.domino.transformer",
        [
            (
                r"\n( +)super\(DominoTransformerLayer, self\)\.__init__\(\)\n",
                r"\n\1super(DominoTransformerLayer, self).__init__()\n\1if not dist.is_initialized():\n"
                r"\1    dist.init_distributed()\n",
            )
        ],
    )


def megatron_stand_ins(group, tp, device, dtype):
    """What a Megatron-DeepSpeed model hands Domino: its layer norm, its weight initialiser and its column- and
    row-parallel linears (each rank holds its slice; the row-parallel one leaves the all-reduce to Domino)."""
    import torch

    class ColumnParallelLinear(torch.nn.Module):
        def __init__(self, inputs, outputs, config, init_method, bias, gather_output):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(outputs // tp, inputs, device=device, dtype=dtype))
            init_method(self.weight)

        def forward(self, x):
            return x @ self.weight.t(), None

    class RowParallelLinearNoComm(torch.nn.Module):
        def __init__(self, inputs, outputs, config, init_method, bias, input_is_parallel, skip_bias_add):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(outputs, inputs // tp, device=device, dtype=dtype))
            init_method(self.weight)

        def forward(self, x):
            return x @ self.weight.t(), None

    def layer_norm(hidden, eps, no_persist_layer_norm):
        return torch.nn.LayerNorm(hidden, eps=eps, device=device, dtype=dtype)

    def initialize_affine_weight(weight, init_method, partition_dim, stride):
        init_method(weight)

    def bias_dropout_add(x, bias, residual, prob):
        return residual + (x if bias is None else x + bias)

    return dict(
        fused_layer_norm=layer_norm,
        _initialize_affine_weight_gpu=initialize_affine_weight,
        ColumnParallelLinear=ColumnParallelLinear,
        RowParallelLinearNoComm=RowParallelLinearNoComm,
        apply_rotary_pos_emb=None,
        bias_dropout_add_fused_train=bias_dropout_add,
        bias_dropout_add_fused_inference=bias_dropout_add,
    )


@pytest.mark.ds_config(pytest.param(CONFIG, id="tp2"))
@pytest.mark.ds_version(
    affected=">=0.16.0,<0.16.3",
    raises=AttributeError,
    match=r"'NoneType' object has no attribute 'all_reduce'",
    fix=init_comm_in_the_layer,
)
def test_domino_transformer_forward_without_init_distributed(ds_config, ds_rank, ds_device):
    import torch
    from deepspeed.runtime.domino.transformer import DominoTransformer, ModelType

    torch.distributed.init_process_group("gloo")  # what Megatron's initialize does; no deepspeed.init_distributed()
    tp = torch.distributed.get_world_size()
    group = torch.distributed.new_group(list(range(tp)))
    mpu = types.SimpleNamespace(
        get_tensor_model_parallel_world_size=lambda: tp,
        get_tensor_model_parallel_rank=lambda: torch.distributed.get_rank(group),
        get_tensor_model_parallel_group=lambda: group,
    )
    dtype = precision_dtype(ds_config)
    generator = torch.Generator().manual_seed(1 + ds_rank)  # each rank its own slices

    def init_method(weight):
        with torch.no_grad():
            weight.copy_(torch.randn(weight.shape, generator=generator, device="cpu").mul_(0.2))

    config = types.SimpleNamespace(
        num_layers=1, hidden_size=HIDDEN, ffn_hidden_size=2 * HIDDEN, num_attention_heads=HEADS,
        kv_channels=HIDDEN // HEADS, attention_dropout=0.0, hidden_dropout=0.0, layernorm_epsilon=1e-5,
        no_persist_layer_norm=False, llama_model=False, apply_residual_connection_post_layernorm=False,
        init_method=init_method, output_layer_init_method=init_method, add_bias_linear=False,
        gated_linear_unit=False, swiglu=False, params_dtype=dtype, perform_initialization=True,
    )  # fmt: skip
    model = DominoTransformer(
        config, ModelType.encoder_or_decoder, mpu, **megatron_stand_ins(group, tp, ds_device, dtype)
    )
    micro = ds_config["train_micro_batch_size_per_gpu"]
    data = torch.Generator().manual_seed(7)  # the same half-batches on both tensor-parallel ranks
    halves = [
        torch.randn(SEQUENCE, micro, HIDDEN, generator=data, device="cpu").to(ds_device, dtype).requires_grad_()
        for _ in range(2)
    ]
    out0, out1 = model(halves, None)
    (out0.float().pow(2).mean() + out1.float().pow(2).mean()).backward()

    assert all(torch.isfinite(out).all().item() for out in (out0, out1)), "the Domino layer gave non-finite outputs"
    missing = [name for name, p in model.named_parameters() if p.grad is None]
    assert not missing, f"no gradient for {missing}"
