"""Running a test's body in its world, in place of the test function, and judging how it ended.

Setup parses the markers and has the session's worlds (``backends``) prepare the test; at call the body runs in a
world of that backend (a nondeterministic repro: a ``series`` of them); the gates then judge the ending, and the
verdict becomes pytest's outcome (``pytest_dsrepro_conclude``: the plugin's own, or a scan's).
"""

from __future__ import annotations

import dataclasses
import functools
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import pytest
from packaging.version import Version

from ..core.errors import HarnessError, MarkerError
from ..core.gates import Judgement, Reason, Verdict, holding, installed_deepspeed, judge_runs
from ..core.outcome import ErrorInfo, RankResult, Status, WorldOutcome, describe_failure
from ..worlds.client import RunStops
from . import markers, refusals
from .rank_job import body_call
from .series import run_series
from .skip_location import skip_at
from .stash import (
    JUDGEMENT_KEY,
    MARKS_KEY,
    OUTCOME_KEY,
    PREPARED_KEY,
    SERIES_KEY,
    SETTINGS_KEY,
    WORLDS_KEY,
    Marks,
    Prepared,
)

#: pytest's ``Failed``, which its public API names only as ``pytest.fail.Exception`` (mypy takes no such base).
_Failed = pytest.fail.Exception


class WorldFailed(_Failed):  # type: ignore[misc,valid-type]
    """A test failure raised in the pytest process for a failed world; keeps the structured outcome.

    A ``pytest.fail`` exception with ``pytrace=False``: pytest shows exactly the rank stories, not the plugin's frames.
    """

    __module__ = "builtins"  # as pytest's own Failed: the short summary reads "WorldFailed: ranks 0-1: ..."

    def __init__(self, outcome: WorldOutcome, heading: str = "") -> None:
        story = describe_failure(outcome)
        super().__init__(f"{heading}\n{story}" if heading else story, pytrace=False)
        self.outcome = outcome


def setup(item: pytest.Item) -> None:
    """Parse the markers once, and for a world test have the session's worlds prepare it before any fixture runs.

    Every input a test gives is checked before anything is spawned (a marker's arguments, a ``ds_config`` preset
    here; fixture values when the body is sent): on a cold cache the fork server's first start takes minutes.
    """
    settings = item.config.stash[SETTINGS_KEY]
    try:
        marks = markers.parse(item, settings)
        if settings.scan is None:  # a scan runs the user's config, which the scan judges against the premise
            markers.check_config(item, marks.premise)
    except MarkerError as exc:
        markers.fail(str(exc))
    item.stash[MARKS_KEY] = marks
    refusals.where_not_applicable(item, marks)
    if marks.world is None:
        return
    refusals.xunit_setup(item)
    item.stash[PREPARED_KEY] = item.config.stash[WORLDS_KEY].prepare(item, marks.world)


@contextmanager
def in_world(item: pytest.Function) -> Iterator[None]:
    """While pytest calls a world test, its function is one that runs the body in the world.

    pytest's own ``pytest_pyfunc_call`` still picks the arguments, so the body gets exactly what pytest would pass.
    """
    __tracebackhide__ = True
    prepared = item.stash.get(PREPARED_KEY, None)
    if prepared is None:
        yield
        return
    original = item.obj
    item.obj = functools.partial(_run, item, original, prepared)
    try:
        yield
    finally:
        item.obj = original


def _run(item: pytest.Function, function: Callable[..., Any], prepared: Prepared, **kwargs: Any) -> None:
    __tracebackhide__ = True
    call = body_call(item, function, kwargs, prepared)
    worlds = item.config.stash[WORLDS_KEY]

    def world(run: int) -> WorldOutcome:
        return worlds.run(call, prepared, run)

    plan = item.stash[MARKS_KEY].nondeterministic
    outcome = world(0) if plan is None else run_series(item, item.stash[MARKS_KEY], plan, world)
    item.stash[OUTCOME_KEY] = outcome
    if outcome.passed:
        _warn_returned(item.nodeid, function, outcome)
        return
    declared = outcome.declared
    if declared is not None:
        declare(item, declared)
    raise WorldFailed(outcome)


def declare(item: pytest.Item, result: RankResult) -> NoReturn:
    """Skip or xfail the test as the body did in its rank; a skip is reported at the body's line."""
    __tracebackhide__ = True
    if result.status is Status.XFAILED:
        pytest.xfail(result.detail)
    if result.where is None:
        pytest.skip(result.detail)
    skip_at(item, result.detail, *result.where)


def _warn_returned(nodeid: str, function: Callable[..., Any], outcome: WorldOutcome) -> None:
    """pytest's warning for a test that returns a value (its ranks' bodies return nothing to pytest), at the test."""
    returned = next((r.returned for r in outcome.ranks if r.returned), "")
    if returned:
        code = function.__code__
        warnings.warn_explicit(
            pytest.PytestReturnNotNoneWarning(
                f"Test functions should return None, but {nodeid} returned {returned} in its ranks.\n"
                "Did you mean to use `assert` instead of `return`?"
            ),
            None,
            code.co_filename,
            code.co_firstlineno,
        )


def _with_prerequisites(judgement: Judgement, marks: Marks, version: Version) -> Judgement:
    """The judgement, saying which other bugs' fixes the run had applied first (the verdict stands on them)."""
    applied = tuple(c.describe() for c in holding(marks.prerequisites, version))
    if not applied:
        return judgement
    note = f" (with the prerequisite fix for {'; '.join(applied)})"
    return dataclasses.replace(judgement, message=judgement.message + note, prerequisites=applied)


def _with_measurements(judgement: Judgement, outcome: WorldOutcome | None) -> Judgement:
    """The judgement, saying what the body timed against its reference (``inrank.perf``), with the margin."""
    measured = outcome.measurements if outcome is not None else ()
    if not measured:
        return judgement
    note = "".join(f"; measured: {m.describe()}" for m in measured)
    return dataclasses.replace(judgement, message=judgement.message + note)


def _failures(exc: BaseException | None) -> tuple[RankResult, ...]:
    if exc is None:
        return ()
    if isinstance(exc, WorldFailed):
        return exc.outcome.failures
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return (RankResult(0, Status.FAILED, error=ErrorInfo.from_exception(exc, text)),)


def _story(exc: BaseException | None) -> str:
    """What the user reads under a verdict: the world's story, else the exception's traceback ("" for a pass)."""
    story = describe_failure(exc.outcome) if isinstance(exc, WorldFailed) else ""
    if exc is not None and not story:
        story = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return story


def _judged(exc: BaseException | None) -> bool:
    """Is ``exc`` an ending of the body (a failure, a pass)? A skip or xfail stands as pytest's; Ctrl-C, pytest's
    exit and the like end the session, never judged (a test interrupted is no verdict). pytest's ``Failed`` (a world
    failed, a marker is wrong) derives from ``BaseException``, as ``xfail``'s does from it."""
    if isinstance(exc, (pytest.skip.Exception, pytest.xfail.Exception)):
        return False
    return exc is None or isinstance(exc, (Exception, pytest.fail.Exception))


def judge_call(item: pytest.Function, exc: BaseException | None) -> None:
    """The verdict on the body's ending: returns when pytest's own outcome stands, else raises the concluded one.

    A harness error (no world ran) fails the test as such and is never judged against the gates.
    """
    __tracebackhide__ = True
    if not _judged(exc):
        return
    marks = item.stash.get(MARKS_KEY, Marks(None, (), None, None))
    if isinstance(exc, RunStops):
        pytest.exit(f"pytest-dsrepro: {exc}", returncode=pytest.ExitCode.USAGE_ERROR)
    if isinstance(exc, HarnessError):
        if marks.gates:
            item.stash[JUDGEMENT_KEY] = Judgement(Reason.HARNESS_ERROR, f"no world ran: {exc}")
        markers.fail(f"pytest-dsrepro could not run this test's world: {exc}")
    if not marks.gates:
        return
    where = f"@pytest.mark.ds_version on {item.nodeid}"
    version = installed_deepspeed()
    if version is None:
        markers.fail(f"{where}: DeepSpeed is not installed, so no release can be judged")
    series = item.stash.get(SERIES_KEY, None)
    runs = [o.failures for o in series.outcomes] if series is not None else [_failures(exc)]
    try:
        judgement = judge_runs(
            marks.gates, marks.variant, version, runs, where, marks.nondeterministic, series.seconds if series else 0
        )
    except MarkerError as error:
        markers.fail(str(error))
    judgement = _with_measurements(_with_prerequisites(judgement, marks, version), item.stash.get(OUTCOME_KEY, None))
    item.stash[JUDGEMENT_KEY] = judgement
    item.config.hook.pytest_dsrepro_conclude(item=item, judgement=judgement, story=_story(exc))


def conclude(judgement: Judgement, story: str) -> bool:
    """The plugin's own outcome of a verdict: REPRODUCED is pytest's xfail, UNEXPECTED a failure saying what was
    expected, above the story; any other verdict is the body's own pass."""
    if judgement.verdict is Verdict.REPRODUCED:
        pytest.xfail(judgement.message)
    if judgement.verdict is Verdict.UNEXPECTED:
        markers.fail(f"{judgement.message}\n\n{story}".rstrip())
    return True
