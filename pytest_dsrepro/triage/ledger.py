"""The fix ledger: every commit of DeepSpeed since v0.14.0 that the rule (``selects``) takes for a fix of its Python
runtime, each with one disposition (``DISPOSITIONS``: repro, known, not for users, not a fix) and its reason, as data
in the package (``fixes/*.toml``). The one owner of the files' format: reading, validation, the rule. Words alone do
not make a fix, hence the dispositions; ``dsrepro ledger --check`` names a selected commit without a row. The rule
and the dispositions are written out in docs/ledger.md. Pure: no pytest, no torch, no git; errors name file, line and
row.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace
from importlib import resources
from importlib.abc import Traversable
from pathlib import Path
from typing import Any

from packaging.version import Version

from ..core import faces, paths, toml_input
from ..core.errors import MarkerError
from ..core.faces import Face

#: The package's folder of ledger files.
PACKAGED = "fixes"
#: Where the ledger starts: fixes first shipped after this release.
START = "v0.14.0"
#: What a row says a commit is.
REPRO, KNOWN, NOT_FOR_USERS, NOT_A_FIX = "repro", "known", "not for users", "not a fix"
DISPOSITIONS = (REPRO, KNOWN, NOT_FOR_USERS, NOT_A_FIX)
#: The part of DeepSpeed a fix is in.
AREAS = (
    "zero12", "zero3", "offload", "checkpoint", "pipeline", "optim", "sched", "precision", "engine", "hf", "moe",
    "comm", "compile", "autotp", "sequence", "inference", "ops", "monitor", "profiling", "launcher", "accelerator",
    "activation", "data", "compression", "elasticity", "autotuning", "utils", "other",
)  # fmt: skip
#: A subject that says it repairs something.
REPAIR = re.compile(
    r"\b(?:fix(?:es|ed|ing)?|bugs?|bugfix|hotfix|crash(?:es)?|hangs?|errors?|exception|wrong|incorrect|broken|"
    r"regression|repair|restore|workaround|mismatch|leak|deadlock|typo)\b",
    re.IGNORECASE,
)
#: A message that closes an issue: ``Fixes #123``, ``closes: https://github.com/deepspeedai/DeepSpeed/issues/123``.
CLOSES = re.compile(
    r"\b(?:fix(?:es|ed)?|close[sd]?|resolve[sd]?)\s*:?\s*(?:https://github\.com/(?:deepspeedai|microsoft)/DeepSpeed/"
    r"issues/(\d+)|#(\d+))",
    re.IGNORECASE,
)
_KEYS = frozenset({"commit", "pr", "title", "first", "issues", "area", "disposition", "repro", "cpu", "reason",
                   "since", "workaround", "face"})  # fmt: skip
_FACE_KEYS = frozenset({*faces.PARAMETERS, "seen"})
#: A face's message pattern says at least this many letters of its own (besides its type): ``\d+`` matches anything.
_SAYS = 3
_WEB = "https://github.com/deepspeedai/DeepSpeed"


class LedgerError(ValueError):
    """The ledger's files are wrong; the message names every problem, each with its file, line and row."""


# --- the rule ------------------------------------------------------------------------------------------------------


def runtime_files(files: Iterable[str]) -> list[str]:
    """The files of DeepSpeed's Python runtime among ``files`` (paths from the repository's root)."""
    return [f for f in files if f.startswith("deepspeed/") and f.endswith(".py")]


def closed_issues(body: str) -> tuple[int, ...]:
    """The issues a commit message says it closes."""
    return tuple(sorted({int(a or b) for a, b in CLOSES.findall(body)}))


def selects(subject: str, body: str, files: Iterable[str], pr: int | None, named: Collection[int]) -> str | None:
    """Why the rule selects a commit (a phrase), or None: it changes DeepSpeed's Python runtime (``runtime_files``),
    and its subject uses a repair word, or its message closes an issue, or ``named`` (the pull requests a catalogued
    repro or a known fix names) holds its pull request."""
    if not runtime_files(files):
        return None
    word = REPAIR.search(subject)
    if word is not None:
        return f"its subject says {word.group()!r}"
    closed = closed_issues(body)
    if closed:
        return f"it closes #{closed[0]}"
    if pr is not None and pr in named:
        return f"a repro or a known fix names #{pr}"
    return None


# --- rows ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Seen:
    """One face of a fix's bug (``core.faces.Face``: what triage matches) and the line it was seen as (``seen``: what
    the face's ``match`` must find, checked when the ledger is read)."""

    face: Face
    seen: str


@dataclass(frozen=True)
class FixRow:
    """One row of the ledger: a commit, its pull request and title, the first release with it, the issues it closes,
    its area and disposition with the reason; a ``repro`` row's repro id; a ``known`` row's faces, whether a CPU world
    could show it (``cpu``), the first affected release where known (``since``) and a ``workaround``."""

    commit: str
    pr: int | None
    title: str
    first: str
    issues: tuple[int, ...]
    area: str
    disposition: str
    reason: str
    repro: str | None = None
    cpu: bool | None = None
    since: str | None = None
    workaround: str | None = None
    seen: tuple[Seen, ...] = ()
    place: str = field(default="", compare=False)  # ``file:line`` of its ``[[fix]]``, for messages

    @property
    def short(self) -> str:
        return self.commit[:9]

    @property
    def label(self) -> str:
        """``#8088 7aafb3290``, or the short hash alone."""
        return f"#{self.pr} {self.short}" if self.pr is not None else self.short

    @property
    def link(self) -> str:
        """The pull request, else the commit, on GitHub."""
        return f"{_WEB}/pull/{self.pr}" if self.pr is not None else f"{_WEB}/commit/{self.commit}"

    @property
    def issue_links(self) -> tuple[str, ...]:
        return tuple(f"{_WEB}/issues/{n}" for n in self.issues)

    @property
    def affected(self) -> str:
        """The releases with the bug: from ``since`` where the row knows it, up to the first with the fix."""
        return f">={self.since},<{self.first}" if self.since else f"<{self.first}"

    @property
    def faces(self) -> tuple[Face, ...]:
        """The faces as triage matches them (``as_message``)."""
        return tuple(as_message(s.face) for s in self.seen)


def as_message(face: Face) -> Face:
    """A face as a log's exception is matched: its pattern without the type it may start with (``KeyError: 'x'`` is
    the message ``'x'`` of a ``KeyError``)."""
    for name in dict.fromkeys(n for n in (face.raises, face.raises_name) if n):
        for prefix in (f"{name}: ", f"{re.escape(name)}: ", f"{name}:", f"{re.escape(name)}:"):
            if face.match and face.match.startswith(prefix) and len(face.match) > len(prefix):
                return replace(face, match=face.match[len(prefix) :])
    return face


# --- reading -------------------------------------------------------------------------------------------------------


@dataclass
class _Reader:
    """One file's rows read, each problem kept with its place."""

    name: str
    text: str
    problems: list[str] = field(default_factory=list)

    def rows(self) -> list[FixRow]:
        try:
            data: dict[str, Any] = toml_input.loads(self.text)
        except toml_input.TOMLDecodeError as exc:
            self.problems.append(f"{self.name}: not valid TOML: {exc}")
            return []
        entries = data.get("fix", [])
        if set(data) - {"fix"} or not isinstance(entries, list):
            self.problems.append(f"{self.name}: rows are [[fix]] tables, and nothing else")
            return []
        lines = [n for n, line in enumerate(self.text.splitlines(), 1) if re.match(r"\s*\[\[\s*fix\s*\]\]", line)]
        read = (self.row(entry, f"{self.name}:{lines[i] if i < len(lines) else 1}", i + 1)
                for i, entry in enumerate(entries))  # fmt: skip
        return [row for row in read if row is not None]

    def row(self, entry: Mapping[str, Any], place: str, n: int) -> FixRow | None:
        pr = f"#{entry['pr']} " if "pr" in entry else ""
        said = f"{place}: row {n} ({pr}{str(entry.get('commit'))[:9]})"
        before = len(self.problems)
        problems = [*_unknown(entry, _KEYS), *_mechanical(entry), *_disposition(entry)]
        seen = tuple(s for i, face in enumerate(entry.get("face", []), 1) if (s := self.face(face, said, i)))
        self.problems += [f"{said}: {p}" for p in problems]
        if len(self.problems) > before:
            return None
        return FixRow(entry["commit"], entry.get("pr"), entry["title"], entry["first"], tuple(entry["issues"]),
                   entry["area"], entry["disposition"], entry["reason"], entry.get("repro"), entry.get("cpu"),
                   entry.get("since"), entry.get("workaround"), seen, place)  # fmt: skip

    def face(self, face: Mapping[str, Any], said: str, n: int) -> Seen | None:
        where = f"{said}: face {n}"
        problems = list(_unknown(face, _FACE_KEYS))
        seen = face.get("seen")
        if not isinstance(seen, str) or not seen.strip():
            problems.append("seen must be the line as it appeared")
        try:
            parsed = faces.parse((), {k: v for k, v in face.items() if k in faces.PARAMETERS}, where)
        except MarkerError as exc:
            self.problems.append(str(exc))
            return None
        problems += _face_problems(parsed, seen)
        self.problems += [f"{where}: {p}" for p in problems]
        return Seen(parsed, seen) if not problems and isinstance(seen, str) else None


def _face_problems(face: Face, seen: object) -> list[str]:
    """What is wrong with a face beside its seen line: a pattern that says nothing (``\\d+``) or does not find the
    line, a face with nothing to match, words alone that the line does not say."""
    problems = []
    message = as_message(face).match
    if message and len(re.findall(r"[A-Za-z]", re.sub(r"\\[A-Za-z]", "", message))) < _SAYS:
        problems.append(f"match {face.match!r} is too broad: a message's words, not only numbers or wildcards")
    if isinstance(seen, str) and face.match and not re.search(face.match, seen):
        problems.append(f"match {face.match!r} does not match its seen {seen!r}")
    if not face.match and not face.words and not (face.raises and face.frames):
        problems.append("a face without match needs words, or raises with frames")
    silent = isinstance(seen, str) and not face.match and face.words  # words alone: the seen line says them
    if silent and not any(w.lower() in str(seen).lower() for w in face.words):
        problems.append(f"a face without match needs words its seen {seen!r} says")
    return problems


def _unknown(entry: Mapping[str, Any], keys: frozenset[str]) -> list[str]:
    return [f"unknown key {k!r}" for k in sorted(set(entry) - keys)]


def _version(value: object) -> bool:
    try:
        Version(str(value))
    except ValueError:  # InvalidVersion, or a part of 4300 digits or more (int())
        return False
    return isinstance(value, str)


def _mechanical(entry: Mapping[str, Any]) -> list[str]:
    """The fields the rule fills: commit, pull request, title, first release, issues."""
    problems = []
    if not isinstance(entry.get("commit"), str) or not re.fullmatch(r"[0-9a-f]{40}", entry["commit"]):
        problems.append(f"commit {entry.get('commit')!r} must be a full commit hash")
    if "pr" in entry and (not isinstance(entry["pr"], int) or isinstance(entry["pr"], bool)):
        problems.append(f"pr {entry['pr']!r} must be a pull request's number")
    if not isinstance(entry.get("title"), str) or not entry["title"].strip():
        problems.append("title must be the commit's subject")
    if not _version(entry.get("first")):
        problems.append(f"first {entry.get('first')!r} must be the first release with the fix, such as '0.18.3'")
    issues = entry.get("issues")
    if not isinstance(issues, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in issues):
        problems.append(f"issues {issues!r} must be a list of issue numbers")
    return problems


def _disposition(entry: Mapping[str, Any]) -> list[str]:
    """The fields a person fills: area, disposition and reason, and what each disposition needs."""
    disposition = entry.get("disposition")
    if not disposition:
        return ["not filled in: no disposition"]
    problems = []
    if disposition not in DISPOSITIONS:
        problems.append(f"disposition {disposition!r} must be one of {', '.join(map(repr, DISPOSITIONS))}")
    if entry.get("area") not in AREAS:
        problems.append(f"area {entry.get('area')!r} must be one of {', '.join(AREAS)}")
    if not isinstance(entry.get("reason"), str) or not entry["reason"].strip():
        problems.append("reason must say in a sentence why it has its disposition")
    if (disposition == REPRO) != isinstance(entry.get("repro"), str):
        problems.append("a repro row (and only one) names its catalogued bug: repro = '<id>'")
    if disposition == KNOWN and not isinstance(entry.get("cpu"), bool):
        problems.append("a known row says whether a CPU world could show it: cpu = true or false")
    if disposition == KNOWN and not entry.get("face"):
        problems.append("a known row needs a face: [[fix.face]] with what users see and where")
    since, first = entry.get("since"), entry.get("first")
    if since is not None and (not _version(since) or (_version(first) and Version(since) >= Version(str(first)))):
        problems.append(f"since {since!r} must be a release before first {first!r}")
    if "workaround" in entry and not isinstance(entry["workaround"], str):
        problems.append("workaround must be a sentence")
    return problems


def _duplicates(fixes: Iterable[FixRow]) -> list[str]:
    first: dict[str, FixRow] = {}
    problems = []
    for fix in fixes:
        if fix.commit in first:
            problems.append(f"{fix.place}: commit {fix.short} is already a row at {first[fix.commit].place}")
        first.setdefault(fix.commit, fix)
    return problems


def parse(files: Iterable[tuple[str, str]]) -> tuple[FixRow, ...]:
    """The rows of ledger files (each a name and its text), oldest release first; ``LedgerError`` names every
    problem."""
    readers = [_Reader(name, text) for name, text in files]
    fixes = [fix for reader in readers for fix in reader.rows()]
    problems = [p for reader in readers for p in reader.problems] + _duplicates(fixes)
    if problems:
        raise LedgerError(f"the ledger has {len(problems)} problem(s):\n" + "\n".join(problems))
    return tuple(sorted(fixes, key=lambda f: Version(f.first)))


def load(directory: Path | None = None) -> tuple[FixRow, ...]:
    """The ledger of ``directory`` (its ``*.toml`` files), else the package's own."""
    folder: Traversable = directory if directory is not None else resources.files(__package__).joinpath(PACKAGED)
    why = (
        paths.not_a_directory(folder) if isinstance(folder, Path) else None if folder.is_dir() else "no such directory"
    )
    if why is not None:  # a FIFO or a symbolic link loop said as what it is
        raise LedgerError(f"{folder}: {why} of ledger files" if why == "no such directory" else f"{folder}: {why}")
    files = sorted((f for f in folder.iterdir() if f.name.endswith(".toml")), key=lambda f: f.name)
    try:
        texts = [(f.name, _text(f)) for f in files]
    except (OSError, UnicodeDecodeError) as exc:
        raise LedgerError(f"{folder}: a ledger file cannot be read ({exc})") from None
    return parse(texts)


def _text(file: Traversable) -> str:
    """A ledger file's text; one that is no regular file (a FIFO named ``*.toml``, a link loop) refused unopened."""
    if isinstance(file, Path):
        return paths.read_text(file)
    return file.read_text(encoding="utf-8")


def check_catalogue(fixes: Iterable[FixRow], repros: Mapping[str, int | None]) -> None:
    """The rows against the catalogue (each repro's id and the pull request its markers name as the fix): a repro row
    names a catalogued bug, and a catalogued bug's fix in the ledger is its repro row. ``LedgerError`` otherwise."""
    catalogued = {pr: bug for bug, pr in repros.items() if pr is not None}
    problems = []
    for fix in fixes:
        if fix.disposition == REPRO and fix.repro not in repros:
            problems.append(f"{fix.place}: row {fix.label}: repro {fix.repro!r} is not a catalogued bug")
        elif fix.pr in catalogued and fix.disposition != REPRO:
            problems.append(f"{fix.place}: row {fix.label}: the catalogued bug {catalogued[fix.pr]!r} names #{fix.pr} "
                            f"as its fix: the row's disposition is repro, not {fix.disposition!r}")  # fmt: skip
    if problems:
        raise LedgerError(f"the ledger has {len(problems)} problem(s):\n" + "\n".join(problems))
