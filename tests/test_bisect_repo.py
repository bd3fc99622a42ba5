"""dsrepro bisect --repo: from releases to the commit (and pull request) where a test's outcome flips.

End to end on a git repository each test builds: a package named ``deepspeed`` (so the plugin's gates judge it),
built as DeepSpeed is (``setup.py`` reading ``version.txt``, bumped right after each release, plus
``DS_BUILD_STRING``), whose history introduces a bug and later fixes it, with a commit that does not build and one
whose code hangs. Every environment comes from uv's cache with ``UV_OFFLINE=1``: nothing is downloaded. The pure
parts (the clone read, the environments' cache, the probe store, what a run says) are tested directly.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from filelock import FileLock
from packaging.version import Version

from conftest import ROOT, wait_for_no_processes
from pytest_dsrepro.tools.bisect import Invocation, Probe
from pytest_dsrepro.tools.bisect_cache import (
    CannotInstall,
    CommitEnvironments,
    Outcomes,
    Ready,
    own_bytes,
    parse_size,
    repro_key,
)
from pytest_dsrepro.tools.bisect_repo import Session, report, run_stages
from pytest_dsrepro.tools.history import Clone, Commit, HistoryError, describe_left_out

FAKE_SETUP = """\
import os
from setuptools import setup

# As DeepSpeed's setup.py: version.txt, then DS_BUILD_STRING (how dsrepro bisect names the commit).
version = open("version.txt").read().strip() + os.environ.get("DS_BUILD_STRING", "")
setup(name="deepspeed", version=version, packages=["deepspeed", "deepspeed.accelerator", "deepspeed.comm"])
"""

FAKE_INIT = '''\
"""A package named deepspeed, for dsrepro bisect's tests: its history breaks total() and later mends it."""
from importlib.metadata import version

__version__ = version("deepspeed")


def init_distributed(**kwargs):
    """The plugin binds DeepSpeed's comm layer in every rank that imports DeepSpeed: nothing to bind here."""


def total(values):
{body}
'''

FAKE_ACCELERATOR = '''\
class _Cpu:
    """What the plugin's fork server asks of an accelerator: its name, its backend, no comm op to build."""

    def device_name(self, index=None):
        return "cpu"

    def communication_backend_name(self):
        return "gloo"

    def create_op_builder(self, name):
        return None


def get_accelerator():
    return _Cpu()
'''

CORRECT = "    return sum(values)\n"
BUGGY = "    return sum(values[1:])  # the first value is lost\n"
HANGS = "    import time\n\n    while True:  # waits for values that never come\n        time.sleep(1)\n"

#: The repository's history, oldest first: (subject, version.txt, total()'s body, release tag, builds).
HISTORY = [
    ("Add totals (#1)", "0.1.0", CORRECT, "v0.1.0", True),
    ("Count from zero (#2)", "0.1.1", CORRECT, "v0.1.1", True),
    ("Bump the version after 0.1.1 (#3)", "0.2.0", CORRECT, None, True),
    ("Document totals (#4)", "0.2.0", CORRECT, None, True),
    ("Move setup.py to a new layout (#5)", "0.2.0", CORRECT, None, False),
    ("Wait for every rank's values (#6)", "0.2.0", HANGS, None, True),
    ("Stop waiting (#7)", "0.2.0", CORRECT, None, True),
    ("Sum in place (#8)", "0.2.0", BUGGY, None, True),
    ("Name the sums (#9)", "0.2.0", BUGGY, None, True),
    ("Release 0.2.0 (#10)", "0.2.0", BUGGY, "v0.2.0", True),
    ("Bump the version after 0.2.0 (#11)", "0.3.0", BUGGY, None, True),
    ("Name the totals (#12)", "0.3.0", BUGGY, None, True),
    ("Sum a copy (#13)", "0.3.0", CORRECT, None, True),
    ("Release 0.3.0 (#14)", "0.3.0", CORRECT, "v0.3.0", True),
]

#: The user's own repro file: a world test gated on the releases the bug affects.
REPRO = """\
import os
from pathlib import Path

import pytest


@pytest.mark.ds_world(size=1)
@pytest.mark.ds_version(affected=">=0.2.0,<0.3.0", raises=AssertionError, match="wrong total")
def test_total():
    import deepspeed

    marks = os.environ.get("BISECT_TEST_MARKS")
    if marks:
        Path(marks, deepspeed.__version__).touch()  # the test knows which probe's world is running
    assert deepspeed.total([1, 2, 3]) == 6, "wrong total"
"""


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}  # fmt: skip
    return subprocess.run(["git", "-C", str(repo), *args], env=env, capture_output=True, text=True, check=True).stdout


def build_history(repo: Path) -> dict[str, str]:
    """The repository of ``HISTORY``; returns each subject's commit."""
    repo.mkdir(parents=True)
    git(repo, "init", "-q", "-b", "master")
    package = repo / "deepspeed"
    (package / "accelerator").mkdir(parents=True)
    (package / "comm").mkdir()
    (package / "accelerator" / "__init__.py").write_text(FAKE_ACCELERATOR)
    (package / "comm" / "__init__.py").write_text("")
    (package / "comm" / "torch.py").write_text("def build_shm_op():\n    return None\n")
    shas = {}
    for subject, version, body, tag, builds in HISTORY:
        (repo / "version.txt").write_text(version + "\n")
        (package / "__init__.py").write_text(FAKE_INIT.format(body=body))
        (repo / "setup.py").write_text(FAKE_SETUP if builds else "raise SystemExit('setup.py moved to build/')\n")
        with (repo / "CHANGES.md").open("a") as changes:
            changes.write(f"- {subject}\n")
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "-m", subject)
        shas[subject] = git(repo, "rev-parse", "HEAD").strip()
        if tag:
            git(repo, "tag", "-a", tag, "-m", f"release {tag}")
    return shas


def snapshot(repo: Path) -> dict[str, str]:
    """Every file and link of the clone, its .git included, with its content and mode: any write shows."""
    found = {}
    for path in sorted(repo.rglob("*")):
        if path.is_symlink():
            found[str(path)] = f"-> {os.readlink(path)}"
        elif path.is_file():
            st = path.stat()
            found[str(path)] = f"{st.st_mode:o} {st.st_mtime_ns} {hashlib.sha256(path.read_bytes()).hexdigest()}"
        else:
            found[str(path)] = "dir"
    return found


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """The user's clone: the repository of ``HISTORY`` (read by every test here, written by none)."""
    repo = tmp_path_factory.mktemp("user") / "DeepSpeed"
    return repo, build_history(repo)


# --- the clone, read ---------------------------------------------------------------------------------------------


def test_a_commit_names_its_pull_request() -> None:
    squashed = Commit(
        "029e0a33d6d41220cdaab0eec6a06044a24425f9", "Use ds-specific module id to avoid conflicts (#6847)"
    )
    assert (squashed.pr, squashed.short, str(squashed)) == (6847, "029e0a33d", "029e0a33d")
    assert Commit("a" * 40, "Fix (#12) and its test (#13) ").pr == 13
    assert Commit("a" * 40, "Update CNAME").pr is None
    assert Commit("a" * 40, "Merge pull request #7850 from deepspeedai/loadams/update-post-0.18.6").pr == 7850
    assert Commit("a" * 40, "Release", Version("0.16.4")).label == "v0.16.4 aaaaaaaaa"
    web = "https://github.com/deepspeedai/DeepSpeed"
    clone = Clone(Path("."))
    assert clone.link(squashed, web) == f"{web}/pull/6847"
    assert clone.link(Commit("b" * 40, "Update CNAME"), web) == f"{web}/commit/{'b' * 40}"


@pytest.mark.parametrize(
    ("origin", "web"),
    [
        ("git@github.com:me/DeepSpeed.git", "https://github.com/me/DeepSpeed"),
        ("https://github.com/microsoft/DeepSpeed", "https://github.com/microsoft/DeepSpeed"),
        ("/work/.mirror/deepspeedai+DeepSpeed/repo", "https://github.com/deepspeedai/DeepSpeed"),
        (None, "https://github.com/deepspeedai/DeepSpeed"),
    ],
)
def test_links_go_to_the_clones_github_repository(tmp_path: Path, origin: str | None, web: str) -> None:
    git(tmp_path, "init", "-q")
    if origin:
        git(tmp_path, "remote", "add", "origin", origin)
    assert Clone.open(tmp_path).web() == web


def test_the_clone_gives_releases_ranges_and_revisions(clone: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    repo, shas = clone
    before = snapshot(repo)
    found = Clone.open(repo)
    tags = found.releases()
    assert sorted(tags) == [Version(v) for v in ("0.1.0", "0.1.1", "0.2.0", "0.3.0")]
    assert tags[Version("0.2.0")] == shas["Release 0.2.0 (#10)"]  # annotated tags: the commit, not the tag object
    release = found.end("0.2.0", tags)
    assert (release.sha, release.release, release.subject) == (shas["Release 0.2.0 (#10)"], Version("0.2.0"),
                                                               "Release 0.2.0 (#10)")  # fmt: skip
    assert found.end("v0.2.0", tags) == release
    assert found.end(shas["Sum in place (#8)"][:10], tags).subject == "Sum in place (#8)"
    commits = found.commits(found.end("0.2.0", tags), found.end("0.3.0", tags), {v: k for k, v in tags.items()})
    assert [c.subject for c in commits] == [s for s, *_ in HISTORY[9:]]
    assert [str(c.release) for c in commits if c.release] == ["0.2.0", "0.3.0"]
    with pytest.raises(HistoryError, match=r"deepspeed 0\.19\.8 has no tag v0\.19\.8 in .* \(its newest release tag "
                                           r"is v0\.3\.0\); fetch the tags \(git -C .* fetch --tags\)"):  # fmt: skip
        found.end("0.19.8", tags)
    with pytest.raises(HistoryError, match="'no-such-branch' is not a release or a commit of"):
        found.end("no-such-branch", tags)
    with pytest.raises(HistoryError, match=r"v0\.3\.0 \w+ is not an ancestor of v0\.2\.0 \w+ .* one line of history"):
        found.commits(found.end("0.3.0", tags), found.end("0.2.0", tags))
    with pytest.raises(HistoryError, match="not a git repository"):
        Clone.open(tmp_path)
    assert snapshot(repo) == before


def test_a_commits_tree_is_written_from_the_objects_the_clone_has(tmp_path: Path) -> None:
    """Files, executable bits and links, from the object database; a blob the clone lacks (a mirror's missing
    image) is left out and named, where ``git archive`` would refuse the whole tree."""
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "pkg").mkdir()
    (repo / "pkg" / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (repo / "pkg" / "run.sh").chmod(0o755)
    (repo / "setup.py").write_text("print('setup')\n")
    (repo / "docs").mkdir()
    (repo / "docs" / "figure.gif").write_bytes(b"GIF89a only here")
    os.symlink("pkg/run.sh", repo / "run")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "Add a figure (#1)")
    missing = git(repo, "rev-parse", "HEAD:docs/figure.gif").strip()
    (repo / ".git" / "objects" / missing[:2] / missing[2:]).unlink()
    found = Clone.open(repo)
    before = snapshot(repo)
    out = tmp_path / "tree"
    out.mkdir()
    assert found.export(found.commit("HEAD"), out) == ["docs/figure.gif"]
    assert (out / "setup.py").read_text() == "print('setup')\n"
    assert os.access(out / "pkg" / "run.sh", os.X_OK)
    assert not os.access(out / "setup.py", os.X_OK)
    assert os.readlink(out / "run") == "pkg/run.sh"
    assert not (out / "docs" / "figure.gif").exists()
    assert snapshot(repo) == before
    assert describe_left_out([f"f{i}" for i in range(5)]) == "f0, f1, f2 and 2 more"


# --- what is kept between runs -----------------------------------------------------------------------------------


def _ready_env(envs: CommitEnvironments, name: str, size: int, used: float) -> Path:
    directory = envs.envs / name
    directory.mkdir(parents=True)
    ready = Ready(name, "0.2.0+x", size, 1.0)
    (directory / "ready.json").write_text(json.dumps(dataclasses.asdict(ready)))
    os.utime(directory / "ready.json", (used, used))
    return directory


def test_environments_beyond_the_limit_go_least_recently_used_first(tmp_path: Path) -> None:
    envs = CommitEnvironments(tmp_path / "bisect", Clone(tmp_path), tmp_path / "constraints.txt", limit=250)
    now = time.time()
    oldest, old, new, _ = (_ready_env(envs, name, size, now - age) for name, size, age in
                           (("oldest", 100, 400), ("old", 100, 300), ("new", 100, 200), ("newest", 50, 100)))  # fmt: skip
    half_made = envs.envs / "half-made"  # what a killed install leaves: no ready.json
    (half_made / "bin").mkdir(parents=True)
    orphan = envs.envs / "could-not-be-made.lock"
    orphan.touch()
    with FileLock(f"{oldest}.lock"):  # another process's probe uses it
        removed = envs.prune(keep=old)
    assert removed == [new]  # oldest is in use, old is the caller's: new goes, 350 -> 250 bytes
    assert [p.name for p in sorted(envs.envs.iterdir()) if p.is_dir()] == ["newest", "old", "oldest"]
    assert not orphan.exists()
    assert envs.notes == [f"removed the environment {new.name} (least recently used; --env-cache)"]
    envs.limit = 150
    assert envs.prune() == [oldest]  # free now
    assert envs.prune() == []


def test_own_bytes_leave_out_files_linked_from_elsewhere(tmp_path: Path) -> None:
    """What removing an environment frees: uv links torch from its cache, which removing frees nothing of."""
    (tmp_path / "env").mkdir()
    (tmp_path / "env" / "own").write_bytes(b"x" * 100_000)
    (tmp_path / "uv-cache").write_bytes(b"y" * 100_000)
    os.link(tmp_path / "uv-cache", tmp_path / "env" / "linked")
    assert 100_000 <= own_bytes(tmp_path / "env") < 200_000
    assert [parse_size(t) for t in ("10G", "500M", "1.5GiB", "2048")] == [10 * 2**30, 500 * 2**20, 3 * 2**29, 2048]
    with pytest.raises(ValueError, match="'ten' is not a size"):
        parse_size("ten")


def test_an_interrupted_or_failed_install_leaves_nothing(
    tmp_path: Path, clone: tuple[Path, dict[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from pytest_dsrepro.tools import install

    repo, shas = clone
    envs = CommitEnvironments(tmp_path / "bisect", Clone(repo), ROOT / "constraints.txt")
    commit = Clone(repo).commit(shas["Sum in place (#8)"])
    monkeypatch.setattr(install, "add_this_plugin", lambda *args: None)
    for fault in (KeyboardInterrupt(), OSError("disk full")):

        def source(tree: Path, *args: object, fault: BaseException = fault, **kwargs: object) -> object:
            assert (tree / "setup.py").is_file()  # the commit's tree is there while it installs
            raise fault

        monkeypatch.setattr(install, "install_source", source)
        with pytest.raises(type(fault)), envs.using(commit):
            pass
        assert not envs.directory(commit).exists()
        assert list((envs.root / "sources").iterdir()) == []
    monkeypatch.setattr(install, "install_source", lambda *a, **k: install.InstallResult(
        "x", "python", False, "failed", "import failed: ImportError: no module named _ops", None, 1.0))  # fmt: skip
    with pytest.raises(CannotInstall, match="import failed: ImportError: no module named _ops"), envs.using(commit):
        pass
    assert not envs.directory(commit).exists()


#: A commit's install in ``dsrepro bisect --repo``'s cache, its environment thousands of files by the time uv is
#: stopped (a real one is ~800 MB), so that removing it takes long enough for a second Ctrl-C to land in it.
INSTALLING = """
import sys
from pathlib import Path

from pytest_dsrepro.tools import install, processes
from pytest_dsrepro.tools.bisect_cache import CommitEnvironments
from pytest_dsrepro.tools.history import Clone

root, repo, sha, constraints = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4])


def environment_python(directory, python):
    for d in range(40):
        (directory / "lib" / str(d)).mkdir(parents=True)
        for i in range(500):
            (directory / "lib" / str(d) / str(i)).write_bytes(b"x")
    return sys.executable


def install_source(tree, *args, **kwargs):
    processes.run(["sh", "-c", f"touch {root / 'installing'}; exec sleep 60"])


install.environment_python = environment_python
install.add_this_plugin = lambda *args: None
install.install_source = install_source
try:
    with CommitEnvironments(root, Clone(repo), constraints).using(Clone(repo).commit(sha)):
        pass
except KeyboardInterrupt:
    sys.exit(130)
"""


def test_a_second_ctrl_c_while_a_half_made_environment_is_removed_waits_for_it(
    tmp_path: Path, clone: tuple[Path, dict[str, str]]
) -> None:
    """Issue 38: a second Ctrl-C during the removal that the first started left 819 MB in the cache. It now waits
    until the environment and the commit's tree are gone, then ends the command as interrupted."""
    repo, shas = clone
    root = tmp_path / "bisect"
    sha = shas["Sum in place (#8)"]
    directory = CommitEnvironments(root, Clone(repo), ROOT / "constraints.txt").directory(Clone(repo).commit(sha))
    proc = subprocess.Popen(
        [sys.executable, "-c", INSTALLING, str(root), str(repo), sha, str(ROOT / "constraints.txt")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (root / "installing").exists():
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "the install never started"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C at the terminal: dsrepro and its uv
        lib = directory / "lib"
        while lib.is_dir() and len(os.listdir(lib)) == 40 and proc.poll() is None:
            time.sleep(0.001)
        os.kill(proc.pid, signal.SIGINT)  # the second, while the environment is being removed
        out = proc.communicate(timeout=60)[0]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, out
    assert not directory.exists(), "a half-made environment was left in the cache"
    assert list((root / "sources").iterdir()) == []


def test_outcomes_are_kept_per_test_and_commit(tmp_path: Path) -> None:
    (tmp_path / "test_a.py").write_text("def test_a(): pass\n")
    key = repro_key("test_a.py::test_a", [], tmp_path, 1)
    assert key == repro_key("test_a.py::test_a", [], tmp_path, 1)
    assert key != repro_key("test_a.py::test_a", ["-x"], tmp_path, 1)
    assert key != repro_key("test_a.py::test_a", [], tmp_path, 3)
    (tmp_path / "test_a.py").write_text("def test_a(): assert False\n")  # an edited repro is probed again
    assert key != repro_key("test_a.py::test_a", [], tmp_path, 1)
    outcomes = Outcomes(tmp_path / "outcomes" / key)
    commit = Commit("c" * 40, "Sum in place (#8)")
    assert (outcomes.get(commit), len(outcomes)) == (None, 0)
    outcomes.put(commit, {"bug": True, "detail": "failed as declared", "seconds": 3.0, "install_seconds": 1.0})
    assert outcomes.get(commit) == {"bug": True, "detail": "failed as declared", "seconds": 3.0, "install_seconds": 1.0}
    assert len(outcomes) == 1
    (outcomes.directory / f"{commit.sha}.json").write_text('{"bug": "yes"}')  # not this version's: probed again
    assert outcomes.get(commit) is None


# --- the search over a clone, with probes that need no install ----------------------------------------------------

#: What each commit of ``HISTORY`` does when probed: the bug (True), none (False), no answer (None).
ANSWERS = {subject: {CORRECT: False, BUGGY: True, HANGS: None}[body] if builds else None
           for subject, _, body, _, builds in HISTORY}  # fmt: skip


@dataclass
class Scripted:
    """A prober whose answers are ``ANSWERS``: the search, the store and the report without installing anything."""

    invocation: Invocation
    asked: list[str]

    def __call__(self, commit: Commit) -> Probe[Commit]:
        self.asked.append(commit.subject)
        return Probe(commit, ANSWERS[commit.subject], "scripted", 2.0, 1.0)


def _args(tmp_path: Path, good: str, bad: str, **more: object) -> argparse.Namespace:
    given = {"good": good, "bad": bad, "runs": 1, "cache_dir": tmp_path / "cache", "constraints": None, **more}
    return argparse.Namespace(**given)


def test_releases_then_commits_stored_as_they_are_known(clone: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    repo, shas = clone
    found_clone = Clone.open(repo)
    tags = found_clone.releases()
    good, bad = found_clone.end("0.1.0", tags), found_clone.end("0.2.0", tags)
    outcomes = Outcomes(tmp_path / "outcomes")
    asked: list[str] = []
    told = io.StringIO()
    invocation = Invocation("test_total.py::test_total", ("--ds-timeout", "8"))
    session = Session(Scripted(invocation, asked), outcomes, told)  # type: ignore[arg-type]
    found = run_stages(found_clone, good, bad, session)
    assert asked == ["Add totals (#1)", "Release 0.2.0 (#10)", "Count from zero (#2)",  # the releases
                     "Wait for every rank's values (#6)", "Move setup.py to a new layout (#5)", "Stop waiting (#7)",
                     "Sum in place (#8)"]  # fmt: skip
    assert found.commits.first_after.at.subject == "Sum in place (#8)"
    assert found.commits.exact
    progress = [line for line in told.getvalue().splitlines() if line.startswith("[")]
    assert progress[0] == "[1/~8] deepspeed 0.1.0 (" + shas["Add totals (#1)"][:9] + "): installing and running ..."
    assert progress[3].startswith("[4/~6] commit " + shas["Wait for every rank's values (#6)"][:9])
    assert len(outcomes) == 7

    text = report(_args(tmp_path, "0.1.0", "0.2.0"), found_clone, found, session, 90.0)
    flip, before = shas["Sum in place (#8)"][:9], shas["Stop waiting (#7)"][:9]
    assert text.splitlines()[:2] == [
        f"first commit where the outcome flips: {flip} Sum in place (#8)",
        "  pull request #8: https://github.com/deepspeedai/DeepSpeed/pull/8",
    ]
    assert f"  the newest commit before it that was tested: {before} Stop waiting (#7): no bug (scripted)" in text
    assert (
        f"skipped {shas['Move setup.py to a new layout (#5)'][:9]} Move setup.py to a new layout (#5): scripted" in text
    )
    assert '    @pytest.mark.ds_version(affected=">=0.2.0", ...)' in text  # the release stage's specifier
    rows = text[text.index("probes, oldest first") :].splitlines()
    assert rows[0] == "probes, oldest first (7: 7 run now, 0 stored by an earlier run; 1.5 min):"
    order = [row.split()[1] for row in rows[2:9]]
    assert order == sorted(order, key=lambda short: [s[:9] for s in shas.values()].index(short))  # oldest first
    assert rows[-1] == (f"  dsrepro bisect test_total.py::test_total --good {before} --bad {flip} --repo {repo} "
                        f"--fresh --cache-dir {tmp_path / 'cache'} -- --ds-timeout 8")  # fmt: skip

    again = Session(Scripted(invocation, asked := []), outcomes, io.StringIO())  # type: ignore[arg-type]
    assert run_stages(found_clone, good, bad, again).commits.first_after.at.subject == "Sum in place (#8)"
    assert asked == []  # every probe from the store
    assert all(p.stored for p in again.known.values())
    table = report(_args(tmp_path, "0.1.0", "0.2.0"), found_clone, found, again, 1.0)
    assert f"  {flip}           bug      2.0 s, install 1.0 s (stored)  scripted" in table
    fresh = Session(Scripted(invocation, asked), outcomes, io.StringIO(), fresh=True)  # type: ignore[arg-type]
    run_stages(found_clone, good, bad, fresh)
    assert len(asked) == 7


def test_a_flip_next_to_skipped_commits_names_every_candidate(
    clone: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    repo, shas = clone
    found_clone = Clone.open(repo)
    invocation = Invocation("test_total.py::test_total")
    older = found_clone.commit(shas["Stop waiting (#7)"])
    newer = found_clone.commit(shas["Name the sums (#9)"])

    class Broken(Scripted):
        def __call__(self, commit: Commit) -> Probe[Commit]:
            probe = super().__call__(commit)
            return Probe(commit, None, "cannot install or import: x") if "(#8)" in commit.subject else probe

    session = Session(Broken(invocation, []), Outcomes(tmp_path / "o"), io.StringIO())  # type: ignore[arg-type]
    found = run_stages(found_clone, older, newer, session)
    assert not found.commits.exact
    text = report(_args(tmp_path, older.sha, newer.sha), found_clone, found, session, 1.0)
    assert text.splitlines()[:5] == [
        "the outcome flips at one of these commits (those before the last could not be tested):",
        f"  {shas['Sum in place (#8)'][:9]} Sum in place (#8)",
        "    pull request #8: https://github.com/deepspeedai/DeepSpeed/pull/8",
        f"  {shas['Name the sums (#9)'][:9]} Name the sums (#9)",
        "    pull request #9: https://github.com/deepspeedai/DeepSpeed/pull/9",
    ]


# --- end to end: real environments, real worlds, nothing downloaded ------------------------------------------------

#: Long enough for a world of a freshly installed commit on a loaded 2-core machine (8 s once judged a working
#: commit hung there, and the verdict lost its exact commit), short enough for the hanging commit's probe.
WORLD_TIMEOUT = 20


@pytest.fixture(scope="module")
def bisect_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache for this module's bisects: an environment made by one is reused by the next, as for a user."""
    return tmp_path_factory.mktemp("cache")


def _dsrepro(args: list[str], cwd: Path, cache: Path, marks: Path) -> subprocess.Popen[str]:
    """``dsrepro bisect`` as a user starts it at a terminal (its own process group, as a shell's job), offline."""
    env = {**os.environ, "UV_OFFLINE": "1", "BISECT_TEST_MARKS": str(marks), "COLUMNS": "200"}
    env.pop("PYTHONPATH", None)
    command = [sys.executable, "-m", "pytest_dsrepro.tools.cli", "bisect", *args, "--cache-dir", str(cache),
               "--constraints", str(ROOT / "constraints.txt"), "--", "--ds-timeout", str(WORLD_TIMEOUT)]  # fmt: skip
    return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip


@pytest.fixture
def user(tmp_path: Path) -> tuple[Path, Path]:
    """The user's directory, holding their repro file, and where its worlds say which release they run."""
    (tmp_path / "test_total.py").write_text(REPRO)
    (tmp_path / "marks").mkdir()
    return tmp_path, tmp_path / "marks"


def _no_leftovers(cache: Path, tag: str) -> None:
    assert not wait_for_no_processes(tag, timeout=30)
    assert list((cache / "bisect" / "sources").iterdir()) == []
    envs = [p for p in (cache / "bisect" / "envs").iterdir() if p.is_dir()]
    assert all((p / "ready.json").is_file() for p in envs), envs  # none half made


def test_bisect_finds_the_pull_request_that_introduced_the_bug_and_resumes_after_ctrl_c(
    clone: tuple[Path, dict[str, str]], bisect_cache_dir: Path, user: tuple[Path, Path], process_tag: str
) -> None:
    """From two releases to the commit: 0.1.0 fine, 0.2.0 not; on the way a commit that does not build and one whose
    world hangs, stopped at the world timeout and skipped. Ctrl-C during that world leaves nothing behind; the same
    command then resumes from the outcomes the first run stored. The user's clone is never written."""
    repo, shas = clone
    cwd, marks = user
    before = snapshot(repo)
    args = ["test_total.py::test_total", "--good", "0.1.0", "--bad", "0.2.0", "--repo", str(repo)]
    hang = shas["Wait for every rank's values (#6)"][:9]

    first = _dsrepro(args, cwd, bisect_cache_dir, marks)
    deadline = time.monotonic() + 900
    while not (marks / f"0.2.0+{hang}").exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert first.poll() is None, first.communicate()
    time.sleep(2)  # inside the hung world now
    os.killpg(first.pid, signal.SIGINT)  # Ctrl-C at the terminal: the whole foreground job gets it
    out, err = first.communicate(timeout=120)
    assert first.returncode == 130, err
    assert re.search(r"interrupted: \d+ probe outcomes are stored; the same command resumes from them", err), err
    assert "dsrepro bisect: interrupted" in err
    finished = re.findall(r"^    ([0-9a-f]{9}): ", err, re.MULTILINE)
    assert hang not in finished
    assert len(finished) >= 3
    _no_leftovers(bisect_cache_dir, process_tag)
    assert snapshot(repo) == before

    second = _dsrepro(args, cwd, bisect_cache_dir, marks)
    out, err = second.communicate(timeout=1800)
    assert second.returncode == 0, err
    for short in finished:
        assert re.search(rf"^    {short}: .* s, stored by an earlier run\]$", err, re.MULTILINE), err
    flip, broken = shas["Sum in place (#8)"][:9], shas["Move setup.py to a new layout (#5)"][:9]
    assert re.search(rf"^\[\d+/~\d+\] commit {hang} Wait for every rank's values \(#6\): installing and running",
                     err, re.MULTILINE)  # fmt: skip
    lines = out.splitlines()
    assert lines[:2] == [
        f"first commit where the outcome flips: {flip} Sum in place (#8)",
        "  pull request #8: https://github.com/deepspeedai/DeepSpeed/pull/8",
    ], out + err
    assert "  the bug starts showing (regression) there: " in out
    assert (f"skipped {broken} Move setup.py to a new layout (#5): cannot install or import: installing deepspeed "
            f"{broken} failed") in out  # fmt: skip
    hung = next(line for line in lines if line.startswith(f"skipped {hang} "))
    assert f"failed otherwise, not as declared (rank 0: hung: still running when the {WORLD_TIMEOUT}s world " in hung
    row = re.search(rf"^  \d+\s+{hang}\s+skipped\s+([\d.]+) s, install [\d.]+ s\s+failed otherwise", out, re.M)
    assert row, out
    assert float(row.group(1)) < 600  # the world timeout ended it, not the probe's
    assert f"  dsrepro bisect test_total.py::test_total --good {shas['Stop waiting (#7)'][:9]} --bad {flip}" in out
    _no_leftovers(bisect_cache_dir, process_tag)
    assert snapshot(repo) == before


def test_bisect_finds_the_pull_request_that_fixed_the_bug_and_its_rerun_agrees(
    clone: tuple[Path, dict[str, str]], bisect_cache_dir: Path, user: tuple[Path, Path], process_tag: str
) -> None:
    """0.2.0 has the bug, 0.3.0 not. The commits between report 0.3.0 (version.txt is bumped right after a release):
    one that still fails as declared is the bug there, whatever its version says. The printed command re-runs the
    verdict's two commits and agrees."""
    repo, shas = clone
    cwd, marks = user
    before = snapshot(repo)
    done = _dsrepro(["test_total.py::test_total", "--good", "0.3.0", "--bad", "0.2.0", "--repo", str(repo)], cwd,
                    bisect_cache_dir, marks)  # fmt: skip
    out, err = done.communicate(timeout=1800)
    assert done.returncode == 0, err
    fix, still = shas["Sum a copy (#13)"][:9], shas["Name the totals (#12)"][:9]
    assert out.splitlines()[:2] == [
        f"first commit where the outcome flips: {fix} Sum a copy (#13)",
        "  pull request #13: https://github.com/deepspeedai/DeepSpeed/pull/13",
    ]
    assert "  the bug stops showing (fixed) there: " in out
    assert re.search(rf"^    {still}: bug \(failed as declared \(rank 0: AssertionError: wrong total", err, re.M), err
    assert (marks / f"0.3.0+{still}").exists()  # it reported the next release's version
    command = shlex.split(out.splitlines()[-1])
    assert command[:9] == ["dsrepro", "bisect", "test_total.py::test_total", "--good", fix, "--bad", still,
                           "--repo", str(repo)]  # fmt: skip
    cut = command.index("--")
    envs = bisect_cache_dir / "bisect" / "envs"
    made = {p.name: (p / "ready.json").stat().st_mtime for p in envs.iterdir() if p.is_dir()}
    rerun = _dsrepro([*command[2:cut]], cwd, bisect_cache_dir, marks)
    out, err = rerun.communicate(timeout=900)
    assert rerun.returncode == 0, err
    assert out.splitlines()[0] == f"first commit where the outcome flips: {fix} Sum a copy (#13)"
    assert "stored by an earlier run" not in err  # --fresh: both probed again ...
    now = {p.name: (p / "ready.json").stat().st_mtime for p in envs.iterdir() if p.is_dir()}
    assert now.keys() == made.keys()  # ... in the environments made before, reused
    assert sum(now[name] > made[name] for name in made) == 2  # and marked as the most recently used
    _no_leftovers(bisect_cache_dir, process_tag)
    assert snapshot(repo) == before


def test_sigterm_unwinds_a_bisect_as_ctrl_c_does() -> None:
    """Unattended bisects are stopped with SIGTERM (a scheduler, kill; SIGINT is ignored in a background job)."""
    from pytest_dsrepro.tools.processes import interrupting

    before = signal.getsignal(signal.SIGTERM)

    def terminated() -> None:
        with interrupting(signal.SIGTERM):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)

    with pytest.raises(KeyboardInterrupt):
        terminated()
    assert signal.getsignal(signal.SIGTERM) == before


def test_bad_input_is_refused_before_anything_is_installed(
    clone: tuple[Path, dict[str, str]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pytest_dsrepro.tools import cli

    repo, shas = clone
    monkeypatch.chdir(tmp_path)
    (tmp_path / "test_total.py").write_text(REPRO)
    cache = ["--cache-dir", str(tmp_path / "cache")]

    def refused(*args: str) -> tuple[int, str]:
        code = cli.main(["bisect", *args, *cache])
        return code, capsys.readouterr().err.strip()

    assert refused("test_total.py::test_total", "--good", "0.1.0", "--bad", "0.2.0", "--fresh") == (
        2,
        "dsrepro bisect: --fresh and --env-cache apply to commits: give --repo PATH, your DeepSpeed clone",
    )
    assert refused("test_total.py::test_total", "--good", "0.1.0", "--bad", "0.2.0", "--repo", str(tmp_path)) == (
        2,
        f"dsrepro bisect: --repo {tmp_path}: not a git repository (give the path of your DeepSpeed clone)",
    )
    code, err = refused("test_total.py::test_total", "--good", "0.1.0", "--bad", "0.19.8", "--repo", str(repo))
    assert (code, err.split(" in ")[0]) == (2, "dsrepro bisect: deepspeed 0.19.8 has no tag v0.19.8")
    code, err = refused("test_nope.py::test_total", "--good", "0.1.0", "--bad", "0.2.0", "--repo", str(repo))
    assert (code, err) == (2, f"dsrepro bisect: test_nope.py::test_total: no such file {tmp_path / 'test_nope.py'} (node "
                              "ids are read from --chdir, else here)")  # fmt: skip
    code, err = refused("test_total.py::test_total", "--good", "0.2.0", "--bad", "v0.2.0", "--repo", str(repo))
    assert (code, err) == (2, f"dsrepro bisect: --good and --bad are the same commit (v0.2.0 {shas['Release 0.2.0 (#10)'][:9]});"
                              " give two different ones")  # fmt: skip
    with pytest.raises(SystemExit):
        cli.main(["bisect", "t.py::t", "--good", "1", "--bad", "2", "--runs", "0"])
    assert "--runs: '0' is not a whole number of runs >= 1" in capsys.readouterr().err
    assert not (tmp_path / "cache" / "bisect" / "envs").exists()  # nothing was installed


def test_a_commits_tree_installs_by_the_recipe_named_after_the_commit(
    clone: tuple[Path, dict[str, str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``install.install_source``: torch pinned, no build isolation, ``DS_BUILD_OPS=0``, the version named by
    ``DS_BUILD_STRING``; the commit's wheel built in a uv cache of its own, so the environment alone holds its
    files; a tree that builds but does not import is refused with the import's error. Offline: nothing downloaded."""
    from pytest_dsrepro.tools import install

    repo, shas = clone
    monkeypatch.setenv("UV_OFFLINE", "1")
    commit = Clone(repo).commit(shas["Sum a copy (#13)"])
    tree = tmp_path / "tree"
    tree.mkdir()
    Clone(repo).export(commit, tree)
    python = install.environment_python(tmp_path / "env")
    constraints = ROOT / "constraints.txt"
    done = install.install_source(tree, f"+{commit.short}", python=python, constraints=constraints, name=commit.short)
    assert done.ok, done.reason
    assert done.probe is not None
    assert done.probe.deepspeed == f"0.3.0+{commit.short}"
    assert done.torch is not None
    assert install.pinned(constraints, "torch").contains(done.torch)  # type: ignore[union-attr]
    installed = Path(subprocess.run([python, "-c", "import deepspeed; print(deepspeed.__file__)"], capture_output=True,
                                    text=True, check=True).stdout.strip())  # fmt: skip
    assert installed.stat().st_nlink == 1  # linked from no cache: removing the environment frees it
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("uv-cache-")] == []

    (tree / "deepspeed" / "__init__.py").write_text("raise ImportError('cannot import name _ops')\n")
    broken = install.install_source(tree, "+broken", python=python, constraints=constraints, name="broken")
    assert (broken.ok, broken.reason) == (False, "import failed: ImportError: cannot import name _ops")
