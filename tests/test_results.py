"""The results file: ``core.results`` (the schema: typed records, validation, files) as pure functions, the recording
side's summary, and once end to end: ``--ds-results`` writes one file per run, serial and under xdist."""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from conftest import RunPytest, deepspeed_version
from pytest_dsrepro.core import results
from pytest_dsrepro.core.gates import Rate, Reason, Verdict
from pytest_dsrepro.core.outcome import ErrorInfo, Measurement, RankResult, Status, WorldOutcome
from pytest_dsrepro.core.results import Environment, RankStory, ReproMeta, RunRecord, Source, TestRecord

ENV = Environment(deepspeed="0.18.3", torch="2.13.0", python="3.11.7", backend="gloo", world_size=2, os="Linux",
                  cpu="AMD EPYC", cpu_count=2, gpu=None, gpu_count=0)  # fmt: skip
REPRO = ReproMeta(id="demo", title="A demo", upstream="https://x.invalid/1", affected=(">=0.1",))
STOCK = TestRecord(
    nodeid="t.py::test[stock]", repro=REPRO, variant="stock", verdict=Verdict.REPRODUCED, reason=Reason.REPRODUCED,
    outcome="xfailed", error="REPRODUCED on deepspeed 0.18.3: ranks 0-1: AttributeError: x", duration=1.25,
    config={"zero_optimization": {"stage": 3}}, config_notes=("fp16 -> fp32",),
    ranks=(RankStory("ranks 0-1", "AttributeError: x", "Traceback ...", "out"),), longrepr=None, world_size=2,
    attempts=2, source=Source("repros/t.py", "def patch(mp): ...\n\ndef test(): ...\n", "patch"),
)  # fmt: skip
RACE = dataclasses.replace(
    STOCK, nodeid="t.py::race[stock]", attempts=1, error="REPRODUCED 9/20 on deepspeed 0.18.3: ...",
    rate=Rate(runs=20, planned=20, failed=9, needed=1, seconds=31.5),
)  # fmt: skip
SLOW = dataclasses.replace(
    STOCK, nodeid="t.py::slow[stock]", attempts=1,
    measurements=(Measurement("backward of 256 tensors", "8 backwards of 32 tensors", 0.79, 0.1, 3.0, 5),),
)  # fmt: skip
PLAIN = TestRecord(nodeid="t.py::test_plain", repro=None, variant=None, verdict=None, reason=None, outcome="failed",
                   error="assert 1 == 2", duration=0.1, config=None, longrepr="E   assert 1 == 2")  # fmt: skip
RUN = RunRecord(created=datetime.datetime(2026, 11, 22, 10, tzinfo=datetime.timezone.utc), environment=ENV,
                tests=(STOCK, PLAIN, RACE, SLOW))  # fmt: skip


def test_a_run_survives_json_text() -> None:
    data = json.loads(json.dumps(RUN.to_json()))
    assert data["schema"] == results.SCHEMA
    assert data["created"] == "2026-11-22T10:00:00+00:00"
    assert data["tests"][0]["verdict"] == "REPRODUCED"
    assert data["tests"][0]["reason"] == "reproduced"
    assert list(data["environment"]) == ["deepspeed", "torch", "python", "backend", "world_size", "os", "cpu",
                                         "cpu_count", "gpu", "gpu_count", "pytest", "plugin", "accelerator",
                                         "ds_report", "torch_env"]  # fmt: skip
    assert data["tests"][0]["attempts"] == 2
    assert data["tests"][0]["source"]["fix"] == "patch"
    assert (data["tests"][0]["rate"], data["tests"][0]["measurements"]) == (None, [])
    assert data["tests"][2]["rate"] == {"runs": 20, "planned": 20, "failed": 9, "needed": 1, "seconds": 31.5}
    assert data["tests"][3]["measurements"] == [{
        "what": "backward of 256 tensors", "reference": "8 backwards of 32 tensors", "seconds": 0.79,
        "reference_seconds": 0.1, "limit": 3.0, "repeats": 5, "clock": "cpu",
    }]  # fmt: skip
    assert RunRecord.from_json(data) == RUN


def test_write_names_files_by_release_and_read_gives_them_back(tmp_path: Path) -> None:
    path = results.write(RUN, tmp_path / "new")
    assert path.name.startswith("results-deepspeed-0.18.3-")
    assert path.suffix == ".json"
    assert results.read(path) == RUN
    unavailable = RunRecord(environment=ENV, unavailable="import failed")
    assert results.write(unavailable, tmp_path).name.startswith("results-deepspeed-0.18.3-unavailable-")
    assert results.write(RUN, tmp_path) != results.write(RUN, tmp_path)  # never overwritten


def test_read_all_says_what_it_cannot_read_and_what_to_do(tmp_path: Path) -> None:
    good = results.write(RUN, tmp_path / "a")
    (tmp_path / "a" / "package.json").write_text('{"name": "x"}')
    (tmp_path / "b.json").write_text("{")
    empty = results.write(RUN, tmp_path / "c")
    empty.write_text("")  # a disk that filled up: the file is there, its content is not
    files, unreadable = results.read_all([tmp_path / "a", tmp_path / "b.json", tmp_path / "c", good])
    assert [f.path for f in files] == [good]  # a file reached twice is read once
    assert files[0].created == RUN.created
    assert [(str(u), u.kind, u.release) for u in unreadable] == [
        (f"{tmp_path / 'a' / 'package.json'}: not a pytest-dsrepro results file (no 'schema')", "foreign", None),
        (f"{tmp_path / 'b.json'}: not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 "
         "(char 1)): cut short by an interrupted run, a full disk or a partial copy? Run its tests again, or delete "
         "it", "truncated", None),
        (f"{empty}: empty: cut short by an interrupted run, a full disk or a partial copy? Run its tests again, or "
         "delete it", "truncated", RUN.version),  # the release, from the name write() gave the file
    ]  # fmt: skip
    with pytest.raises(FileNotFoundError, match=r"no such file or directory: .*missing"):
        results.read_all([tmp_path / "missing"])


@pytest.mark.parametrize(
    ("schema", "kind", "said"),
    [
        (results.SCHEMA + 1, "newer", "written by a newer pytest-dsrepro (9.1); this one reads results files of "
         f"schema 5 to {results.SCHEMA}: upgrade pytest-dsrepro to read it"),
        (4, "older", "written by an older pytest-dsrepro (9.1); this one reads results files of "
         f"schema 5 to {results.SCHEMA}: run those tests again to write it anew"),
        ("http://json-schema.org/draft-07/schema#", "foreign", "not a pytest-dsrepro schema"),
    ],
)  # fmt: skip
def test_a_file_of_another_schema_is_told_what_to_do(tmp_path: Path, schema: object, kind: str, said: str) -> None:
    """A newer plugin's file is read by upgrading this one (running the tests again would write the old schema);
    an older one is written anew by running its tests again."""
    data = {**RUN.to_json(), "schema": schema}
    data["environment"]["plugin"] = "9.1"
    path = tmp_path / "r.json"
    path.write_text(json.dumps(data))
    ((found,),) = results.read_all([path])[1:]
    assert (found.kind, found.release) == (kind, RUN.version)
    assert said in found.problem
    with pytest.raises(ValueError, match="this one reads results files of schema"):
        results.read(path)


def test_a_schema_5_file_reads_as_a_run_that_scanned_nothing(tmp_path: Path) -> None:
    """Schema 6 only added the scan's fields: results written before it still merge with new ones."""
    data = RUN.to_json()
    del data["scan"]
    for test in data["tests"]:
        del test["scan"]
    path = tmp_path / "r.json"
    path.write_text(json.dumps({**data, "schema": 5}))
    assert results.read(path) == RUN
    assert results.read_all([path])[0][0].run == RUN


def test_a_file_without_its_time_is_as_old_as_the_file(tmp_path: Path) -> None:
    path = results.write(dataclasses.replace(RUN, created=None), tmp_path)
    (stored,) = results.read_all([path])[0]
    assert stored.created == datetime.datetime.fromtimestamp(path.stat().st_mtime, datetime.timezone.utc)


def _broken(change: Any) -> dict[str, Any]:
    data = RUN.to_json()
    change(data)
    return data


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.pop("schema"), "not a pytest-dsrepro results file (no 'schema')"),
        (lambda d: d.update(schema=1), "schema 1: written by an older pytest-dsrepro; this one reads results files "
         f"of schema 5 to {results.SCHEMA}: run those tests again to write it anew"),
        (lambda d: d.update(schema="6"), "schema '6': not a pytest-dsrepro schema; this one reads results files of "
         f"schema 5 to {results.SCHEMA}"),
        (lambda d: d.update(extra=1), "results file: unknown field 'extra'"),
        (lambda d: d.pop("tests"), "results file: missing field 'tests'"),
        (lambda d: d.update(tests={}), "results file: 'tests' must be a list, not an object"),
        (lambda d: d.update(created="yesterday"), "results file: 'created' is 'yesterday', not an ISO 8601 time"),
        (lambda d: d.update(unavailable=["x"]), "results file: 'unavailable' must be a string, not a list"),
        # the drift this module ends: install wrote "platform" where the report reads "os"
        (lambda d: d["environment"].update(platform=d["environment"].pop("os")), "environment: missing field 'os'"),
        (lambda d: d["environment"].update(world_size="2"), "environment: 'world_size' must be a whole number"),
        (lambda d: d.update(environment=None), "environment must be an object, not null"),
        (lambda d: d["tests"].append(3), "tests[4] must be an object, not 3"),
        (lambda d: d["tests"][0].pop("reason"), "tests[0] (t.py::test[stock]): missing field 'reason'"),
        (lambda d: d["tests"][0].update(verdict="MAYBE"),
         "tests[0] (t.py::test[stock]): 'verdict' is 'MAYBE', not one of REPRODUCED, FIXED, NOT-YET-AFFECTED, "
         "PASSES-WITH-FIX"),
        (lambda d: d["tests"][0].update(reason="because"), "'reason' is 'because', not one of reproduced, "),
        (lambda d: d["tests"][0].update(verdict="FIXED"),
         "tests[0] (t.py::test[stock]): verdict FIXED does not follow from reason 'reproduced' (REPRODUCED)"),
        (lambda d: d["tests"][0].update(reason=None), "verdict REPRODUCED without a reason"),
        (lambda d: d["tests"][1].update(reason="harness-error"), "reason 'harness-error' without its verdict UNEXPECTED"),
        (lambda d: d["tests"][0].update(outcome="fine"), "'outcome' is 'fine', not one of passed, failed, skipped"),
        (lambda d: d["tests"][0].update(duration=-1), "'duration' must be a number of seconds >= 0, not -1"),
        (lambda d: d["tests"][0].update(config_notes="x"), "'config_notes' must be a list of strings, not a string"),
        (lambda d: d["tests"][0]["ranks"][0].pop("traceback"),
         "tests[0] (t.py::test[stock]).ranks[0]: missing field 'traceback'"),
        (lambda d: d["tests"][0].update(repro="demo"),
         "tests[0] (t.py::test[stock]): 'repro' must be an object or null, not a string"),
        (lambda d: d["tests"][0].update(attempts=0), "'attempts' must be a whole number >= 1, not 0"),
        (lambda d: d["tests"][0].update(world_size=-2), "'world_size' must be a whole number >= 0 or null, not -2"),
        (lambda d: d["tests"][0]["source"].pop("fix_code"),
         "tests[0] (t.py::test[stock]).source: missing field 'fix_code'"),
        (lambda d: d["tests"][0]["source"].update(code=None), ".source: 'code' must be a string, not null"),
        (lambda d: d["environment"].update(ds_report=3), "environment: 'ds_report' must be a string, not 3"),
        (lambda d: d["tests"][0]["repro"].update(affected=">=0.1"),
         "tests[0] (t.py::test[stock]).repro: 'affected' must be a list of strings, not a string"),
        (lambda d: d["tests"][2].update(rate=9), "tests[2] (t.py::race[stock]): 'rate' must be an object or null, not 9"),
        (lambda d: d["tests"][2]["rate"].pop("needed"), "tests[2] (t.py::race[stock]).rate: missing field 'needed'"),
        (lambda d: d["tests"][2]["rate"].update(failed=21),
         "tests[2] (t.py::race[stock]).rate: runs 20, planned 20, failed 21, needed 1 do not add up"),
        (lambda d: d["tests"][3].update(measurements={}),
         "tests[3] (t.py::slow[stock]): 'measurements' must be a list, not an object"),
        (lambda d: d["tests"][3]["measurements"][0].update(limit="3x"),
         "tests[3] (t.py::slow[stock]).measurements[0]: 'limit' must be a number >= 0, not a string"),
        (lambda d: d["tests"][3]["measurements"][0].update(repeats=0),
         "tests[3] (t.py::slow[stock]).measurements[0]: 'repeats' must be a whole number >= 1, not 0"),
        (lambda d: d["tests"][3]["measurements"][0].update(clock="gpu"),
         "tests[3] (t.py::slow[stock]).measurements[0]: 'clock' is 'gpu', not one of cpu, wall"),
    ],
)  # fmt: skip
def test_from_json_says_what_is_wrong_and_where(change: Any, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        RunRecord.from_json(_broken(change))


def test_records_are_checked_when_built_too() -> None:
    with pytest.raises(ValueError, match=r"t.py::x: verdict UNEXPECTED without a reason"):
        dataclasses.replace(PLAIN, nodeid="t.py::x", verdict=Verdict.UNEXPECTED)
    with pytest.raises(ValueError, match="schema 1: written by an older pytest-dsrepro; this one reads results files"):
        RunRecord(schema=1, environment=ENV)
    skipped = dataclasses.replace(PLAIN, verdict=Verdict.SKIPPED, outcome="skipped")  # a gated test never judged
    assert skipped.reason is None


def test_repro_meta_reads_the_marker_as_declared() -> None:
    """``ds_repro(id, title, upstream, fix_ref=None, fixed_in=None, root_cause='')``, positional or keyword."""
    ds_versions = [((), {"affected": "<0.18.3"}), ((">=0.18.3,<0.19.5",), {}), ((), {"affected": "<0.18.3"})]
    meta = results.repro_meta(("zero3-x", "Title"), {"upstream": "https://u", "fixed_in": None, "typo": 1},
                              "/w/repros/test_zero3_x.py", ds_versions)  # fmt: skip
    assert meta == ReproMeta(
        id="zero3-x", title="Title", upstream="https://u", affected=("<0.18.3", ">=0.18.3,<0.19.5")
    )
    plain = results.repro_meta((), {"title": 3}, Path("repros/test_module_id.py"), [((), {"raises": KeyError})])
    assert (plain.id, plain.title, plain.affected, plain.root_cause) == ("module_id", "3", (), "")


def test_rank_stories_tell_each_ending_once() -> None:
    error = ErrorInfo(("builtins.KeyError", "builtins.Exception"), "'k'", "Traceback\nKeyError: 'k'")
    outcome = WorldOutcome(4, "gloo", (
        RankResult(0, Status.FAILED, error, output="x" * 5000),
        RankResult(1, Status.FAILED, error),
        RankResult(2, Status.PASSED),
        RankResult(3, Status.HUNG, detail="after 5s", stack="File a.py, line 1"),
    ), 5.0)  # fmt: skip
    first, hung = results.rank_stories(outcome)
    assert (first.ranks, first.error, first.traceback) == ("ranks 0-1", "KeyError: 'k'", error.traceback)
    assert len(first.output) == results.OUTPUT_KEPT
    assert (hung.ranks, hung.error, hung.traceback) == ("rank 3", "hung: after 5s", "File a.py, line 1")
    assert results.rank_stories(None) == ()


def test_environment_of_this_machine() -> None:
    env = results.environment("gloo", 2, ["NVIDIA A100", "NVIDIA A100", "NVIDIA H100"])
    assert (env.backend, env.world_size, env.gpu, env.gpu_count) == ("gloo", 2, "NVIDIA A100, NVIDIA H100", 3)
    assert env.python
    assert env.os
    assert env.cpu
    assert (env.cpu_count or 0) >= 1
    assert results.environment(None, None).gpu_count == 0


def test_summary_lines_put_the_verdict_first() -> None:
    from pytest_dsrepro.session.recording import RecordedTests

    harness = dataclasses.replace(PLAIN, nodeid="t.py::h", repro=REPRO, verdict=Verdict.UNEXPECTED,
                                  reason=Reason.HARNESS_ERROR, error="no world ran: server died")  # fmt: skip
    plain_pass = dataclasses.replace(PLAIN, nodeid="t.py::ok", outcome="passed", error=None)
    run = RecordedTests([STOCK, harness, plain_pass, RACE])
    assert run.summary_lines() == [
        "REPRODUCED       t.py::test[stock]  (2 attempts)",
        "UNEXPECTED       t.py::h  -- no world ran: server died",
        "REPRODUCED 9/20  t.py::race[stock]",
    ]
    assert run.record(ENV).tests == (STOCK, harness, plain_pass, RACE)


REPRO_FILE = """
import pytest

pytestmark = [
    pytest.mark.ds_repro(id="demo-bug", title="A demo bug", upstream="https://example.invalid/1", fixed_in=None,
                         root_cause="json has no epilogue."),
    pytest.mark.ds_world,
]

def patch(monkeypatch):
    import json
    monkeypatch.setattr(json, "epilogue", lambda: None, raising=False)

@pytest.mark.ds_config("zero2")
@pytest.mark.ds_version(affected=">=0.1", raises=AttributeError, match="epilogue", fix=patch)
def test_demo(ds_config, ds_rank):
    import json
    json.epilogue()

def test_plain_skip(ds_rank):
    pytest.skip("nothing to see")
"""


@pytest.mark.parametrize("xdist", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_results_file(pytester: pytest.Pytester, run: RunPytest, xdist: list[str]) -> None:
    pytester.makepyfile(test_demo=REPRO_FILE)
    result = run(f"--ds-results={pytester.path / 'out'}", *xdist)
    result.assert_outcomes(passed=1, xfailed=1, skipped=1)
    (path,) = (pytester.path / "out").glob("*.json")
    run_record = json.loads(path.read_text())
    results.read(path)  # valid, by the one reader
    env = run_record["environment"]
    assert run_record["schema"] == results.SCHEMA
    assert run_record["unavailable"] is None
    assert env["deepspeed"] == deepspeed_version()
    assert env["backend"] == "gloo"
    assert env["world_size"] == 2
    assert env["cpu_count"] >= 1
    assert env["gpu_count"] == 0
    assert env["os"]
    assert env["accelerator"] == "cpu"  # as the fork server's DeepSpeed names it (under xdist: its rule for it)
    assert (env["ds_report"], env["torch_env"]) == (None, None)  # gathered for a --ds-report only
    assert env["plugin"] == metadata.version("pytest-dsrepro")
    tests = {t["nodeid"]: t for t in run_record["tests"]}
    stock = tests["test_demo.py::test_demo[zero2-stock]"]
    assert stock["verdict"] == "REPRODUCED"
    assert stock["outcome"] == "xfailed"
    assert stock["variant"] == "stock"
    assert stock["reason"] == "reproduced"
    assert stock["error"].startswith(f"REPRODUCED on deepspeed {deepspeed_version()}: ranks 0-1: AttributeError:")
    assert stock["repro"]["id"] == "demo-bug"
    assert stock["repro"]["affected"] == [">=0.1"]
    assert stock["config"]["zero_optimization"]["stage"] == 2
    assert stock["config"]["train_batch_size"] == 4
    assert "fp16 -> fp32: fp16 training needs CUDA; this is a gloo/CPU world" in stock["config_notes"]
    assert stock["ranks"][0]["ranks"] == "ranks 0-1"
    assert "json.epilogue()" in stock["ranks"][0]["traceback"]
    assert (stock["world_size"], stock["attempts"]) == (2, 1)
    source = stock["source"]
    assert (source["path"], source["fix"], source["fix_code"]) == ("test_demo.py", "patch", None)
    assert source["code"].startswith("import pytest\n\npytestmark = [\n")  # as the file has it, from the top
    assert "def patch(monkeypatch):" in source["code"]
    assert "def test_demo(ds_config, ds_rank):\n    import json\n    json.epilogue()\n" in source["code"]
    assert "test_plain_skip" not in source["code"]  # what the test does not use stays out
    fixed = tests["test_demo.py::test_demo[zero2-fixed]"]
    assert (fixed["verdict"], fixed["reason"], fixed["outcome"], fixed["error"]) == (
        "PASSES-WITH-FIX", "fix-holds", "passed", None)  # fmt: skip
    skipped = tests["test_demo.py::test_plain_skip"]
    assert (skipped["outcome"], skipped["error"]) == ("skipped", "nothing to see")
