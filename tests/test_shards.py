"""DeepSpeed's tests in shards (issue 37, item 2): ``dsrepro upstream --shard I/N`` in separate processes, then
``--merge``: one report and one matrix, a shard that died named, never silently missing. The checkout is
``tests/examples/upstream`` with a file of plain tests written here (each shard a quick run)."""

from __future__ import annotations

import json
import os
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

    # one shard's own run sorts its failures too: known, so exit 0
    alone = _dsrepro("unit", "--shard", "3/3", "--results", str(tmp_path / "alone"), "--failures", str(failures), "--",
                     "-p", "no:cacheprovider", cwd=tests)  # fmt: skip
    out, err = alone.communicate(timeout=300)
    assert alone.returncode == 0, out[-2000:] + err[-2000:]
    assert "dsrepro upstream: 1 failed: 0 new, 1 known" in err


def results_release() -> str:
    return deepspeed_version()


# ---- the pieces -------------------------------------------------------------------------------------------------


def _results(directory: Path, release: str, nodeids: list[str]) -> None:
    tests = [results.TestRecord(nodeid=n, repro=None, variant=None, verdict=None, reason=None, outcome="passed",
                                error=None, duration=0.1, config=None) for n in nodeids]  # fmt: skip
    env = results.Environment(**{**results.environment("gloo", 2).to_json(), "deepspeed": release})
    results.write(results.RunRecord(environment=env, tests=tuple(tests)), directory)


def test_the_merge_judges_each_shard_by_its_manifest_and_its_results(tmp_path: Path) -> None:
    plan = {1: ["u/t.py::a", "u/t.py::d"], 2: ["u/t.py::b"], 3: ["u/t.py::c"], 4: ["u/t.py::e"]}
    for i in (1, 2, 3):
        shard_manifests.write(
            Manifest(i, 4, "0.19.8", tuple(plan[i]), exitstatus=0 if i != 2 else None), tmp_path / str(i)
        )
    _results(tmp_path / "1", "0.19.8", plan[1])
    _results(tmp_path / "3", "0.19.8", [])  # ended without its test
    _results(tmp_path / "3", "0.16.4", plan[3])  # another release's results in the directory: not this shard's
    found = shard_manifests.find([tmp_path])
    assert [m.index for _, m in found] == [1, 2, 3]
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


def test_a_manifest_that_is_not_one_is_named(tmp_path: Path) -> None:
    bad = tmp_path / f"x{shard_manifests.SUFFIX}"
    bad.write_text(json.dumps({"schema": 1, "index": 3, "count": 2, "deepspeed": None, "planned": [],
                               "exitstatus": None}))  # fmt: skip
    with pytest.raises(ValueError, match=r"x.shard: 'index' and 'count' must be whole numbers, 1 <= index <= count"):
        shard_manifests.read(bad)
    bad.write_text("{")
    with pytest.raises(ValueError, match=r"x.shard: not valid JSON"):
        shard_manifests.find([tmp_path])
