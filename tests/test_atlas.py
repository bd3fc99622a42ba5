"""The regression atlas (issue 37, item 4): the fix commits of a clone's range whose change adds or edits tests, found
with git and ``ast`` on a small repository written here in DeepSpeed's layout; each test's range from its runs."""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

from conftest import commit_files, git_in
from pytest_dsrepro.core import checkout, results, versions
from pytest_dsrepro.core.gates import Reason, Verdict
from pytest_dsrepro.tools import atlas, atlas_command, install, upstream_command, upstream_runs
from pytest_dsrepro.tools.environments import ReleaseEnv
from pytest_dsrepro.tools.history import Clone, Commit
from pytest_dsrepro.triage import known_fixes

BEFORE = """\
import pytest
from unit.common import DistributedTest


class TestBase(DistributedTest):
    world_size = [1, 2]


class TestZero(TestBase):
    def test_kept(self):
        assert True

    def test_edited(self):
        assert 1


def test_plain():
    pass


def helper():
    return 1
"""
AFTER = BEFORE.replace("assert 1", "assert 2  # the fix's new check").replace(
    "return 1", "return 2  # a helper's change is no test's"
) + (
    """

class TestAdded(DistributedTest):
    world_size = 4

    def test_new(self):
        pass


class Helper:
    def test_not_collected(self):
        pass
"""
)


def test_a_fix_is_what_its_subject_says_or_an_issue_it_closes() -> None:
    assert atlas.fix_reason("Fix ZeRO-1/2 with zero-sized parameters (#8280)", "") == "subject says fix"
    assert atlas.fix_reason("[bugfix] offload states (#1)", "") == "subject says fix"
    assert atlas.fix_reason("Fixes for the launcher", "") == "subject says fix"
    assert atlas.fix_reason("Keep dtype (#8215)", "Summary\n\nFixes #7775\n") == "closes #7775"
    assert atlas.fix_reason("Keep dtype", "resolves: https://github.com/a/b/issues/12") == (
        "closes https://github.com/a/b/issues/12"
    )
    assert atlas.fix_reason("Add prefix caching (#8001)", "see #12 for the design") is None
    assert atlas.fix_reason("Prefix fixtures in tests (#9)", "") is None  # "fixtures" is no fix


def test_the_tests_a_change_adds_or_edits_by_ast() -> None:
    found = atlas.tests_in(AFTER)
    assert list(found) == ["TestZero::test_kept", "TestZero::test_edited", "test_plain", "TestAdded::test_new"]
    assert (found["TestZero::test_kept"].distributed, found["TestZero::test_kept"].world_size) == (True, "[1, 2]")
    assert (found["TestAdded::test_new"].distributed, found["TestAdded::test_new"].world_size) == (True, "4")
    assert (found["test_plain"].distributed, found["test_plain"].world_size) == (False, None)
    assert [t.name for t in atlas.changed_tests(BEFORE, AFTER)] == ["TestZero::test_edited", "TestAdded::test_new"]
    assert [t.name for t in atlas.changed_tests(None, AFTER)] == list(found)  # a new file: every test
    resized = AFTER.replace("world_size = 4", "world_size = 8")  # a class's own line changes each of its tests
    assert [t.name for t in atlas.changed_tests(AFTER, resized)] == ["TestAdded::test_new"]
    assert atlas.tests_in("def test_(:\n") == {}


@pytest.fixture
def clone(tmp_path: Path) -> Path:
    """A repository in DeepSpeed's layout: v0.1.0, a fix with tests, a feature with tests, a fix without tests,
    an issue closed by a refactor, v0.2.0, then a fix no release has yet."""
    root = tmp_path / "DeepSpeed"
    root.mkdir()
    git_in(root, "init", "-q")
    base = {"version.txt": "0.1.0\n", "tests/conftest.py": "", "tests/unit/common.py": "class DistributedTest: pass\n",
            "tests/unit/runtime/test_zero.py": BEFORE}  # fmt: skip
    commit_files(root, "Initial", base, tag="v0.1.0")
    commit_files(
        root, "Fix the gradient norm (#12)", {"tests/unit/runtime/test_zero.py": AFTER, "deepspeed/x.py": "1\n"}
    )
    commit_files(root, "Add a feature (#13)", {"tests/unit/comm/test_feature.py": "def test_feature():\n    pass\n"})
    commit_files(root, "Fix a typo in the docs (#14)", {"docs/a.md": "typo fixed\n"})
    commit_files(root, "Refactor the launcher (#15)\n\nCloses #7", {"tests/unit/launcher/test_run.py": "def test_run():\n    pass\n",
            "tests/unit/launcher/util.py": "def test_in_no_test_file(): pass\n"}, tag="v0.2.0")  # fmt: skip
    commit_files(root, "Fix later (#16)", {"tests/unit/comm/test_later.py": "def test_later():\n    pass\n"})
    return root


def test_the_fix_commits_of_a_range_with_their_tests_and_releases(clone: Path) -> None:
    repo = Clone.open(clone)
    older, newer = atlas.parse_range(repo, "v0.1.0..HEAD")
    found, count = atlas.fixes(repo, older, newer)
    assert count == 4  # #12, #14, #15 (closes #7), #16; not the feature
    assert [(f.commit.pr, f.reason, f.before, f.first) for f in found] == [
        (12, "subject says fix", Version("0.1.0"), Version("0.2.0")),
        (15, "closes #7", Version("0.1.0"), Version("0.2.0")),
        (16, "subject says fix", Version("0.2.0"), None),
    ]
    assert found[0].tests == (
        atlas.FixTest("unit/runtime/test_zero.py::TestZero::test_edited", True, "[1, 2]", added=False),
        atlas.FixTest("unit/runtime/test_zero.py::TestAdded::test_new", True, "4", added=True),
    )
    assert [t.nodeid for t in found[1].tests] == ["unit/launcher/test_run.py::test_run"]  # not util.py
    assert found[0].files == ["unit/runtime/test_zero.py"]
    lines = atlas.listing(found, count, 1.25)
    assert (
        lines[0] == f"{found[0].commit.short} Fix the gradient norm (#12) [subject says fix; before 0.1.0, first 0.2.0]"
    )
    assert lines[1] == "    ~ unit/runtime/test_zero.py::TestZero::test_edited (DistributedTest)"
    assert lines[-1] == (
        "4 fix commits, 3 with tests under tests/unit/ (1 in no release yet); 4 tests (3 added, 2 in DistributedTest "
        "classes) in 3 files; 1.2 s"
    )
    with pytest.raises(atlas.AtlasError, match=r"give OLDER\.\.NEWER"):
        atlas.parse_range(repo, "v0.1.0")
    with pytest.raises(atlas.AtlasError, match="is not an ancestor"):
        atlas.fixes(repo, newer, older)


def test_the_dry_run_from_the_command_line(clone: Path) -> None:
    command = [sys.executable, "-m", "pytest_dsrepro.tools.cli", "atlas", "--repo", str(clone), "--range", "v0.1.0..HEAD",
               "--dry-run"]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "    + unit/comm/test_later.py::test_later" in proc.stdout
    assert "4 fix commits, 3 with tests under tests/unit/" in proc.stdout
    wrong = subprocess.run([*command[:-2], "v9.9.9..HEAD"], capture_output=True, text=True, timeout=120)
    assert wrong.returncode == 2
    assert "dsrepro atlas: deepspeed 9.9.9 has no tag v9.9.9" in wrong.stderr


def _test(nodeid: str, outcome: str, verdict: Verdict | None = None) -> results.TestRecord:
    reason = Reason.NOT_APPLICABLE if verdict is Verdict.NOT_APPLICABLE else None
    return results.TestRecord(nodeid=nodeid, repro=None, variant=None, verdict=verdict, reason=reason, outcome=outcome,
                              error=None, duration=1.0, config=None)  # fmt: skip


def test_each_tests_range_from_its_runs() -> None:
    fix = atlas.Fix(Commit("a" * 40, "Fix x (#1)"), "subject says fix", (), Version("0.16.4"), Version("0.17.0"))
    old, new = Version("0.16.4"), Version("0.17.0")
    t = "unit/x.py::T::test"
    clean = atlas.range_of(t, fix, {old: [_test(f"{t}[a]", "passed"), _test(f"{t}[b]", "failed")],
                                    new: [_test(f"{t}[a]", "passed"), _test(f"{t}[b]", "passed")]})  # fmt: skip
    assert (clean.clean, clean.why, clean.outcomes) == (True, "fails on 0.16.4, passes from 0.17.0",
                                                         ((old, "FAILED"), (new, "PASSED")))  # fmt: skip
    newer = atlas.range_of(t, fix, {old: [_test("unit/x.py::(module)", "skipped", Verdict.NOT_APPLICABLE)],
                                    new: [_test(t, "passed")]})  # fmt: skip
    assert (newer.clean, newer.outcomes[0]) == (False, (old, "NOT-RUN"))
    not_applicable = atlas.range_of(
        t, fix, {old: [_test(t, "skipped", Verdict.NOT_APPLICABLE)], new: [_test(t, "passed")]}
    )
    assert not_applicable.why == "cannot be collected on 0.16.4 (the test imports what the fix added)"
    partly = atlas.range_of(t, fix, {old: [_test(f"{t}[a]", "failed"), _test(f"{t}[b]", "skipped")],
                                     new: [_test(f"{t}[a]", "passed"), _test(f"{t}[b]", "skipped")]})  # fmt: skip
    assert (partly.clean, partly.why) == (True, "fails on 0.16.4, passes from 0.17.0 (its other cases skip here)")
    both = atlas.range_of(t, fix, {old: [_test(t, "passed")], new: [_test(t, "passed")]})
    assert both.why.startswith("passes on both")
    unreleased = atlas.Fix(fix.commit, fix.reason, (), Version("0.19.5"), None)
    assert atlas.range_of(t, unreleased, {}).why == "no release has the fix yet"
    assert atlas.releases_to_run(fix, Version("0.16.0"), [Version(v) for v in ("0.15.9", "0.16.0", "0.16.2", "0.16.4",
                                 "0.17.0", "0.18.0")], between=True) == [Version(v) for v in ("0.16.0", "0.16.2",
                                 "0.16.4", "0.17.0")]  # fmt: skip
    assert atlas.releases_to_run(fix, None, [], between=False) == [old, new]


def test_a_fix_runs_at_its_own_revision_and_its_ranges_come_from_the_results(clone: Path, tmp_path: Path) -> None:
    """The fix's tests come from a shared, sparse checkout of the fix commit (the revision results name), and the
    runner's results give each test's range."""
    repo = Clone.open(clone)
    fix, *_ = atlas.fixes(repo, *atlas.parse_range(repo, "v0.1.0..HEAD"))[0]
    seen: list[tuple[str, list[str], list[str]]] = []

    def runner(tests: checkout.Checkout, targets: list[str], releases: list[str], where: Path) -> None:
        seen.append((tests.revision, targets, releases))
        assert (tests.tests / "unit" / "runtime" / "test_zero.py").read_text() == AFTER
        assert not (tests.root / "deepspeed").exists()  # only tests/ and version.txt
        for release in releases:
            outcome = "failed" if release == "0.1.0" else "passed"
            env = results.Environment(**{**results.environment("gloo", 2).to_json(), "deepspeed": release})
            records = tuple(_test(t, outcome) for t in targets)
            results.write(results.RunRecord(environment=env, tests=records), where)

    ranges = atlas.run_fix(fix, repo, [Version("0.1.0"), Version("0.2.0")], tmp_path / "out", runner)
    assert seen == [(fix.commit.sha, [t.nodeid for t in fix.tests], ["0.1.0", "0.2.0"])]
    assert [(r.nodeid, r.clean) for r in ranges] == [(t.nodeid, True) for t in fix.tests]
    assert len(list((tmp_path / "out" / fix.commit.short).glob("*.json"))) == 2
    # Run again (a stopped atlas resumed): the releases it holds are not run again; a newly asked one is.
    seen.clear()
    again = atlas.run_fix(fix, repo, [Version("0.1.0"), Version("0.2.0")], tmp_path / "out", runner)
    assert (seen, [r.clean for r in again]) == ([], [True] * len(fix.tests))
    atlas.run_fix(fix, repo, [Version("0.1.0"), Version("0.3.0")], tmp_path / "out", runner)
    assert seen == [(fix.commit.sha, [t.nodeid for t in fix.tests], ["0.3.0"])]


def test_the_trees_source_directories_are_the_releases_it_runs_on(tmp_path: Path) -> None:
    """DeepSpeed's package links in its top-level ``op_builder`` and ``accelerator``; a test that reads
    ``op_builder/builder.py`` by path must read the release under test's, on each release in turn (the sparse tree
    has none, and the fix commit's own would make the test pass on every release)."""
    root = tmp_path / "DeepSpeed"
    (root / "deepspeed" / "ops").mkdir(parents=True)
    (root / "deepspeed" / "ops" / "op_builder").symlink_to("../../op_builder")
    (root / "deepspeed" / "accelerator").symlink_to("../accelerator/")
    (root / "deepspeed" / "ops" / "kernels.h").symlink_to("../../../outside.h")  # not a source directory here
    git_in(root, "init", "-q")
    fix = commit_files(root, "Fix the builder (#3)", {"op_builder/builder.py": "the fix commit's\n", "version.txt": "0.2.0\n",
                  "accelerator/__init__.py": "", "tests/conftest.py": "", "tests/unit/common.py": "",
                  "tests/unit/ops/test_op_builder.py": "def test(): pass\n"})  # fmt: skip
    tree = atlas.sparse_checkout(Clone.open(root), Commit(fix, "Fix the builder (#3)"), tmp_path / "tree").root
    assert atlas.package_links(tree) == {"op_builder": "ops/op_builder", "accelerator": "accelerator"}

    def prepare(version: Version) -> ReleaseEnv:
        site = tmp_path / f"env-{version}"
        (site / "deepspeed" / "ops" / "op_builder").mkdir(parents=True, exist_ok=True)
        (site / "deepspeed" / "__init__.py").write_text("")
        (site / "deepspeed" / "ops" / "op_builder" / "builder.py").write_text(f"deepspeed {version}'s\n")
        return ReleaseEnv(sys.executable, {**os.environ, "PYTHONPATH": str(site)})

    prepared = atlas.with_release_sources(tree, prepare)
    for version in ("0.1.0", "0.2.0"):
        prepared(Version(version))
        assert (tree / "op_builder" / "builder.py").read_text() == f"deepspeed {version}'s\n"
    shutil.rmtree(tree)  # as the atlas's temporary directory goes: the links go, never what they point at
    assert (tmp_path / "env-0.2.0" / "deepspeed" / "ops" / "op_builder" / "builder.py").exists()


def test_a_fix_whose_run_breaks_is_said_and_the_atlas_goes_on(
    clone: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An atlas runs a hundred fixes for hours: one whose pytest ends with a usage error is a "cannot tell" with its
    error, and the fixes after it still run."""
    ran: list[list[str]] = []

    def run_releases(
        args: argparse.Namespace,
        tests: checkout.Checkout,
        targets: list[str],
        releases: list[str],
        prepare: atlas.Prepare,
    ) -> int:
        ran.append(targets)
        assert args.pytest_args == ["-m", ""]  # not DeepSpeed's default deselection: a fix's own tests all run
        if len(ran) == 1:
            raise upstream_runs.UpstreamError("pytest on deepspeed 0.1.0 ended with exit code 4")
        for release in releases:
            env = results.Environment(**{**results.environment("gloo", 2).to_json(), "deepspeed": release})
            outcome = "failed" if release == "0.1.0" else "passed"
            results.write(
                results.RunRecord(environment=env, tests=tuple(_test(t, outcome) for t in targets)), args.results
            )
        return 0

    monkeypatch.setattr(upstream_runs, "run_releases", run_releases)
    parser = argparse.ArgumentParser()
    atlas_command.add_arguments(parser)
    args = parser.parse_args(["--repo", str(clone), "--range", "v0.1.0..HEAD", "--results", str(tmp_path / "out")])
    assert atlas_command.run(args) == 0
    out, err = capsys.readouterr()
    assert len(ran) == 2  # #12 broke, #15 still ran (#16 is in no release)
    assert "pytest on deepspeed 0.1.0 ended with exit code 4" in err
    assert "cannot tell unit/runtime/test_zero.py::TestZero::test_edited: its run broke: pytest on deepspeed" in out
    assert "clean       unit/launcher/test_run.py::test_run: fails on 0.1.0, passes from 0.2.0" in out
    assert out.splitlines()[-1].startswith("2 fixes run, 3 tests: 1 clean ranges; cannot tell: {'its run broke': 2}")


@pytest.mark.parametrize("command", ["atlas", "upstream"])
def test_no_torch_to_pin_is_one_line_before_any_release_is_built(
    command: str, clone: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Release environments pin the torch installed here when no constraints file is found: with no torch here
    either (``dsrepro`` installed on its own), each command that builds them says so once and stops, before any
    release, not with a traceback."""
    real = versions.installed
    monkeypatch.setattr(versions, "installed", lambda name: None if name == "torch" else real(name))
    monkeypatch.delenv(install.CONSTRAINTS_ENV, raising=False)
    monkeypatch.chdir(tmp_path)  # no constraints.txt here or above
    parser = argparse.ArgumentParser()
    module = atlas_command if command == "atlas" else upstream_command
    module.add_arguments(parser)
    cache = ["--cache-dir", str(tmp_path / "cache")]
    argv = {"atlas": ["--repo", str(clone), "--range", "v0.1.0..HEAD", *cache],
            "upstream": ["--checkout", str(clone), "--release", "0.1.0", *cache]}  # fmt: skip
    assert module.run(parser.parse_args(argv[command])) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (
        f"dsrepro {command}: torch is not installed in this environment; install the torch to test with first"
    )
    assert err.count("torch is not installed") == 1
    assert not (tmp_path / "cache").exists()


def test_what_triage_knows_of_a_fix_comes_from_its_clean_tests(clone: Path, tmp_path: Path) -> None:
    """Its pull request and title (the squash-merged subject), its releases, and each clean test with what it raised
    on the release before; from the atlas's results, by ``dsrepro atlas --known-fixes``, which runs nothing."""
    repo = Clone.open(clone)
    fix = atlas.fixes(repo, *atlas.parse_range(repo, "v0.1.0..HEAD"))[0][0]
    for release, outcome, error in (
        ("0.1.0", "failed", "WorldFailed: ranks 0-1: KeyError: 7"),
        ("0.2.0", "passed", None),
    ):
        env = results.Environment(**{**results.environment("gloo", 2).to_json(), "deepspeed": release})
        records = tuple(dataclasses.replace(_test(t.nodeid, outcome), error=error) for t in fix.tests)
        results.write(results.RunRecord(environment=env, tests=records), tmp_path / "out" / fix.commit.short)
    known = atlas.known_fix(fix, atlas.runs_of(fix, tmp_path / "out"))
    assert known is not None
    assert (known.pr, known.title, known.before, known.first) == (12, "Fix the gradient norm", "0.1.0", "0.2.0")
    assert known.tests[0] == known_fixes.FixedTest(fix.tests[0].nodeid, "ranks 0-1: KeyError: 7")
    written = tmp_path / "known.json"
    command = [sys.executable, "-m", "pytest_dsrepro.tools.cli", "atlas", "--repo", str(clone), "--range", "v0.1.0..HEAD",
               "--results", str(tmp_path / "out"), "--known-fixes", str(written)]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"1 of 3 fixes with a clean range, written to {written}\n"
    assert known_fixes.load(written) == (known,)
