"""Recording, the pytest side of the results file: a ``TestRecord`` per test report (a plugin object may amend it,
``pytest_dsrepro_test_record``), ``RecordedTests`` collecting them where reports arrive, what the terminal summary
and JUnit properties say of them.

The schema is ``core.results``'s; this module only reads the facts a test left on its stash (its markers, world,
config, world outcome and verdict, each kept by the module that decided it) and its report. Records travel inside
``report.user_properties`` as JSON data, so they reach the controller under xdist.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from ..core import results
from ..core.errors import MarkerError
from ..core.gates import Judgement, Verdict
from ..core.results import Environment, Origin, ReproMeta, RunRecord, Source, TestRecord
from ..core.source import module_slice
from ..core.text import aligned
from . import markers
from .execution import CONFIG_KEY, OUTCOME_KEY, PREPARED_KEY
from .markers import MARKS_KEY
from .verdicts import JUDGEMENT_KEY

#: The ``user_properties`` name under which a report carries its record.
PROPERTY = "dsrepro"
#: The verdicts whose summary line says why (the rest are what the declared range predicts).
EXPLAINED = (Verdict.UNEXPECTED.value, Verdict.NOT_APPLICABLE.value, Verdict.SKIPPED.value)
#: The verdicts of a body that passed as its range predicts: their record has no error line.
PASSING = (Verdict.FIXED, Verdict.NOT_YET_AFFECTED, Verdict.PASSES_WITH_FIX)
#: The JUnit ``<property>`` names on a test's ``<testcase>`` (``PROPERTY`` + ``.`` + one of these).
JUNIT_NAMES = ("verdict", "reason", "deepspeed", "repro", "variant", "ranks", "attempts", "rate", "margin", "measured")


def repro_meta(item: pytest.Item) -> ReproMeta | None:
    """The ``ds_repro`` metadata of a test, or None when it is not a catalogued repro."""
    mark = item.get_closest_marker("ds_repro")
    if mark is None:
        return None
    ds_versions = [(m.args, m.kwargs) for m in item.iter_markers("ds_version")]
    try:
        seen = markers.faces(item)
    except MarkerError:  # its setup failed saying so; the record keeps what the markers say soundly
        seen = ()
    return results.repro_meta(mark.args, mark.kwargs, item.path, ds_versions, seen)


def _outcome_word(report: pytest.TestReport) -> str:
    if hasattr(report, "wasxfail"):
        return "xfailed" if report.skipped else "xpassed"
    if report.when != "call" and report.failed:
        return "error"
    return report.outcome


def _error_line(report: pytest.TestReport, judgement: Judgement | None) -> str | None:
    if judgement is not None and judgement.verdict not in PASSING:
        return judgement.message.splitlines()[0]
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)  # the exception line, as pytest's short summary shows it
        text = crash.message if crash is not None else report.longreprtext.strip()
        return text.splitlines()[0] if text.strip() else "failed"
    return None


def _fix_name(fix: Callable[..., Any]) -> str:
    return f"{getattr(fix, '__module__', '?')}.{getattr(fix, '__qualname__', repr(fix))}"


def repro_source(item: pytest.Item, fix: Callable[..., Any] | None) -> Source | None:
    """The test and what it uses from its file, and the fix (``core.source``); None when the file cannot be read."""
    module = getattr(item, "module", None)
    cls = getattr(item, "cls", None)
    name = cls.__qualname__.split(".")[0] if cls is not None else getattr(item, "originalname", item.name)
    try:
        text = item.path.read_text()
    except (OSError, UnicodeDecodeError):
        return None
    in_file = (
        fix is not None
        and module is not None
        and getattr(fix, "__module__", None) == module.__name__
        and getattr(module, getattr(fix, "__qualname__", ""), None) is fix
    )
    names = [name, "pytestmark", *([fix.__qualname__] if in_file and fix is not None else [])]
    try:
        code = module_slice(text, names)
    except SyntaxError:
        return None
    fix_code = None
    if fix is not None and not in_file:
        try:
            fix_code = inspect.getsource(fix)
        except (OSError, TypeError):
            fix_code = None
    fix_name = None if fix is None else (fix.__qualname__ if in_file else _fix_name(fix))
    elsewhere = item.get_closest_marker("ds_world") is not None and "ds_world" not in code
    return Source(item.nodeid.split("::", 1)[0], code, fix_name, fix_code, world_elsewhere=elsewhere)


def record(item: pytest.Item, report: pytest.TestReport) -> TestRecord:
    """The record of one report of ``item``, from what the test left on its stash."""
    judgement = item.stash.get(JUDGEMENT_KEY, None)
    marks = item.stash.get(MARKS_KEY, None)
    prepared = item.stash.get(PREPARED_KEY, None)
    verdict, reason = (judgement.verdict, judgement.reason) if judgement else (None, None)
    gated = bool(marks.gates) if marks is not None else item.get_closest_marker("ds_version") is not None
    if judgement is None and report.skipped and not hasattr(report, "wasxfail") and gated:
        verdict, reason = Verdict.SKIPPED, None  # a gated test that never got judged: no reason to give
    config = item.stash.get(CONFIG_KEY, None)
    outcome = item.stash.get(OUTCOME_KEY, None)
    meta = repro_meta(item)
    return TestRecord(
        nodeid=item.nodeid,
        repro=meta,
        variant=marks.variant if marks is not None else markers.variant(item),  # markers that failed to parse
        verdict=verdict,
        reason=reason,
        outcome=_outcome_word(report),
        error=_error_line(report, judgement),
        duration=round(report.duration, 3),
        config=config.config if config else None,
        config_notes=config.notes if config else (),
        ranks=results.rank_stories(outcome),
        longrepr=(report.longreprtext or None) if report.failed else None,
        world_size=prepared.spec.size if prepared is not None else None,
        source=repro_source(item, marks.fix if marks is not None else None) if gated or meta else None,
        prerequisites=judgement.prerequisites if judgement else (),
        rate=judgement.rate if judgement else None,
        measurements=outcome.measurements if outcome is not None else (),
        origin=_origin(item),
    )


def _origin(item: pytest.Item) -> Origin | None:
    """The test's ``ds_origin``; None when its marker is wrong (its setup failed saying so)."""
    try:
        return markers.origin(item)
    except MarkerError:
        return None


def attach(item: pytest.Item, report: pytest.TestReport) -> None:
    """Put the record of a call, or of a setup/teardown that did not pass, on the report (as JSON data), as a plugin
    object amends it."""
    if report.when == "call" or not report.passed:
        own = record(item, report)
        amended = item.config.hook.pytest_dsrepro_test_record(item=item, record=own)
        report.user_properties.append((PROPERTY, (amended or own).to_json()))


def junit_properties(test: TestRecord, deepspeed: str | None) -> list[tuple[str, str]]:
    """The ``<property>`` elements of a test's JUnit ``<testcase>``: what a CI reader filters on."""
    values = {
        "verdict": test.verdict.value if test.verdict else None,
        "reason": test.reason.value if test.reason else None,
        "deepspeed": deepspeed,
        "repro": test.repro.id if test.repro else None,
        "variant": test.variant,
        "ranks": None if test.world_size is None else str(test.world_size),
        "attempts": str(test.attempts),
        "rate": None if test.rate is None else str(test.rate),  # runs failed as declared / runs made
        "margin": f"{min(m.margin for m in test.measurements):.2f}" if test.measurements else None,
        "measured": "; ".join(m.describe() for m in test.measurements) or None,
    }
    return [(f"{PROPERTY}.{name}", value) for name in JUNIT_NAMES if (value := values[name]) is not None]


@dataclass(frozen=True)
class Summary:
    """The run's part of the terminal summary: a heading and its lines (none: nothing is written)."""

    title: str
    lines: list[str]
    with_worlds: bool = True  # the worlds the run ran on are said after the lines (else with -v only)


@dataclass
class RecordedTests:
    """Collects the records of one pytest run, where reports arrive (the controller under xdist).

    ``attempt`` holds each test's records of its current attempt (since its setup report), so that a rerun can drop
    them; ``rerun`` the tests whose current attempt is being run again. Reruns (pytest-rerunfailures): an attempt
    that is run again is reported with the outcome ``rerun``; its records are dropped when that report arrives, so
    each test is recorded once, by its last attempt, with the number of attempts.
    """

    tests: list[TestRecord] = field(default_factory=list)
    attempt: dict[str, list[TestRecord]] = field(default_factory=dict)
    rerun: set[str] = field(default_factory=set)

    def add(self, report: pytest.TestReport) -> None:
        nodeid = report.nodeid
        if report.when == "setup":
            self.attempt[nodeid] = []
            self.rerun.discard(nodeid)
        if str(report.outcome) == "rerun":  # pytest-rerunfailures' own outcome: the next attempt supersedes this one
            dropped = self.attempt.pop(nodeid, [])
            self.tests = [t for t in self.tests if not any(t is d for d in dropped)]
            self.rerun.add(nodeid)
            return
        attempts = int(getattr(report, "rerun", 0)) + 1  # set by pytest-rerunfailures on every report it logs
        for name, value in report.user_properties:
            if name == PROPERTY:
                test = dataclasses.replace(TestRecord.from_json(value), attempts=attempts)
                self.tests.append(test)
                self.attempt.setdefault(nodeid, []).append(test)

    def junit_properties(self, report: pytest.TestReport, deepspeed: str | None) -> list[tuple[str, str]]:
        """The properties for a teardown report, the one junitxml writes a ``<testcase>``'s properties from.

        An attempt that is run again gets one property that says so (junitxml writes a ``<testcase>`` per attempt);
        the last attempt gets the verdict's properties.
        """
        if report.when != "teardown":
            return []
        if report.nodeid in self.rerun:
            attempt = int(getattr(report, "rerun", 0)) + 1
            return [(f"{PROPERTY}.rerun", f"attempt {attempt} failed and was run again; the last attempt counts")]
        tests = self.attempt.get(report.nodeid, [])
        judged = [t for t in tests if t.verdict is not None] or tests
        if not judged or not (judged[0].verdict or judged[0].repro or judged[0].world_size):
            return []  # not this plugin's business
        return junit_properties(judged[0], deepspeed)

    def record(self, environment: Environment) -> RunRecord:
        return RunRecord(created=results.now(), environment=environment, tests=tuple(self.tests))

    def summary_lines(self) -> list[str]:
        """The terminal summary: one line per gated test, its verdict first."""
        return aligned((t.label, f"{t.nodeid}{_tries(t)}{_why(t)}") for t in self.tests if t.verdict or t.repro)


def _tries(test: TestRecord) -> str:
    return f"  ({test.attempts} attempts)" if test.attempts > 1 else ""


def _why(test: TestRecord) -> str:
    """What the summary line says after the test: why its verdict, the fixes it stood on, what it measured."""
    word = test.verdict.value if test.verdict else test.outcome.upper()
    why = f"  -- {test.error}" if word in EXPLAINED else ""
    why += "".join(f"  (prerequisite fix for {p})" for p in test.prerequisites)
    return why + "".join(f"  ({m.brief})" for m in test.measurements)
