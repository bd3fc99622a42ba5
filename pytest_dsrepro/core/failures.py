"""Why DeepSpeed's own tests fail on a CPU, as data: the failures file (``upstream-failures.toml``) read and applied.

DeepSpeed's ``tests/unit`` run on CPU worlds (``dsrepro upstream``) fails tens of tests for reasons that do not
change from run to run: the CPU accelerator lacks a feature, the test is newer than the release, the machine, or a
DeepSpeed bug. The failures file says which, once, so that a run can say which of its failures are new.

Pure: reading is ``tomllib`` (through ``core.toml_input``) plus checks whose errors name ``file:line``; classifying
takes results records.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from . import paths, toml_input
from .gates import Verdict
from .results import TestRecord

#: The failures file packaged with the plugin, the default of ``dsrepro upstream --failures``.
PACKAGED = Path(__file__).resolve().parent.parent / "upstream-failures.toml"
#: The outcomes that are failures of a test (pytest's ``error``: its setup or teardown failed).
FAILING = ("failed", "error")


class FailuresFileError(ValueError):
    """The failures file is wrong; the message starts with ``file:line``."""


class FailureClass(str, enum.Enum):
    """Why a test fails on a CPU, and the field that says what exactly."""

    CPU_ACCELERATOR_LACKS = "cpu-accelerator-lacks"
    NEWER_THAN_RELEASE = "newer-than-release"
    OLDER_THAN_RELEASE = "older-than-release"
    ENVIRONMENT = "environment"
    DEEPSPEED_BUG = "deepspeed-bug"

    @property
    def field(self) -> str:
        return _FIELDS[self]


_FIELDS = {
    FailureClass.CPU_ACCELERATOR_LACKS: "lacks",
    FailureClass.NEWER_THAN_RELEASE: "needs",
    FailureClass.OLDER_THAN_RELEASE: "removed",
    FailureClass.ENVIRONMENT: "environment",
    FailureClass.DEEPSPEED_BUG: "repro",  # or "report": one of them at least
}
_OWN = ("lacks", "needs", "removed", "environment")  # the fields of one class each
_KEYS = ("tests", "class", *_OWN, "repro", "report", "deepspeed", "why")


@dataclass(frozen=True)
class Known:
    """One entry of the failures file: the tests it covers, their class and what exactly, where it was written::

        [[failure]]
        tests = ["unit/v1/zero/test_zero_autocast.py::*"]   # node ids as run from tests/; ``*`` matches any text
        class = "cpu-accelerator-lacks"                      # or newer-/older-than-release, environment, deepspeed-bug
        lacks = "bf16 autocast under ZeRO"                   # the class's own field, below
        deepspeed = "<=0.19.8"                               # optional: the releases the entry holds for
        why = "..."                                          # optional: what a reader needs besides

    The class's own field: ``lacks`` (the feature the CPU accelerator lacks), ``needs`` (what the release does not
    have yet), ``removed`` (what the release dropped that an older test still uses: the tests of a checkout run on a
    newer release), ``environment`` (what of the machine), and for ``deepspeed-bug`` ``repro`` (a catalogue repro's
    id) and/or ``report`` (a paste-ready upstream report, a path in this repository). Only ``*`` is a wildcard: node
    ids hold ``[...]`` parameters, which shell patterns would read as character sets.
    """

    tests: tuple[str, ...]
    cls: FailureClass
    detail: str  # the class's own field: the feature lacked, what is needed, the environment, the repro or report
    where: str  # file:line of the entry
    deepspeed: SpecifierSet | None = None
    why: str = ""
    repro: str | None = None
    report: str | None = None

    def covers(self, nodeid: str, release: str | None) -> bool:
        """Whether this entry explains ``nodeid`` failing on ``release`` (an entry without ``deepspeed`` holds on
        every release; a release that is no version, on none that names releases)."""
        if self.deepspeed is not None:
            try:
                if release is None or Version(release) not in self.deepspeed:
                    return False
            except ValueError:  # InvalidVersion, or a part of 4300 digits or more (int())
                return False
        return any(_pattern(test).fullmatch(nodeid) for test in self.tests)

    @property
    def label(self) -> str:
        """``cpu-accelerator-lacks: bf16 autocast``, as a run's summary names the class."""
        return f"{self.cls.value}: {self.detail}"


def _pattern(test: str) -> re.Pattern[str]:
    return re.compile(".*".join(re.escape(part) for part in test.split("*")))


def _entry_lines(text: str) -> list[int]:
    """The line of each ``[[failure]]`` header, in order: the n-th entry's line for messages."""
    return [n for n, line in enumerate(text.splitlines(), 1) if re.match(r"\s*\[\[\s*failure\s*\]\]", line)]


def _key_line(text: str, start: int, key: str) -> int:
    """The line of ``key = ...`` in the entry whose header is on ``start`` (else the header's)."""
    lines = text.splitlines()
    for n in range(start, len(lines)):  # the lines after the header (``start`` counts from 1)
        if re.match(r"\s*\[", lines[n]):
            break
        if re.match(rf"\s*{re.escape(key)}\s*=", lines[n]):
            return n + 1
    return start


def parse(text: str, path: str = "upstream-failures.toml") -> tuple[Known, ...]:
    """The entries of a failures file's text; ``FailuresFileError`` names ``path:line`` and what is wrong."""
    try:
        data: dict[str, Any] = toml_input.loads(text)
    except toml_input.TOMLDecodeError as exc:
        found = re.search(r"line (\d+)", str(exc))
        line = found[1] if found else max(len(text.splitlines()), 1)  # tomllib: "(at end of document)"
        raise FailuresFileError(f"{path}:{line}: not valid TOML: {exc}") from None
    extra = sorted(set(data) - {"failure"})
    if extra:
        raise FailuresFileError(f"{path}:1: unknown table or key {extra[0]!r}; entries are [[failure]] tables")
    entries = data.get("failure", [])
    if not isinstance(entries, list):
        raise FailuresFileError(f"{path}:1: 'failure' must be [[failure]] tables")
    headers = _entry_lines(text)
    return tuple(
        _entry(e, _Place(text, path, headers[i] if i < len(headers) else 1, i + 1)) for i, e in enumerate(entries)
    )


@dataclass(frozen=True)
class _Place:
    """One entry being read: where it is, for messages that name the line of the key at fault."""

    text: str
    path: str
    line: int
    number: int

    def bad(self, key: str | None, problem: str) -> FailuresFileError:
        at = self.line if key is None else _key_line(self.text, self.line, key)
        return FailuresFileError(f"{self.path}:{at}: failure {self.number}: {problem}")


def _tests(data: dict[str, Any], place: _Place) -> tuple[str, ...]:
    tests = data.get("tests")
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) and t.strip() for t in tests):
        raise place.bad(
            "tests" if "tests" in data else None, "'tests' must be a non-empty list of node ids or patterns"
        )
    wrong = [t for t in tests if "::" not in t and not t.endswith("*")]
    if wrong:
        raise place.bad("tests", f"{wrong[0]!r} is no node id (FILE::TEST) or pattern ending in '*'")
    return tuple(tests)


def _class(data: dict[str, Any], place: _Place) -> FailureClass:
    try:
        return FailureClass(data.get("class"))
    except ValueError:
        choices = ", ".join(c.value for c in FailureClass)
        key = "class" if "class" in data else None
        raise place.bad(key, f"'class' is {data.get('class')!r}, not one of {choices}") from None


def _detail(cls: FailureClass, texts: dict[str, str | None], place: _Place) -> str:
    """The class's own field (a deepspeed-bug's repro, else its report); no other class's field."""
    misplaced = [k for k in _OWN if texts[k] and k != cls.field]
    if misplaced:
        raise place.bad(misplaced[0], f"{misplaced[0]!r} belongs to another class than {cls.value}")
    if cls is FailureClass.DEEPSPEED_BUG:
        detail = texts["repro"] or texts["report"]
        if not detail:
            raise place.bad(None, "a deepspeed-bug names its catalogue 'repro' or its upstream 'report' (or both)")
        return detail
    detail = texts[cls.field]
    if not detail:
        raise place.bad(None, f"a {cls.value} entry says which in {cls.field!r}")
    return detail


def _entry(data: dict[str, Any], place: _Place) -> Known:
    unknown = sorted(set(data) - set(_KEYS))
    if unknown:
        raise place.bad(unknown[0], f"unknown key {unknown[0]!r} (keys: {', '.join(_KEYS)})")
    tests, cls = _tests(data, place), _class(data, place)
    texts: dict[str, str | None] = {}
    for key in _KEYS[2:]:
        value = data.get(key)
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise place.bad(key, f"{key!r} must be a non-empty string")
        texts[key] = value
    detail = _detail(cls, texts, place)
    specifier = None
    if texts["deepspeed"]:
        try:
            specifier = SpecifierSet(texts["deepspeed"])
        except InvalidSpecifier:
            raise place.bad("deepspeed", f"'deepspeed' {texts['deepspeed']!r} is no version specifier") from None
    where = f"{place.path}:{place.line}"
    return Known(tests, cls, detail, where, specifier, texts["why"] or "", texts["repro"], texts["report"])


def read(path: Path) -> tuple[Known, ...]:
    """A failures file; ``FailuresFileError`` when it cannot be read or is wrong (naming ``path:line``)."""
    try:
        text = paths.read_text(path)  # a FIFO refused, not waited on
    except (OSError, UnicodeDecodeError) as exc:
        raise FailuresFileError(f"{path}:1: cannot be read: {exc}") from None
    return parse(text, str(path))


# --- a run's failures, sorted --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Failure:
    """A test that failed in a run, on the DeepSpeed the run imported; ``known``: the entry that explains it."""

    nodeid: str
    deepspeed: str | None
    error: str | None
    known: Known | None

    @property
    def new(self) -> bool:
        return self.known is None


@dataclass(frozen=True)
class Sorted:
    """A run's failures, each known or new, and the entries whose tests ran and did not fail (fixed, or flaky)."""

    failures: tuple[Failure, ...]
    passing: tuple[tuple[str, Known], ...]  # (nodeid, entry): a known failure that passed this time

    @property
    def new(self) -> tuple[Failure, ...]:
        return tuple(f for f in self.failures if f.new)

    @property
    def known(self) -> tuple[Failure, ...]:
        return tuple(f for f in self.failures if not f.new)


@dataclass(frozen=True)
class Outcome:
    """How one test ended on the DeepSpeed a run imported, as the failures file sorts it: from a results record
    (``outcome_of``), or from what another harness reported (the benchmark's JUnit files)."""

    nodeid: str
    deepspeed: str | None
    outcome: str  # passed, failed, error, skipped, not-applicable
    error: str | None = None


def outcome_of(deepspeed: str | None, test: TestRecord) -> Outcome:
    """A record's outcome; NOT-APPLICABLE (a test the release cannot run) is no failure, whatever pytest said."""
    word = "not-applicable" if test.verdict is Verdict.NOT_APPLICABLE else test.outcome
    return Outcome(test.nodeid, deepspeed, word, test.error)


def classify(runs: Iterable[tuple[str | None, Sequence[TestRecord]]], known: Sequence[Known]) -> Sorted:
    """Each failing test of ``runs`` (the DeepSpeed a run imported, its records), sorted by ``sort_outcomes``."""
    return sort_outcomes((outcome_of(release, test) for release, tests in runs for test in tests), known)


def sort_outcomes(outcomes: Iterable[Outcome], known: Sequence[Known]) -> Sorted:
    """Each failing test (in its body or its setup) with the first entry that covers it, else new; and each passing
    test an entry covers."""
    failures, passing = [], []
    for o in outcomes:
        entry = next((k for k in known if k.covers(o.nodeid, o.deepspeed)), None)
        if o.outcome in FAILING:
            failures.append(Failure(o.nodeid, o.deepspeed, o.error, entry))
        elif entry is not None and o.outcome == "passed":
            passing.append((o.nodeid, entry))
    return Sorted(tuple(failures), tuple(passing))


def summary(result: Sorted) -> list[str]:
    """What a run says of its failures: the new ones first (with their error), then the known ones by class."""
    lines = []
    for f in result.new:
        on = f" on deepspeed {f.deepspeed}" if f.deepspeed else ""
        lines.append(f"NEW      {f.nodeid}{on}: {f.error or 'failed'}")
    for f in result.known:
        assert f.known is not None
        lines.append(f"known    {f.nodeid}: {f.known.label} ({f.known.where})")
    for nodeid, entry in result.passing:
        lines.append(f"passed   {nodeid}: listed as {entry.label} ({entry.where}): fixed, or not always failing?")
    head = f"{len(result.failures)} failed: {len(result.new)} new, {len(result.known)} known"
    return [head, *lines]
