"""ZeRO-3 with ``torch_autocast``: a LoRA layer with a bf16 base weight and fp32 adapters fails in its first forward
(deepspeedai/DeepSpeed PR #8113).

With ``torch_autocast`` on, ZeRO-3 all-gathers the parameters of the modules declared safe in lower precision in the
autocast dtype, and buckets a module's coalesced fetch by that communication dtype. The function that gathers one
bucket still asserted that the parameters' *own* dtypes agree: "all params must have the same dtype". A LoRA layer
as PEFT builds it keeps its frozen base weight in bf16 and its trainable adapters in fp32 (PEFT's
``autocast_adapter_dtype``) in one module; declared autocast-safe, all three are gathered in bf16, in one bucket,
and the first forward fails on every rank. PR #8113 checks the communication dtype instead (first released in
0.19.3). The assertion dates from PR #6993, which brought ``torch_autocast`` in 0.17.2, but until PR #7543 (0.17.6)
``torch_autocast`` refused at ``initialize`` any parameter that is not fp32, so a bf16 base weight never got that far.

(PEFT's own ``lora.Linear`` keeps base and adapters in separate ``nn.Linear`` children, fetched one module at a time:
a tiny Llama with PEFT LoRA under this config trained 4 steps on 0.19.2 without the error. So the repro holds the
three parameters in one module, as upstream's test does.)
"""

import pytest

from pytest_dsrepro.inrank.models import lora_linear, make_batch

pytestmark = [
    pytest.mark.ds_repro(
        id="zero3-autocast-mixed-dtype",
        title="ZeRO-3 torch_autocast with a bf16 base weight and fp32 LoRA adapters in one module: AssertionError "
        "'all params must have the same dtype'",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/8113",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/8113",
        fixed_in="0.19.3",
        root_cause="ZeRO-3 buckets a coalesced all-gather by autocast communication dtype, but the bucket's gather "
        "asserted that the parameters' own dtypes are equal.",
    ),
    pytest.mark.ds_premise(
        stage=3,
        config={"torch_autocast.enabled": True},
        sets={"zero_force_ds_cpu_optimizer": False},
        because="the body trains the adapters with torch's SGD: a torch optimizer beside CPU optimizer offload needs "
        "zero_force_ds_cpu_optimizer off",
    ),
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/blob/v0.19.2/deepspeed/runtime/zero/partition_parameters.py#L1236",
        frames=("partition_parameters.py:_all_gather_dtype",),
        words=("torch_autocast", "lower_precision_safe_modules"),
    ),
]

ZERO3_AUTOCAST = {
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "torch_autocast": {
        "enabled": True,
        "dtype": "torch.bfloat16",
        "lower_precision_safe_modules": ["pytest_dsrepro.inrank.models.LoraLinear"],
    },
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "zero_force_ds_cpu_optimizer": False,
    "zero_allow_untested_optimizer": True,  # plain SGD on the adapters
}


def check_communication_dtype(monkeypatch):
    """Backport of PR #8113: a bucket's parameters must share their communication dtype, not their own dtype."""
    from deepspeed.runtime.zero import partition_parameters

    from pytest_dsrepro.inrank.backport import backport, release_has

    if not release_has(partition_parameters.Init, '"all params must have the same dtype"'):
        return  # this release has the fix
    backport(
        monkeypatch,
        "deepspeed.runtime.zero.partition_parameters",
        [
            (
                r'assert all\(p\.dtype == dtype for p in params\), "all params must have the same dtype"',
                "assert all(get_allgather_dtype(p, p.ds_tensor) == allgather_dtype for p in params), "
                '"all params in a coalesced bucket must have the same communication dtype"',
            )
        ],
    )


@pytest.mark.ds_config(pytest.param(ZERO3_AUTOCAST, id="zero3_autocast_bf16"))
@pytest.mark.ds_not_applicable(
    releases="<0.17.6",
    reason="torch_autocast arrived in 0.17.2 (PR #6993) and required every parameter in fp32 (AssertionError: All "
    "parameters must be float32 for torch autocast) until PR #7543 (0.17.6)",
)
@pytest.mark.ds_version(
    affected=">=0.17.6,<0.19.3",
    raises=AssertionError,
    match="all params must have the same dtype",
    fix=check_communication_dtype,
)
def test_lora_layer_with_bf16_base_under_torch_autocast(ds_engine, ds_config, ds_rank):
    import torch
    from deepspeed.utils import safe_get_full_fp32_param

    model = lora_linear(features=16, rank=4, base_dtype=torch.bfloat16, seed=3)
    reference = lora_linear(features=16, rank=4, base_dtype=torch.bfloat16, seed=3)
    adapters = [model.lora_a, model.lora_b]
    engine = ds_engine(model=model, optimizer=torch.optim.SGD(adapters, lr=0.05))
    x, _ = make_batch(ds_config["train_micro_batch_size_per_gpu"], seed=4, rank=ds_rank)
    losses = []
    for _ in range(3):
        loss = torch.nn.functional.mse_loss(engine(x).float(), x)  # the adapters learn what the base lacks
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], f"the adapters did not train: {losses}"
    # The base weight is frozen and still bit-identical to the reference's; the adapters moved, the same on all ranks.
    from deepspeed import zero

    with zero.GatheredParameters([model.weight]):
        torch.testing.assert_close(model.weight.data, reference.weight, rtol=0, atol=0)
    trained = torch.cat([safe_get_full_fp32_param(p).flatten() for p in adapters])
    assert not torch.equal(trained[-64:], torch.zeros_like(trained[-64:])), "lora_b never left zero"
    gathered = [torch.empty_like(trained) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(gathered, trained)
    assert all(torch.equal(g, gathered[0]) for g in gathered), "ranks disagree on the trained adapters"
