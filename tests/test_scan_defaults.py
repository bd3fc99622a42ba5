"""Each release's own defaults: a config as the installed DeepSpeed reads it, asked of that release in a real
subprocess (``scan.defaults`` running ``scan.probe``), kept in the cache per install and
config; and, pure, what two releases that read a config differently make of a premise (``core.ds_defaults``).
"""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest
from packaging.version import Version

from pytest_dsrepro.core import configs, ds_defaults
from pytest_dsrepro.core.ds_defaults import ReleaseReading
from pytest_dsrepro.core.gates import installed_deepspeed
from pytest_dsrepro.core.premises import parse
from pytest_dsrepro.scan import defaults
from pytest_dsrepro.scan.scanner import taken_out

WHERE = "@pytest.mark.ds_premise on t.py::test_x"


def written(zero: dict[str, object], **more: object) -> dict[str, object]:
    return configs.resolve({"zero_optimization": zero, **more}, "scan", 2, "gloo").written


def test_the_installed_release_reads_each_config_in_a_subprocess_kept_in_the_cache(tmp_path: Path) -> None:
    """The values the release resolves where the config is silent: ``overlap_comm`` by stage, ``reduce_scatter`` on,
    the deprecated ``cpu_offload`` as ``offload_optimizer``, gradient clipping 1.0 from 0.19.3 on (PR #8068), 0 before;
    a key its config classes do not know is taken out, named with DeepSpeed's message, and the rest read; a value they
    cannot take is the config's refusal; an optimizer parameter the engine refuses (``max_grad_norm``, GPT-NeoX's)
    is taken out as an unknown key is. Asked again, the cache answers, with no process."""
    neox = {"type": "Adam", "params": {"lr": 1e-3, "max_grad_norm": 1.0}}
    wanted = [written({"stage": 2, "cpu_offload": True}), written({"stage": 3}),
              written({"stage": 3, "stage3_x": 1, "offload_param": {"device": "cpu", "y": 2}}),
              written({"stage": 3, "overlap_comm": "sometimes"}),
              written({"stage": 1}, optimizer=neox, gradient_clipping=0.5),
              written({"stage": 1}, bf16={"enabled": True, "loss_scale": 0}, fp16={"enabled": False, "loss_scale": 0})]  # fmt: skip
    probe = defaults.start([ds_defaults.request(w, 2) for w in wanted], tmp_path, gloo=True)
    assert probe.child is not None
    assert probe.healed == []  # a cache that has none of them yet is no damaged cache
    two, three, typo, refused, clipped, scaled = probe.wait()
    assert probe.problem is None
    assert two is not None
    assert three is not None
    assert typo is not None
    assert refused is not None
    assert two.sections["zero_optimization"]["overlap_comm"] is False
    assert three.sections["zero_optimization"]["overlap_comm"] is True
    assert two.sections["zero_optimization"]["reduce_scatter"] is True
    assert two.sections["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    clipping = 1.0 if installed_deepspeed() >= Version("0.19.3") else 0.0
    assert two.keys["gradient_clipping"] == clipping
    assert two.keys["train_micro_batch_size_per_gpu"] == 2
    assert two.keys["gradient_accumulation_steps"] == 1
    assert typo.refused is None
    assert sorted(typo.unknown) == ["zero_optimization.offload_param.y", "zero_optimization.stage3_x"]
    assert "DeepSpeedZeroConfig: stage3_x: Extra inputs are not permitted" in typo.unknown["zero_optimization.stage3_x"]
    assert typo.sections["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert refused.refused is not None
    assert "overlap_comm" in refused.refused
    assert clipped is not None
    assert clipped.refused is None
    assert list(clipped.unknown) == ["optimizer.params.max_grad_norm"]
    assert "ValueError: 'max_grad_norm' is not supported as an optimizer parameter" in clipped.unknown[
        "optimizer.params.max_grad_norm"]  # fmt: skip
    assert clipped.keys["gradient_clipping"] == 0.5
    assert scaled is not None
    # DeepSpeedBF16Config (0.19.8) refuses loss_scale as extra: the bf16 key, not fp16's of the same name
    assert list(scaled.unknown) == ["bf16.loss_scale"]
    again = defaults.start([ds_defaults.request(w, 2) for w in wanted], tmp_path, gloo=True)
    assert again.child is None
    assert again.wait() == [two, three, typo, refused, clipped, scaled]


def test_a_key_no_release_knows_is_found_by_its_place_and_taken_out() -> None:
    """A pydantic error names the key inside the section whose model refused it; every key of the config that ends
    there is the one, and taking it out leaves the rest."""
    config = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "y": 2}}, "y": 1}
    assert ds_defaults.named(config, ("offload_param", "y")) == ["zero_optimization.offload_param.y"]
    assert ds_defaults.named(config, ("y",)) == ["zero_optimization.offload_param.y", "y"]
    assert ds_defaults.named(config, ()) == []
    left = ds_defaults.without(config, {"zero_optimization.offload_param.y": "said"})
    assert left == {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}, "y": 1}
    assert config["zero_optimization"]["offload_param"]["y"] == 2  # the config itself is left as it was


def test_a_default_meets_a_premise_the_written_config_does_not_name(tmp_path: Path) -> None:
    """A plain ZeRO-2 config leaves ``reduce_scatter`` to DeepSpeed: a premise that needs it on is met by the
    release's default, and one that needs it off says it is the default that is on."""
    config = written({"stage": 2})
    (reading,) = defaults.start([ds_defaults.request(config, 2)], tmp_path, gloo=True).wait()
    assert reading is not None
    read = ds_defaults.merged(config, reading)
    assert (
        parse((), {"stage": 2, "config": {"zero_optimization.reduce_scatter": True}}, WHERE).unmet(read, config) == ()
    )
    assert parse((), {"config": {"zero_optimization.reduce_scatter": False}}, WHERE).unmet(read, config) == (
        "needs zero_optimization.reduce_scatter false; the config leaves it to DeepSpeed's default, true",
    )


#: What two releases make of the same config, as their probes answered (0.16.4 and 0.19.8, read on this machine):
#: gradient clipping off and on by default (PR #8068, 0.19.3), pinned offload memory off and on by default.
OLD = ReleaseReading(keys={"gradient_clipping": 0.0}, sections={"zero_optimization": {"stage": 2, "offload_optimizer": {
    "device": "cpu", "pin_memory": False}}})  # fmt: skip
NEW = ReleaseReading(keys={"gradient_clipping": 1.0}, sections={"zero_optimization": {"stage": 2, "offload_optimizer": {
    "device": "cpu", "pin_memory": True}}})  # fmt: skip


def test_two_releases_that_differ_give_the_premise_and_its_sets_their_own_values() -> None:
    """The premise check, ``sets`` and the notes read the same resolved config: on the older release the body's
    unclipped comparison needs no change, on the newer one the scan says it turns the default off."""
    config = written({"stage": 2, "offload_optimizer": {"device": "cpu"}})
    premise = parse((), {"stage": 2, "config": {"zero_optimization.offload_optimizer.pin_memory": True},
                         "sets": {"gradient_clipping": 0.0}, "because": "unclipped SGD"}, WHERE)  # fmt: skip
    old, new = ds_defaults.merged(config, OLD), ds_defaults.merged(config, NEW)
    assert premise.unmet(old, config) == (
        "needs zero_optimization.offload_optimizer.pin_memory true; the config leaves it to DeepSpeed's default, false",
    )
    assert premise.unmet(new, config) == ()
    assert premise.apply(dict(config), old, config) == []
    assert premise.apply(dict(config), new, config) == ["gradient_clipping 1 (DeepSpeed's default) -> 0: unclipped SGD"]


def test_a_probe_that_fails_is_said_and_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Injected: the probe's module cannot start. The readings are missing, the reason is one line, no process or
    file is left, and nothing is cached."""
    monkeypatch.setattr(defaults, "MODULE", "pytest_dsrepro.no_such_probe")
    probe = defaults.start([ds_defaults.request(written({"stage": 1}), 2)], tmp_path, gloo=True)
    assert probe.wait() == [None]
    assert probe.problem is not None
    assert probe.problem.startswith("reading DeepSpeed's defaults failed (exit 1): ")
    assert probe.problem.endswith("No module named pytest_dsrepro.no_such_probe")
    assert probe.workdir is not None
    assert not Path(probe.workdir.name).exists()
    assert not list((tmp_path / "defaults").rglob("*.json"))


def test_a_probe_never_read_is_stopped(tmp_path: Path) -> None:
    probe = defaults.start([ds_defaults.request(written({"stage": 0}), 2)], tmp_path, gloo=True)
    assert probe.child is not None
    pid = probe.child.pid
    probe.close()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert probe.workdir is not None
    assert not Path(probe.workdir.name).exists()


def test_a_refused_config_is_judged_on_what_it_writes_and_what_no_release_defaults() -> None:
    """DeepSpeed refused it, so no release value is known: a key the release would default is not judged (benefit of
    the doubt: the bug is CANNOT TELL, not NOT APPLICABLE), a missing scheduler is missing on every release."""
    from pytest_dsrepro.scan.scanner import ConfigRead

    config = written({"stage": 2, "typo": 1})
    read = ConfigRead(config, config, refused="ValidationError: typo", defaults_known=False)
    scheduled = parse((), {"config": {"scheduler.type": "WarmupLR"}}, WHERE)
    assert read.premise_problems(scheduled) == ("needs scheduler.type WarmupLR; the config does not set it",)
    defaulted = parse((), {"stage": 2, "config": {"zero_optimization.reduce_scatter": True}}, WHERE)
    assert read.premise_problems(defaulted) == ()
    assert parse((), {"stage": 3}, WHERE).unmet(config) == ("needs ZeRO stage 3; the config has 2",)
    assert ds_defaults.read_by_release("zero_optimization.overlap_comm")
    assert not ds_defaults.read_by_release("scheduler.params.warmup_num_steps")


def test_keys_refused_in_one_error_are_said_in_one_note() -> None:
    """bf16 with fp16's loss-scale keys copied in: pydantic's one error names each key; the scan says them once,
    and a key refused for its own reason apart."""
    error = "ValidationError: 2 validation errors for DeepSpeedBF16Config: {}: Extra inputs are not permitted"
    other = "ValueError: 'max_grad_norm' is not supported as an optimizer parameter"
    unknown = {"bf16.loss_scale": error.format("loss_scale"), "bf16.hysteresis": error.format("hysteresis"),
               "optimizer.params.max_grad_norm": other}  # fmt: skip
    assert taken_out(unknown, "0.19.8") == [
        "judged without bf16.loss_scale, bf16.hysteresis: DeepSpeed 0.19.8 does not take them (ValidationError: 2 "
        "validation errors for DeepSpeedBF16Config: Extra inputs are not permitted); no catalogued bug depends on "
        "them, and the rest of the config is judged",
        f"judged without optimizer.params.max_grad_norm: DeepSpeed 0.19.8 does not take it ({other}); no catalogued "
        "bug depends on it, and the rest of the config is judged",
    ]
