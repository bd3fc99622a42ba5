"""Presets, "auto" resolution and CPU adaptation; then every preset driving a real ZeRO engine in a 2-rank world."""

from __future__ import annotations

import pytest

from conftest import RunPytest
from pytest_dsrepro.core.configs import PRESETS, ConfigError, resolve


def test_auto_values_resolve_like_hugging_face() -> None:
    resolved = resolve("zero2", "zero2", world_size=2, backend="nccl")
    config = resolved.config
    assert config["train_micro_batch_size_per_gpu"] == 2
    assert config["gradient_accumulation_steps"] == 1
    assert config["train_batch_size"] == 4  # micro x accumulation x world size
    assert config["optimizer"]["params"] == {"lr": 1e-3, "weight_decay": 0.0}
    assert config["fp16"]["enabled"] is True  # a GPU world keeps fp16
    assert resolved.notes == ()
    assert resolve("zero3_offload", "zero3_offload", world_size=4, backend="nccl").config["train_batch_size"] == 8


def test_cpu_world_adaptations_are_said() -> None:
    resolved = resolve("zero3_offload", "zero3_offload", world_size=2, backend="gloo")
    assert resolved.config["fp16"] == {"enabled": False}
    assert resolved.config["zero_optimization"]["offload_param"]["pin_memory"] is False
    assert resolved.notes[0] == "fp16 -> fp32: fp16 training needs CUDA; this is a gloo/CPU world"
    assert any("offload_optimizer.pin_memory -> false" in n for n in resolved.notes)
    zero2 = resolve("zero2", "zero2", world_size=2, backend="gloo")
    assert zero2.config["optimizer"]["params"]["torch_adam"] is True
    assert "optimizer AdamW -> torch implementation: DeepSpeed's CPU Adam is a JIT build" in zero2.notes


def test_presets_are_not_mutated_by_resolution() -> None:
    before = repr(PRESETS)
    for name in PRESETS:
        resolve(name, name, world_size=2, backend="gloo")
    assert repr(PRESETS) == before


def test_dicts_and_unknown_names() -> None:
    resolved = resolve({"zero_optimization": {"stage": 1}}, "config2", world_size=2, backend="gloo")
    assert resolved.name == "config2"
    assert resolved.config["train_batch_size"] == 4
    with pytest.raises(ConfigError, match=r"unknown preset 'zer3'; presets: zero0, zero1, zero2, zero3, zero3_offload"):
        resolve("zer3", "zer3", world_size=2, backend="gloo")


def test_every_preset_trains_a_step_in_a_real_world(pytester: pytest.Pytester, run: RunPytest) -> None:
    pytester.makepyfile(
        """
        import math
        import pytest

        @pytest.mark.ds_world
        @pytest.mark.ds_config(
            "zero0", "zero1", "zero2", "zero3", "zero3_offload", {"zero_optimization": {"stage": 2}},
            pytest.param({"zero_optimization": {"stage": 1}}, id="stage1_inline"),
        )
        def test_step(ds_engine, ds_config, ds_rank):
            import torch
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
            engine = ds_engine(model=model)
            assert engine.zero_optimization_stage() == ds_config["zero_optimization"]["stage"]
            x = torch.randn(ds_config["train_micro_batch_size_per_gpu"], 8, generator=torch.Generator().manual_seed(ds_rank))
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            engine.step()
            assert math.isfinite(loss.item())
        """
    )
    result = run("-v")
    result.assert_outcomes(passed=7)
    result.stdout.fnmatch_lines_random(
        [
            "*test_step?zero2? PASSED*",
            "*test_step?zero3_offload? PASSED*",
            "*test_step?config5? PASSED*",
            "*test_step?stage1_inline? PASSED*",
        ]
    )


def test_bad_configs_name_the_preset_or_key(pytester: pytest.Pytester, run: RunPytest) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ds_world
        @pytest.mark.ds_config("zer3")
        def test_typo(ds_config):
            pass

        @pytest.mark.ds_world
        @pytest.mark.ds_config({"zero_optimization": {"stage": 3, "stage3_bogus_knob": 1}})
        def test_rejected(ds_engine):
            ds_engine()

        def test_unmarked(ds_config):
            pass
        """
    )
    result = run()
    result.assert_outcomes(failed=1, errors=2)
    result.stdout.fnmatch_lines_random(
        [
            "*@pytest.mark.ds_config on test_bad_configs*.py::test_typo[[]zer3[]]: unknown preset 'zer3'; presets: *",
            "ranks 0-1: ConfigRejected: DeepSpeed rejected ds_config [[]config0[]]: ValidationError: *",
            "*stage3_bogus_knob*",
            "*test_unmarked: ds_config needs @pytest.mark.ds_config('zero3', ...) on the test",
        ]
    )


def test_a_scheduler_deepspeed_refuses_is_a_rejected_config(pytester: pytest.Pytester, run: RunPytest) -> None:
    """DeepSpeed checks a scheduler's parameters when ``initialize`` builds it, not in its config classes: ``ds_engine``
    builds it first, so that the refusal reads as one (here Hugging Face's "auto" warm-up, 0 steps, which 0.19.3 and
    later refuse); a scheduler whose parameters DeepSpeed takes builds the engine as before."""
    pytester.makepyfile(
        """
        import pytest

        def warmup(steps):
            return {"train_micro_batch_size_per_gpu": 2,
                    "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": steps}}}

        @pytest.mark.ds_world(size=1)
        @pytest.mark.ds_config(pytest.param(warmup(0), id="none"), pytest.param(warmup(2), id="two"))
        def test_warmup(ds_engine):
            ds_engine()
        """
    )
    result = run()
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        ["*rank 0: ConfigRejected: DeepSpeed rejected ds_config [[]none[]]: ValueError: warmup_num_steps must be a "
         "positive integer, got 0*"]
    )  # fmt: skip
