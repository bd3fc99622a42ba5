"""The failures file (issue 37, item 3): why DeepSpeed's tests fail on a CPU, as data; each run's failures sorted into
known (with their class) and new, and the exit code that tells them apart."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_dsrepro.core import failures, results
from pytest_dsrepro.core.failures import FailureClass, FailuresFileError
from pytest_dsrepro.core.gates import Reason, Verdict
from pytest_dsrepro.tools import known_failures

GOOD = """\
# comments are fine
[[failure]]
tests = ["unit/v1/zero/test_autocast.py::*"]
class = "cpu-accelerator-lacks"
lacks = "fp16"

[[failure]]
tests = ["unit/runtime/test_new.py::TestNew::test_it[a-b]"]
class = "newer-than-release"
needs = "deepspeed.runtime.added"
deepspeed = "<=0.19.8"

[[failure]]
tests = ["unit/moe/test_race.py::test_resume"]
class = "deepspeed-bug"
report = "docs/upstream-reports/race.md"
why = "rank 0 rewrites the checkpoint while the others read it"
"""


def _record(nodeid: str, outcome: str, verdict: Verdict | None = None) -> results.TestRecord:
    reason = Reason.NOT_APPLICABLE if verdict is Verdict.NOT_APPLICABLE else None
    return results.TestRecord(nodeid=nodeid, repro=None, variant=None, verdict=verdict, reason=reason,
                              outcome=outcome, error=f"{outcome} here", duration=1.0, config=None)  # fmt: skip


def test_entries_are_read_with_their_class_detail_and_place() -> None:
    autocast, newer, race = failures.parse(GOOD, "f.toml")
    assert (autocast.cls, autocast.detail, autocast.where) == (FailureClass.CPU_ACCELERATOR_LACKS, "fp16", "f.toml:2")
    assert (newer.cls, newer.detail, newer.where) == (
        FailureClass.NEWER_THAN_RELEASE,
        "deepspeed.runtime.added",
        "f.toml:7",
    )
    assert (race.cls, race.report, race.repro, race.where) == (
        FailureClass.DEEPSPEED_BUG, "docs/upstream-reports/race.md", None, "f.toml:13"
    )  # fmt: skip
    assert autocast.covers("unit/v1/zero/test_autocast.py::TestX::test[bf16-1]", "0.19.8")
    assert not autocast.covers("unit/v1/zero/test_autocast_other.py::test", "0.19.8")
    # only * is a wildcard: the brackets of a parameter are themselves
    assert newer.covers("unit/runtime/test_new.py::TestNew::test_it[a-b]", "0.19.8")
    assert not newer.covers("unit/runtime/test_new.py::TestNew::test_it[a]", "0.19.8")
    assert not newer.covers("unit/runtime/test_new.py::TestNew::test_it[a-b]", "0.20.0")  # outside its releases
    assert not newer.covers("unit/runtime/test_new.py::TestNew::test_it[a-b]", None)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[[failure]]\ntests = [\n", r"f.toml:2: not valid TOML"),
        ('[[failure]]\ntests = ["unit/a.py::t"]\nclass = "x\nwhy = "y"\n', r"f.toml:3: not valid TOML"),
        ('[[failure]]\ntests = ["unit/a.py::t"]\nclass = "flaky"\n', r"f.toml:3: failure 1: 'class' is 'flaky', not one of"),
        ('[[failure]]\ntests = ["unit/a.py::t"]\nclass = "environment"\n', r"f.toml:1: failure 1: a environment entry says which in 'environment'"),
        ('[[failure]]\ntests = ["unit/a.py::t"]\nclass = "deepspeed-bug"\n', r"f.toml:1: failure 1: a deepspeed-bug names its catalogue 'repro'"),
        ('[[failure]]\ntests = []\nclass = "environment"\nenvironment = "x"\n', r"f.toml:2: failure 1: 'tests' must be a non-empty list"),
        ('[[failure]]\ntests = ["unit/a.py"]\nclass = "environment"\nenvironment = "x"\n', r"f.toml:2: failure 1: 'unit/a.py' is no node id"),
        ('\n[[failure]]\ntests = ["unit/a.py::t"]\nclass = "environment"\nenvironment = "x"\nlacks = "y"\n',
         r"f.toml:6: failure 1: 'lacks' belongs to another class than environment"),
        ('[[failure]]\ntests = ["unit/a.py::t"]\nclass = "environment"\nenvironment = "x"\n\n[[failure]]\ntests = ["unit/a.py::t"]\n'
         'class = "environment"\nenvironment = "x"\ndeepspeed = "new"\n', r"f.toml:10: failure 2: 'deepspeed' 'new' is no version specifier"),
        ('[[failure]]\ntests = ["unit/a.py::t"]\nkind = "x"\n', r"f.toml:3: failure 1: unknown key 'kind'"),
        ('[failures]\n', r"f.toml:1: unknown table or key 'failures'"),
    ],
)  # fmt: skip
def test_a_wrong_entry_is_named_by_file_and_line(text: str, message: str) -> None:
    with pytest.raises(FailuresFileError, match=message):
        failures.parse(text, "f.toml")


def test_an_unreadable_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(FailuresFileError, match=r"nothing.toml:1: cannot be read"):
        failures.read(tmp_path / "nothing.toml")


def test_a_runs_failures_are_known_or_new_and_the_exit_code_says_which() -> None:
    entries = failures.parse(GOOD)
    tests = [
        _record("unit/v1/zero/test_autocast.py::TestA::test[fp16]", "failed"),
        _record("unit/v1/zero/test_autocast.py::TestA::test[fp32]", "passed"),  # listed, passed: said
        _record("unit/moe/test_race.py::test_resume", "error"),
        _record("unit/comm/test_new_bug.py::test_x", "failed"),
        _record("unit/runtime/test_new.py::(module)", "skipped", Verdict.NOT_APPLICABLE),  # not a failure
    ]
    found = failures.classify([("0.19.8", tests)], entries)
    assert [f.nodeid for f in found.new] == ["unit/comm/test_new_bug.py::test_x"]
    assert [(f.nodeid, f.known.cls if f.known else None) for f in found.known] == [
        ("unit/v1/zero/test_autocast.py::TestA::test[fp16]", FailureClass.CPU_ACCELERATOR_LACKS),
        ("unit/moe/test_race.py::test_resume", FailureClass.DEEPSPEED_BUG),
    ]
    assert [nodeid for nodeid, _ in found.passing] == ["unit/v1/zero/test_autocast.py::TestA::test[fp32]"]
    lines = failures.summary(found)
    assert lines[0] == "3 failed: 1 new, 2 known"
    assert lines[1] == "NEW      unit/comm/test_new_bug.py::test_x on deepspeed 0.19.8: failed here"
    assert "known    unit/moe/test_race.py::test_resume: deepspeed-bug: docs/upstream-reports/race.md (" in lines[3]
    assert known_failures.exit_code(found) == known_failures.NEW_FAILURES
    assert known_failures.exit_code(failures.classify([("0.19.8", tests[:3])], entries)) == known_failures.KNOWN_ONLY


def test_the_packaged_file_reads_and_names_the_race_as_a_bug_in_the_test() -> None:
    entries = failures.read(failures.PACKAGED)
    race = "unit/v1/moe/test_autoep_autotp_checkpoint.py::test_cpu_gloo_folded_checkpoint_edp_replica_resume"
    (entry,) = [e for e in entries if e.covers(race, "0.19.8")]
    assert entry.cls is FailureClass.DEEPSPEED_BUG
    assert entry.report is not None
    assert (Path(__file__).resolve().parents[1] / entry.report).is_file()


def test_release_runs_tell_the_failures_of_their_own_files_and_keep_their_exit_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    env = results.environment("gloo", 2)
    older = results.RunRecord(environment=env, tests=(_record("unit/old.py::test_x", "failed"),))
    results.write(older, tmp_path)  # an earlier run's file in the same directory: not this run's

    def run() -> int:
        release = results.Environment(**{**env.to_json(), "deepspeed": "0.19.8"})
        tests = (_record("unit/v1/zero/test_autocast.py::T::test", "failed"), _record("unit/new.py::test_y", "failed"))
        results.write(results.RunRecord(environment=release, tests=tests), tmp_path)
        return 0

    assert known_failures.after_releases(tmp_path, run, failures.parse(GOOD)) == 0
    err = capsys.readouterr().err
    assert "dsrepro upstream: 2 failed: 1 new, 1 known" in err
    assert "NEW      unit/new.py::test_y on deepspeed 0.19.8" in err
    assert "unit/old.py" not in err
