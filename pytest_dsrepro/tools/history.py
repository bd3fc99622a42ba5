"""The user's DeepSpeed clone, read and never written (``dsrepro bisect --repo``, ``dsrepro ledger --check``): its
releases (tags), the commits between two of them (with their messages and files: ``changes``), a commit's pull
request, and a commit's tree written out into a directory of ours.

Only git commands that read run against the clone (``rev-parse``, ``for-each-ref``, ``log``, ``ls-tree``,
``cat-file``, ``config --get``), through ``core.git`` (optional locks off): nothing of its working tree, index, refs or
worktree list changes, even when a bisect is interrupted. A commit's tree is written from the object database by
``export``: ``git archive`` refuses a tree with a missing object, and a clone of a mirror may lack a few image blobs;
those files are left out and named.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

from ..core.git import GitError, git, git_bytes
from ..core.paths import not_a_directory, real

#: Where a commit's pull request is, when the clone's origin is not on GitHub (a mirror, say).
DEFAULT_WEB = "https://github.com/deepspeedai/DeepSpeed"
#: Squash-merged pull requests end their subject with their number: "Use ds-specific module id ... (#6847)"; a
#: merge commit's says it first: "Merge pull request #7850 from deepspeedai/...".
_PR = re.compile(r"\(#(\d+)\)\s*$|^Merge pull request #(\d+) ")
_GITHUB = re.compile(r"github\.com[:/](?P<repo>[\w.-]+/[\w.-]+?)(\.git)?/?$")
#: How many hex digits name a commit in tables and in the installed version.
SHORT = 9
_MODES = {"100644": 0o644, "100755": 0o755}


class HistoryError(Exception):
    """The clone cannot answer (not a repository, no such release or revision, unrelated ends); the message says
    which and what to do."""


@dataclass(frozen=True)
class Commit:
    """One commit of the clone; ``release`` when a release tag names it."""

    sha: str
    subject: str
    release: Version | None = None

    @property
    def short(self) -> str:
        return self.sha[:SHORT]

    @property
    def pr(self) -> int | None:
        """The pull request a squash merge names at the end of its subject."""
        found = _PR.search(self.subject)
        return int(found.group(1) or found.group(2)) if found else None

    @property
    def title(self) -> str:
        """The subject without the pull request's number a squash merge ends it with."""
        return re.sub(r"\s*\(#\d+\)\s*$", "", self.subject)

    @property
    def label(self) -> str:
        """``v0.16.4 e2dc3eeb1``, or the short hash."""
        return f"v{self.release} {self.short}" if self.release else self.short

    def __str__(self) -> str:
        return self.short


@dataclass(frozen=True)
class Change:
    """A commit with the rest of its message (``body``) and the files it changes (``changes``)."""

    commit: Commit
    body: str
    files: tuple[str, ...]


def release_of(tag: str) -> Version | None:
    """The final release a tag names (``v0.16.4`` or ``0.16.4``); None for any other tag."""
    try:
        version = Version(tag.removeprefix("v"))
    except ValueError:  # InvalidVersion, or a part of 4300 digits or more (int())
        return None
    return None if version.is_prerelease or version.is_devrelease or version.local else version


@dataclass(frozen=True)
class Clone:
    """A git repository on disk (a working clone or a bare one), read with git."""

    path: Path

    @classmethod
    def open(cls, path: Path) -> Clone:
        """The clone at ``path`` (``--repo``); ``HistoryError`` in one line where it is none (a FIFO, a file, a
        symbolic link loop: said, not a ``RuntimeError`` from ``Path.resolve``)."""
        why = not_a_directory(path)
        if why is not None:
            raise HistoryError(f"--repo {path}: {why}")
        clone = cls(real(path))
        try:
            clone.git("rev-parse", "--git-dir")
        except HistoryError:
            raise HistoryError(f"--repo {path}: not a git repository (give the path of your DeepSpeed clone)") from None
        return clone

    def git(self, *args: str) -> str:
        return self.git_bytes(*args).decode(errors="replace")

    def git_bytes(self, *args: str, data: bytes | None = None) -> bytes:
        """git's answer in the clone; what it cannot answer, a ``HistoryError`` with git's own complaint."""
        try:
            return git_bytes(self.path, *args, data=data)
        except GitError as exc:
            raise HistoryError(str(exc)) from None

    # --- releases and revisions ----------------------------------------------------------------------------------

    def releases(self) -> dict[Version, str]:
        """Every release tag's commit, by release."""
        found: dict[Version, str] = {}
        lines = self.git("for-each-ref", "--format=%(refname:short) %(objectname) %(*objectname)", "refs/tags")
        for line in lines.splitlines():
            tag, sha, *peeled = line.split()
            version = release_of(tag)
            if version is not None:
                found.setdefault(version, peeled[0] if peeled else sha)
        return found

    def release(self, version: Version, releases: dict[Version, str] | None = None) -> Commit:
        tags = self.releases() if releases is None else releases
        if version not in tags:
            newest = max(tags, default=None)
            have = f"its newest release tag is v{newest}" if newest else "it has no release tags"
            raise HistoryError(
                f"deepspeed {version} has no tag v{version} in {self.path} ({have}); fetch the tags "
                f"(git -C {self.path} fetch --tags) or choose a release it has"
            )
        return self.commit(tags[version], release=version)

    def commit(self, rev: str, release: Version | None = None) -> Commit:
        try:
            sha, _, subject = self.git("log", "-1", "--format=%H%x00%s", f"{rev}^{{commit}}", "--").partition("\0")
        except HistoryError:
            raise HistoryError(f"{rev!r} is not a release or a commit of {self.path}") from None
        return Commit(sha.strip(), subject.strip(), release)

    def end(self, given: str, releases: dict[Version, str]) -> Commit:
        """A bisect's end as given: a release (its tag's commit; ``0.16.4`` or ``v0.16.4``), else any revision."""
        version = release_of(given)
        if version is not None and (version in releases or re.fullmatch(r"v?\d+(\.\d+)+", given)):
            return self.release(version, releases)
        return self.commit(given)

    def is_ancestor(self, older: Commit, newer: Commit) -> bool:
        try:
            git(self.path, "merge-base", "--is-ancestor", older.sha, newer.sha)
        except GitError:  # exit code 1: not an ancestor
            return False
        return True

    def commits(self, older: Commit, newer: Commit, tagged: dict[str, Version] | None = None) -> list[Commit]:
        """``older``, then every commit after it up to ``newer`` on ``newer``'s first-parent line (one per pull
        request in a squash-merged history), oldest first; ``tagged``: release of a commit, for labels."""
        if not self.is_ancestor(older, newer):
            raise HistoryError(
                f"{older.label} is not an ancestor of {newer.label} in {self.path}: the two ends must lie on one "
                "line of history (a release branch's tag is not on master's)"
            )
        tags = tagged or {}
        log = self.git("log", "--first-parent", "--reverse", "--format=%H%x00%s", f"{older.sha}..{newer.sha}", "--")
        between = []
        for line in log.splitlines():
            sha, _, subject = line.partition("\0")
            between.append(Commit(sha, subject, tags.get(sha)))
        if not between or between[-1].sha != newer.sha:
            raise HistoryError(f"{newer.label} is not on its own first-parent line from {older.label}")
        return [older, *between]

    # --- links ---------------------------------------------------------------------------------------------------

    def web(self) -> str:
        """The GitHub page of the clone's origin, else DeepSpeed's."""
        try:
            url = self.git("config", "--get", "remote.origin.url").strip()
        except HistoryError:
            return DEFAULT_WEB
        found = _GITHUB.search(url)
        return f"https://github.com/{found.group('repo')}" if found else DEFAULT_WEB

    def link(self, commit: Commit, web: str | None = None) -> str:
        base = web or self.web()
        return f"{base}/pull/{commit.pr}" if commit.pr else f"{base}/commit/{commit.sha}"

    # --- a commit's tree -----------------------------------------------------------------------------------------

    def export(self, commit: Commit, destination: Path) -> list[str]:
        """Write ``commit``'s tree into ``destination`` (files, executable bits, symbolic links) from the object
        database. Returns the paths left out: blobs the clone does not have, and submodules."""
        entries: list[tuple[str, str, str, str]] = []  # mode, kind, object, path
        for entry in self.git_bytes("ls-tree", "-r", "-z", "--full-tree", commit.sha).split(b"\0"):
            if entry:
                meta, _, name = entry.partition(b"\t")
                mode, kind, oid = meta.decode().split()
                entries.append((mode, kind, oid, name.decode(errors="surrogateescape")))
        blobs = [e for e in entries if e[1] == "blob"]
        left_out = [e[3] for e in entries if e[1] != "blob"]
        contents = self.git_bytes("cat-file", "--batch", data=b"".join(f"{e[2]}\n".encode() for e in blobs))
        at = 0
        for mode, _, _, path in blobs:  # cat-file answers in order: "<oid> blob <size>\n<data>\n" or "<oid> missing\n"
            end = contents.index(b"\n", at)
            header = contents[at:end].split()
            if header[-1] == b"missing":
                at = end + 1
                left_out.append(path)
                continue
            size = int(header[2])
            _write(destination, path, mode, contents[end + 1 : end + 1 + size])
            at = end + 1 + size + 1
        return left_out


def changes(clone: Clone, older: str, newer: str) -> list[Change]:
    """Every commit of ``older..newer`` in ``clone`` (reachable from ``newer``, not from ``older``: a merged branch's
    commits too), oldest first, with its message and the files it changes (a merge's: none)."""
    ends = [clone.commit(older), clone.commit(newer)]
    log = clone.git("log", "--reverse", "--format=%x00%H%x01%s%x01%b%x01", "--name-only",
                    f"{ends[0].sha}..{ends[1].sha}", "--")  # fmt: skip
    found = []
    for record in log.split("\0")[1:]:
        sha, subject, body, files = record.split("\1")
        found.append(Change(Commit(sha, subject.strip()), body, tuple(f for f in files.splitlines() if f)))
    return found


def _write(root: Path, path: str, mode: str, data: bytes) -> None:
    if Path(path).is_absolute() or ".." in Path(path).parts:
        raise HistoryError(f"the tree names a path outside it: {path}")
    target = root / path
    target.parent.mkdir(parents=True, exist_ok=True)
    if mode == "120000":  # a symbolic link: the blob is where it points
        os.symlink(os.fsdecode(data), target)
        return
    target.write_bytes(data)
    target.chmod(_MODES.get(mode, 0o644))


def describe_left_out(paths: Sequence[str], limit: int = 3) -> str:
    """``blogs/a.gif, blogs/b.gif and 4 more``."""
    shown = ", ".join(paths[:limit])
    return shown + (f" and {len(paths) - limit} more" if len(paths) > limit else "")
