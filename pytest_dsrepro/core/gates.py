"""``ds_version`` gates: which DeepSpeed releases a bug affects, and the verdict a run earns.

Pure functions of a test's markers, the installed release and what the ranks did, so every decision is testable
without a world.
"""

from __future__ import annotations

import enum
import importlib
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from . import versions
from .errors import MarkerError
from .outcome import Measurement, RankResult, Status, group_ranks

#: A repro's fix: called in every rank of a ``[fixed]`` variant with a ``pytest.MonkeyPatch`` (undone afterwards).
Fix = Callable[[Any], None]

STOCK, FIXED = "stock", "fixed"


class Verdict(str, enum.Enum):
    REPRODUCED = "REPRODUCED"  # stock, affected release, failed as declared (a nondeterministic repro: often enough)
    FIXED = "FIXED"  # stock, a release after (or between) the affected ranges, passed
    NOT_YET_AFFECTED = "NOT-YET-AFFECTED"  # stock, a release older than every affected range, passed
    PASSES_WITH_FIX = "PASSES-WITH-FIX"  # the fix variant passed
    UNEXPECTED = "UNEXPECTED"  # anything else
    NOT_APPLICABLE = "NOT-APPLICABLE"  # declared not applicable on this release (ds_not_applicable): no body ran
    SKIPPED = "SKIPPED"


class Reason(str, enum.Enum):
    """Why a run earned its verdict; what tools read instead of the verdict's wording."""

    REPRODUCED = "reproduced"
    NOT_AFFECTED = "not-affected"  # passed after (or between) the affected ranges: FIXED
    NOT_YET_AFFECTED = "not-yet-affected"  # passed before every affected range: the bug is not there yet
    FIX_HOLDS = "fix-holds"
    DID_NOT_REPRODUCE = "did-not-reproduce"  # the body passed where the bug was expected (or failed too rarely)
    FAILED_DIFFERENTLY = "failed-differently"
    REGRESSION = "regression"  # failed as declared on a release newer than (or between) the affected ranges
    BEFORE_AFFECTED = "failed-before-affected-range"  # failed as declared on a release older than every range
    OUTSIDE_RANGE = "failed-outside-affected-range"  # failed outside the ranges, and not with the declared error
    FIX_DOES_NOT_HOLD = "fix-does-not-hold"
    FIX_RAISED = "fix-raised"  # a fix raised while it was being applied: the body never ran
    HARNESS_ERROR = "harness-error"  # no world ran: nothing is known about the bug
    NOT_APPLICABLE = "not-applicable"  # the repro declares this release out of its reach, and why

    @property
    def verdict(self) -> Verdict:
        return _VERDICTS.get(self, Verdict.UNEXPECTED)

    @property
    def body_failed(self) -> bool | None:
        """Did the test body fail? None when no body ran (a harness error, a fix that raised)."""
        if self in (Reason.HARNESS_ERROR, Reason.NOT_APPLICABLE, Reason.FIX_RAISED):
            return None
        return self not in (Reason.NOT_AFFECTED, Reason.NOT_YET_AFFECTED, Reason.FIX_HOLDS, Reason.DID_NOT_REPRODUCE)


_VERDICTS = {
    Reason.REPRODUCED: Verdict.REPRODUCED,
    Reason.NOT_AFFECTED: Verdict.FIXED,
    Reason.NOT_YET_AFFECTED: Verdict.NOT_YET_AFFECTED,
    Reason.FIX_HOLDS: Verdict.PASSES_WITH_FIX,
    Reason.NOT_APPLICABLE: Verdict.NOT_APPLICABLE,
}


@dataclass(frozen=True)
class Nondeterministic:
    """``ds_nondeterministic(runs, failures=1)``: the bug shows in some runs only (a race), so each verdict runs the
    body ``runs`` times, each in a fresh world; REPRODUCED needs ``failures`` of them to fail as declared, FIXED and
    PASSES-WITH-FIX need none to fail."""

    runs: int
    failures: int = 1


#: The most runs one verdict may ask for: a series runs inside one pytest item.
MAX_RUNS = 1000


@dataclass(frozen=True)
class Rate:
    """How the runs of one nondeterministic verdict went: ``failed`` of ``runs`` failed with the declared error.

    ``runs`` is less than ``planned`` when a run ended otherwise (a different error, a crash, a hang, a fix that
    raised): the verdict is UNEXPECTED whatever the rest would do, so the series stops there.
    """

    runs: int
    planned: int
    failed: int
    needed: int  # failures as declared that make REPRODUCED (FIXED and PASSES-WITH-FIX need 0)
    seconds: float  # the runs' wall time, all together

    def __str__(self) -> str:
        return f"{self.failed}/{self.runs}"


@dataclass(frozen=True)
class VersionGate:
    affected: SpecifierSet
    raises: type[BaseException]
    match: str | None = None
    fix: Fix | None = None
    written: str = ""  # the range as the author wrote it (a SpecifierSet prints its parts re-ordered)

    @property
    def range(self) -> str:
        return self.written or str(self.affected)

    def describe(self) -> str:
        expected = self.raises.__qualname__ + (f" matching {self.match!r}" if self.match else "")
        return f"{expected} on deepspeed{self.range}"


@dataclass(frozen=True)
class Condition:
    """A release range where a test is not what its gates alone say: ``ds_prerequisite`` (``fix`` is applied in
    every rank before the body, in both variants: another bug masks this one there) or ``ds_not_applicable``
    (``fix`` is None: the body does not run there)."""

    releases: SpecifierSet
    written: str
    reason: str
    fix: Fix | None = None

    def holds(self, version: Version) -> bool:
        return self.releases.contains(version, prereleases=True)

    def describe(self) -> str:
        return f"deepspeed{self.written}: {self.reason}"


@dataclass(frozen=True)
class Judgement:
    reason: Reason
    message: str
    prerequisites: tuple[str, ...] = ()  # the prerequisites applied to the run (``Condition.describe``)
    rate: Rate | None = None  # a nondeterministic repro's runs (``ds_nondeterministic``)
    measurements: tuple[Measurement, ...] = ()  # what the body timed against its reference (``inrank.perf``)

    @property
    def verdict(self) -> Verdict:
        return self.reason.verdict


def _load_fix(value: object, where: str) -> Fix:
    if isinstance(value, str):
        module, _, name = value.partition(":")
        try:
            obj = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError) as exc:
            raise MarkerError(f"{where}: fix={value!r} cannot be imported ({type(exc).__name__}: {exc})") from None
        value = obj
    if not callable(value):
        raise MarkerError(f"{where}: fix={value!r} is not callable")
    return value


def _specifier(value: object, name: str, where: str) -> SpecifierSet:
    if not isinstance(value, str):
        raise MarkerError(f"{where}: {name}={value!r} must be a PEP 440 specifier string such as '<0.16.4'")
    try:
        return SpecifierSet(value)
    except InvalidSpecifier as exc:
        raise MarkerError(f"{where}: {name}={value!r} is not a valid PEP 440 specifier ({exc})") from None


def parse_condition(args: tuple[object, ...], kwargs: dict[str, object], where: str, *, with_fix: bool) -> Condition:
    """One ``ds_prerequisite(releases, fix=, reason=)`` (``with_fix``) or ``ds_not_applicable(releases, reason=)``."""
    allowed = {"releases", "reason"} | ({"fix"} if with_fix else set())
    if len(args) > 1 or set(kwargs) - allowed or (args and "releases" in kwargs):
        named = ", ".join(f"{name}=" for name in sorted(allowed - {"releases"}))
        raise MarkerError(f"{where}: takes releases, {named}; got {args!r} {sorted(kwargs)}")
    releases = args[0] if args else kwargs.get("releases")
    spec = _specifier(releases, "releases", where)
    reason = kwargs.get("reason")
    if not isinstance(reason, str) or not reason.strip():
        raise MarkerError(f"{where}: reason= must say why, in words (a masking bug, a missing API); got {reason!r}")
    fix = None
    if with_fix:
        if "fix" not in kwargs:
            raise MarkerError(f"{where}: fix= is required: the patch applied before the body on {releases}")
        fix = _load_fix(kwargs["fix"], where)
    assert isinstance(releases, str)
    return Condition(spec, releases, " ".join(reason.split()), fix)


def holding(conditions: Iterable[Condition], version: Version | None) -> tuple[Condition, ...]:
    """The conditions that hold on ``version`` (none where DeepSpeed is not installed)."""
    return () if version is None else tuple(c for c in conditions if c.holds(version))


def parse_gate(args: tuple[object, ...], kwargs: dict[str, object], where: str) -> VersionGate:
    allowed = {"affected", "raises", "match", "fix"}
    if len(args) > 1 or set(kwargs) - allowed:
        raise MarkerError(
            f"{where}: takes affected, raises=, match=, fix=; got {args!r} {sorted(set(kwargs) - allowed)}"
        )
    affected = args[0] if args else kwargs.get("affected")
    raises, match, fix = kwargs.get("raises"), kwargs.get("match"), kwargs.get("fix")
    spec = _specifier(affected, "affected", where)
    if not (isinstance(raises, type) and issubclass(raises, BaseException)):
        raise MarkerError(f"{where}: raises={raises!r} must be an exception type, e.g. raises=AttributeError")
    if match is not None:
        if not isinstance(match, str):
            raise MarkerError(f"{where}: match={match!r} must be a regular expression string")
        try:
            re.compile(match)
        except re.error as exc:
            raise MarkerError(f"{where}: match={match!r} is not a valid regular expression ({exc})") from None
    assert isinstance(affected, str)
    return VersionGate(spec, raises, match, None if fix is None else _load_fix(fix, where), written=affected)


def parse_gates(marks: Iterable[tuple[tuple[object, ...], dict[str, object]]], where: str) -> tuple[VersionGate, ...]:
    """Every ``ds_version`` marker of a test (as ``(args, kwargs)``), validated; they must agree on the fix."""
    gates = tuple(parse_gate(args, kwargs, where) for args, kwargs in marks)
    fixes = {g.fix for g in gates if g.fix is not None}
    if len(fixes) > 1:
        raise MarkerError(
            f"{where}: markers name different fixes; one test has one fix ({', '.join(map(repr, fixes))})"
        )
    return gates


def common_fix(gates: Iterable[VersionGate]) -> Fix | None:
    return next((g.fix for g in gates if g.fix is not None), None)


def installed_deepspeed() -> Version | None:
    return versions.installed("deepspeed")


def oldest_first(specs: Iterable[str]) -> list[str]:
    """Affected ranges in reading order: ``<0.18.3`` before ``>=0.18.3,<0.19.5`` before ``>=0.19.5``."""
    return sorted(specs, key=_lower_bound)


def _lower_bound(spec: str) -> tuple[int, Version]:
    try:
        bounds = [Version(s.version) for s in SpecifierSet(spec) if s.operator in (">=", ">", "==", "~=", "===")]
    except (InvalidSpecifier, InvalidVersion):
        return (1, Version("0"))  # not valid: the test itself will fail and say so; list it last
    return (0, max(bounds, default=Version("0")))


def active_gate(gates: Sequence[VersionGate], version: Version, where: str) -> VersionGate | None:
    hits = [g for g in gates if g.affected.contains(version, prereleases=True)]
    if len(hits) > 1:
        ranges = ", ".join(repr(g.range) for g in hits)
        raise MarkerError(f"{where}: ds_version ranges overlap at deepspeed {version}: {ranges}")
    return hits[0] if hits else None


def _matches(result: RankResult, gate: VersionGate) -> bool:
    error = result.error
    if result.status is not Status.FAILED or error is None or not error.is_instance_of(gate.raises):
        return False
    return gate.match is None or re.search(gate.match, error.text) is not None


def _endings(failures: Sequence[RankResult]) -> str:
    return "; ".join(f"{g.label}: {g.headline}" for g in group_ranks(failures))


def judge(
    gates: Sequence[VersionGate], variant: str | None, version: Version, failures: Sequence[RankResult], where: str
) -> Judgement:
    """The verdict of one run. ``failures`` are the ranks that went wrong (empty: the test passed)."""
    ds = f"deepspeed {version}"
    if variant == FIXED:
        if not failures:
            return Judgement(Reason.FIX_HOLDS, f"passes with the fix on {ds}")
        return Judgement(Reason.FIX_DOES_NOT_HOLD, f"the fix does not hold on {ds}: {_endings(failures)}")
    gate = active_gate(gates, version, where)
    if gate is None:
        if not failures:
            return Judgement(Reason.NOT_AFFECTED, f"not affected: passes on {ds}")
        ranges = " or ".join(g.range for g in gates)
        if all(_lower_bound(g.range)[1] > version for g in gates):
            return Judgement(
                Reason.BEFORE_AFFECTED,
                f"failed on {ds}, older than the affected range ({ranges}): {_endings(failures)}; the bug may be "
                "older than declared, or this release fails for another reason",
            )
        return Judgement(
            Reason.REGRESSION, f"regression: {ds} is outside the affected range ({ranges}) but {_endings(failures)}"
        )
    if not failures:
        return Judgement(
            Reason.DID_NOT_REPRODUCE, f"did not reproduce on {ds}: expected {gate.describe()}, but it passed"
        )
    if all(_matches(r, gate) for r in failures):
        return Judgement(Reason.REPRODUCED, f"REPRODUCED on {ds}: {_endings(failures)}")
    return Judgement(
        Reason.FAILED_DIFFERENTLY, f"failed differently on {ds}: expected {gate.describe()}, got {_endings(failures)}"
    )
