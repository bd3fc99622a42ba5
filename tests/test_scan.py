"""``pytest --ds-scan CONFIG`` and ``dsrepro scan CONFIG``, as a user sees them: real worlds, real DeepSpeed.

A small catalogue of its own shows each verdict (its bodies decide from the config they are given); the catalogue's
own epilogue repro shows the issue's examples: the seed analysis's trigger config and its recommended workaround are
AFFECTED, the same config with an optimizer section is NOT APPLICABLE (the bug cannot happen with one).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

from conftest import ROOT, RunPytest
from pytest_dsrepro.core import results
from pytest_dsrepro.core.gates import installed_deepspeed
from pytest_dsrepro.core.results import ScanVerdict
from pytest_dsrepro.tools import catalogue_run, scan_command

REPROS = """
import pytest

pytestmark = [pytest.mark.ds_world]


def never_raise(monkeypatch):
    pass


@pytest.mark.ds_repro(id="needs-optimizer", title="no optimizer section", upstream="https://example.invalid/1",
                      fixed_in="9.0")
@pytest.mark.ds_premise(stage=3)
@pytest.mark.ds_config("zero3")
@pytest.mark.ds_version(affected=">=0.0.1", raises=AttributeError, match="no optimizer", fix=never_raise)
def test_optimizer(ds_config):
    with open("profile.log", "w") as out:  # a path relative to the run, as a flops profiler's output_file is
        out.write("written by the body")
    if "optimizer" not in ds_config:
        raise AttributeError("no optimizer hook")


@pytest.mark.ds_repro(id="stage0-only", title="a ZeRO-0 bug", upstream="https://example.invalid/2")
@pytest.mark.ds_premise(stage=0)
@pytest.mark.ds_config("zero0")
@pytest.mark.ds_version(affected=">=0.0.1", raises=AttributeError)
def test_stage0(ds_config):
    raise RuntimeError("the body ran, though the premise cannot hold")


@pytest.mark.ds_repro(id="other-error", title="fails otherwise", upstream="https://example.invalid/3")
@pytest.mark.ds_premise(stage=(2, 3), sets={"gradient_clipping": 0.0}, because="the body compares with plain SGD")
@pytest.mark.ds_config({"zero_optimization": {"stage": 3}, "gradient_clipping": 0.0})
@pytest.mark.ds_version(affected=">=0.0.1", raises=AttributeError)
def test_other(ds_config):
    assert ds_config["gradient_clipping"] == 0.0
    raise KeyError("something else")


@pytest.mark.ds_repro(id="no-premise", title="declares no premise", upstream="https://example.invalid/4")
@pytest.mark.ds_config("zero3")
@pytest.mark.ds_version(affected=">=0.0.1", raises=AttributeError)
def test_no_premise(ds_config):
    raise RuntimeError("the body ran, though nothing says what config the bug needs")


def test_not_a_repro():
    raise AssertionError("a scan runs the catalogue's repros only")
"""

#: The seed analysis's trigger: ZeRO-3, parameters offloaded to CPU (pinned), no optimizer.
TRIGGER = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True}},
           "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}  # fmt: skip
#: Its recommended workaround, as the analysis writes it (a comment after the value).
WORKAROUND = """{
  "zero_optimization": {
    "stage": 3,
    "offload_param": {"device": "cpu", "pin_memory": true},
    "offload_optimizer": {
      "device": "none"  // set to "none" to avoid the bug
    }
  },
  "train_micro_batch_size_per_gpu": 2,
  "gradient_accumulation_steps": 1
}
"""
EPILOGUE = "zero3-backward-without-optimizer"


@pytest.fixture
def catalogue(pytester: pytest.Pytester) -> Path:
    pytester.makepyfile(test_repros=REPROS)
    return pytester.path


def config(pytester: pytest.Pytester, value: object, name: str = "ds_config.json") -> Path:
    path = pytester.path / name
    path.write_text(value if isinstance(value, str) else json.dumps(value))
    return path


def test_each_verdict_as_the_user_sees_it(pytester: pytest.Pytester, run: RunPytest, catalogue: Path) -> None:
    user = config(pytester, {"zero_optimization": {"stage": 3}, "fp16": {"enabled": True},
                             "train_batch_size": "auto", "gradient_clipping": 1.0})  # fmt: skip
    result = run("-v", "--ds-scan", str(user), "--ds-results", "out", "--ds-report", "scan.md")
    result.assert_outcomes(failed=2, skipped=2, deselected=1)
    out = result.stdout.str()
    assert "[fixed]" not in out  # one [scan] test per repro, nothing else
    assert "[zero3]" not in out
    result.stdout.fnmatch_lines_random([
        "*test_optimizer[[]scan[]] FAILED*",
        "*test_stage0[[]scan[]] SKIPPED (NOT APPLICABLE: needs ZeRO stage 0; the config has 3)*",
        "*AFFECTED: on deepspeed *: ranks 0-1: AttributeError: no optimizer hook (fixed in 9.0)*",
        "*CANNOT TELL: *KeyError: 'something else'*",
        "*= dsrepro scan of *ds_config.json (deepspeed *) =*",
        'note: "auto" resolved as Hugging Face\'s Trainer does, for each world: train_batch_size',
        "note: fp16 -> fp32: fp16 training needs CUDA; this is a gloo/CPU world",
        "AFFECTED        needs-optimizer  on deepspeed *: ranks 0-1: AttributeError: no optimizer hook (fixed in 9.0)",
        "                                 workaround: the repro's fix, never_raise (test_repros.py)",
        "NOT APPLICABLE  stage0-only      needs ZeRO stage 0; the config has 3",
        "CANNOT TELL     other-error      *KeyError: 'something else'",
        "                                 with gradient_clipping 1 -> 0: the body compares with plain SGD",
        "CANNOT TELL     no-premise       the repro declares no ds_premise: what a config needs for its bug is not known",
        "1 AFFECTED, 2 CANNOT TELL, 1 NOT APPLICABLE (deepspeed *, 2 ranks)",
    ])  # fmt: skip
    assert "the body ran, though" not in out  # NOT APPLICABLE, no premise: no world
    (written,) = results.read_all([pytester.path / "out"])[0]
    assert written.run.scan is not None
    assert written.run.scan.path == str(user)
    found = {t.repro.id: t.scan.verdict for t in written.run.tests if t.repro and t.scan}
    assert found == {"needs-optimizer": ScanVerdict.AFFECTED, "stage0-only": ScanVerdict.NOT_APPLICABLE,
                     "other-error": ScanVerdict.CANNOT_TELL, "no-premise": ScanVerdict.CANNOT_TELL}  # fmt: skip
    report = (pytester.path / "scan.md").read_text()
    assert "| `needs-optimizer` no optimizer section | **AFFECTED** |" in report
    assert "[link](https://example.invalid/1)" in report


def test_a_config_that_meets_no_bug_passes(pytester: pytest.Pytester, run: RunPytest, catalogue: Path) -> None:
    user = config(pytester, {"zero_optimization": {"stage": 2}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    result = run("--ds-scan", str(user), "-k", "optimizer or stage0")
    result.assert_outcomes(skipped=2, deselected=3)
    result.stdout.fnmatch_lines(["*needs ZeRO stage 3; the config has 2*", "2 NOT APPLICABLE (deepspeed *, 2 ranks)"])
    user = config(pytester, {"zero_optimization": {"stage": 3}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    result = run("--ds-scan", str(user), "-k", "optimizer")
    result.assert_outcomes(passed=1, deselected=4)
    result.stdout.fnmatch_lines(
        ["NOT AFFECTED  needs-optimizer  passed with this config, on a release the bug affects"]
    )


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ('{\n  "zero_optimization": {"stage": 3},\n  "fp16": {"enabled": true},\n}\n',
         "*--ds-scan *ds_config.json:4:1: not JSON: Expecting property name enclosed in double quotes"),
        ('{"zero_optimization": {"stage": 3, "stage3_max_live_parameters": "auto"}}',
         '*--ds-scan *ds_config.json: "auto" at zero_optimization.stage3_max_live_parameters: *'),
        ('{"optimizer": {"type": "OneBitAdam"}}',
         "*--ds-scan *ds_config.json: this scan runs in gloo (CPU) worlds; optimizer.type 'OneBitAdam' needs CUDA*"),
    ],
)  # fmt: skip
def test_config_problems_stop_the_run_before_any_world(pytester: pytest.Pytester, run: RunPytest, catalogue: Path,
                                                       text: str, said: str) -> None:  # fmt: skip
    result = run("--ds-scan", str(config(pytester, text)), "--ds-backend", "gloo")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([said])
    assert "Traceback" not in result.stderr.str()


@pytest.fixture
def epilogue(pytester: pytest.Pytester) -> Path:
    """The catalogue's epilogue repro alone, with the catalogue's conftest.py."""
    shutil.copy(ROOT / "repros" / "conftest.py", pytester.path / "conftest.py")
    shutil.copy(ROOT / "repros" / "zero3" / "test_zero3_backward_without_optimizer.py", pytester.path)
    return pytester.path


@pytest.mark.parametrize(
    ("user", "verdict"),
    [(TRIGGER, "AFFECTED"), (WORKAROUND, "AFFECTED"),
     ({**TRIGGER, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, "NOT APPLICABLE")],
    ids=["seed-trigger", "seed-workaround", "with-optimizer"],
)  # fmt: skip
def test_the_seed_analysis_configs(pytester: pytest.Pytester, run: RunPytest, epilogue: Path, user: object,
                                   verdict: str) -> None:  # fmt: skip
    """The issue's example: offload settings do not matter, an optimizer section does."""
    result = run("--ds-scan", str(config(pytester, user)))
    result.stdout.fnmatch_lines([f"{verdict} *{EPILOGUE}  *"])
    if verdict == "AFFECTED":
        result.stdout.fnmatch_lines(["*AttributeError: 'DeepSpeedZeRoOffload' object has no attribute*(unfixed upstream)",
                                     "*workaround: the repro's fix, guard_optimizer_hooks (*)"])  # fmt: skip


#: Two repros beside the catalogue's bug of refusals: one keeps the config's scheduler, one takes it out.
BESIDE_THE_REFUSAL = """
import pytest

pytestmark = [pytest.mark.ds_world]


@pytest.mark.ds_repro(id="keeps-the-scheduler", title="builds the engine", upstream="https://example.invalid/5")
@pytest.mark.ds_premise(stage=2)
@pytest.mark.ds_config({"zero_optimization": {"stage": 2}})
@pytest.mark.ds_version(affected=">=0.0.1", raises=AttributeError)
def test_keeps(ds_engine, ds_config):
    ds_engine()  # what DeepSpeed accepts, it builds


@pytest.mark.ds_repro(id="no-scheduler", title="judges one step", upstream="https://example.invalid/6")
@pytest.mark.ds_premise(stage=2, removes=("scheduler",), because="the body judges one step at its own rate")
@pytest.mark.ds_config({"zero_optimization": {"stage": 2}})
@pytest.mark.ds_version(affected=">=0.0.1", raises=AttributeError)
def test_removes(ds_engine, ds_config):
    assert "scheduler" not in ds_config
    ds_engine()
"""

#: Hugging Face's ZeRO-2 template as users start from it: the scheduler's warm-up left to the Trainer.
HF_ZERO2 = {
    "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2},
}  # fmt: skip


def test_a_refused_warmup_is_the_bug_and_the_rest_is_judged_with_its_fix(pytester: pytest.Pytester,
                                                                        run: RunPytest) -> None:  # fmt: skip
    """On a release that refuses the Trainer's warm-up of 0, the catalogued bug says so (AFFECTED, as written) and
    every other bug is judged with ``warmup_num_steps`` 1, said once above the table; before 0.19.3 nothing is
    refused and the config runs as written. A premise's ``removes`` is said with the bug it is for."""
    shutil.copy(ROOT / "repros" / "conftest.py", pytester.path / "conftest.py")
    shutil.copy(ROOT / "repros" / "optim" / "test_sched_warmup_zero_refused.py", pytester.path)
    shutil.copy(ROOT / "repros" / "_prerequisites.py", pytester.path)  # its prerequisite on 0.18.7-0.18.9
    pytester.makepyfile(test_beside=BESIDE_THE_REFUSAL)
    result = run("--ds-scan", str(config(pytester, HF_ZERO2)))
    removed = "  *with no scheduler (WarmupLR): the body judges one step at its own rate"
    if installed_deepspeed() >= Version("0.19.3"):
        result.stdout.fnmatch_lines_random([
            "note: judged with scheduler.params.warmup_num_steps 0 -> 1: DeepSpeed * refuses the config as written "
            "(ValueError: warmup_num_steps must be a positive integer, got 0), which is the known bug "
            "sched-warmup-zero-refused (its row: as written); every other bug is judged with that bug's fix on the "
            "config's side",
            "AFFECTED      sched-warmup-zero-refused  on deepspeed *: ranks 0-1: ConfigRejected: DeepSpeed rejected "
            "ds_config [[]scan[]]: ValueError: warmup_num_steps must be a positive integer, got 0 (unfixed upstream; "
            "the fix on the config's side: scheduler.params.warmup_num_steps 1)",
            "NOT AFFECTED  keeps-the-scheduler        passed with this config, on a release the bug affects",
            "NOT AFFECTED  no-scheduler               passed with this config, on a release the bug affects",
            removed,
        ])  # fmt: skip
        assert "refuses this config" not in result.stdout.str()  # no bug of the table is left untold by it
    else:
        result.stdout.fnmatch_lines_random(["NOT AFFECTED  sched-warmup-zero-refused  not yet affected*", removed])
        assert "judged with scheduler.params.warmup_num_steps" not in result.stdout.str()


#: A repro whose body trains a step in the config's dtype, as most bodies do, and a bug of the same keys as the
#: catalogue's auto_cast bug whose range holds no release: it mends nothing.
TRAINS = """
import pytest

pytestmark = [pytest.mark.ds_world]


def step(ds_engine, ds_config, ds_rank):
    import torch
    from pytest_dsrepro.inrank.devices import precision_dtype
    from pytest_dsrepro.inrank.models import make_batch, tiny_mlp

    dtype = precision_dtype(ds_config)
    engine = ds_engine(model=tiny_mlp(seed=4).to(dtype))
    x, y = make_batch(ds_config["train_micro_batch_size_per_gpu"], seed=0, rank=ds_rank, dtype=dtype)
    engine.backward(torch.nn.functional.mse_loss(engine(x).float(), y.float()))
    engine.step()


@pytest.mark.ds_repro(id="trains-a-step", title="trains a step", upstream="https://example.invalid/8")
@pytest.mark.ds_premise()
@pytest.mark.ds_config({"zero_optimization": {"stage": 2}})
@pytest.mark.ds_version(affected=">=0.0.1", raises=AttributeError)
def test_step(ds_engine, ds_config, ds_rank):
    step(ds_engine, ds_config, ds_rank)


@pytest.mark.ds_repro(id="casts-in-no-release", title="inputs cast to half", upstream="https://example.invalid/9")
@pytest.mark.ds_premise(config={"fp16.enabled": False, "fp16.auto_cast": True}, mend={"fp16.auto_cast": False})
@pytest.mark.ds_config({"fp16": {"enabled": False, "auto_cast": True}})
@pytest.mark.ds_version(affected="<0.0.1", raises=RuntimeError, match="must have the same dtype")
def test_casts(ds_engine, ds_config, ds_rank):
    step(ds_engine, ds_config, ds_rank)
"""

#: LLaMA-Factory's way (corpus/configs/llamafactory-jonathan-z3.json, at ZeRO-2): the fp16 section kept whole with
#: auto_cast beside bf16, both "auto"; for an fp32 run fp16 is off and auto_cast on.
AUTO_CAST = {
    "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "zero_optimization": {"stage": 2},
    "fp16": {"enabled": "auto", "auto_cast": True, "loss_scale": 0}, "bf16": {"enabled": "auto"},
}  # fmt: skip
CAST_TITLE = "fp16.auto_cast true with fp16 disabled: the engine casts fp32/bf16 inputs to half"


def test_a_bug_every_step_meets_is_the_bug_and_the_rest_is_judged_with_its_fix(pytester: pytest.Pytester,
                                                                              run: RunPytest) -> None:  # fmt: skip
    """DeepSpeed takes the config, but from 0.17.1 every forward of it dies of the auto_cast bug: that bug's row is
    AFFECTED as written, and every other bug is judged with its mend, said once above the table; before 0.17.1
    nothing is mended."""
    shutil.copy(ROOT / "repros" / "conftest.py", pytester.path / "conftest.py")
    shutil.copy(ROOT / "repros" / "precision" / "test_fp16_auto_cast_while_disabled.py", pytester.path)
    pytester.makepyfile(test_trains=TRAINS)
    result = run("--ds-scan", str(config(pytester, AUTO_CAST)), "-k", "not casts")
    if installed_deepspeed() >= Version("0.17.1"):
        result.stdout.fnmatch_lines_random([
            "note: judged with fp16.auto_cast true -> false: on DeepSpeed * the config meets the known bug "
            f"precision-fp16-auto-cast-while-disabled ({CAST_TITLE}), which every other bug's body would meet before "
            "its own check (its row: as written); every other bug is judged with that bug's fix on the config's side",
            "AFFECTED      precision-fp16-auto-cast-while-disabled  on deepspeed *: ranks 0-1: RuntimeError: mat1 and "
            "mat2 must have the same dtype* (unfixed upstream; the fix on the config's side: fp16.auto_cast false)",
            "NOT AFFECTED  trains-a-step                            passed with this config, on a release the bug "
            "affects",
        ])  # fmt: skip
    else:
        result.stdout.fnmatch_lines_random(["NOT AFFECTED  precision-fp16-auto-cast-while-disabled  not yet affected*"])
        assert "judged with" not in result.stdout.str()


def test_a_mending_bug_outside_its_range_mends_nothing(pytester: pytest.Pytester, run: RunPytest) -> None:
    """The same premise and mend, on a release outside the bug's range: the config is judged as written, and every
    body meets what it does (here the bug, outside the catalogued range)."""
    pytester.makepyfile(test_trains=TRAINS)
    result = run("--ds-scan", str(config(pytester, AUTO_CAST)))
    assert "judged with" not in result.stdout.str()
    if installed_deepspeed() >= Version("0.17.1"):  # where DeepSpeed casts the inputs to half
        result.stdout.fnmatch_lines_random([
            "AFFECTED     casts-in-no-release  *RuntimeError: mat1 and mat2 must have the same dtype* (unfixed "
            "upstream; the fix on the config's side: fp16.auto_cast false; outside the catalogued range)",
            "CANNOT TELL  trains-a-step        *RuntimeError: mat1 and mat2 must have the same dtype*",
        ])  # fmt: skip


def test_a_refusal_that_is_a_bugs_fix_is_mended_for_the_other_bugs(pytester: pytest.Pytester, run: RunPytest) -> None:
    """From 0.19.6 DeepSpeed refuses a ``reduce_bucket_size`` of 0, as the fix of zero3-reduce-bucket-size-zero: that
    bug's row is judged as written (fixed: the refusal is the fix), and every other bug with its mend, said once above
    the table with why, instead of CANNOT TELL for a refused config."""
    if installed_deepspeed() < Version("0.19.6"):
        pytest.skip("DeepSpeed refuses a reduce_bucket_size of 0 from 0.19.6 on")
    shutil.copy(ROOT / "repros" / "conftest.py", pytester.path / "conftest.py")
    for name in ("_prerequisites.py", "_zero12.py", "zero3/test_zero3_reduce_bucket_size_zero.py"):
        shutil.copy(ROOT / "repros" / name, pytester.path)
    pytester.makepyfile(test_trains=TRAINS)
    user = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 3, "reduce_bucket_size": 0}}  # fmt: skip
    result = run("--ds-scan", str(config(pytester, user)), "-k", "not casts")
    result.stdout.fnmatch_lines_random([
        "note: judged with zero_optimization.reduce_bucket_size 0 -> 500000000: DeepSpeed * refuses the config as "
        "written (ValidationError: * reduce_bucket_size Input should be greater than 0*), as the fix of the known bug "
        "zero3-reduce-bucket-size-zero (*) does: on this release the config needs that change (its row: as written); "
        "every other bug is judged with that bug's fix on the config's side",
        "NOT AFFECTED  zero3-reduce-bucket-size-zero  fixed: passes on deepspeed *, after the affected range (<0.19.6)",
        "NOT AFFECTED  trains-a-step                  passed with this config, on a release the bug affects",
    ])  # fmt: skip
    assert "refuses this config" not in result.stdout.str()


def test_several_mending_bugs_judge_each_other_with_their_fixes(pytester: pytest.Pytester, run: RunPytest) -> None:
    """A config DeepSpeed refuses (the Trainer's warm-up of 0) whose steps would also meet the auto_cast bug: every
    bug is judged with both mends but a mending bug's own, which its row is."""
    if installed_deepspeed() < Version("0.19.3"):
        pytest.skip("both bugs' ranges hold a release from 0.19.3 on")
    shutil.copy(ROOT / "repros" / "conftest.py", pytester.path / "conftest.py")
    shutil.copy(ROOT / "repros" / "optim" / "test_sched_warmup_zero_refused.py", pytester.path)
    shutil.copy(ROOT / "repros" / "_prerequisites.py", pytester.path)
    shutil.copy(ROOT / "repros" / "precision" / "test_fp16_auto_cast_while_disabled.py", pytester.path)
    pytester.makepyfile(test_trains=TRAINS)
    user = config(pytester, {**HF_ZERO2, "fp16": {"enabled": False, "auto_cast": True}})
    result = run("--ds-scan", str(user), "-k", "not casts")
    either = (
        "(its row: with the other mends, not its own); every other bug is judged with that bug's fix on the "
        "config's side"
    )
    result.stdout.fnmatch_lines_random([
        "note: judged with scheduler.params.warmup_num_steps 0 -> 1: DeepSpeed * refuses the config as written "
        "(ValueError: warmup_num_steps must be a positive integer, got 0), which is the known bug "
        f"sched-warmup-zero-refused {either}",
        "note: judged with fp16.auto_cast true -> false: on DeepSpeed * the config meets the known bug "
        f"precision-fp16-auto-cast-while-disabled ({CAST_TITLE}), which every other bug's body would meet before "
        f"its own check {either}",
        "AFFECTED      sched-warmup-zero-refused                on deepspeed *: ranks 0-1: ConfigRejected: *"
        "warmup_num_steps must be a positive integer, got 0*",
        "AFFECTED      precision-fp16-auto-cast-while-disabled  on deepspeed *: ranks 0-1: RuntimeError: mat1 and "
        "mat2 must have the same dtype*",
        "NOT AFFECTED  trains-a-step                            passed with this config, on a release the bug "
        "affects",
    ])  # fmt: skip


def test_a_config_deepspeed_refuses_starts_no_world(pytester: pytest.Pytester, run: RunPytest,
                                                    catalogue: Path) -> None:  # fmt: skip
    """DeepSpeed's config classes refuse a value they cannot take: said once, above the table, from the release's own
    reading before any world; each bug the config can meet is CANNOT TELL, the others NOT APPLICABLE."""
    user = config(pytester, {"zero_optimization": {"stage": 3, "overlap_comm": "sometimes"}})
    result = run("--ds-scan", str(user), "-k", "not no_premise")
    result.stdout.fnmatch_lines_random([
        "DeepSpeed * refuses this config: ValidationError: 1 validation error for DeepSpeedZeroConfig overlap_comm "
        "Input should be a valid boolean*",
        "CANNOT TELL     needs-optimizer  DeepSpeed refuses this config (above)",
        "NOT APPLICABLE  stage0-only      needs ZeRO stage 0; the config has 3",
        "CANNOT TELL     other-error      DeepSpeed refuses this config (above)",
    ])  # fmt: skip
    assert "pytest-dsrepro: building" not in result.stdout.str()
    assert "something else" not in result.stdout.str()  # no body ran
    assert "For further information" not in result.stdout.str()


def test_a_key_deepspeed_does_not_know_is_taken_out_and_the_rest_judged(pytester: pytest.Pytester, run: RunPytest,
                                                                        catalogue: Path) -> None:  # fmt: skip
    """A key no release knows (a misspelling, a key of a pull request's branch) is taken out, said above the table
    with DeepSpeed's message, and every bug judged on the rest; a monitor is turned off, said once."""
    user = config(pytester, {"zero_optimization": {"stage": 3, "stage3_param_persitance_threshold": 1e5},
                             "wandb": {"enabled": True}})  # fmt: skip
    result = run("--ds-scan", str(user), "-k", "not no_premise")
    result.stdout.fnmatch_lines_random([
        "note: judged without zero_optimization.stage3_param_persitance_threshold: DeepSpeed * does not take it "
        "(ValidationError: 1 validation error for DeepSpeedZeroConfig: stage3_param_persitance_threshold: Extra "
        "inputs are not permitted); no catalogued bug depends on it, and the rest of the config is judged",
        "note: monitors turned off (wandb.enabled false)*",
        "AFFECTED        needs-optimizer  on deepspeed *: ranks 0-1: AttributeError: no optimizer hook (fixed in 9.0)",
        "CANNOT TELL     other-error      *KeyError: 'something else'*",
    ])  # fmt: skip
    assert "refuses this config" not in result.stdout.str()


#: A race with a deterministic form: a scan runs the form, and no series once it has told.
RACE = """
import pytest

pytestmark = [
    pytest.mark.ds_world,
    pytest.mark.ds_repro(id="a-race", title="a race", upstream="https://example.invalid/7"),
    pytest.mark.ds_premise(),
]


@pytest.mark.ds_config("zero0")
@pytest.mark.ds_version(affected=">=0.0.1", raises=AttributeError, match="forced")
def test_forced(ds_config):
    raise AttributeError("forced")


@pytest.mark.ds_config("zero0")
@pytest.mark.ds_nondeterministic(runs=20)
@pytest.mark.ds_version(affected=">=0.0.1", raises=AttributeError, match="forced")
def test_natural(ds_config):
    raise RuntimeError("the series ran")
"""


def test_a_race_told_by_its_deterministic_form_runs_no_series(pytester: pytest.Pytester, run: RunPytest) -> None:
    pytester.makepyfile(test_race=RACE)
    result = run("-rs", "--ds-scan", str(config(pytester, {"zero_optimization": {"stage": 0}})))
    result.assert_outcomes(failed=1, skipped=1)
    result.stdout.fnmatch_lines_random([
        "*NOT APPLICABLE: told by test_forced[[]scan[]] (AFFECTED): this race's series of 20 worlds adds nothing*",
        "AFFECTED  a-race  on deepspeed *: ranks 0-1: AttributeError: forced (unfixed upstream)",
    ])  # fmt: skip
    assert "the series ran" not in result.stdout.str()


def test_defaults_that_cannot_be_read_are_said_and_the_scan_goes_on(pytester: pytest.Pytester, run: RunPytest,
                                                                       catalogue: Path) -> None:  # fmt: skip
    """Injected: the probe of the release's defaults cannot start. One note says so; what a default would decide is
    not judged, the rest is, and the bodies run."""
    pytester.makeconftest("""
        from pytest_dsrepro.scan import defaults

        defaults.MODULE = "pytest_dsrepro.no_such_probe"
    """)
    # a config of this test's own: another test's real probe of the same config leaves its reading in the cache
    user = config(pytester, {"zero_optimization": {"stage": 3}, "steps_per_print": 4271})
    result = run("--ds-scan", str(user), "-k", "optimizer or stage0")
    result.stdout.fnmatch_lines_random([
        "note: reading DeepSpeed's defaults failed (exit 1): *No module named pytest_dsrepro.no_such_probe: a key the "
        "config leaves out that DeepSpeed gives a default was not judged",
        "AFFECTED        needs-optimizer  on deepspeed *: ranks 0-1: AttributeError: no optimizer hook (fixed in 9.0)",
        "NOT APPLICABLE  stage0-only      needs ZeRO stage 0; the config has 3",
    ])  # fmt: skip


def test_dsrepro_scan_exit_codes_and_markdown(pytester: pytest.Pytester, catalogue: Path, process_tag: str) -> None:
    """The command: the table on stdout, Markdown on request, exit 1 when a bug hits, 2 for a config it refuses."""
    (pytester.path / "conftest.py").write_text("")
    user = config(pytester, {"zero_optimization": {"stage": 3}})
    command = [sys.executable, "-m", "pytest_dsrepro.tools.cli", "scan", str(user), "--catalogue", str(catalogue),
               "--markdown", "scan.md", "--", "-k", "optimizer"]  # fmt: skip
    proc = subprocess.run(command, cwd=pytester.path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == scan_command.AFFECTED, proc.stdout + proc.stderr
    assert "AFFECTED  needs-optimizer  on deepspeed" in proc.stdout
    assert "**1 AFFECTED**" in (pytester.path / "scan.md").read_text()
    assert not (catalogue / "profile.log").exists(), "the scan wrote a config's relative output into the catalogue"
    bad = config(pytester, "{\n  // no closing brace\n", "bad.json")
    proc = subprocess.run([*command[:4], str(bad)], cwd=pytester.path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == scan_command.UNUSABLE
    assert (
        proc.stderr.strip() == f"dsrepro scan: {bad}:3:1: not JSON: Expecting property name enclosed in double quotes"
    )


def test_the_catalogue_travels_with_the_package() -> None:
    """Installed from the wheel (as tox installs it), the package holds the catalogue and its conftest.py."""
    found = catalogue_run.installed()
    assert (found.parent.name, found.name) == ("pytest_dsrepro", "catalogue")
    shipped = {p.relative_to(found) for p in found.rglob("*.py")}
    assert shipped >= {p.relative_to(ROOT / "repros") for p in (ROOT / "repros").rglob("*.py")}  # every folder's


def test_extra_packages_reach_each_release_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--with`` joins ``$DSREPRO_EXTRA_PACKAGES`` (which every release environment reads: scan, bisect, upstream)
    in the scan's release environments; without ``--release`` there is no environment to put them in, and the scan
    says so before it starts."""
    from pytest_dsrepro.tools import cli, environments

    monkeypatch.setenv(environments.EXTRA_PACKAGES_ENV, "einops")
    args = cli.build_parser().parse_args(
        ["scan", str(tmp_path / "c.json"), "--with", "huggingface_hub", "--with", "x>=1"]
    )
    seen = []

    def release_environment(*args: object, extra: list[str], **kwargs: object) -> object:
        def prepare(version: object) -> environments.ReleaseEnv:
            seen.append(extra)
            raise environments.EnvironmentUnavailable("stop here")

        return prepare

    monkeypatch.setattr(environments, "release_environment", release_environment)
    with pytest.raises(scan_command.ScanError, match=r"deepspeed 0\.19\.8 cannot run here: stop here"):
        scan_command.scan_releases(args, ["0.19.8"])
    assert seen == [["einops", "huggingface_hub", "x>=1"]]
    user = tmp_path / "c.json"
    user.write_text('{"zero_optimization": {"stage": 3}}')
    proc = subprocess.run([sys.executable, "-m", "pytest_dsrepro.tools.cli", "scan", str(user), "--with", "einops"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == scan_command.UNUSABLE
    assert "--with einops: it installs into --release environments" in proc.stderr


def test_the_shared_fixes_are_public() -> None:
    """A repro written outside the catalogue takes its shared fixes and premises from one public module."""
    from pytest_dsrepro.catalogue import prerequisites

    assert prerequisites.ZERO12_CPU_FLAT_BUFFER.name == "ds_prerequisite"
    assert prerequisites.ZERO3_PARTITIONED.name == "ds_premise"
    assert prerequisites.detach_flat_buffer.__module__ == "pytest_dsrepro.catalogue._prerequisites"
