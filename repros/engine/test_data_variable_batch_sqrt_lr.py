"""Variable batch sizes with ``lr_scaling_method: "sqrt"``: building the learning-rate scheduler raises TypeError.

Dynamic batching (``data_efficiency.data_sampling.dynamic_batching``, PR #7104) packs sequences into batches of up
to ``max_tokens`` and scales the learning rate of each step to its batch's size. Its ``scale_lr`` computed the
square-root method as ``torch.sqrt(batch_size / base_batch_size)``, a Python float where torch wants a tensor, so
``get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed`` dies at once (the scheduler scales the first
batch's rate in its constructor) with ``sqrt(): argument 'input' (position 1) must be Tensor, not float``: the
"sqrt" method documented beside "linear" cannot be used at all (issue #7733). PR #7735 (first released in 0.18.4)
uses ``math.sqrt``. Dynamic batching first shipped in 0.16.5.
"""

import pytest

pytestmark = [
    pytest.mark.ds_repro(
        id="data-variable-batch-sqrt-lr",
        title="Dynamic batching with lr_scaling_method sqrt: torch.sqrt of a float raises TypeError",
        upstream="https://github.com/deepspeedai/DeepSpeed/issues/7733",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/7735",
        fixed_in="0.18.4",
        root_cause="scale_lr passed a Python float to torch.sqrt, which takes tensors only.",
    ),
    pytest.mark.ds_premise(
        config={
            "data_efficiency.data_sampling.dynamic_batching.enabled": True,
            "data_efficiency.data_sampling.dynamic_batching.lr_scaling_method": "sqrt",
        }
    ),
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/issues/7733",
        raises="TypeError",
        match=r"sqrt\(\): argument 'input' \(position 1\) must be Tensor, not float",
        frames=("variable_batch_size_and_lr.py:scale_lr", "variable_batch_size_and_lr.py:step"),
        words=("lr_scaling_method", "scale_lr"),
    ),
]

LR = 0.1
CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "data_efficiency": {
        "enabled": True,
        "seed": 1234,
        "data_sampling": {
            "enabled": True,
            "num_workers": 0,
            "dynamic_batching": {
                "enabled": True,
                "lr_scaling_method": "sqrt",
                "max_tokens": 40,
                "min_batch_size": 1,
                "sequence_picking_order": "dataloader",
            },
        },
    },
}


def math_sqrt(monkeypatch):
    """Backport of PR #7735: the square-root scaling uses ``math.sqrt``."""
    from pytest_dsrepro.inrank.backport import backport, release_has

    module = "deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr"
    if not release_has(module, "torch.sqrt(batch_size / base_batch_size)"):
        return  # this release has the fix
    backport(
        monkeypatch,
        module,
        [(r"torch\.sqrt\(batch_size / base_batch_size\)", "__import__('math').sqrt(batch_size / base_batch_size)")],
    )


@pytest.mark.ds_config(pytest.param(CONFIG, id="dynamic_batching_sqrt"))
@pytest.mark.ds_not_applicable(releases="<0.16.5", reason="dynamic batching first shipped in 0.16.5 (PR #7104)")
@pytest.mark.ds_version(
    affected=">=0.16.5,<0.18.4",
    raises=TypeError,
    match=r"sqrt\(\): argument 'input' \(position 1\) must be Tensor, not float",
    fix=math_sqrt,
)
def test_sqrt_scaled_learning_rate(ds_engine, ds_config, ds_device):
    import math

    import numpy as np
    import torch
    from deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr import (
        get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed,
    )

    from pytest_dsrepro.inrank.models import tiny_mlp

    generator = torch.Generator(device="cpu").manual_seed(0)
    seqlens = torch.randint(3, 12, (32,), generator=generator, device="cpu").tolist()
    dataset = [torch.ones(n, device=ds_device) for n in seqlens]  # token sequences of varying length
    model = tiny_mlp(seed=1)
    engine = ds_engine(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR))
    _, scheduler, _ = get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(
        dataset, engine, dataset_seqlens=np.array(seqlens, dtype=np.int64)
    )
    # The first batch's rate: the optimizer's, scaled by the square root of its size over the reference batch size.
    size, base = scheduler.batch_sizes[0], engine.train_batch_size()
    (got,) = scheduler.get_lr()
    assert math.isclose(got, LR * math.sqrt(size / base), rel_tol=1e-9), (got, size, base)
