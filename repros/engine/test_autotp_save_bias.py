"""AutoTP training, 0.16.4-0.16.5: saving the trained model fails on a tensor-parallel layer with a bias
(IndexError).

AutoTP training (``deepspeed.tp_model_init`` and ``"tensor_parallel": {"autotp_size": N}``, new in 0.16.4) shards
each linear layer of a model over the tensor-parallel ranks. Saving the model (the Trainer's ``save_model``, through
accelerate's ``get_state_dict``, which calls the engine's ``_consolidated_16bit_state_dict`` under AutoTP) gathers
each layer's shards back with ``GatherReplacedLayerParams``, which calls the layer's ``gather_params`` on the weight
and the bias alike. The column-parallel layer (``LinearLayer``: the query, key, value, gate and up projections)
allocated the gathered tensor as ``[ranks * shape[0], shape[1]]``: a bias is one-dimensional, and ``shape[1]``
raises ``IndexError: tuple index out of range``. Every model whose column-parallel projections carry a bias (Qwen2's
query, key and value) fails to save at the end of training. PR #7257 (first in 0.17.0) gathers tensors of any rank
(``[ranks * shape[0], *shape[1:]]``); it also stops sharding the row-parallel layer's bias and adds biases out of
place in training, which a model without row-parallel biases (Qwen2) does not need.

The body trains a tiny Qwen2 with AutoTP over the two ranks for a step, gathers its weights as a saving user does,
and compares what rank 0 got with the same model trained by plain torch on the same batch. Before 0.18.0 AutoTP
training needs PR #7600 on a CPU at all (the prerequisite, ``_autotp.AUTOTP_CPU_DEVICE``).
"""

import pytest
from _autotp import AUTOTP_TRAINING

from pytest_dsrepro.inrank.devices import precision_dtype, rank_device
from pytest_dsrepro.inrank.hf import TINY_CONFIGS, requires_hf, token_batch

pytestmark = [
    pytest.mark.ds_repro(
        id="autotp-save-bias",
        title="AutoTP training: saving the model fails with IndexError on a column-parallel layer's bias",
        upstream="https://github.com/deepspeedai/DeepSpeed/issues/7249",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/7257",
        fixed_in="0.17.0",
        root_cause="LinearLayer.gather_params allocates the gathered tensor as [ranks * shape[0], shape[1]], which a "
        "one-dimensional bias does not have.",
    ),
    *AUTOTP_TRAINING,
    requires_hf,
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/7257",
        raises="IndexError",
        match=r"tuple index out of range",
        frames=("layers.py:gather_params", "layers.py:__enter__", "_replace_module_consolidated_state_dict"),
        words=("GatherReplacedLayerParams", "bias"),
    ),
]

CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "zero_optimization": {"stage": 0, "stage3_gather_16bit_weights_on_model_save": True},
    "tensor_parallel": {"autotp_size": 2},
}


def gather_tensors_of_any_rank(monkeypatch):
    """PR #7257's gather: the column-parallel layer gathers ``[ranks * shape[0], *shape[1:]]`` (a bias too)."""
    from deepspeed.module_inject import layers

    from pytest_dsrepro.inrank.backport import backport, release_has

    if not hasattr(layers, "LinearLayer") or not hasattr(layers.LinearLayer, "gather_params"):
        return
    if not release_has(layers.LinearLayer.gather_params, "param.shape[1],"):
        return  # gathers [ranks * shape[0], *shape[1:]] (0.17.0), or by its partition sizes (later)
    backport(
        monkeypatch,
        "deepspeed.module_inject.layers",
        [
            (
                r"output_param = torch\.empty\(self\.tp_world_size \* param\.shape\[0\],\s*param\.shape\[1\],"
                r"(\s*dtype=param\.dtype,\s*device=param\.device\)\s*dist\.all_gather_into_tensor\(output_param, "
                r"param, group=self\.mp_group\)\s*params_list\[idx\]\.data = output_param)",
                r"output_param = torch.empty((self.tp_world_size * param.shape[0], *param.shape[1:]),\1",
            )
        ],
    )


def tiny_qwen2(seed):
    """A tiny Qwen2 (the sizes of ``inrank.hf``'s tiny Llama): its query, key and value projections carry biases,
    which AutoTP shards with their column-parallel layers."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2", **TINY_CONFIGS["llama"])).to(rank_device())


@pytest.mark.ds_config(pytest.param(CONFIG, id="autotp2"))
@pytest.mark.ds_version(
    affected=">=0.16.4,<0.17.0",
    raises=IndexError,
    match=r"tuple index out of range",
    fix=gather_tensors_of_any_rank,
)
def test_autotp_trained_model_with_biases_saves(ds_config, ds_rank, tmp_path):
    import deepspeed
    import torch

    dtype = precision_dtype(ds_config)
    tp = ds_config["tensor_parallel"]["autotp_size"]
    micro, accumulation = ds_config["train_micro_batch_size_per_gpu"], ds_config["gradient_accumulation_steps"]
    model = deepspeed.tp_model_init(tiny_qwen2(seed=4), tp_size=tp, dtype=dtype)
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1e-2),
        config=ds_config,
    )
    # The ranks of a tensor-parallel group see the same batch.
    batch = token_batch(micro, seed=9, rank=(ds_rank // tp))
    for _ in range(accumulation):
        engine.backward(engine(**batch).loss)
        engine.step()
    # What a Trainer's save_model gets the weights with under AutoTP (accelerate's get_state_dict): the full
    # state dict, on rank 0.
    saved = engine._consolidated_16bit_state_dict()

    if ds_rank != 0:
        return
    reference = tiny_qwen2(seed=4).to(dtype)
    optimizer = torch.optim.SGD(reference.parameters(), lr=1e-2)
    for _ in range(accumulation):
        (reference(**batch).loss / accumulation).backward()
    optimizer.step()
    expected = reference.state_dict()
    assert sorted(saved) == sorted(expected), "the saved model has other tensors"
    rtol = 1e-4 if dtype == torch.float32 else 2e-2
    for name, tensor in expected.items():
        torch.testing.assert_close(saved[name], tensor, rtol=rtol, atol=1e-5, msg=f"saved {name} differs")
