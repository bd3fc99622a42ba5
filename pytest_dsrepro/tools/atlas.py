"""``dsrepro atlas``: every DeepSpeed fix that carries its own test, run on the release before the fix and on the first
release that has it, so that each fix's test gives its observed affected range.

The fixes come from the user's clone (``history``: read, never written) over a range ``A..B`` (``fixes``); each fix's
tests run at its commit on each release (``run_fix``), so the rows stand in ``dsrepro matrix`` beside the catalogue,
named ``DeepSpeed@<fix> <node id>``. ``range_of`` reads each test's range from those results. The results directory
is also where a stopped atlas resumes: a fix's release that already has results is not run again.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

from ..core import checkout, results
from ..core.gates import Verdict
from ..core.git import git
from ..triage.known_fixes import FixedTest, KnownFix
from . import upstream_runs
from .environments import ReleaseEnv, installed_package
from .history import Clone, Commit, HistoryError, release_of

#: A subject that says it fixes something: fix, fixes, fixed, fixing, bugfix, hotfix (any case, a word of its own).
_FIX_WORD = re.compile(r"\b(?:bug|hot)?fix(?:e[sd]|ing)?\b", re.IGNORECASE)
#: A message that closes an issue, as GitHub reads it: "Fixes #8279", "closes https://github.com/o/r/issues/12".
_CLOSES = re.compile(
    r"\b(?:close[sd]?|fix(?:e[sd])?|resolve[sd]?)\s*:?\s+(?P<issue>#\d+|https://github\.com/[\w.-]+/[\w.-]+/issues/\d+)",
    re.IGNORECASE,
)
#: Where DeepSpeed's unit tests live, and the files pytest collects there (DeepSpeed's pytest.ini keeps the default).
UNIT = "tests/unit/"
_TEST_FILE = re.compile(r"(?:^|/)(?:test_[^/]*|[^/]*_test)\.py$")


class AtlasError(Exception):
    """A wrong range or clone: said in one line, exit 2."""


def fix_reason(subject: str, body: str) -> str | None:
    """Why a commit counts as a fix: its subject says so (``subject says fix``), or its message closes an issue
    (``closes #8279``); None when neither."""
    if _FIX_WORD.search(subject):
        return "subject says fix"
    found = _CLOSES.search(f"{subject}\n{body}")
    return f"closes {found['issue']}" if found else None


# --- tests in a file, by ast ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TestFunction:
    """A test function of a file at one commit: its node id's tail, the class's harness, and its definition."""

    __test__ = False  # not a pytest test class, whatever its name

    name: str  # ``TestX::test_y`` or ``test_f``
    distributed: bool  # a method of a DeepSpeed ``DistributedTest`` class
    world_size: str | None  # the class's ``world_size`` as written (``2``, ``[1, 2]``); None: the default or none
    definition: str  # what the test is made of (its definition and its class's own lines), without positions


def _base_names(cls: ast.ClassDef) -> list[str]:
    return [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else "" for b in cls.bases]


def _class_lines(cls: ast.ClassDef) -> str:
    """A class without its methods: decorators, bases, attributes (a change there changes every test of it)."""
    kept = [s for s in cls.body if not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return "|".join(ast.dump(node) for node in [*cls.decorator_list, *cls.bases, *cls.keywords, *kept])


def tests_in(source: str) -> dict[str, TestFunction]:
    """The test functions pytest would collect from a module's source (module-level ``test_*`` and ``test_*``
    methods of ``Test*`` classes), by name; a class is a ``DistributedTest`` through its bases in the file too.
    A file that does not parse has none."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return {}
    found: dict[str, TestFunction] = {}
    distributed: dict[str, bool] = {}
    sizes: dict[str, str | None] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            found[node.name] = TestFunction(node.name, False, None, ast.dump(node))
        if not isinstance(node, ast.ClassDef):
            continue
        bases = _base_names(node)
        distributed[node.name] = any(b == "DistributedTest" or distributed.get(b, False) for b in bases)
        own = [s.value for s in node.body if isinstance(s, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "world_size" for t in s.targets)]  # fmt: skip
        sizes[node.name] = ast.unparse(own[-1]) if own else next((sizes[b] for b in bases if sizes.get(b)), None)
        if not node.name.startswith("Test"):
            continue
        shell = _class_lines(node)
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name.startswith("test"):
                name = f"{node.name}::{item.name}"
                size = sizes[node.name] if distributed[node.name] else None
                found[name] = TestFunction(name, distributed[node.name], size, shell + ast.dump(item))
    return found


def changed_tests(before: str | None, after: str) -> list[TestFunction]:
    """The tests of ``after`` that ``before`` (None: the file is new) lacks or defines otherwise, in file order: a test
    is edited when its definition, its decorators or its class's own lines changed."""
    old = tests_in(before) if before is not None else {}
    return [t for name, t in tests_in(after).items() if name not in old or old[name].definition != t.definition]


# --- fix commits ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FixTest:
    """One fix commit's own test: its node id as run from ``tests/`` and what the harness makes of it."""

    nodeid: str
    distributed: bool
    world_size: str | None
    added: bool  # a new test (else an edited one)


@dataclass(frozen=True)
class Fix:
    """A fix commit of the range: why it counts, its tests, the release before it and the first one with it."""

    commit: Commit
    reason: str
    tests: tuple[FixTest, ...]
    before: Version | None  # None: no release tag lacks it (it predates them all)
    first: Version | None  # None: no release has it yet

    @property
    def files(self) -> list[str]:
        """The test files, as targets from ``tests/``, each once."""
        return list(dict.fromkeys(t.nodeid.partition("::")[0] for t in self.tests))


def _show(clone: Clone, sha: str, path: str) -> str | None:
    try:
        return clone.git("show", f"{sha}:{path}")
    except HistoryError:
        return None


def fix_tests(clone: Clone, commit: Commit) -> tuple[FixTest, ...]:
    """The tests a commit adds or edits under ``tests/unit`` (against its first parent; renames followed)."""
    diff = clone.git("diff-tree", "-r", "-M", "--no-commit-id", "--name-status", f"{commit.sha}^1", commit.sha,
                     "--", UNIT)  # fmt: skip
    found: list[FixTest] = []
    for line in diff.splitlines():
        status, *paths = line.split("\t")
        path, old_path = paths[-1], paths[0]
        if status[0] not in "AMR" or not _TEST_FILE.search(path):
            continue
        after = _show(clone, commit.sha, path)
        before = None if status[0] == "A" else _show(clone, f"{commit.sha}^1", old_path)
        old_names = tests_in(before).keys() if before is not None else set()
        for test in changed_tests(before, after or ""):
            nodeid = f"{path.removeprefix('tests/')}::{test.name}"
            found.append(FixTest(nodeid, test.distributed, test.world_size, test.name not in old_names))
    return tuple(found)


def _releases_around(clone: Clone, sha: str) -> tuple[Version | None, Version | None]:
    having = {v for tag in clone.git("tag", "--contains", sha).split() if (v := release_of(tag))}
    lacking = {v for tag in clone.git("tag", "--no-contains", sha).split() if (v := release_of(tag))}
    first = min(having, default=None)
    before = max((v for v in lacking if first is None or v < first), default=None)
    return before, first


def fixes(clone: Clone, older: Commit, newer: Commit) -> tuple[list[Fix], int]:
    """Every fix commit of ``older..newer`` that carries a test, and how many fix commits there are in all.

    The commits of ``newer``'s first-parent line after ``older`` (one per pull request in DeepSpeed's squash-merged
    history) that are fixes (``fix_reason``), and of those the ones whose change adds or edits test functions under
    ``tests/unit`` (``changed_tests``: the changed files parsed with ``ast`` at the commit and at its parent). For
    each, the release before (the newest release tag that does not contain the commit) and the first release (the
    oldest tag that contains it), from ``git tag --contains``.
    """
    if not clone.is_ancestor(older, newer):
        raise AtlasError(f"{older.label} is not an ancestor of {newer.label}: give a range on one line of history")
    log = clone.git("log", "--first-parent", "--reverse", "--format=%H%x00%s%x00%b%x1e", f"{older.sha}..{newer.sha}")
    found, count = [], 0
    for record in log.split("\x1e"):
        sha, _, rest = record.strip().partition("\0")
        subject, _, body = rest.partition("\0")
        reason = fix_reason(subject, body) if sha else None
        if reason is None:
            continue
        count += 1
        commit = Commit(sha, subject)
        tests = fix_tests(clone, commit)
        if tests:
            found.append(Fix(commit, reason, tests, *_releases_around(clone, sha)))
    return found, count


def parse_range(clone: Clone, text: str) -> tuple[Commit, Commit]:
    """``v0.16.0..edaa722`` (either end a release or any revision) -> its two commits."""
    older, sep, newer = text.partition("..")
    if not sep or not older or not newer:
        raise AtlasError(f"--range {text!r}: give OLDER..NEWER, e.g. v0.16.0..master")
    releases = clone.releases()
    return clone.end(older, releases), clone.end(newer, releases)


# --- running, and what a test's runs say ---------------------------------------------------------------------------


def releases_to_run(fix: Fix, start: Version | None, available: Iterable[Version], between: bool) -> list[Version]:
    """The release before the fix and the first with it; with ``between``, also every release from the range's start
    (``start``) up to the one before."""
    chosen = {v for v in (fix.before, fix.first) if v is not None}
    if between and fix.before is not None:
        chosen |= {v for v in available if (start is None or v >= start) and v < fix.before}
    return sorted(chosen)


@dataclass(frozen=True)
class Range:
    """What one fix's test said: ``clean`` when it fails before the fix and passes from it; else why not."""

    nodeid: str
    outcomes: tuple[tuple[Version, str], ...]  # each release run, with its word (PASSED, FAILED, NOT-APPLICABLE, ...)
    clean: bool
    why: str


def _word(test: results.TestRecord) -> str:
    return test.verdict.value if test.verdict is Verdict.NOT_APPLICABLE else test.outcome.upper()


def range_of(nodeid: str, fix: Fix, runs: dict[Version, list[results.TestRecord]]) -> Range:
    """One test's observed range from its records per release (a parametrized test: every case; the test counts
    as failing where any case failed)."""
    outcomes: list[tuple[Version, str]] = []
    for version in sorted(runs):
        mine = [t for t in runs[version] if t.nodeid == nodeid or t.nodeid.startswith(f"{nodeid}[")]
        words = {_word(t) for t in mine} or {"NOT-RUN"}
        word = next((w for w in ("FAILED", "ERROR") if w in words), None) or "/".join(sorted(words))
        outcomes.append((version, word))
    said = dict(outcomes)
    before, first = said.get(fix.before) if fix.before else None, said.get(fix.first) if fix.first else None
    if fix.first is None:
        why = "no release has the fix yet"
    elif fix.before is None:
        why = "no release before the fix"
    elif before in ("FAILED", "ERROR") and first in ("PASSED", "PASSED/SKIPPED"):
        some = " (its other cases skip here)" if first != "PASSED" else ""
        return Range(nodeid, tuple(outcomes), True, f"fails on {fix.before}, passes from {fix.first}{some}")
    elif before == Verdict.NOT_APPLICABLE.value:
        why = f"cannot be collected on {fix.before} (the test imports what the fix added)"
    elif before == "PASSED" and first == "PASSED":
        why = "passes on both: the bug does not show on a CPU, or the test is not the bug's"
    else:
        why = f"{before} on {fix.before}, {first} on {fix.first}"
    return Range(nodeid, tuple(outcomes), False, why)


Prepare = Callable[[Version], ReleaseEnv]


def sparse_checkout(clone: Clone, commit: Commit, directory: Path) -> checkout.Checkout:
    """The commit's ``tests/`` and ``version.txt`` in ``directory``: a shared clone (objects read from the user's
    clone, nothing written there), so its revision is the fix commit's, as results name it."""
    git(None, "clone", "-q", "--shared", "--no-checkout", str(clone.path), str(directory))
    git(directory, "sparse-checkout", "set", "--no-cone", "/tests/", "/version.txt")
    git(directory, "-c", "advice.detachedHead=false", "checkout", "-q", "--detach", commit.sha)
    return checkout.read(directory)


def package_links(tree: Path) -> dict[str, str]:
    """The top-level source directories DeepSpeed's package links in, as of the tree's commit, each with where the
    package holds it: ``deepspeed/ops/op_builder -> ../../op_builder`` gives ``{"op_builder": "ops/op_builder"}``."""
    links = {}
    for entry in git(tree, "ls-tree", "-r", "-z", "HEAD", "--", "deepspeed").split("\0"):
        mode, _, rest = entry.partition(" ")
        if mode != "120000":
            continue
        blob, path = rest.split(" ", 1)[1].split("\t", 1)
        target = os.path.normpath(os.path.join(os.path.dirname(path), git(tree, "cat-file", "blob", blob)))
        if "/" not in target and not target.startswith(".."):
            links[target] = path.removeprefix("deepspeed/")
    return links


def with_release_sources(tree: Path, prepare: Prepare) -> Prepare:
    """``prepare``, then the tree's top-level source directories (``package_links``) made links to the installed
    release's own: a test that reaches ``op_builder/`` by path, as ``test_op_builder.py`` loads
    ``op_builder/builder.py``, then tests the release it runs on, as it tests the checkout in DeepSpeed's CI
    (the sparse tree has no sources, and the fix commit's would say nothing of a release)."""
    links = package_links(tree)

    def prepared(version: Version) -> ReleaseEnv:
        env = prepare(version)
        package = installed_package(env)
        for top, inside in links.items():
            (tree / top).unlink(missing_ok=True)
            (tree / top).symlink_to(package / inside, target_is_directory=True)
        return env

    return prepared


def run_fix_tests(
    tests: checkout.Checkout,
    targets: list[str],
    releases: list[str],
    where: Path,
    prepare: Prepare,
    pytest_args: Sequence[str] = (),
) -> None:
    """Fixes' own tests (``targets``, node ids) on ``releases``, each in its environment with the release's sources
    (``with_release_sources``), results into ``where``. Every test named runs, also those DeepSpeed's pytest.ini
    deselects by default (sequential, nightly: markers that schedule its CI, not what a test means)."""
    run_args = argparse.Namespace(results=where, pytest_args=["-m", "", *pytest_args])
    upstream_runs.run_releases(run_args, tests, targets, releases, with_release_sources(tests.root, prepare))


Runner = Callable[[checkout.Checkout, list[str], list[str], Path], None]


def run_fix(fix: Fix, clone: Clone, releases: Sequence[Version], out: Path, runner: Runner) -> list[Range]:
    """The fix's tests at the fix commit on each release (``runner``: ``upstream_runs.run_releases``), results
    kept in ``out/<short>``; then each test's range. A release ``out/<short>`` already holds a run of (or an
    install failure on) is not run again: an atlas of a hundred fixes that is stopped resumes where it was.

    The fix commit's ``tests/`` are checked out from the clone (a shared clone of it, sparse: the tests and
    ``version.txt``, with the source directories DeepSpeed's package links in linked to each release's own), and the
    runner (``atlas_command``'s) runs them on each release as ``dsrepro upstream --release`` does, each run's results
    checked and kept."""
    where = out / fix.commit.short
    missing = [v for v in releases if v not in _recorded(where)]
    if missing:
        with tempfile.TemporaryDirectory(prefix=f"dsrepro-atlas-{fix.commit.short}-") as tmp:
            found = sparse_checkout(clone, fix.commit, Path(tmp) / "DeepSpeed")
            runner(found, [t.nodeid for t in fix.tests], [str(v) for v in missing], where)
    runs = runs_of(fix, out)
    return [range_of(t.nodeid, fix, runs) for t in fix.tests]


def runs_of(fix: Fix, out: Path) -> dict[Version, list[results.TestRecord]]:
    """A fix's records per release, from its results directory ``out/<short>`` (installs that failed left out)."""
    runs: dict[Version, list[results.TestRecord]] = {}
    for f in _results_in(out / fix.commit.short):
        if f.run.unavailable is None:
            runs.setdefault(Version(f.run.version), []).extend(f.run.tests)
    return runs


#: A squash-merged commit's subject: the pull request's title, then its number.
_SUBJECT = re.compile(r"^(?P<title>.*?)\s*\(#(?P<pr>\d+)\)\s*$")


def known_fix(fix: Fix, runs: dict[Version, list[results.TestRecord]]) -> KnownFix | None:
    """What triage knows of a fix (``triage.known_fixes``): its pull request and title, its releases, and each of its
    tests with a clean range with what it raised on the release before; None when no test's range is clean or the
    subject names no pull request."""
    subject = _SUBJECT.match(fix.commit.subject)
    if subject is None or fix.before is None or fix.first is None:
        return None
    tests = []
    for test in fix.tests:
        if not range_of(test.nodeid, fix, runs).clean:
            continue
        failed = [t.error for t in runs.get(fix.before, []) if t.nodeid.split("[")[0] == test.nodeid and t.error]
        tests.append(FixedTest(test.nodeid, failed[0].removeprefix("WorldFailed: ") if failed else ""))
    if not tests:
        return None
    return KnownFix(int(subject["pr"]), subject["title"], fix.commit.sha, str(fix.before), str(fix.first), tuple(tests))


def _results_in(where: Path) -> list[results.ResultsFile]:
    return results.read_all([where])[0] if where.exists() else []


def _recorded(where: Path) -> set[Version]:
    """The releases a fix's results directory holds a run of, or an install failure on."""
    return {Version(f.run.version) for f in _results_in(where)}


# --- what a dry run says ----------------------------------------------------------------------------------------------


def listing(found: Sequence[Fix], fix_count: int, seconds: float) -> list[str]:
    """The dry run: each fix commit with its releases and tests, then the counts."""
    lines = []
    for fix in found:
        around = f"before {fix.before or '-'}, first {fix.first or 'none yet'}"
        lines.append(f"{fix.commit.short} {fix.commit.subject} [{fix.reason}; {around}]")
        lines += [f"    {'+' if t.added else '~'} {t.nodeid}" + (" (DistributedTest)" if t.distributed else "")
                  for t in fix.tests]  # fmt: skip
    tests = [t for fix in found for t in fix.tests]
    unreleased = sum(fix.first is None for fix in found)
    lines.append(
        f"{fix_count} fix commits, {len(found)} with tests under {UNIT} ({unreleased} in no release yet); "
        f"{len(tests)} tests ({sum(t.added for t in tests)} added, {sum(t.distributed for t in tests)} in "
        f"DistributedTest classes) in {len({(f.commit.sha, p) for f in found for p in f.files})} files; {seconds:.1f} s"
    )
    return lines
