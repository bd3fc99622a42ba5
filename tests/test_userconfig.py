"""A user's ds_config.json as ``--ds-scan`` and ``dsrepro scan`` read it (``core.userconfig``), and the scan's
verdicts and tables (``core.scan_verdicts``): pure, no world."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from pytest_dsrepro.core import configs, results, scan_verdicts, userconfig
from pytest_dsrepro.core.gates import Rate, Reason
from pytest_dsrepro.core.results import (
    Environment,
    Finding,
    ReproMeta,
    RunRecord,
    ScanSource,
    ScanVerdict,
    Source,
    TestRecord,
)

#: The seeds chapter's ZeRO-3 offload config, as it writes it: comments after values, "auto" batch sizes.
SEED_ZERO3_OFFLOAD = """{
  "zero_optimization": {
    "stage": 3,
    "offload_optimizer": {
      "device": "cpu",     // the key: the optimizer to CPU
      "pin_memory": true
    },
    "offload_param": {
      "device": "cpu",     /* the parameters too (slower) */
      "pin_memory": true
    },
    "stage3_param_persistence_threshold": 1e5,
    "reduce_bucket_size": 1e7
  },
  "fp16": { "enabled": true },
  "train_batch_size": "auto",
  "gradient_accumulation_steps": "auto"
}
"""


def write(tmp_path: Path, text: str, name: str = "ds_config.json") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def refused(tmp_path: Path, text: str, backend: str | None = "gloo") -> str:
    path = write(tmp_path, text)
    with pytest.raises(userconfig.UserConfigError) as info:
        userconfig.load(path, backend)
    return str(info.value).replace(str(path), "CFG")


def test_json_with_comments_is_read_as_written(tmp_path: Path) -> None:
    user = userconfig.load(write(tmp_path, SEED_ZERO3_OFFLOAD), "gloo")
    assert user.config["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert user.config["train_batch_size"] == "auto"  # each world resolves it for its size
    assert user.notes == (
        "2 comment(s) (// or /* */) read as blanks: JSON with comments is accepted",
        '"auto" resolved as Hugging Face\'s Trainer does, for each world: train_batch_size, gradient_accumulation_steps',
    )


def test_monitors_are_turned_off_and_said_once(tmp_path: Path) -> None:
    """A monitor would make every rank import its package (wandb, comet_ml) and write logs; no bug depends on one."""
    text = json.dumps({"zero_optimization": {"stage": 2}, "wandb": {"enabled": True, "project": "p"},
                       "tensorboard": {"enabled": False}, "csv_monitor": {"enabled": True}})  # fmt: skip
    user = userconfig.load(write(tmp_path, text), "gloo")
    assert user.config["wandb"] == {"enabled": False, "project": "p"}
    assert user.config["csv_monitor"] == {"enabled": False}
    assert user.notes == (
        "monitors turned off (wandb.enabled false, csv_monitor.enabled false): no catalogued bug depends on one, and "
        "each would make every rank import its own package and write its logs",
    )
    assert userconfig.monitors_off({"comet": {"enabled": False}}) is None


def test_slashes_in_strings_are_no_comment() -> None:
    text, comments = userconfig.strip_comments('{"nvme_path": "//mnt/x/*y*/"} // one')
    assert json.loads(text) == {"nvme_path": "//mnt/x/*y*/"}
    assert comments == 1


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{\n  "a": 1, // fine\n  "b": 2,\n}\n', "CFG:4:1: not JSON: Expecting property name enclosed in double quotes"),
        ('{\n  /* open\n  "a": 1\n}', "CFG:2:3: a /* comment is never closed"),
        ("{'stage': 3}", "CFG:1:2: not JSON: Expecting property name enclosed in double quotes"),
        ("[1, 2]", "CFG: a DeepSpeed config is one JSON object ({...}), not a list"),
        ('{"zero_optimization": {"stage": 4}}', "CFG: zero_optimization.stage is 4; DeepSpeed's stages are 0-3"),
        ('{"zero_optimization": {"stage": 3, "offload_param": {"device": "disk"}}}',
         'CFG: zero_optimization.offload_param.device is "disk"; DeepSpeed\'s devices are none, cpu, nvme'),
        ('{"zero_optimization": {"stage": 3, "stage3_max_live_parameters": "auto"}}',
         'CFG: "auto" at zero_optimization.stage3_max_live_parameters: Hugging Face\'s Trainer fills only'),
        ('{"optimizer": {"type": "Lamb", "params": {"lr": 0.1}}}',
         "CFG: this scan runs in gloo (CPU) worlds; optimizer.type 'Lamb' needs CUDA: DeepSpeed's Lamb is its "
         "FusedLamb CUDA kernel"),
        ('{"amp": {"enabled": true}}', "CFG: this scan runs in gloo (CPU) worlds; amp.enabled needs CUDA"),
        ('{\n  "zero_optimization": {"stage": 1,\n    "stage": 3}\n}',
         'CFG:3:5: the key "stage" is given twice in one object (first at 2:25); DeepSpeed refuses such a config'),
        ('{"a": {"x": 1}, "b": [{"x": 1}, {"x": 2}], "c": "x", "a": 2}',
         'CFG:1:54: the key "a" is given twice in one object (first at 1:2)'),
    ],
)  # fmt: skip
def test_what_cannot_be_scanned_is_refused_naming_the_place(tmp_path: Path, text: str, message: str) -> None:
    assert refused(tmp_path, text).startswith(message)


def test_a_key_given_twice_is_refused_as_deepspeed_refuses_it(tmp_path: Path) -> None:
    """JSON's parsers keep the last of two equal keys; DeepSpeed's config reader refuses the file, and so does a
    scan, before any world."""
    from deepspeed.runtime.config_utils import dict_raise_error_on_duplicate_keys

    text = '{"train_batch_size": 8, "train_batch_size": 16}'
    with pytest.raises(ValueError, match="Duplicate keys"):
        json.loads(text, object_pairs_hook=dict_raise_error_on_duplicate_keys)
    assert refused(tmp_path, text).startswith('CFG:1:25: the key "train_batch_size" is given twice')


def test_cuda_only_settings_pass_where_the_worlds_may_have_gpus(tmp_path: Path) -> None:
    assert userconfig.load(write(tmp_path, '{"optimizer": {"type": "Lamb"}}'), None).config["optimizer"]


def test_gpu_only_settings_with_a_cpu_form_are_adapted_and_said() -> None:
    raw = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme",
                                                                   "pin_memory": True}}}  # fmt: skip
    resolved = configs.resolve(raw, "scan", 2, "gloo")
    assert resolved.written["zero_optimization"]["offload_optimizer"]["device"] == "nvme"  # premises read this
    assert resolved.config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert resolved.notes[:2] == (
        "offload_optimizer.device nvme -> cpu: NVMe offload needs DeepSpeed's async I/O op (libaio), which these "
        "worlds do not build; ZeRO's offload path, to CPU memory",
        "offload_optimizer.pin_memory -> false: pinned memory needs CUDA",
    )


def test_scheduler_autos_are_filled_as_hugging_face_fills_them() -> None:
    raw = {"optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto", "warmup_num_steps": "auto"}}}  # fmt: skip
    config = configs.resolve(raw, "scan", 2, "gloo").config
    assert config["scheduler"]["params"] == {"warmup_max_lr": 1e-3, "warmup_num_steps": 0}


@pytest.mark.parametrize(
    ("reason", "rate", "verdict", "detail"),
    [
        (Reason.REPRODUCED, None, ScanVerdict.AFFECTED, "on deepspeed 0.18.3: ranks 0-1: E (fixed in 0.19.0)"),
        (Reason.REGRESSION, None, ScanVerdict.AFFECTED, "M (fixed in 0.19.0; outside the catalogued range)"),
        (Reason.NOT_AFFECTED, None, ScanVerdict.NOT_AFFECTED, "M"),
        (Reason.NOT_YET_AFFECTED, None, ScanVerdict.NOT_AFFECTED, "M"),
        (Reason.DID_NOT_REPRODUCE, None, ScanVerdict.NOT_AFFECTED, "passed with this config, on a release the bug affects"),
        (Reason.DID_NOT_REPRODUCE, Rate(20, 20, 1, 2, 9.0), ScanVerdict.AFFECTED, "M (fixed in 0.19.0)"),
        (Reason.FAILED_DIFFERENTLY, None, ScanVerdict.CANNOT_TELL, "M"),
        (Reason.OUTSIDE_RANGE, None, ScanVerdict.CANNOT_TELL, "M"),
        (Reason.HARNESS_ERROR, None, ScanVerdict.CANNOT_TELL, "M"),
        (Reason.NOT_APPLICABLE, None, ScanVerdict.NOT_APPLICABLE, "M"),
    ],
)  # fmt: skip
def test_a_judgement_becomes_a_scan_verdict(reason: Reason, rate: Rate | None, verdict: ScanVerdict,
                                            detail: str) -> None:  # fmt: skip
    message = "REPRODUCED on deepspeed 0.18.3: ranks 0-1: E" if reason is Reason.REPRODUCED else "M"
    found = scan_verdicts.finding(reason, message, fixed_in="0.19.0", rate=rate)
    assert (found.verdict, found.detail) == (verdict, detail)


def record(version: str, verdicts: dict[str, ScanVerdict]) -> RunRecord:
    env = Environment(deepspeed=version, torch="2.13.0", python="3.11", backend="gloo", world_size=2, os="Linux",
                      cpu="x", cpu_count=2, gpu=None, gpu_count=0)  # fmt: skip
    tests = tuple(
        TestRecord(nodeid=f"repros/test_{bug}.py::test_it[scan]", repro=ReproMeta(bug, f"{bug} title",
                   f"https://example.invalid/{bug}"), variant=None, verdict=None, reason=None, outcome="passed",
                   error=None, duration=1.0, config={}, config_notes=("fp16 -> fp32: on CPU",),
                   source=Source(f"repros/test_{bug}.py", "code", fix="the_fix"),
                   scan=Finding(word, f"{bug} on {version}", ("k 1 -> 0: why",) if bug == "b" else ()))
        for bug, word in verdicts.items()
    )  # fmt: skip
    return RunRecord(environment=env, tests=tests, scan=ScanSource("cfg.json", {"a": 1}, ("1 comment(s)",)))


def test_the_table_one_release() -> None:
    run = record("0.18.3", {"a": ScanVerdict.AFFECTED, "b": ScanVerdict.NOT_AFFECTED, "c": ScanVerdict.NOT_APPLICABLE})
    assert scan_verdicts.terminal(run) == [
        "note: 1 comment(s)",
        "note: fp16 -> fp32: on CPU",
        "AFFECTED        a  a on 0.18.3",
        "                   workaround: the repro's fix, the_fix (repros/test_a.py)",
        "NOT AFFECTED    b  b on 0.18.3",
        "                   with k 1 -> 0: why",
        "NOT APPLICABLE  c  c on 0.18.3",
        "1 AFFECTED, 1 NOT AFFECTED, 1 NOT APPLICABLE (deepspeed 0.18.3, 2 ranks)",
    ]
    text = scan_verdicts.markdown(run)
    assert "Config `cfg.json`, scanned against the pytest-dsrepro catalogue on DeepSpeed 0.18.3" in text
    assert "| `a` a title | **AFFECTED** | a on 0.18.3; workaround: the repro's fix `the_fix (repros/test_a.py)` | " \
           "[link](https://example.invalid/a) |" in text  # fmt: skip
    assert results.RunRecord.from_json(json.loads(json.dumps(run.to_json()))) == run  # the schema holds it


def test_across_releases_the_first_clean_one() -> None:
    runs = [record("0.19.8", {"a": ScanVerdict.NOT_AFFECTED, "b": ScanVerdict.CANNOT_TELL}),
            record("0.18.3", {"a": ScanVerdict.AFFECTED, "b": ScanVerdict.NOT_AFFECTED}),
            record("0.19.0", {"a": ScanVerdict.NOT_AFFECTED, "b": ScanVerdict.NOT_AFFECTED})]  # fmt: skip
    lines = scan_verdicts.across(runs)
    assert lines[0].split() == ["bug", "0.18.3", "0.19.0", "0.19.8"]
    assert lines[1].split() == ["a", "AFFECTED", "NOT", "AFFECTED", "NOT", "AFFECTED"]
    assert lines[-1] == "first release where this config hits no known bug: deepspeed 0.19.0"
    assert scan_verdicts.across(runs[:1])[-1] == (
        "first release where this config hits no known bug: deepspeed 0.19.8 (but 1 could not be told there: CANNOT TELL)"
    )
    assert scan_verdicts.first_clean(runs[1:2]) is None
    assert (
        scan_verdicts.across(runs[1:2])[-1]
        == "the newest release scanned, deepspeed 0.18.3, has a known bug this config hits"
    )
    assert "| `a` | AFFECTED | NOT AFFECTED | NOT AFFECTED |" in scan_verdicts.markdown_across(runs)


def test_a_release_where_nothing_was_told_is_never_named_clean() -> None:
    """CANNOT TELL rows and no NOT AFFECTED one: the scan told nothing about that release, so it is not clean, and
    neither is an older one named clean past it."""
    untold = record("0.19.8", {"a": ScanVerdict.CANNOT_TELL, "b": ScanVerdict.NOT_APPLICABLE})
    told = record("0.18.3", {"a": ScanVerdict.NOT_AFFECTED, "b": ScanVerdict.NOT_APPLICABLE})
    assert scan_verdicts.first_clean([untold, told]) is None
    assert scan_verdicts.across([untold, told])[-1] == (
        "no release can be named clean: on the newest scanned, deepspeed 0.19.8, every bug the config meets was "
        "CANNOT TELL or NOT APPLICABLE"
    )
    assert scan_verdicts.first_clean([told]) == "0.18.3"


def test_a_config_deepspeed_refuses_is_said_once_above_the_table() -> None:
    """Every repro fails the same way when DeepSpeed refuses the config: one line at the top with DeepSpeed's own
    words, the release, and the "auto" that gave the refused value; each row points at it."""
    said = ('failed differently on 0.19.8: expected AssertionError, got rank 0: ConfigRejected: DeepSpeed rejected '
            'ds_config [scan]: ValueError: warmup_num_steps must be a positive integer, got 0')  # fmt: skip
    run = record("0.19.8", {"a": ScanVerdict.CANNOT_TELL, "b": ScanVerdict.CANNOT_TELL})
    resolved = {"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 0}}}
    tests = tuple(
        dataclasses.replace(t, scan=Finding(ScanVerdict.CANNOT_TELL, said), config=resolved) for t in run.tests
    )
    written = ScanSource(
        "hf.json",
        {
            "optimizer": {"type": "AdamW", "params": {"eps": "auto"}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": "auto"}},
        },
    )
    run = dataclasses.replace(run, tests=tests, scan=written)
    lines = scan_verdicts.terminal(run)
    assert lines[0] == (
        "DeepSpeed 0.19.8 refuses this config: ValueError: warmup_num_steps must be a positive integer, got 0 (your "
        '"auto" at scheduler.params.warmup_num_steps is 0 as Hugging Face\'s Trainer fills it by default: give the '
        "Trainer a value that DeepSpeed accepts, or write one in the config)"
    )
    assert sum("refuses this config:" in line for line in lines) == 1
    assert [line.split()[-5:] for line in lines if line.startswith("CANNOT TELL")] == [
        ["DeepSpeed", "refuses", "this", "config", "(above)"]
    ] * 2
    # A release that refuses the config is never named clean, even where a body that builds no DeepSpeed config of
    # its own passed there (Hugging Face's Trainer, say): across releases the conclusion says why.
    passed = dataclasses.replace(tests[0], nodeid="repros/test_c.py::test_it[scan]",
                                 repro=ReproMeta("c", "c title"), scan=Finding(ScanVerdict.NOT_AFFECTED, "fixed"))  # fmt: skip
    refusing = dataclasses.replace(run, tests=(*tests, passed))
    older = record("0.16.4", {"a": ScanVerdict.NOT_AFFECTED, "b": ScanVerdict.NOT_AFFECTED})
    assert scan_verdicts.first_clean([older, refusing]) is None
    assert scan_verdicts.across([older, refusing])[-1] == (
        "no release can be named clean: the newest scanned, deepspeed 0.19.8, refuses this config (above)"
    )
