"""ds_premise: parsed and validated in core (errors name marker and test), judged on configs as DeepSpeed reads them,
checked against each repro's own configs at setup and by ``dsrepro list``; every catalogued repro declares one."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import RunPytest
from pytest_dsrepro.core import configs, ds_defaults
from pytest_dsrepro.core.ds_defaults import ReleaseReading
from pytest_dsrepro.core.errors import MarkerError
from pytest_dsrepro.core.premises import own_config_problem, parse
from pytest_dsrepro.tools import catalogue

ROOT = Path(__file__).resolve().parent.parent
WHERE = "@pytest.mark.ds_premise on t.py::test_x"


def written(spec: object) -> dict[str, object]:
    return configs.resolve(spec, "c", 2, "gloo").written


def test_stage_and_optimizer_on_presets() -> None:
    premise = parse((), {"stage": 3, "optimizer": False}, WHERE)
    assert premise.unmet(written("zero3")) == ()
    assert premise.unmet(written("zero3_offload")) == ()
    assert premise.unmet(written("zero2")) == (
        "needs ZeRO stage 3; the config has 2",
        "needs no optimizer section; the config has one",
    )
    assert premise.describe() == "ZeRO stage 3, no optimizer section"


def test_absent_sections_are_facts_of_every_release_and_other_keys_the_releases() -> None:
    """No zero_optimization section is stage 0; no precision section is fp32; no offload section is 'none', on every
    release. Any other key a config leaves out is the scanned release's own default: judged as written it is unset,
    judged as a release reads it (``ds_defaults.merged``) it is that release's value, named as its default."""
    premise = parse((), {"stage": 0, "precision": "fp32", "offload_param": "none"}, WHERE)
    assert premise.unmet({"train_micro_batch_size_per_gpu": 1}) == ()
    threshold = parse((), {"config": {"zero_optimization.stage3_param_persistence_threshold": ">0"}}, WHERE)
    written = {"zero_optimization": {"stage": 3}}
    assert threshold.unmet(written) == (
        "needs zero_optimization.stage3_param_persistence_threshold >0; the config does not set it",
    )
    read = ds_defaults.merged(written, ReleaseReading(sections={"zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 100000}}))  # fmt: skip
    assert threshold.unmet(read, written) == ()
    zero = parse((), {"config": {"zero_optimization.stage3_param_persistence_threshold": 0}}, WHERE)
    assert zero.unmet(read, written) == (
        "needs zero_optimization.stage3_param_persistence_threshold 0; the config leaves it to DeepSpeed's default, "
        "100000",
    )


def test_a_release_reading_merges_under_what_the_config_writes() -> None:
    """Sections as the release resolves them (its defaults, its renames of deprecated keys), keys the release does
    not know kept as written; a scalar key from the release only where the config leaves it out."""
    written = {"gradient_clipping": 0.5, "zero_optimization": {"stage": 2, "cpu_offload": True, "mine": 1}}
    reading = ReleaseReading(
        keys={"gradient_clipping": 1.0, "gradient_accumulation_steps": 4},
        sections={"zero_optimization": {"stage": 2, "overlap_comm": False, "offload_optimizer": {"device": "cpu"}}},
    )
    assert ds_defaults.merged(written, reading) == {
        "gradient_clipping": 0.5,
        "gradient_accumulation_steps": 4,
        "zero_optimization": {"stage": 2, "cpu_offload": True, "mine": 1, "overlap_comm": False,
                              "offload_optimizer": {"device": "cpu"}},
    }  # fmt: skip
    assert written["zero_optimization"] == {"stage": 2, "cpu_offload": True, "mine": 1}  # left as it was


def test_the_batch_keys_are_derived_as_deepspeed_derives_them() -> None:
    """Given keys are kept; the others follow train = micro x accumulation x ranks; what does not divide over the
    world is left for DeepSpeed to refuse, in its own words."""
    derived = configs.resolve({"train_batch_size": 512, "train_micro_batch_size_per_gpu": 32}, "c", 2, "gloo")
    assert derived.written["gradient_accumulation_steps"] == 8
    only = configs.resolve({"train_batch_size": 8}, "c", 2, "gloo").written
    assert (only["train_micro_batch_size_per_gpu"], only["gradient_accumulation_steps"]) == (4, 1)
    odd = configs.resolve({"train_batch_size": 1, "gradient_accumulation_steps": 1}, "c", 2, "gloo").written
    assert "train_micro_batch_size_per_gpu" not in odd
    assert ds_defaults.request(derived.written, 2) == {"config": derived.written, "world_size": 2}
    assert ds_defaults.digest(derived.written) == ds_defaults.digest(dict(reversed(derived.written.items())))


def test_precision_offload_and_comparisons() -> None:
    premise = parse((), {"precision": ("bf16", "fp16"), "offload_optimizer": "cpu",
                         "gradient_accumulation": ">=3"}, WHERE)  # fmt: skip
    fp16 = written("zero3_offload")  # fp16, offloaded, "auto" accumulation -> 1
    assert premise.unmet(fp16) == ("needs gradient_accumulation_steps >=3; the config has 1",)
    legacy = {"bf16": {"enabled": True}, "gradient_accumulation_steps": 4, "zero_optimization": {"cpu_offload": True}}
    assert premise.unmet(legacy) == ()  # the deprecated flag is an offload to cpu
    assert premise.describe() == (
        "precision fp16 or bf16, offload_optimizer device cpu, gradient_accumulation_steps >=3"
    )


def test_a_section_written_as_a_bare_value_is_read() -> None:
    """``"fp16": false`` (DeepSpeed refuses it; triage met it in the corpus) is read, "auto" resolved around it, not an
    AttributeError from inside the reading: precision from the sections that are objects, no offload."""
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "fp16": False,
        "bf16": {"enabled": "auto"},
        "scheduler": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
        "zero_optimization": {"offload_param": True},
    }
    resolved = configs.resolve(config, "c", 2, "gloo")
    assert resolved.written["fp16"] is False
    assert resolved.written["bf16"] == {"enabled": False}
    assert resolved.written["optimizer"]["params"]["lr"] == configs.TrainingArgs().learning_rate
    premise = parse((), {"precision": "fp16", "offload_param": "cpu"}, WHERE)
    assert premise.unmet(resolved.written) == ("needs precision fp16; the config has fp32",
                                               "needs offload_param device cpu; the config has none")  # fmt: skip


def test_scheduler_type_and_a_key_left_unset() -> None:
    """A key required to be None must be absent: what a bug in a scheduler's fallback for that key needs."""
    premise = parse((), {"config": {"scheduler.type": "WarmupLR", "scheduler.params.warmup_max_lr": None}}, WHERE)
    assert premise.describe() == "scheduler.type WarmupLR, scheduler.params.warmup_max_lr unset"
    assert premise.unmet({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}}}) == ()
    assert premise.unmet({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 0.01}}}) == (
        "needs scheduler.type WarmupLR; the config has WarmupDecayLR",
        "needs scheduler.params.warmup_max_lr unset; the config has 0.01",
    )
    assert premise.unmet({}) == ("needs scheduler.type WarmupLR; the config does not set it",)


def test_sets_are_applied_with_notes() -> None:
    premise = parse((), {"stage": 2, "sets": {"gradient_clipping": 0.0, "zero_optimization.reduce_bucket_size": 256},
                         "because": "the body compares with plain SGD"}, WHERE)  # fmt: skip
    config = written("zero2")
    notes = premise.apply(config)
    assert config["gradient_clipping"] == 0.0
    assert config["zero_optimization"]["reduce_bucket_size"] == 256
    assert notes == [
        "gradient_clipping 1 -> 0, zero_optimization.reduce_bucket_size 200000000 -> 256: the body compares with "
        "plain SGD"
    ]
    assert premise.apply(config) == []  # already there: nothing said


def test_a_premise_removes_keys_and_names_the_defaults_it_changes() -> None:
    """``removes`` takes a section out (said with its type); a value that was the release's default is named so;
    a repro's own config holding a removed key is a defect."""
    premise = parse((), {"stage": 2, "removes": ("scheduler",), "sets": {"gradient_clipping": 0.0},
                         "because": "one step at SGD's rate"}, WHERE)  # fmt: skip
    user = {"zero_optimization": {"stage": 2}, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 1}}}
    read = {**user, "gradient_clipping": 1.0}  # as 0.19.8 reads it
    assert premise.apply(user, read, user) == [
        "no scheduler (WarmupLR), gradient_clipping 1 (DeepSpeed's default) -> 0: one step at SGD's rate"
    ]
    assert "scheduler" not in user
    assert premise.describe_sets() == "gradient_clipping=0, no scheduler"
    own = configs.resolve({"scheduler": {"type": "WarmupLR"}, "gradient_clipping": 0.0,
                           "zero_optimization": {"stage": 2}}, "c", 2, "gloo")  # fmt: skip
    assert own_config_problem(premise, "c", own.written, own.config) == (
        "sets no scheduler (its config has one) differs from the test's own config [c]; a scan would run users' "
        "configs with settings the repro never runs with"
    )


def test_a_key_may_be_a_list_of_any_values() -> None:
    premise = parse((), {"config": {"scheduler.params.cycle_min_lr": list}}, WHERE)
    assert premise.describe() == "scheduler.params.cycle_min_lr a list"
    assert premise.unmet({"scheduler": {"params": {"cycle_min_lr": [0.1, 0.2]}}}) == ()
    assert premise.unmet({"scheduler": {"params": {"cycle_min_lr": 0.004}}}) == (
        "needs scheduler.params.cycle_min_lr a list; the config has 0.004",
    )


def test_a_key_may_be_one_of_several_values_and_a_refusal_has_its_mend() -> None:
    premise = parse((), {"config": {"scheduler.type": ("WarmupLR", "WarmupDecayLR"),
                                    "scheduler.params.warmup_num_steps": 0},
                         "mend": {"scheduler.params.warmup_num_steps": 1}}, WHERE)  # fmt: skip
    assert premise.describe() == "scheduler.type WarmupLR or WarmupDecayLR, scheduler.params.warmup_num_steps 0"
    config = {"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 0}}}
    assert premise.unmet(config) == ()
    assert premise.mended(config) == ["scheduler.params.warmup_num_steps 0 -> 1"]
    assert premise.unmet(config) == ("needs scheduler.params.warmup_num_steps 0; the config has 1",)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stage": 4}, "stage=4 must be one of 0, 1, 2, 3, or a tuple of them"),
        ({"stage": True}, "stage=True must be one of 0, 1, 2, 3"),
        ({"precision": "fp8"}, "precision='fp8' must be one of 'fp32', 'fp16', 'bf16'"),
        ({"offload_param": "disk"}, "offload_param='disk' must be one of 'none', 'cpu', 'nvme'"),
        ({"optimizer": "adam"}, "optimizer='adam' must be True (the config has an optimizer section) or False"),
        (
            {"gradient_accumulation": "at least 3"},
            "gradient_accumulation='at least 3' must be a number or a comparison",
        ),
        ({"config": ["zero_optimization.stage"]}, "config= must be a dict of dotted config keys"),
        ({"sets": {"gradient_clipping": 0.0}}, "sets= and removes= need because=: why a scan changes a user's config"),
        ({"removes": ("scheduler",)}, "sets= and removes= need because="),
        ({"removes": "scheduler", "because": "x"}, "removes= must be a tuple of dotted config keys"),
        ({"because": "why"}, "because= explains sets= or removes=, neither of which is given"),
        ({"mend": [("a", 1)]}, "mend= must be a dict of dotted config keys"),
        (
            {"config": {"fp16.auto_cast": True}, "mend": {"fp16.auto_cast": True}},
            "mend= must take a config out of the premise (the fix on the config's side): it sets none of the premise's "
            "config= keys to a value the premise excludes",
        ),
        ({"stage": 3, "mend": {"zero_allow_untested_optimizer": True}}, "mend= must take a config out of the premise"),
        ({"stages": 3}, "unexpected argument(s) stages; takes stage=, precision="),
        ({"accelerator": "tpu"}, "accelerator='tpu' must be one of cpu, cuda"),
    ],
)
def test_bad_arguments_name_marker_and_test(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(MarkerError) as info:
        parse((), kwargs, WHERE)
    assert str(info.value).startswith(f"{WHERE}: {message}")


def test_own_config_problems() -> None:
    premise = parse((), {"stage": 3, "sets": {"gradient_clipping": 0.0}, "because": "no clipping"}, WHERE)
    own = configs.resolve({**configs.PRESETS["zero3"], "gradient_clipping": 0.0}, "zero3", 2, "gloo")
    assert own_config_problem(premise, "zero3", own.written, own.config) is None
    bare = configs.resolve("zero3", "zero3", 2, "gloo")  # clipping left to the release: 0 before 0.19.3, 1 after
    assert own_config_problem(premise, "zero3", bare.written, bare.config) == (
        "sets gradient_clipping=0 (its config has unset) differs from the test's own config [zero3]; a scan would run "
        "users' configs with settings the repro never runs with"
    )
    two = configs.resolve("zero2", "zero2", 2, "gloo")
    assert own_config_problem(premise, "zero2", two.written, two.config) == (
        "the test's own config [zero2] does not meet the premise: needs ZeRO stage 3; the config has 2"
    )
    clipped = configs.resolve({**configs.PRESETS["zero3"], "gradient_clipping": 1.0}, "c", 2, "gloo")
    assert own_config_problem(premise, "c", clipped.written, clipped.config) == (
        "sets gradient_clipping=0 (its config has 1) differs from the test's own config [c]; a scan would run users' "
        "configs with settings the repro never runs with"
    )


def test_every_catalogued_repro_declares_a_premise_its_own_configs_meet() -> None:
    """The catalogue's repros, collected as ``dsrepro list`` does: each has a premise, and every config a repro runs
    meets it and holds what a scan sets (``collect`` refuses a defect, naming test and premise)."""
    entries = catalogue.collect([str(ROOT / "repros")])
    assert len(entries) >= 15
    assert [e.id for e in entries if e.premise is None] == []
    epilogue = next(e for e in entries if e.id == "zero3-backward-without-optimizer")
    # an optimizer section is NOT APPLICABLE, said: with one the bug cannot happen, on any release it affects
    assert epilogue.premise == "ZeRO stage 3, no optimizer section"


MODULE = """
import pytest

pytestmark = [
    pytest.mark.ds_repro(id="x", title="x", upstream="https://example.invalid/1"),
    pytest.mark.ds_premise({premise}),
    pytest.mark.ds_world,
]

@pytest.mark.ds_config("zero2")
@pytest.mark.ds_version(affected="<0.0.1", raises=AttributeError)
def test_x(ds_engine):
    pass
"""


def test_own_config_that_misses_its_premise_fails_at_setup(pytester: pytest.Pytester, run: RunPytest) -> None:
    """Before any world starts: the test fails naming marker, test, config and what it lacks."""
    pytester.makepyfile(test_x=MODULE.format(premise="stage=3, optimizer=False"))
    result = run("-q", "--ds-world-size", "2")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines([
        "*@pytest.mark.ds_premise on test_x.py::test_x[[]zero2[]]: the test's own config [[]zero2[]] does not meet the "
        "premise: needs ZeRO stage 3; the config has 2; needs no optimizer section; the config has one*"
    ])  # fmt: skip
    assert "pytest-dsrepro: building" not in result.stdout.str()


def test_bad_premise_marker_fails_the_test_and_the_listing(pytester: pytest.Pytester, run: RunPytest) -> None:
    pytester.mkdir("repros")
    pytester.makepyfile(**{"repros/test_x": MODULE.format(premise="stage=5")})
    result = run("-q", "repros")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        ["*@pytest.mark.ds_premise on repros/test_x.py::test_x[[]zero2[]]: stage=5 must be one of*"]
    )
    pytester.chdir()
    with pytest.raises(catalogue.CollectionFailed, match=r"stage=5 must be one of 0, 1, 2, 3"):
        catalogue.collect(["repros"])
