"""ZeRO-3 keeps parameters gathered through backward when the model runs a second, ``no_grad`` forward in the step,
as DPO does for its reference pass (DeepSpeed PR #6726, rolled back by PR #7258).

ZeRO-3 counts, per module, the gradients still to come back through it (``ds_grads_remaining``: one per forward
whose inputs need a gradient) and releases the module's gathered parameters when the count returns to zero in
backward. The forward pre-hook *resets* the count to 0 on every forward, so a second forward under ``no_grad``
between the first forward and ``backward`` (DPO and other preference losses score the batch with the policy under
``no_grad``, or once more for a reference) wipes the first forward's count: in backward it goes to -1, never 0, so
no layer is released after its gradients and backward ends with the whole model unpartitioned at once. On real
models that is an out-of-memory error ("I had OOM problem when doing DPO training using zero3").

PR #6726 set the count only where a module has none yet (first released in 0.16.0; it also stopped the fetch
coordinator's count of available parameters from going negative, a path this repro does not need). PR #7258
("rollback #6726", commit f45950258, first released in 0.16.8, for issue #7116) restored the reset, and the bug is
back from 0.16.8 (of the catalogue's releases: 0.16.5 passes, 0.17.0 fails). No release since fixes the count
(0.19.8 still resets it). PR #8148 (commit a31eb3165, first released in 0.19.3, for activation checkpointing with
frozen parameters) drains, at the end of every backward, the modules whose post-backward hook never fired, so from
0.19.3 the parameters are no longer left gathered *after* backward; they still stay gathered inside backward, after
their gradients, which is where the memory peaks. The test therefore looks inside backward, when it reaches the
first layer, and the second range is open.
"""

import pytest
from _prerequisites import ZERO3_PARTITIONED
from _zero3 import ZERO3

from pytest_dsrepro.inrank.devices import precision_dtype
from pytest_dsrepro.inrank.models import make_batch

pytestmark = [
    pytest.mark.ds_repro(
        id="zero3-second-forward-keeps-params",
        title="ZeRO-3: a second no_grad forward before backward (DPO) keeps parameters gathered through backward",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/6726",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/6726",
        fixed_in=None,
        root_cause="The forward pre-hook resets module.ds_grads_remaining to 0 on every forward, so a later no_grad "
        "forward erases the count of the first; backward drives it negative and never runs the post-backward release. "
        "PR #6726 fixed it in 0.16.0; PR #7258 rolled that back in 0.16.8, and no release has fixed it again (from "
        "0.19.3, PR #8148 releases the leftovers only at the end of backward).",
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
    """PR #6726 (its module-hook half), on the releases before it and on those since its rollback (PR #7258): a
    module's count of pending gradients starts at 0 once, and is not reset by later forwards."""
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
    match="parameters still gathered in backward after their gradients, beyond a plain step",
    fix=count_from_first_forward,
)
# PR #7258 rolled PR #6726 back (first released in 0.16.8): the same bug, the same face; unfixed upstream since.
@pytest.mark.ds_version(
    affected=">=0.16.8",
    raises=AssertionError,
    match="parameters still gathered in backward after their gradients, beyond a plain step",
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

    # What is gathered when backward reaches the first layer's output: by then the later layers' gradients are done
    # and their post-backward hooks have released them (the first layer itself is about to be fetched, or prefetched,
    # and is not judged). 0.19.3 and later release a backward's leftovers at its end, so a check after backward alone
    # misses the bug there, while the whole model is still gathered at once inside backward.
    in_backward = []

    def first_layer_output_hook(module, inputs, output):
        if output.requires_grad:
            output.register_hook(lambda grad: in_backward.extend(n for n in still_gathered() if not n.startswith("0.")))

    engine.module[0].register_forward_hook(first_layer_output_hook)

    def train_step(with_reference_pass):
        in_backward.clear()
        for _ in range(engine.gradient_accumulation_steps()):
            policy = engine(x)
            reference = 0 * policy.detach()
            if with_reference_pass:
                with torch.no_grad():  # the preference loss's second pass over the same model
                    reference = engine(x)
            engine.backward(torch.nn.functional.mse_loss(policy - reference, y - reference))
        held = sorted(set(in_backward))
        engine.step()
        return held

    # The reference in the same run: what a plain step holds gathered at that point of backward.
    plain = train_step(with_reference_pass=False)
    held = [name for name in train_step(with_reference_pass=True) if name not in plain]
    assert not held, f"parameters still gathered in backward after their gradients, beyond a plain step's: {held}"
