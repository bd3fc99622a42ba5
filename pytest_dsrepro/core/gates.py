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

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from . import versions
from .errors import MarkerError
from .outcome import RankResult, Status, group_ranks, rank_ranges
from .text import cut
from .typed_json import Inconsistent

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

    def __post_init__(self) -> None:
        if self.runs > self.planned or self.failed > self.runs or self.needed > self.planned:
            raise Inconsistent(
                f"runs {self.runs}, planned {self.planned}, failed {self.failed}, needed {self.needed} do not add up "
                "(failed <= runs <= planned, needed <= planned)"
            )

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
        found = SpecifierSet(value)
        for s in found:  # compared later, each version is read: a part of 4300 digits is int()'s ValueError there
            if s.operator != "===":
                Version(s.version.removesuffix(".*"))
    except ValueError as exc:  # InvalidSpecifier, or a version no release can have
        raise MarkerError(f"{where}: {name}={cut(repr(value), 80)} is not a valid PEP 440 specifier "
                          f"({cut(str(exc), 80)})") from None  # fmt: skip
    return found


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


def parse_nondeterministic(args: tuple[object, ...], kwargs: dict[str, object], where: str) -> Nondeterministic:
    """One ``ds_nondeterministic(runs, failures=1)`` marker, validated."""
    names = ("runs", "failures")
    if len(args) > len(names) or set(kwargs) - set(names) or set(names[: len(args)]) & set(kwargs):
        raise MarkerError(f"{where}: takes runs, failures=; got {args!r} {sorted(kwargs)}")
    given: dict[str, object] = {**dict(zip(names, args, strict=False)), **kwargs}
    runs, failures = given.get("runs"), given.get("failures", 1)
    if not isinstance(runs, int) or isinstance(runs, bool) or not 2 <= runs <= MAX_RUNS:
        raise MarkerError(
            f"{where}: runs={runs!r} must be the number of runs per verdict, a whole number 2 to {MAX_RUNS}"
        )
    if not isinstance(failures, int) or isinstance(failures, bool) or not 1 <= failures <= runs:
        raise MarkerError(
            f"{where}: failures={failures!r} must say how many of the {runs} runs failing as declared make "
            f"REPRODUCED, a whole number 1 to {runs}"
        )
    return Nondeterministic(runs, failures)


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
    except ValueError:  # InvalidSpecifier, InvalidVersion, or a part of 4300 digits or more (int())
        return (1, Version("0"))  # not valid: the test itself will fail and say so; list it last
    return (0, max(bounds, default=Version("0")))


def affecting(gates: Sequence[VersionGate], version: Version) -> list[VersionGate]:
    """The gates whose affected range holds ``version`` (more than one: ranges that overlap, ``active_gate``'s
    error)."""
    return [g for g in gates if g.affected.contains(version, prereleases=True)]


def active_gate(gates: Sequence[VersionGate], version: Version, where: str) -> VersionGate | None:
    hits = affecting(gates, version)
    if len(hits) > 1:
        ranges = ", ".join(repr(g.range) for g in hits)
        raise MarkerError(f"{where}: ds_version ranges overlap at deepspeed {version}: {ranges}")
    return hits[0] if hits else None


def _matches(result: RankResult, gate: VersionGate) -> bool:
    error = result.error
    if result.status is not Status.FAILED or error is None or not error.is_instance_of(gate.raises):
        return False
    return gate.match is None or re.search(gate.match, error.text) is not None


def causes(failures: Sequence[RankResult]) -> tuple[RankResult, ...]:
    """The ranks that failed first, on their own: every failure but those that only lost a peer (gloo's "Connection
    closed by peer" in a rank that waited in a collective for a rank that had already failed). All of them when
    every failure lost a peer (then no rank is known to have failed first)."""
    own = tuple(r for r in failures if not r.lost_peer)
    return own or tuple(failures)


def _told(failures: Sequence[RankResult]) -> str:
    """The ranks that failed first, each ending once; then the collateral ones, named as such."""
    first = causes(failures)
    text = "; ".join(f"{g.label}: {g.headline}" for g in group_ranks(first))
    collateral = [r for r in failures if r not in first]
    if collateral:
        text += f"; collateral: {rank_ranges(r.rank for r in collateral)} then lost a peer"
    return text


class Ending(enum.Enum):
    """How one run ended, as the verdict counts it."""

    PASSED = "passed"
    DECLARED = "declared"  # failed with the declared error
    OTHER = "other"  # anything else: a different error, a crash, a hang, a fix that raised


def _ending(failures: Sequence[RankResult], gates: Sequence[VersionGate]) -> Ending:
    """``gates``: the errors that count as declared (the active gate's on an affected release, else any gate's)."""
    if not failures:
        return Ending.PASSED
    first = causes(failures)
    if any(r.fix for r in first):
        return Ending.OTHER
    if all(any(_matches(r, g) for g in gates) for r in first):
        return Ending.DECLARED
    return Ending.OTHER


def ending(
    gates: Sequence[VersionGate], variant: str | None, version: Version, failures: Sequence[RankResult], where: str
) -> Ending:
    """How one run ended; a series of runs stops at the first ``Ending.OTHER`` (its verdict is UNEXPECTED then)."""
    gate = None if variant == FIXED else active_gate(gates, version, where)
    return _ending(failures, gates if gate is None else [gate])


def _declared(gates: Sequence[VersionGate]) -> str:
    """The declared errors in words, each once: ``AttributeError matching 'epilogue' or KeyError``."""
    said = [g.raises.__qualname__ + (f" matching {g.match!r}" if g.match else "") for g in gates]
    return " or ".join(dict.fromkeys(said))


def judge(
    gates: Sequence[VersionGate], variant: str | None, version: Version, failures: Sequence[RankResult], where: str
) -> Judgement:
    """The verdict of one run. ``failures`` are the ranks that went wrong (empty: the test passed)."""
    return judge_runs(gates, variant, version, [failures], where)


def judge_runs(
    gates: Sequence[VersionGate],
    variant: str | None,
    version: Version,
    runs: Sequence[Sequence[RankResult]],
    where: str,
    plan: Nondeterministic | None = None,
    seconds: float = 0.0,
) -> Judgement:
    """The verdict of a series of runs (one, unless ``plan`` declares the bug nondeterministic): each element of
    ``runs`` is one run's failing ranks. A series ends early at the first run that ended otherwise than passing or
    failing as declared (``ending``), so ``len(runs)`` may be less than ``plan.runs``."""
    gate = None if variant == FIXED else active_gate(gates, version, where)
    told = _Told.of(runs, gates if gate is None else [gate], plan, version, affected=gate is not None)
    rate = None if plan is None else Rate(len(runs), plan.runs, told.declared, told.needed, round(seconds, 3))
    if told.raised:
        reason, message = _raised(told)
    elif variant == FIXED:
        reason, message = _with_fix(told)
    elif gate is None:
        reason, message = _outside(gates, version, told)
    else:
        reason, message = _affected(gate, told)
    return Judgement(reason, message, rate=rate)


@dataclass(frozen=True)
class _Told:
    """A series of runs as the verdict's words need it."""

    on: str  # "on deepspeed X", and for a series how it went
    said: str  # the ranks of the run the user is shown (the one that ended otherwise, else the first that failed)
    failed: bool  # some run failed
    otherwise: bool  # some run ended otherwise than passing or failing as declared
    declared: int  # runs that failed as declared
    needed: int  # of them, for REPRODUCED
    raised: str  # the fixes that raised, named; "" when none did

    @classmethod
    def of(
        cls,
        runs: Sequence[Sequence[RankResult]],
        declared_by: Sequence[VersionGate],
        plan: Nondeterministic | None,
        version: Version,
        *,
        affected: bool,
    ) -> _Told:
        endings = [_ending(run, declared_by) for run in runs]
        failing = [run for run, e in zip(runs, endings, strict=True) if e is not Ending.PASSED]
        other = next((run for run, e in zip(runs, endings, strict=True) if e is Ending.OTHER), None)
        declared = endings.count(Ending.DECLARED)
        needed = plan.failures if plan else 1
        on = f"on deepspeed {version}"
        if plan and len(runs) < plan.runs:
            on += (f" (run {len(runs)} of {plan.runs} ended otherwise, so the runs stopped; {declared} failed as "
                   "declared before it)")  # fmt: skip
        elif plan:
            on += f" ({declared}/{len(runs)} runs failed as declared" + (f", {needed} needed)" if affected else ")")
        raised = dict.fromkeys(r.fix for run in failing for r in causes(run) if r.fix)
        shown = other if other is not None else (failing[0] if failing else ())
        return cls(on, _told(shown), bool(failing), other is not None, declared, needed, ", ".join(raised))


def _raised(told: _Told) -> tuple[Reason, str]:
    return Reason.FIX_RAISED, (
        f"the fix raised {told.on}, so it was never applied and the body never ran ({told.raised}): {told.said}"
    )


def _with_fix(told: _Told) -> tuple[Reason, str]:
    if not told.failed:
        return Reason.FIX_HOLDS, f"passes with the fix {told.on}"
    return Reason.FIX_DOES_NOT_HOLD, f"the fix does not hold {told.on}: {told.said}"


def _outside(gates: Sequence[VersionGate], version: Version, told: _Told) -> tuple[Reason, str]:
    """A stock run on a release no gate covers: before every range, or after (or between) them."""
    ranges = " or ".join(oldest_first(g.range for g in gates))
    before = all(_lower_bound(g.range)[1] > version for g in gates)
    if not told.failed and before:
        return Reason.NOT_YET_AFFECTED, f"not yet affected: passes {told.on}, older than the affected range ({ranges})"
    if not told.failed:
        return Reason.NOT_AFFECTED, f"fixed: passes {told.on}, after the affected range ({ranges})"
    if told.otherwise:
        return Reason.OUTSIDE_RANGE, (
            f"fails outside the affected range ({ranges}) {told.on}, not with the declared error ({_declared(gates)}): "
            f"{told.said}"
        )
    if before:
        return Reason.BEFORE_AFFECTED, (
            f"failed with the declared error {told.on}, older than the affected range ({ranges}): the bug may be "
            f"older than declared: {told.said}"
        )
    return Reason.REGRESSION, (
        f"regression: failed with the declared error {told.on}, outside the affected range ({ranges}): {told.said}"
    )


def _affected(gate: VersionGate, told: _Told) -> tuple[Reason, str]:
    """A stock run on a release the gate covers."""
    if told.otherwise:
        return Reason.FAILED_DIFFERENTLY, f"failed differently {told.on}: expected {gate.describe()}, got {told.said}"
    if told.declared >= told.needed:
        return Reason.REPRODUCED, f"REPRODUCED {told.on}: {told.said}"
    if not told.failed:
        return Reason.DID_NOT_REPRODUCE, f"did not reproduce {told.on}: expected {gate.describe()}, but it passed"
    return Reason.DID_NOT_REPRODUCE, (
        f"did not reproduce {told.on}: expected {gate.describe()}; the first run that did: {told.said}"
    )
