"""ZeRO-3's all-reduce parameter fetch adds one parameter's partition padding into the next parameter
(deepspeedai/DeepSpeed PR #8158).

With ``stage3_use_all_reduce_for_fetch_params`` (PR #5420, 0.14.3; it saves the all-gather's peak memory), ZeRO-3
fetches a module's parameters by having every rank write its partitions into a zeroed flat buffer and summing the
buffers with an all-reduce. The buffer gives each parameter ``ds_numel_aligned`` slots (its size rounded up to a
multiple of the world size), but the loop that places them advanced by ``ds_numel``: after a parameter whose size
is not a multiple of the world size, the next one starts inside its predecessor's padding. The last rank's
partition of the predecessor carries that padding, which ZeRO-3 allocates with ``torch.empty`` and never writes, so
the sum adds whatever memory it got into the next parameter's first elements. Nothing fails: the layer computes
with wrong weights. PR #8158 advances by ``ds_numel_aligned`` (first released in 0.19.4).

The padding's content is what the allocator hands out: stale data on a busy process, often zeros in a fresh one.
As upstream's own test does, the repro makes it deterministic: while the model is built and partitioned under
``deepspeed.zero.Init``, ZeRO-3's ``torch.empty`` returns tensors filled with a sentinel (7777). Nothing is written
into the buffers under test; the sentinel only shows where uninitialised memory ends up.
"""

import pytest

from pytest_dsrepro.inrank.devices import rank_device
from pytest_dsrepro.inrank.models import make_batch

pytestmark = [
    pytest.mark.ds_repro(
        id="zero3-allreduce-fetch-padded",
        title="ZeRO-3 stage3_use_all_reduce_for_fetch_params: a parameter after a padded one is fetched with its "
        "predecessor's padding added in (silent)",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/8158",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/8158",
        fixed_in="0.19.4",
        root_cause="The all-reduce fetch sizes each parameter's slot by ds_numel_aligned but places the next "
        "parameter after ds_numel, so the last rank's uninitialised partition padding is summed into it.",
    ),
    pytest.mark.ds_premise(
        stage=3,
        config={"zero_optimization.stage3_use_all_reduce_for_fetch_params": True},
        sets={
            "gradient_clipping": 0.0,
            "zero_optimization.stage3_param_persistence_threshold": 0,
            "zero_force_ds_cpu_optimizer": False,
        },
        because="the body takes the same SGD step by hand, unclipped, and checks every parameter as it is fetched; "
        "a torch optimizer beside CPU optimizer offload needs zero_force_ds_cpu_optimizer off",
    ),
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/blob/v0.19.3/deepspeed/runtime/zero/partitioned_param_coordinator.py#L310",
        words=("stage3_use_all_reduce_for_fetch_params", "ds_numel_aligned", "all-reduce fetch"),
    ),
]

ZERO3_ALL_REDUCE_FETCH = {
    "zero_optimization": {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,  # every parameter is fetched, none kept whole
        "stage3_use_all_reduce_for_fetch_params": True,
    },
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "zero_force_ds_cpu_optimizer": False,
    "zero_allow_untested_optimizer": True,  # plain SGD: the reference takes the same step by hand
}
SENTINEL = 7777.0
#: Odd sizes: with 2 ranks every weight and bias (35, 7, 7, 1 elements) is padded by one element.
IN, OUT = 5, 7


def advance_by_aligned_size(monkeypatch):
    """Backport of PR #8158: the all-reduce fetch places each parameter ``ds_numel_aligned`` after the last."""
    from deepspeed.runtime.zero import partition_parameters

    from pytest_dsrepro.inrank.backport import backport, release_has

    if not release_has(partition_parameters.Init, "start_param += param.ds_numel\n"):
        return  # this release has the fix
    backport(
        monkeypatch,
        "deepspeed.runtime.zero.partition_parameters",
        [(r"start_param \+= param\.ds_numel\n", "start_param += param.ds_numel_aligned\n")],
    )


def accept_wait_arguments(monkeypatch):
    """PR #7414 (0.17.3): ``AllReduceCoalescedHandle.wait`` takes the ``handle_dependency`` argument that PR #6694
    (0.16.3) passes to every fetch handle's ``wait``; without it the all-reduce fetch fails with a ``TypeError``."""
    import functools

    from deepspeed.runtime.zero.partition_parameters import AllReduceCoalescedHandle

    from pytest_dsrepro.inrank.backport import release_has

    if not release_has(AllReduceCoalescedHandle, "def wait(self) -> None:"):
        return  # fixed (0.17.3), or before PR #6694 (the wait takes its arguments through **kwargs from then on)
    wait = AllReduceCoalescedHandle.wait

    @functools.wraps(wait)
    def wait_ignoring_arguments(self, **_kwargs):
        return wait(self)

    monkeypatch.setattr(AllReduceCoalescedHandle, "wait", wait_ignoring_arguments)


def model_with_sentinel_padding(ds_config):
    """``Linear(5, 7) -> ReLU -> Linear(7, 1)``, built and partitioned under ``zero.Init`` while ZeRO-3's
    ``torch.empty`` fills what it allocates with ``SENTINEL``; and the same weights as a plain torch module."""
    import deepspeed
    import torch
    from deepspeed.runtime.zero import partition_parameters

    def build(seed):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(IN, OUT), torch.nn.ReLU(), torch.nn.Linear(OUT, 1))

    reference = build(seed=9).to(rank_device())  # where the engine computes: the rank's device
    real_empty, public_empty = partition_parameters._orig_torch_empty, torch.empty

    def sentinel_empty(*args, **kwargs):
        tensor = real_empty(*args, **kwargs)
        return tensor.fill_(SENTINEL) if tensor.is_floating_point() else tensor

    partition_parameters._orig_torch_empty = sentinel_empty
    try:
        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = build(seed=9)
    finally:  # zero.Init's exit puts back torch.empty from _orig_torch_empty: both are restored here
        partition_parameters._orig_torch_empty, torch.empty = real_empty, public_empty
    return model, reference


@pytest.mark.ds_prerequisite(
    fix=accept_wait_arguments,
    releases=">=0.16.3,<0.17.3",
    reason="PR #7414: from 0.16.3 to 0.17.2 every all-reduce fetch fails first, TypeError: AllReduceCoalescedHandle"
    ".wait() got an unexpected keyword argument 'handle_dependency'",
)
@pytest.mark.ds_config(pytest.param(ZERO3_ALL_REDUCE_FETCH, id="zero3_all_reduce_fetch"))
@pytest.mark.ds_version(
    affected="<0.19.4",
    raises=AssertionError,
    match="fetched with wrong values",
    fix=advance_by_aligned_size,
)
def test_all_reduce_fetch_returns_the_parameters(ds_engine, ds_config, ds_rank):
    import torch

    model, reference = model_with_sentinel_padding(ds_config)
    engine = ds_engine(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = make_batch(ds_config["train_micro_batch_size_per_gpu"], hidden=IN, seed=2, rank=ds_rank)

    for step in range(2):
        seen = {}

        def record(module, _inputs, seen=seen):
            seen[module] = (module.weight.clone(), module.bias.clone())

        hooks = [model[i].register_forward_pre_hook(record) for i in (0, 2)]
        out = engine(x)
        for hook in hooks:
            hook.remove()
        # What each layer computed with, against the plain module (the fetch only moves partitions; the sentinel
        # would be off by thousands).
        for i in (0, 2):
            weight, bias = seen[model[i]]
            if not (torch.allclose(weight, reference[i].weight) and torch.allclose(bias, reference[i].bias)):
                raise AssertionError(
                    f"step {step}: layer {i} fetched with wrong values: bias {bias.tolist()}, "
                    f"expected {reference[i].bias.tolist()}"
                )
        expected = reference(x)
        torch.testing.assert_close(out, expected)
        loss = torch.nn.functional.mse_loss(out, y)
        engine.backward(loss)
        engine.step()
        # The reference takes the same SGD step on the mean of the ranks' gradients.
        reference.zero_grad()
        torch.nn.functional.mse_loss(expected, y).backward()
        with torch.no_grad():
            for p in reference.parameters():
                torch.distributed.all_reduce(p.grad)
                p -= 0.1 * p.grad / torch.distributed.get_world_size()
