"""The flops profiler leaves its start-time hooks behind on a module the model uses in two places.

With ``"flops_profiler": {"enabled": true}`` the engine profiles the forward passes of its ``profile_step`` on rank 0:
``FlopsProfiler.start_profile`` walks the model with ``Module.apply`` and gives each module a forward pre-hook that
synchronizes the device and notes the time, keeping its handle on the module so that ``stop_profile`` can remove it.
The check that should skip a module already hooked asked for ``__start_time_hook_handle`` (no trailing underscores),
a name nothing sets, while the handle is stored as ``__start_time_hook_handle__``. ``apply`` reaches a module once
per parent, so one instance shared by two blocks (a single activation module, as models built from a shared
activation object have) was hooked twice, the second handle overwriting the first; ``stop_profile`` removes only
the one it holds. Every profiled forward leaves one more pre-hook on the shared module, and they stay for the rest of
training: each forward of it then synchronizes the device, long after profiling ended (issue #5432). PR #6668 checks
the right name (first released in 0.15.4).

The typo is as old as the profiler's start-time hook; of this catalogue's releases only 0.14.4 has it.
"""

import pytest

from pytest_dsrepro.inrank.devices import precision_dtype
from pytest_dsrepro.inrank.models import make_batch

pytestmark = [
    pytest.mark.ds_repro(
        id="engine-flops-profiler-shared-module-hooks",
        title="Flops profiler: a module shared by two parents keeps a device-synchronizing pre-hook per profiled "
        "forward",
        upstream="https://github.com/deepspeedai/DeepSpeed/issues/5432",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/6668",
        fixed_in="0.15.4",
        root_cause="start_profile checked a misspelled attribute (__start_time_hook_handle) before registering its "
        "start-time pre-hook, so a module reached twice was hooked twice and stop_profile removed one hook.",
    ),
    pytest.mark.ds_premise(config={"flops_profiler.enabled": True}),
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/6668",
        words=("registration check", "__start_time_hook_handle", "start_time_hook", "flops profiler"),
    ),
]

PROFILED = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 0.0,
    "flops_profiler": {"enabled": True, "profile_step": 1, "module_depth": -1, "top_modules": 1, "detailed": False},
}


def check_the_stored_name(monkeypatch):
    """Backport of PR #6668: ``start_profile`` looks for the attribute its handle is stored under."""
    from deepspeed.profiling.flops_profiler.profiler import FlopsProfiler

    from pytest_dsrepro.inrank.backport import backport, release_has

    if not release_has(FlopsProfiler.start_profile, 'if not hasattr(module, "__start_time_hook_handle"):'):
        return  # this release has the fix
    backport(
        monkeypatch,
        "deepspeed.profiling.flops_profiler.profiler",
        [(r'hasattr\(module, "__start_time_hook_handle"\)', 'hasattr(module, "__start_time_hook_handle__")')],
    )


def shared_activation_model(ds_device, dtype):
    """Two blocks that share one activation module, as a model built around one activation object does."""
    import torch

    torch.manual_seed(11)
    act = torch.nn.GELU()
    blocks = [torch.nn.Sequential(torch.nn.Linear(8, 8), act) for _ in range(2)]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(8, 1)).to(device=ds_device, dtype=dtype), act


@pytest.mark.ds_config(pytest.param(PROFILED, id="zero0_flops_profiler"))
@pytest.mark.ds_version(
    affected="<0.15.4",
    raises=AssertionError,
    match=r"the flops profiler left \d+ forward pre-hooks? on the shared module",
    fix=check_the_stored_name,
)
def test_profiling_leaves_no_hooks(ds_config, ds_rank, ds_device, tmp_path):
    import deepspeed
    import torch

    dtype = precision_dtype(ds_config)
    model, act = shared_activation_model(ds_device, dtype)
    # The profile goes to a file of its own rather than into the rank's output.
    config = {**ds_config, "flops_profiler": {**ds_config["flops_profiler"], "output_file": str(tmp_path / "flops")}}
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    profile_step = config["flops_profiler"].get("profile_step", 1)
    for step in range(profile_step + 2):  # up to, through and past the profiled step
        if step == profile_step:  # the hooks before it: ZeRO-3 hooks every module (the shared one twice) of its own
            hooks_before = len(act._forward_pre_hooks)
        for micro in range(engine.gradient_accumulation_steps()):
            micro_batch = config["train_micro_batch_size_per_gpu"]
            x, y = make_batch(micro_batch, hidden=8, seed=10 * step + micro, rank=ds_rank, dtype=dtype)
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            engine.step()

    left = len(act._forward_pre_hooks) - hooks_before
    assert left == 0, (
        f"the flops profiler left {left} forward pre-hooks on the shared module after profiling step {profile_step} "
        "(each synchronizes the device on every later forward)"
    )
