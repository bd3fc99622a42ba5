"""DeepSpeed's own tests run here unchanged (issue 21), proved on test files written for these tests in DeepSpeed's
style: ``tests/examples/upstream`` holds a checkout's shape (version.txt, an unbuilt ``deepspeed/`` that must never be
imported, ``tests/pytest.ini``, ``tests/conftest.py`` with DeepSpeed's hooks, and a stand-in ``tests/unit/common.py``
with DeepSpeed's API that skips every multi-rank test as DeepSpeed's harness does on a CPU and refuses to run the rest).
Nothing of DeepSpeed's own is copied; real DeepSpeed and real worlds run the tests."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from packaging.version import Version

from conftest import RunPytest, deepspeed_version, leftovers
from pytest_dsrepro.core import checkout, results
from pytest_dsrepro.core.gates import Reason, Verdict
from pytest_dsrepro.tools import matrix, matrix_command, upstream_command, upstream_runs
from pytest_dsrepro.tools.environments import EnvironmentUnavailable, ReleaseEnv
from pytest_dsrepro.tools.releases import ReleaseListError, read_releases
from pytest_dsrepro.upstream import collection, harness

PLUGIN = ("-p", "pytest_dsrepro.upstream")


def _git(root: Path, *args: str) -> str:
    command = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@example.com", *args]
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def ds_checkout(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A DeepSpeed-shaped git checkout in the pytester directory, its tests committed; pytest runs from its tests/,
    as ``dsrepro upstream`` runs it (from the checkout's root, ``python -m pytest`` would import the checkout's
    unbuilt ``deepspeed/`` before any plugin loads)."""
    pytester.copy_example("upstream")
    (pytester.path / ".gitignore").write_text("__pycache__/\n*.pyc\n")  # as DeepSpeed's: bytecode is no change
    _git(pytester.path, "init", "-q")
    _git(pytester.path, "add", "-A")
    _git(pytester.path, "commit", "-qm", "tests")
    monkeypatch.chdir(pytester.path / "tests")
    return pytester.path


def _records(directory: Path) -> dict[str, results.TestRecord]:
    files, unreadable = results.read_all([directory])
    assert not unreadable
    return {t.nodeid: t for f in files for t in f.run.tests}


def test_upstream_classes_run_in_the_plugins_worlds(ds_checkout: Path, run: RunPytest, tmp_path: Path) -> None:
    """world_size (int, list, per method, 3 ranks), init_distributed/set_dist_env off, reuse_dist_env, upstream's
    skips and helpers, distributed fixtures by name and in the newer form, class_tmpdir, a timeout that ends one test
    with every rank's stack and not the session, a file that needs a newer DeepSpeed: each in one run."""
    out = tmp_path / "results"
    result = run(*PLUGIN, "unit", "--ignore=unit/runtime/test_broken.py", "-v", "-rs", "--ds-results", str(out))
    revision = _git(ds_checkout, "rev-parse", "HEAD")
    result.stdout.fnmatch_lines(
        [
            f"dsrepro upstream: DeepSpeed's tests from {ds_checkout} at {revision[:12]} (*); DeepSpeed {deepspeed_version()} from *site-packages/deepspeed"
        ]
    )
    result.stdout.fnmatch_lines_random(
        [
            "*test_worlds.py::TestTwoRanks::test_world PASSED*",
            "*test_worlds.py::TestTwoRanks::test_one PASSED*",
            "*test_worlds.py::TestTwoRanks::test_three PASSED*",  # DeepSpeed's harness skips it on a CPU
            "*test_worlds.py::TestSizes::test_sizes[[]1rank-5[]] PASSED*",
            "*test_worlds.py::TestSizes::test_sizes[[]2ranks-5[]] PASSED*",
            "*test_worlds.py::TestNoInit::test_own_group PASSED*",
            "*test_worlds.py::TestNoEnv::test PASSED*",
            "*test_worlds.py::TestReused::test_a PASSED*",
            "*test_worlds.py::TestReused::test_b PASSED*",
            "*test_fixture_worlds.py::TestLoad::test_by_name[[]7[]] PASSED*",
            "*test_fixture_worlds.py::TestLoad::test_newer_form PASSED*",
            "*test_hang.py::TestHangs::test_hangs FAILED*",
            "*test_hang.py::TestHangs::test_after PASSED*",  # the session went on
            "SKIPPED [[]1[]] unit/comm/test_worlds.py:*: bfloat16 is not supported on this accelerator",
            "SKIPPED [[]1[]] unit/comm/test_worlds.py:*: upstream's own skipif",
            "ranks 0-1: hung: still running when the 6s world timeout expired",
            "*test_hang.py*, line 15 in test_hangs",  # rank 1's stack, in its sleep
            "NOT-APPLICABLE  unit/runtime/test_newer.py::(module)  -- not applicable on deepspeed *: cannot be collected: "
            "ModuleNotFoundError: No module named 'deepspeed.runtime.zero.added_by_a_newer_fix'",
        ]
    )
    result.assert_outcomes(passed=12, failed=1, skipped=3, deselected=1)
    assert "unbuilt deepspeed" not in result.stdout.str()
    records = _records(out)
    assert {t.origin for t in records.values()} == {
        results.Origin("DeepSpeed", revision, _git(ds_checkout, "describe", "--tags", "--always"))
    }
    assert records["unit/runtime/test_newer.py::(module)"].verdict is Verdict.NOT_APPLICABLE
    assert records["unit/comm/test_worlds.py::TestTwoRanks::test_three"].world_size == 3


def test_a_file_that_needs_a_newer_release_is_not_applicable_per_node_id(
    ds_checkout: Path, run: RunPytest, tmp_path: Path
) -> None:
    """The tests asked for by node id keep their ids. Any other import error is an ERROR of the file, and the run goes
    on (pytest alone stops every test at collection: "Interrupted: 1 error during collection"): in the results, where
    the failures file sorts it."""
    out = tmp_path / "results"
    result = run(
        *PLUGIN,
        "unit/runtime/test_newer.py::TestNewer::test_helper",
        "unit/runtime/test_broken.py",
        "unit/comm/test_worlds.py::TestTwoRanks::test_world",
        "-v",
        "--ds-results",
        str(out),
    )
    result.stdout.fnmatch_lines_random(
        [
            "NOT-APPLICABLE  unit/runtime/test_newer.py::TestNewer::test_helper  -- not applicable on deepspeed *: "
            "cannot be collected: ModuleNotFoundError: No module named 'deepspeed.runtime.zero.added_by_a_newer_fix'",
            "ERROR unit/runtime/test_broken.py::(module)*",
            "*ModuleNotFoundError: No module named 'a_package_nobody_installed'",
            "*test_worlds.py::TestTwoRanks::test_world PASSED*",
        ]
    )
    assert "Interrupted" not in result.stdout.str()
    result.assert_outcomes(passed=1, skipped=1, errors=1)
    broken = _records(out)["unit/runtime/test_broken.py::(module)"]
    assert (broken.outcome, broken.verdict) == ("error", None)
    assert "No module named 'a_package_nobody_installed'" in (broken.error or "")


SKIPS_AS_A_WHOLE = """\
from deepspeed.accelerator import get_accelerator
import pytest
from unit.common import DistributedTest

if get_accelerator().device_name() == "cpu":
    pytest.skip("this file needs a GPU", allow_module_level=True)


class TestOnGPUs(DistributedTest):
    world_size = 2

    def test(self):
        pass
"""


def test_a_file_that_skips_as_a_whole_skips_the_tests_asked_for_by_node_id(
    ds_checkout: Path, run: RunPytest, tmp_path: Path
) -> None:
    """pytest alone ends such a run at collection ("found no collectors", exit 4), losing every other test asked for;
    the atlas asks for tests by node id on releases where their file skips itself."""
    (ds_checkout / "tests" / "unit" / "runtime" / "test_gpu_only.py").write_text(SKIPS_AS_A_WHOLE)
    out = tmp_path / "results"
    asked = ("unit/runtime/test_gpu_only.py::TestOnGPUs::test", "unit/comm/test_worlds.py::TestTwoRanks::test_world")
    result = run(*PLUGIN, *asked, "-rs", "--ds-results", str(out))
    result.stdout.fnmatch_lines(["SKIPPED [[]1[]] unit/runtime/test_gpu_only.py*: this file needs a GPU"])
    result.assert_outcomes(passed=1, skipped=1)
    assert {n: t.outcome for n, t in _records(out).items()} == dict(zip(asked, ("skipped", "passed"), strict=True))
    whole = run(*PLUGIN, "unit/runtime/test_gpu_only.py", "-rs")  # the file asked for: pytest's own module skip
    whole.stdout.fnmatch_lines(["SKIPPED [[]1[]] unit/runtime/test_gpu_only.py:6: this file needs a GPU"])
    whole.assert_outcomes(skipped=1)


def test_a_deepspeed_that_does_not_import_is_one_line_before_anything_runs(
    ds_checkout: Path, pytester: pytest.Pytester, run: RunPytest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From the checkout's root ``python -m pytest`` puts the checkout's unbuilt ``deepspeed/`` first."""
    monkeypatch.chdir(ds_checkout)
    result = run(*PLUGIN, "tests/unit/comm")
    result.stderr.fnmatch_lines(
        [
            f"ERROR: pytest_dsrepro.upstream: DeepSpeed from {ds_checkout / 'deepspeed'} does not import: "
            'ImportError("the checkout\'s unbuilt deepspeed/ was imported instead of the installed release")'
        ]
    )
    assert "Traceback" not in result.stderr.str()
    assert result.ret == pytest.ExitCode.USAGE_ERROR


EARLY = """\
import psutil
from unit.common import DistributedTest



def servers():
    return sum("pytest_dsrepro.worlds.server" in p.cmdline() for p in psutil.Process().children())


print(f"fork servers while collecting: {servers()}")


class TestEarly(DistributedTest):
    world_size = 2

    def test_world(self):
        pass


def test_no_world():
    assert servers() == 0
"""


def test_the_fork_server_starts_while_pytest_imports_deepspeed(ds_checkout: Path, run: RunPytest) -> None:
    """A run of DeepSpeed's tests starts its worlds' fork server from its first hook, so that the server imports
    torch and DeepSpeed while pytest does and collects: it is there by the time a test file is collected, and the
    file's world runs on it. A run whose tests turn out to start no world stops it once they are known; a
    collection only starts none."""
    (ds_checkout / "tests" / "unit" / "comm" / "test_early.py").write_text(EARLY)
    result = run(*PLUGIN, "unit/comm/test_early.py::TestEarly", "-s")
    result.stdout.fnmatch_lines(["fork servers while collecting: 1"])
    result.assert_outcomes(passed=1)
    plain = run(*PLUGIN, "unit/comm/test_early.py::test_no_world", "-s")
    plain.stdout.fnmatch_lines(["fork servers while collecting: 1"])
    plain.assert_outcomes(passed=1)
    collected = run(*PLUGIN, "unit/comm/test_early.py", "-s", "--collect-only")
    collected.stdout.fnmatch_lines(["fork servers while collecting: 0"])


SPAWNED = """\
import multiprocessing


def imported(queue):
    try:
        import deepspeed

        queue.put(deepspeed.__file__)
    except ImportError as exc:
        queue.put(repr(exc))


def test_a_spawned_child_imports_the_installed_deepspeed():
    context = multiprocessing.get_context("spawn")  # as DeepSpeed's run_cpu_gloo_test helpers start theirs
    queue = context.Queue()
    child = context.Process(target=imported, args=(queue,))
    child.start()
    try:
        imported_from = queue.get(timeout=120)
        assert "site-packages" in imported_from, imported_from
    finally:
        child.join()
"""


def test_the_checkout_comes_off_sys_path_once_deepspeeds_conftest_has_run(ds_checkout: Path, run: RunPytest) -> None:
    """DeepSpeed's conftest puts the checkout first on ``sys.path``; the layer takes it off again, so that a test's
    own ``multiprocessing`` children, which start from the pytest process's ``sys.path``, import the installed
    DeepSpeed, not the checkout's (here an unbuilt one that raises), nor the checkout's ``op_builder``."""
    (ds_checkout / "tests" / "unit" / "comm" / "test_spawned.py").write_text(SPAWNED)
    result = run(*PLUGIN, "unit/comm/test_spawned.py", "-v")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*test_spawned.py::test_a_spawned_child_imports_the_installed_deepspeed PASSED*"])


def test_dsrepro_upstream_runs_node_ids_from_where_you_are(ds_checkout: Path, tmp_path: Path, process_tag: str) -> None:
    out = tmp_path / "results"
    (ds_checkout / "tests" / "unit" / "comm" / "test_worlds.py").write_text(
        (ds_checkout / "tests" / "unit" / "comm" / "test_worlds.py").read_text() + "\n# changed, not committed\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pytest_dsrepro.tools.cli", "upstream", "unit/comm/test_worlds.py::TestTwoRanks::test_one",
         "--results", str(out), "--", "-p", "no:cacheprovider"],
        cwd=ds_checkout / "tests", capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "with uncommitted changes under tests/" in proc.stderr
    (record,) = _records(out).values()
    assert record.nodeid == "unit/comm/test_worlds.py::TestTwoRanks::test_one"
    assert record.outcome == "passed"
    assert record.origin is not None
    assert record.origin.revision == _git(ds_checkout, "rev-parse", "HEAD") + "+dirty"


INTERRUPTED = """\
import time
from pathlib import Path

import deepspeed.comm as dist
from unit.common import DistributedTest


class TestInterrupted(DistributedTest):
    world_size = 1

    def test_1_passes(self):
        assert dist.get_world_size() == 1

    def test_2_interrupted(self):
        Path("ready").write_text("1")
        time.sleep(600)
"""


def test_ctrl_c_in_dsrepro_upstream_lets_pytest_write_its_summary_and_results(
    ds_checkout: Path, tmp_path: Path, process_tag: str, private_tmp: Path
) -> None:
    """Issue 38, item 3: Ctrl-C at the terminal reaches ``dsrepro upstream`` and its pytest; pytest is left to end as
    Ctrl-C ends it (its summary, its results file, no server log left), then ``dsrepro`` says it was interrupted."""
    (ds_checkout / "tests" / "unit" / "comm" / "test_interrupted.py").write_text(INTERRUPTED)
    out = tmp_path / "results"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest_dsrepro.tools.cli", "upstream", "unit/comm/test_interrupted.py",
         "--results", str(out), "--", "-p", "no:cacheprovider", "-rA"],
        cwd=ds_checkout / "tests", stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        ready = ds_checkout / "tests" / "ready"
        deadline = time.monotonic() + 300
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the second test never started"
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)  # as Ctrl-C at a terminal: the whole foreground group
        text = proc.communicate(timeout=120)[0]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # only matters when an assertion above failed
    assert proc.returncode == 130, text[-3000:]
    pytest.LineMatcher(text.splitlines()).fnmatch_lines(
        ["*KeyboardInterrupt*", "*1 passed*in *", "dsrepro upstream: interrupted"]
    )
    assert {r.nodeid.split("::")[-1]: r.outcome for r in _records(out).values()} == {"test_1_passes": "passed"}
    assert leftovers(private_tmp) == []


def test_dsrepro_upstream_refuses_what_is_not_a_checkout_or_not_in_it(ds_checkout: Path, tmp_path: Path) -> None:
    def dsrepro(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "pytest_dsrepro.tools.cli", "upstream", *args]
        return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=120)

    elsewhere = dsrepro(cwd=tmp_path)
    assert elsewhere.returncode == 2
    assert f"dsrepro upstream: {tmp_path.resolve()} is not inside a DeepSpeed checkout" in elsewhere.stderr
    outside = dsrepro("version.txt", cwd=ds_checkout)
    assert outside.returncode == 2
    assert "dsrepro upstream: version.txt is not under the checkout's tests directory" in outside.stderr
    missing = dsrepro("tests/unit/nothing.py", "--release", "0.19.8", cwd=ds_checkout)
    assert missing.returncode == 2
    assert "dsrepro upstream: tests/unit/nothing.py: no such file or directory" in missing.stderr


def test_releases_each_run_on_their_environment_and_are_checked(
    ds_checkout: Path, tmp_path: Path, process_tag: str
) -> None:
    """One run per release, its results kept only when the run is what it says; an uninstallable release is
    recorded as unavailable; a run whose DeepSpeed is not the release asked for is refused."""
    installed = deepspeed_version()
    out = tmp_path / "results"

    def prepare(version: Version) -> ReleaseEnv:
        if str(version) == "0.1.0":
            raise EnvironmentUnavailable("no wheel or sdist builds here")
        return ReleaseEnv(sys.executable, dict(os.environ))  # this environment, whatever was asked for

    args = argparse.Namespace(results=out, pytest_args=["-p", "no:cacheprovider", "-k", "test_one"])
    found = checkout.read(ds_checkout)
    target = ["unit/comm/test_worlds.py::TestTwoRanks"]
    assert upstream_runs.run_releases(args, found, target, [installed, "0.1.0"], prepare) == 0
    files, _ = results.read_all([out])
    assert sorted((f.run.version, bool(f.run.unavailable)) for f in files) == [("0.1.0", True), (installed, False)]
    with pytest.raises(upstream_runs.UpstreamError, match=f"the run on deepspeed 0.2.0 ran deepspeed {installed}"):
        upstream_runs.run_releases(args, found, target, ["0.2.0"], prepare)


# ---- the pieces, as plain functions ----------------------------------------------------------------------------


def test_a_tree_without_git_history_is_named_by_its_version(tmp_path: Path) -> None:
    """An unpacked archive of DeepSpeed's tests, bare or inside another project's repository (whose commit is not
    DeepSpeed's): version.txt names it, and its revision is unknown."""
    for mark in checkout.MARKS:
        (tmp_path / "ds" / mark).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "ds" / mark).write_text("0.19.8\n" if mark == "version.txt" else "")
    for _ in range(2):
        found = checkout.read(tmp_path / "ds")
        assert (found.revision, found.version) == (checkout.UNKNOWN, "0.19.8")
        assert found.describe() == f"{tmp_path / 'ds'} (version.txt 0.19.8, no git history: the revision is unknown)"
        subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
        subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=u", "-c", "user.email=u@example.invalid",
                        "commit", "-q", "--allow-empty", "-m", "another project"], check=True)  # fmt: skip


class _Exec:
    world_size = 2
    init_distributed = True
    set_dist_env = True
    reuse_dist_env = False
    exec_timeout = 600
    backend = "ccl"


_Exec.__name__ = harness.EXEC


def test_upstream_class_attributes_become_world_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    class Plain(_Exec):
        pass

    class Own(_Exec):
        world_size = (1, 4)
        init_distributed = False
        set_dist_env = False
        reuse_dist_env = True
        exec_timeout = 30
        backend = "gloo"

    assert harness.world(Plain) == {"size": 2, "process_group": True, "launcher_env": True, "reuse": False}
    assert harness.world(Own) == {
        "size": [1, 4], "process_group": False, "launcher_env": False, "reuse": True, "timeout": 30.0, "backend": "gloo"
    }  # fmt: skip
    monkeypatch.setenv(harness.NO_REUSE, "1")
    assert harness.world(Own, size=4)["reuse"] is False
    assert harness.world(Own, size=4)["size"] == 4


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (
            ModuleNotFoundError("No module named 'deepspeed.x'", name="deepspeed.x"),
            "ModuleNotFoundError: No module named 'deepspeed.x'",
        ),
        (
            ImportError("cannot import name 'y' from 'deepspeed.z'", name="deepspeed.z"),
            "ImportError: cannot import name 'y' from 'deepspeed.z'",
        ),
        (ModuleNotFoundError("No module named 'transformers'", name="transformers"), None),
        (SyntaxError("invalid syntax"), None),
    ],
)
def test_which_import_errors_say_the_release_lacks_something(error: Exception, reason: str | None) -> None:
    wrapped = pytest.Collector.CollectError("ImportError while importing test module")
    wrapped.__cause__ = error
    assert collection.lacks(wrapped) == reason


def test_a_missing_attribute_of_a_deepspeed_module_says_so_too() -> None:
    import types

    module = types.ModuleType("deepspeed.runtime.fake")
    with pytest.raises(AttributeError) as info:
        module.helper  # noqa: B018
    assert collection.lacks(info.value) == "AttributeError: module 'deepspeed.runtime.fake' has no attribute 'helper'"


def test_a_deepspeed_source_loaded_by_path_under_another_name_is_deepspeed_by_its_file(tmp_path: Path) -> None:
    """``ops/test_op_builder.py`` loads ``op_builder/builder.py`` as ``test_op_builder_module``: on a release whose
    builder lacks what the test uses, the file needs a newer release; a module of the same name elsewhere does not."""
    import types

    import deepspeed

    builder, elsewhere = types.ModuleType("test_op_builder_module"), types.ModuleType("test_op_builder_module")
    builder.__file__ = str(Path(deepspeed.__file__).parent / "ops" / "op_builder" / "builder.py")
    elsewhere.__file__ = str(tmp_path / "op_builder" / "builder.py")
    missing = []
    for module in (builder, elsewhere):
        with pytest.raises(AttributeError) as info:
            module.probe_is_compatible  # noqa: B018
        missing.append(collection.lacks(info.value))
    assert missing == ["AttributeError: module 'test_op_builder_module' has no attribute 'probe_is_compatible'", None]


def test_requested_node_ids_inside_a_test_file(tmp_path: Path) -> None:
    path = tmp_path / "tests" / "unit" / "test_x.py"
    path.parent.mkdir(parents=True)
    path.write_text("")
    args = ["tests/unit/test_x.py::TestA::test_b[1]", "tests/unit", "tests/unit/test_y.py::TestC"]
    assert collection.requested(args, tmp_path, path) == [["TestA", "test_b[1]"], []]
    assert collection.requested(["tests/other"], tmp_path, path) == [[]]


def test_releases_files_and_targets(tmp_path: Path) -> None:
    releases = tmp_path / "releases.txt"
    releases.write_text("# tested\n0.16.4\n\n0.19.8  # newest\n")
    assert read_releases(releases) == ["0.16.4", "0.19.8"]
    releases.write_text("0.16.4\nlatest\n")
    with pytest.raises(ReleaseListError, match=r"releases.txt:2: 'latest' is not a release version"):
        read_releases(releases)
    tests = tmp_path / "tests"
    (tests / "unit").mkdir(parents=True)
    (tests / "unit" / "test_x.py").write_text("")
    assert upstream_command.target("tests/unit/test_x.py::T::t[a-b]", tmp_path, tests) == "unit/test_x.py::T::t[a-b]"
    assert upstream_command.target(".", tests, tests) == "."


def _record(nodeid: str, outcome: str, revision: str, verdict: Verdict | None = None) -> dict[str, object]:
    record = results.TestRecord(
        nodeid=nodeid, repro=None, variant=None, verdict=verdict,
        reason=Reason.NOT_APPLICABLE if verdict is Verdict.NOT_APPLICABLE else None,
        outcome=outcome, error=None, duration=1.0, config=None, origin=results.Origin("DeepSpeed", revision, "v0.19.5"),
    )  # fmt: skip
    return record.to_json()


def test_upstream_rows_in_the_matrix_from_shards_and_releases(tmp_path: Path) -> None:
    """Files of two shards of each of two releases merge into rows named by revision and node id."""
    here = results.environment("gloo", 2)
    test = "unit/runtime/zero/test_x.py::TestX::test_y"
    runs = {
        "old-1": ("0.16.4", [_record(test, "failed", "a" * 40)]),
        "old-2": ("0.16.4", [_record("unit/other.py::(module)", "skipped", "a" * 40, Verdict.NOT_APPLICABLE)]),
        "new-1": ("0.19.8", [_record(test, "passed", "a" * 40)]),
        "new-2": ("0.19.8", [_record("unit/other.py::(module)", "passed", "a" * 40)]),
    }
    for name, (version, tests) in runs.items():
        env = {**here.to_json(), "deepspeed": version}
        data = {
            "schema": results.SCHEMA,
            "created": None,
            "environment": env,
            "unavailable": None,
            "tests": tests,
            "scan": None,
        }
        (tmp_path / name).mkdir()
        (tmp_path / name / "r.json").write_text(json.dumps(data))
    merged = matrix.merge(*matrix.load([tmp_path / name for name in runs]))
    short = results.Origin("DeepSpeed", "a" * 40, "v0.19.5").short
    assert [(name, [r.label for r in rows]) for name, rows in merged.groups()] == [
        (f"{short} unit/other.py", ["(module)"]),
        (f"{short} unit/runtime/zero/test_x.py", ["TestX::test_y"]),
    ]
    words = [[(c.stock.word if (c := merged.cell(row, col)) and c.stock else None) for col in merged.columns]
             for row in merged.rows]  # fmt: skip
    assert words == [["NOT-APPLICABLE", "PASSED"], ["FAILED", "PASSED"]]  # each shard's test, on both releases
    assert matrix_command.exit_code(merged) == 0
    assert merged.counts() == {"NOT-APPLICABLE": 1, "PASSED": 2, "FAILED": 1}
