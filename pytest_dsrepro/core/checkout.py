"""A DeepSpeed source checkout whose own tests run here (``dsrepro upstream``): where it is and which revision.

Read with git (a subprocess), nothing imported. The revision is what results and the matrix name an upstream test's
row by, so it is read from the checkout itself, never taken from a caller; a tree without git history of its own (an
unpacked archive of DeepSpeed's tests) is named by its version.txt, its revision said to be unknown.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .git import GitError, git

#: What makes a directory a DeepSpeed checkout whose tests can run: DeepSpeed's harness and its test configuration.
MARKS = ("tests/unit/common.py", "tests/conftest.py", "version.txt")
#: The revision of a tree without git history of its own.
UNKNOWN = "unknown"
#: Where the checkout's tests run from: its pytest.ini, conftest.py and the ``unit`` package live there.
TESTS = "tests"


class CheckoutError(Exception):
    """Not a DeepSpeed checkout, or not one git can read; the message says which."""


@dataclass(frozen=True)
class Checkout:
    root: Path
    revision: str  # the full commit id; "+dirty" when its tests/ has changes git has not committed
    described: str  # ``git describe --tags --always``: v0.19.5-46-gedaa722
    version: str  # version.txt: what DeepSpeed built from this checkout would call itself

    @property
    def tests(self) -> Path:
        return self.root / TESTS

    @property
    def dirty(self) -> bool:
        return self.revision.endswith("+dirty")

    def describe(self) -> str:
        if self.revision == UNKNOWN:
            return f"{self.root} ({self.described})"
        changes = ", with uncommitted changes under tests/" if self.dirty else ""
        return f"{self.root} at {self.revision.removesuffix('+dirty')[:12]} ({self.described}){changes}"


def find(start: Path) -> Path | None:
    """The DeepSpeed checkout holding ``start`` (a directory or file in it), or None."""
    for directory in (start.resolve(), *start.resolve().parents):
        if all((directory / mark).is_file() for mark in MARKS):
            return directory
    return None


def _git(root: Path, *args: str) -> str:
    """git's answer, or the checkout's own error saying what git said (``core.git``: nothing written by reading)."""
    try:
        return git(root, *args, timeout=60).strip()
    except GitError as exc:
        raise CheckoutError(f"git could not read {root}: {exc}") from None


def read(root: Path) -> Checkout:
    """The checkout at ``root`` as it is now; ``CheckoutError`` when it is not a DeepSpeed git checkout."""
    missing = [mark for mark in MARKS if not (root / mark).is_file()]
    if missing:
        raise CheckoutError(f"{root} is not a DeepSpeed checkout (no {', '.join(missing)})")
    version = (root / "version.txt").read_text().strip()
    if not _has_history(root):
        return Checkout(root.resolve(), UNKNOWN, f"version.txt {version}, no git history: the revision is unknown",
                        version)  # fmt: skip
    commit = _git(root, "rev-parse", "HEAD")
    dirty = bool(_git(root, "status", "--porcelain", "--", TESTS))
    return Checkout(
        root=root.resolve(),
        revision=commit + ("+dirty" if dirty else ""),
        described=_git(root, "describe", "--tags", "--always"),
        version=version,
    )


def _has_history(root: Path) -> bool:
    """Is ``root`` the top of a git repository with a commit (not an archive unpacked bare, or into another
    project's repository, whose commit is not DeepSpeed's)?"""
    try:
        top = git(root, "rev-parse", "--show-toplevel", timeout=60).strip()
        git(root, "rev-parse", "--verify", "HEAD", timeout=60)
    except GitError:
        return False
    return Path(top).resolve() == root.resolve()
