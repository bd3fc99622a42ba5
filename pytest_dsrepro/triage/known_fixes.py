"""The known fixes: every DeepSpeed fix whose own test gave a clean range in the regression atlas (it fails on the
release before the fix and passes from the first release with it), as ``dsrepro triage`` knows them. The one owner of
the file's format (``known-fixes.json``, shipped in the package; ``dsrepro atlas --known-fixes`` writes it anew from
an atlas's results).

Each fix is known by its pull request and title, its first fixed release, and each clean test with what that test
raised on the release before the fix: the failure a user of that release may meet. Pure: no pytest, no torch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ..core import json_input, paths, typed_json
from ..core.files import write_atomically

#: The one schema version of the file.
SCHEMA = 1
#: The file shipped in the package: the atlas over v0.16.0..edaa72212 (docs/upstream-run.md).
PACKAGED = "known-fixes.json"


@dataclass(frozen=True)
class FixedTest:
    """A fix's own test with a clean range: its node id as run from DeepSpeed's ``tests/``, and what it raised on the
    release before the fix (``Type: message``, as the results record it)."""

    nodeid: str
    failure: str


@dataclass(frozen=True)
class KnownFix:
    """A DeepSpeed fix that carries a test: its pull request, title and commit, the release before it and the first
    release with it, and its tests with a clean range."""

    pr: int
    title: str
    commit: str
    before: str
    first: str
    tests: tuple[FixedTest, ...]

    @property
    def link(self) -> str:
        return f"https://github.com/deepspeedai/DeepSpeed/pull/{self.pr}"


@dataclass(frozen=True)
class _File:
    """The file: its schema, where its fixes came from (an atlas's range), the fixes."""

    schema: int
    source: str
    fixes: tuple[KnownFix, ...]


def to_json(fixes: Sequence[KnownFix], source: str) -> str:
    return json.dumps(typed_json.written(_File(SCHEMA, source, tuple(fixes))), indent=1) + "\n"


def from_json(text: str, where: str) -> tuple[KnownFix, ...]:
    """The fixes of a file's text; ``ValueError`` naming ``where`` and what is wrong."""
    try:
        data = json_input.loads(text)
    except json_input.BadJSON as exc:
        raise ValueError(f"{where}: not a known-fixes file: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ValueError(f"{where}: not a known-fixes file of schema {SCHEMA}")
    return typed_json.read(_File, data, where).fixes


def write(path: Path, fixes: Sequence[KnownFix], source: str) -> None:
    write_atomically(path, to_json(sorted(fixes, key=lambda f: f.pr), source))


def load(path: Path | None = None) -> tuple[KnownFix, ...]:
    """The known fixes of ``path``, else the package's own."""
    if path is not None:
        return from_json(paths.read_text(path), str(path))  # a FIFO refused, not waited on
    packaged = resources.files(__package__).joinpath(PACKAGED)
    return from_json(packaged.read_text(), PACKAGED) if packaged.is_file() else ()
