"""DeepSpeed's tests in shards (issue 37, item 2): ``dsrepro upstream --shard I/N`` in separate processes, then
``--merge``: one report and one matrix, a shard that died named, never silently missing. The checkout is
``tests/examples/upstream`` with a file of plain tests written here (each shard a quick run)."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import deepspeed_version
from pytest_dsrepro.core import results, shard_manifests
from pytest_dsrepro.core.shard_manifests import Manifest, ShardState

PLAIN = """\
import time


def test_a():
    pass


def test_waits():
    time.sleep(float(__import__("os").environ.get("SHARD_TEST_WAIT", "0")))


def test_fails():
    assert 1 == 2, "an upstream test that fails"


def test_b():
    pass
"""
FAILURES = """\
[[failure]]
tests = ["unit/runtime/test_plain.py::test_fails"]
class = "environment"
environment = "written for this test"
"""


def _git(root: Path, *args: str) -> None:
    command = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@example.com", *args]
    subprocess.run(command, check=True, capture_output=True)


@pytest.fixture
def plain_checkout(pytester: pytest.Pytester) -> Path:
    """A DeepSpeed-shaped checkout whose only tests are ``PLAIN``'s four, committed."""
    pytester.copy_example("upstream")
    for path in (pytester.path / "tests" / "unit").rglob("test_*.py"):
        path.unlink()
    (pytester.path / "tests" / "unit" / "runtime" / "test_plain.py").write_text(PLAIN)
    (pytester.path / ".gitignore").write_text("__pycache__/\n")
    _git(pytester.path, "init", "-q")
    _git(pytester.path, "add", "-A")
    _git(pytester.path, "commit", "-qm", "tests")
    return pytester.path


def _dsrepro(*args: str, cwd: Path, **popen: object) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "pytest_dsrepro.tools.cli", "upstream", *args]
    return subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)  # type: ignore[call-overload, no-any-return]


def _merge(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pytest_dsrepro.tools.cli", "upstream", "--merge", *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_shards_as_processes_merge_and_a_killed_one_is_named(
    plain_checkout: Path, tmp_path: Path, process_tag: str
) -> None:
    """Three shards as three processes; the second (whose test waits) killed with SIGKILL once it has collected.
    The merge names it dead, with its planned tests, and exits 3; the shards that finished merge into one report and
    matrix; with the second run again, the merge is complete and tells known failures from new ones."""
    failures = tmp_path / "failures.toml"
    failures.write_text(FAILURES)
    tests = plain_checkout / "tests"
    procs = {
        i: _dsrepro("unit", "--shard", f"{i}/3", "--results", str(tmp_path / f"shard-{i}"), "--", "-p", "no:cacheprovider",
                    cwd=tests, env={**os.environ, "SHARD_TEST_WAIT": "600" if i == 2 else "0"}, start_new_session=True)
        for i in (1, 2, 3)
    }  # fmt: skip
    manifest = tmp_path / "shard-2" / Manifest(2, 3, None, ()).filename().replace("none", results_release())
    deadline = time.monotonic() + 240
    while not manifest.exists() and procs[2].poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert manifest.exists(), procs[2].communicate(timeout=60)
    os.killpg(procs[2].pid, signal.SIGKILL)  # the shard's job is lost: dsrepro and its pytest at once
    procs[2].communicate(timeout=60)
    for i, code in ((1, 0), (3, 1)):  # shard 3 holds test_fails: NEW, since the packaged file does not list it
        out, err = procs[i].communicate(timeout=300)
        assert procs[i].returncode == code, out[-2000:] + err[-2000:]

    dead = _merge(*(str(tmp_path / f"shard-{i}") for i in (1, 2, 3)), cwd=tmp_path)
    assert dead.returncode == 3, dead.stdout + dead.stderr
    assert (
        f"shard 2/3 on deepspeed {results_release()}: dead: planned 1 tests, no results file: pytest never ended"
        in (dead.stdout)
    )
    assert "    not run: unit/runtime/test_plain.py::test_waits" in dead.stdout
    assert "shard 1/3" in dead.stdout
    assert "complete: ran its 2 planned tests" in dead.stdout
    assert "incomplete: shard 2/3" in dead.stderr
    assert "DeepSpeed repro matrix" in dead.stdout  # the matrix of what the others ran

    both = _merge(str(tmp_path / "shard-1"), "--shard", "1/3", cwd=tmp_path)
    assert both.returncode == 2
    assert "dsrepro upstream: --merge runs nothing: give it the shards' results directories alone" in both.stderr
    missing = _merge(str(tmp_path / "shard-1"), str(tmp_path / "shard-3"), cwd=tmp_path)
    assert missing.returncode == 3
    assert f"shard 2/3 on deepspeed {results_release()}: missing: no manifest" in missing.stdout

    again = _dsrepro("unit", "--shard", "2/3", "--results", str(tmp_path / "shard-2"), "--", "-p", "no:cacheprovider",
                     cwd=tests)  # fmt: skip
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, out[-2000:] + err[-2000:]
    merged = _merge(*(str(tmp_path / f"shard-{i}") for i in (1, 2, 3)), cwd=tmp_path)
    assert merged.returncode == 1, merged.stdout + merged.stderr  # complete; test_fails is not in the packaged file
    assert "NEW      unit/runtime/test_plain.py::test_fails" in merged.stdout
    known = _merge(*(str(tmp_path / f"shard-{i}") for i in (1, 2, 3)), "--failures", str(failures), cwd=tmp_path)
    assert known.returncode == 0, known.stdout + known.stderr
    assert "known    unit/runtime/test_plain.py::test_fails: environment: written for this test" in known.stdout
    files, unreadable = results.read_all([tmp_path])
    assert not unreadable  # the manifests are not taken for results files
    assert sorted(t.nodeid for f in files for t in f.run.tests) == [
        f"unit/runtime/test_plain.py::test_{name}" for name in ("a", "b", "fails", "waits")
    ]

    # shard 2 run again into its own directory, and killed once it has collected: dead, whatever the run before
    # left there (its results are set aside, never read as this run's)
    before = manifest.read_text()
    rerun = _dsrepro("unit", "--shard", "2/3", "--results", str(tmp_path / "shard-2"), "--", "-p", "no:cacheprovider",
                     cwd=tests, env={**os.environ, "SHARD_TEST_WAIT": "600"}, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 240
    while manifest.read_text() == before and rerun.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert json.loads(manifest.read_text())["exitstatus"] is None, rerun.communicate(timeout=60)
    os.killpg(rerun.pid, signal.SIGKILL)
    rerun.communicate(timeout=60)
    killed = _merge(*(str(tmp_path / f"shard-{i}") for i in (1, 2, 3)), cwd=tmp_path)
    assert killed.returncode == 3, killed.stdout + killed.stderr
    (earlier,) = (tmp_path / "shard-2").glob("*.json")
    assert (
        f"shard 2/3 on deepspeed {results_release()}: dead: planned 1 tests, no results file: pytest never ended "
        "(killed, or its machine lost?) (results of an earlier run in its directory are not its own)"
    ) in killed.stdout
    assert (
        f"left out: {earlier}: an earlier run, replaced by the run of shard 2/3 on deepspeed {results_release()} in its "
        "directory"
    ) in killed.stdout
    assert "incomplete: shard 2/3" in killed.stderr

    # one shard's own run sorts its failures too: known, so exit 0
    alone = _dsrepro("unit", "--shard", "3/3", "--results", str(tmp_path / "alone"), "--failures", str(failures), "--",
                     "-p", "no:cacheprovider", cwd=tests)  # fmt: skip
    out, err = alone.communicate(timeout=300)
    assert alone.returncode == 0, out[-2000:] + err[-2000:]
    assert "dsrepro upstream: 1 failed: 0 new, 1 known" in err


def results_release() -> str:
    return deepspeed_version()


# ---- the pieces -------------------------------------------------------------------------------------------------


def _results(directory: Path, release: str, nodeids: list[str], outcome: str = "passed", later: bool = False) -> None:
    tests = [results.TestRecord(nodeid=n, repro=None, variant=None, verdict=None, reason=None, outcome=outcome,
                                error=None if outcome == "passed" else "AssertionError: no", duration=0.1, config=None)
             for n in nodeids]  # fmt: skip
    env = results.Environment(**{**results.environment("gloo", 2).to_json(), "deepspeed": release})
    created = results.now() + datetime.timedelta(seconds=10 if later else 0)
    results.write(results.RunRecord(created=created, environment=env, tests=tuple(tests)), directory)


def test_the_merge_judges_each_shard_by_its_manifest_and_its_results(tmp_path: Path) -> None:
    plan = {1: ["u/t.py::a", "u/t.py::d"], 2: ["u/t.py::b"], 3: ["u/t.py::c"], 4: ["u/t.py::e"]}
    for i in (1, 2, 3):
        shard_manifests.write(
            Manifest(i, 4, "0.19.8", tuple(plan[i]), exitstatus=0 if i != 2 else None), tmp_path / str(i)
        )
    _results(tmp_path / "1", "0.19.8", plan[1])
    _results(tmp_path / "3", "0.19.8", [])  # ended without its test
    _results(tmp_path / "3", "0.16.4", plan[3])  # another release's results in the directory: not this shard's
    found, unreadable = shard_manifests.find([tmp_path])
    assert [m.index for _, m in found] == [1, 2, 3]
    assert not unreadable
    files, _ = results.read_all([tmp_path])
    verdicts = shard_manifests.judge(found, files)
    assert [(s.index, s.state) for s in verdicts] == [
        (1, ShardState.COMPLETE), (2, ShardState.DEAD), (3, ShardState.INCOMPLETE), (4, ShardState.MISSING)
    ]  # fmt: skip
    assert verdicts[2].detail == "ran 0 of 1 planned tests, pytest exit status 0"
    assert verdicts[2].missing == ("u/t.py::c",)
    assert [(s.index, s.state) for s in shard_manifests.judge([], [], count=2)] == [
        (1, ShardState.MISSING),
        (2, ShardState.MISSING),
    ]


def test_a_manifest_that_is_not_one_is_named_and_the_others_are_read(tmp_path: Path) -> None:
    shard_manifests.write(Manifest(1, 2, "0.19.8", ("u/t.py::a",), exitstatus=0), tmp_path / "1")
    bad = tmp_path / "2" / f"x{shard_manifests.SUFFIX}"
    bad.parent.mkdir()
    bad.write_text(json.dumps({"schema": 2, "index": 3, "count": 2, "deepspeed": None, "planned": [],
                               "exitstatus": None}))  # fmt: skip
    with pytest.raises(ValueError, match=r"x.shard: 'index' and 'count' must be whole numbers, 1 <= index <= count"):
        shard_manifests.read(bad)
    found, unreadable = shard_manifests.find([tmp_path, tmp_path / "1"])  # reached twice: read once
    assert [m.index for _, m in found] == [1]
    assert [str(u) for u in unreadable] == [f"{bad}: 'index' and 'count' must be whole numbers, 1 <= index <= count"]
    bad.write_text("{")
    (again,) = shard_manifests.find([tmp_path])[1]
    assert again.path == bad
    assert again.problem.startswith("not valid JSON")


def test_a_schema_1_manifest_reads_as_one_whose_directory_held_nothing(tmp_path: Path) -> None:
    path = tmp_path / f"old{shard_manifests.SUFFIX}"
    path.write_text(json.dumps({"schema": 1, "index": 1, "count": 1, "deepspeed": "0.19.8", "planned": ["u::a"],
                                "exitstatus": 0}))  # fmt: skip
    assert shard_manifests.read(path) == Manifest(1, 1, "0.19.8", ("u::a",), 0, earlier=())


def test_an_earlier_run_in_a_shards_directory_is_not_its_own(tmp_path: Path) -> None:
    """Shard 2 ran, then ran again into the same directory and died: the first run's file is set aside (it holds
    the shard's planned test), the shard is dead; a file of another shard in that directory is not set aside."""
    _results(tmp_path, "0.19.8", ["u/t.py::a"])  # shard 1's, in the same directory, before shard 2 ran
    _results(tmp_path, "0.19.8", ["u/t.py::b"])  # shard 2's first run
    earlier = shard_manifests.results_in(tmp_path)
    shard_manifests.write(Manifest(1, 2, "0.19.8", ("u/t.py::a",), exitstatus=0), tmp_path)
    shard_manifests.write(Manifest(2, 2, "0.19.8", ("u/t.py::b",), earlier=earlier), tmp_path)
    files, _ = results.read_all([tmp_path])
    found, _ = shard_manifests.find([tmp_path])
    replaced = shard_manifests.superseded(found, files)
    (first_run,) = (f.path for f in files if f.run.tests[0].nodeid == "u/t.py::b")
    assert replaced == {first_run: "shard 2/2 on deepspeed 0.19.8"}
    verdicts = shard_manifests.judge(found, [f for f in files if f.path not in replaced])
    assert [(s.index, s.state) for s in verdicts] == [(1, ShardState.COMPLETE), (2, ShardState.DEAD)]
    _results(tmp_path, "0.19.8", ["u/t.py::b"])  # the re-run ends: complete, from its own file
    files, _ = results.read_all([tmp_path])
    verdicts = shard_manifests.judge(found, [f for f in files if f.path not in replaced])
    assert [(s.index, s.state) for s in verdicts] == [(1, ShardState.COMPLETE), (2, ShardState.COMPLETE)]


def test_a_test_in_two_results_files_counts_once_from_the_newer(tmp_path: Path) -> None:
    _results(tmp_path / "a", "0.19.8", ["u/t.py::a", "u/t.py::b"], outcome="failed")
    _results(tmp_path / "b", "0.19.8", ["u/t.py::b"], later=True)
    _results(tmp_path / "b", "0.16.4", ["u/t.py::b"])  # another release: its own test
    files, _ = results.read_all([tmp_path])
    kept, repeated = shard_manifests.counted_once(files)
    outcomes = sorted((f.run.environment.deepspeed, t.nodeid, t.outcome) for f in kept for t in f.run.tests)
    assert outcomes == [("0.16.4", "u/t.py::b", "passed"), ("0.19.8", "u/t.py::a", "failed"),
                        ("0.19.8", "u/t.py::b", "passed")]  # fmt: skip
    (r,) = repeated
    assert str(r).startswith("1 tests of deepspeed 0.19.8 are in more than one results file (")
    assert str(r).endswith("): each counted once, the newest")


def test_the_merge_names_a_bad_manifest_and_counts_copies_once(tmp_path: Path) -> None:
    """What a user sees: one shard's artifact downloaded twice (its manifest and results in two directories), and a
    manifest damaged in a third: the shard counts once, its failure once, the damaged manifest is named, exit 3."""
    for where in ("job-1", "job-1-again"):
        shard_manifests.write(Manifest(1, 2, "0.19.8", ("u/t.py::a",), exitstatus=1), tmp_path / where)
    _results(tmp_path / "job-1", "0.19.8", ["u/t.py::a"], outcome="failed")
    shutil.copy2(next((tmp_path / "job-1").glob("*.json")), tmp_path / "job-1-again")
    (tmp_path / "job-2").mkdir()
    damaged = tmp_path / "job-2" / Manifest(2, 2, "0.19.8", ()).filename()
    damaged.write_text('{"schema": 2, "index": 2')
    merged = _merge(*(str(tmp_path / d) for d in ("job-1", "job-1-again", "job-2")), cwd=tmp_path)
    assert merged.returncode == 3, merged.stdout + merged.stderr
    lines = merged.stdout.splitlines()
    assert sum(line.startswith("shard 1/2 on deepspeed 0.19.8: complete") for line in lines) == 1
    assert "shard 2/2 on deepspeed 0.19.8: missing: no manifest" in merged.stdout
    assert any(line.startswith("unreadable manifest: ") and str(damaged) in line and "not valid JSON" in line
               for line in lines)  # fmt: skip
    assert "counted once: 1 tests of deepspeed 0.19.8 are in more than one results file" in merged.stdout
    assert "1 failed: 1 new, 0 known" in lines  # not 2: the copy is the same run
    assert sum(line.startswith("NEW      u/t.py::a") for line in lines) == 1
    assert "incomplete: shard 2/2 on deepspeed 0.19.8 (missing), unreadable manifests" in merged.stderr
