"""The flops profiler leaves ``@`` and attention wrapped after a session: each later session counts them again.

``FlopsProfiler.start_profile()`` swaps torch's functions for counting wrappers and ``end_profile()`` puts the
originals back. Since PR #4724 (2024, before 0.14.4) it wraps ``Tensor.__matmul__`` (the ``@`` operator) and
``F.scaled_dot_product_attention`` too, but the restore never covered those two, and it rebinds ``torch.bmm`` to the
saved ``torch.matmul`` (a typo from PR #2068). So after one profiling session (the engine's ``profile_step``, a
``get_model_profile`` call, a session of the user's own) ``@`` stays wrapped; the next session wraps the wrapper,
and every ``@`` and every attention call is counted once per session so far: identical forwards report more FLOPs
and MACs each time. ``torch.bmm`` meanwhile is ``torch.matmul`` for the rest of the process and broadcasts where it
should refuse. PR #8246 restores all three from their own saved originals (first released in 0.19.6).
"""

import pytest

from pytest_dsrepro.inrank.devices import precision_dtype
from pytest_dsrepro.inrank.models import make_batch

pytestmark = [
    pytest.mark.ds_repro(
        id="flops-profiler-session-leaks-wrappers",
        title="Flops profiler: @ and attention stay wrapped after a session, so each later session counts them again",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/8246",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/8246",
        fixed_in="0.19.6",
        root_cause="_reload_functionals/_reload_tensor_methods did not restore F.scaled_dot_product_attention or "
        "Tensor.__matmul__, and set torch.bmm to the saved torch.matmul.",
    ),
    pytest.mark.ds_premise(config={"flops_profiler.enabled": True}),
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/8246",
        frames=("profiler.py:_reload_tensor_methods", "profiler.py:_reload_functionals"),
        words=("flops_profiler", "get_total_flops", "__matmul__", "scaled_dot_product_attention", "torch.bmm"),
    ),
]

HIDDEN = 16
CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    # The engine's own profile step is left out of reach: every rank profiles in the body, the same sessions.
    "flops_profiler": {"enabled": True, "profile_step": 1000, "detailed": False},
}


def restore_every_wrapped_op(monkeypatch):
    """Backport of PR #8246: restore ``Tensor.__matmul__``, ``F.scaled_dot_product_attention`` and ``torch.bmm``."""
    from deepspeed.profiling.flops_profiler import profiler

    from pytest_dsrepro.inrank.backport import backport, release_has

    if release_has(profiler, "torch.bmm = old_functions[torch.bmm.__str__]"):
        return  # this release has the fix
    backport(
        monkeypatch,
        "deepspeed.profiling.flops_profiler.profiler",
        [
            (r"torch\.bmm = old_functions\[torch\.matmul\.__str__\]", "torch.bmm = old_functions[torch.bmm.__str__]"),
            (
                r"(\n([ \t]+)torch\.Tensor\.matmul = old_functions\[torch\.Tensor\.matmul\.__str__\])",
                r"\1\n\2torch.Tensor.__matmul__ = old_functions[torch.Tensor.__matmul__.__str__]",
            ),
            (
                r"(\n([ \t]+)F\.embedding = old_functions\[F\.embedding\.__str__\])",
                r"\1\n\2F.scaled_dot_product_attention = old_functions[F.scaled_dot_product_attention.__str__]",
            ),
        ],
    )


def matmul_net(seed, device):
    """A regression model whose forward is one ``x @ W``: the only op the profiler counts is ``Tensor.__matmul__``."""
    import torch

    class MatmulNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            generator = torch.Generator().manual_seed(seed)
            self.weight = torch.nn.Parameter(torch.randn(HIDDEN, 1, generator=generator, device="cpu").to(device) * 0.1)

        def forward(self, x):
            return x @ self.weight

    return MatmulNet()


@pytest.mark.ds_config(pytest.param(CONFIG, id="zero0_flops_profiler"))
@pytest.mark.ds_version(
    affected="<0.19.6",
    raises=AssertionError,
    match=r"profiling session counted .* FLOPs for the same forward",
    fix=restore_every_wrapped_op,
)
def test_repeated_profiling_sessions_count_the_same(ds_engine, ds_config, ds_rank, ds_device):
    import torch

    engine = ds_engine(model=matmul_net(seed=3, device=ds_device), optimizer="adam")
    x, y = make_batch(
        ds_config["train_micro_batch_size_per_gpu"], HIDDEN, seed=0, rank=ds_rank, dtype=precision_dtype(ds_config)
    )

    def profiled_forward():
        """One session of the engine's profiler around a forward, as a profile step runs it: its total FLOPs."""
        engine.flops_profiler.start_profile()
        with torch.no_grad():
            engine(x)
        flops = engine.flops_profiler.get_total_flops()
        engine.flops_profiler.end_profile()
        return flops

    counts = []
    while len(counts) < 3:
        # Never in the step whose forward the engine profiles itself (a config's profile_step: rank 0 starts a session
        # of its own there, which a session of the body's would nest, and nested sessions leak on any release).
        if engine.global_steps != engine.flops_profiler_profile_step():
            counts.append(profiled_forward())
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))  # training goes on between sessions
        engine.step()

    # The first session is the reference (what the profiler counts for one x @ W with nothing left over: its own
    # count, whatever it makes of @ calling torch.matmul), the later ones must agree with it.
    assert counts == [counts[0]] * 3, (
        f"each profiling session counted {counts} FLOPs for the same forward: the @ operator was still wrapped from "
        "the sessions before"
    )
    a, b = torch.ones(2, 3, 4, device=ds_device), torch.ones(4, 5, device=ds_device)
    with pytest.raises(RuntimeError):
        torch.bmm(a, b)  # bmm takes two batches of matrices; matmul would broadcast b
