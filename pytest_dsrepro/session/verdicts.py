"""A test's verdict and its pytest outcome, in one module, as pytest keeps skips and xfails in ``skipping.py``.

At setup a test is refused before any world (``refuse``; ``refuse_accelerator``: a CPU-only bug in an NCCL world).
After the body the gates judge how it ended (``judge``: the judgement kept on the item's stash for the record) and the
verdict becomes pytest's outcome through ``pytest_dsrepro_conclude`` (a plugin object's conclusion first, else the
plugin's own: ``conclude``). A world that failed fails the test with every rank's story (``WorldFailed``); a skip or
xfail the body raised in a rank stands (``declare``), reported at the body's line (``skip_at``, moved onto the report
by ``relocate``). A harness error (no world ran) fails the test as such (``fail_harness``), never judged against the
gates; a wrong marker fails it with the marker's own words (``fail``).
"""

from __future__ import annotations

import dataclasses
import os
import traceback
from dataclasses import dataclass
from typing import NoReturn

import pytest
from packaging.version import Version

from ..core.errors import HarnessError, MarkerError
from ..core.gates import FIXED, Judgement, Reason, Verdict, affecting, holding, installed_deepspeed, judge_runs
from ..core.outcome import ErrorInfo, RankResult, Status, WorldOutcome, describe_failure
from ..core.premises import Premise
from ..core.world_spec import accelerator_for
from ..worlds.client import RunStops
from .markers import MARKS_KEY, Marks

#: The test's verdict: decided at setup (NOT-APPLICABLE), after the body (``judge``), or for a harness error.
JUDGEMENT_KEY = pytest.StashKey[Judgement]()
#: Where a skip the harness raised is reported (``skip_at``): the body's line in its rank, or the test's.
SKIP_AT_KEY = pytest.StashKey[tuple[str, int]]()

#: pytest's xunit-style methods of a test class: they run in the pytest process, so what they set never reaches ranks.
XUNIT_METHODS = ("setup_method", "teardown_method", "setup_class", "teardown_class")

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


@dataclass(frozen=True)
class Series:
    """The worlds one nondeterministic verdict ran, in order, and their wall time all together."""

    outcomes: tuple[WorldOutcome, ...]
    seconds: float


# ---- failing and skipping -------------------------------------------------------------------------------------


def fail(message: str) -> NoReturn:
    """Fail the test (or its collection) with ``message`` alone: no traceback, no chained exception printed twice."""
    raise pytest.fail.Exception(message, pytrace=False) from None


def fail_harness(doing: str, error: HarnessError) -> NoReturn:
    """Fail the test for the harness's own error: pytest-dsrepro could not do ``doing`` (no world ran)."""
    fail(f"pytest-dsrepro could not {doing}: {error}")


def skip_at(item: pytest.Item, reason: str, path: str, line: int) -> NoReturn:
    """Skip ``item``, reported at ``path:line`` (1-based, as pytest's short summary shows it).

    pytest reports a skip at the frame that raised it, which for a skip the harness raises is the plugin's own code;
    the place is kept here and set on the report when it is made (``relocate``), as pytest's own skipping does.
    """
    __tracebackhide__ = True
    item.stash[SKIP_AT_KEY] = (path, line)
    raise pytest.skip.Exception(reason)


def skip_at_test(item: pytest.Item, reason: str) -> NoReturn:
    """Skip ``item``, reported at the test's definition, as a ``skipif`` marker's skip is."""
    __tracebackhide__ = True
    path, line, _ = item.reportinfo()
    skip_at(item, reason, str(path), (line or 0) + 1)


def relocate(item: pytest.Item, report: pytest.TestReport) -> None:
    """Put a skipped report at the place ``skip_at`` kept (once: a later phase of the test is not moved)."""
    where = item.stash.get(SKIP_AT_KEY, None)
    if where is None or not report.skipped or hasattr(report, "wasxfail") or not isinstance(report.longrepr, tuple):
        return
    del item.stash[SKIP_AT_KEY]
    report.longrepr = (*where, report.longrepr[2])


def declare(item: pytest.Item, result: RankResult) -> NoReturn:
    """Skip or xfail the test as the body did in its rank; a skip is reported at the body's line."""
    __tracebackhide__ = True
    if result.status is Status.XFAILED:
        pytest.xfail(result.detail)
    if result.where is None:
        pytest.skip(result.detail)
    skip_at(item, result.detail, *result.where)


# ---- at setup -------------------------------------------------------------------------------------------------


def not_applicable(marks: Marks, version: Version | None) -> Judgement | None:
    """NOT-APPLICABLE with the declared reasons, on a release the test declares out of its reach."""
    found = holding(marks.not_applicable, version)
    if not found:
        return None
    reasons = "; ".join(c.describe() for c in found)
    return Judgement(Reason.NOT_APPLICABLE, f"not applicable on deepspeed {version}: {reasons}")


def fix_not_needed(marks: Marks, version: Version | None) -> Judgement | None:
    """NOT-APPLICABLE for a ``[fixed]`` variant on a release outside every affected range: a fix is for the releases
    that have the bug; elsewhere its ``[stock]`` twin runs the same code (FIXED, NOT-YET-AFFECTED), and a second world
    would only run it again. Ranges that overlap are the ``[stock]`` twin's error to say, after its body."""
    if marks.variant != FIXED or version is None or affecting(marks.gates, version):
        return None
    ranges = " or ".join(gate.range for gate in marks.gates)
    return Judgement(
        Reason.NOT_APPLICABLE,
        f"not applicable on deepspeed {version}: the fix is for the affected releases ({ranges}); "
        "here the [stock] run is the test",
    )


def wrong_accelerator(premise: Premise | None, backend: str, accelerator: str) -> Judgement | None:
    """NOT-APPLICABLE, with why, in a world whose ranks run DeepSpeed's ``accelerator`` when the repro's premise names
    another as the only one its bug exists with: the code path it catches is not there, so its verdict would be about
    nothing (a ``cpu``-only bug in an NCCL world, whose ranks run ``cuda``)."""
    if premise is None or premise.accelerator is None or premise.accelerator == accelerator:
        return None
    return Judgement(
        Reason.NOT_APPLICABLE,
        f"not applicable in a {backend} world: its bug exists only with DeepSpeed's {premise.accelerator} "
        f"accelerator (its ds_premise), and this world's ranks run the {accelerator} one",
    )


def refuse_accelerator(item: pytest.Item, marks: Marks, backend: str) -> None:
    """A world test whose settled ``backend`` gives its ranks an accelerator its premise rules out gets no world
    (``wrong_accelerator``): reported as a skip at the test, as a release out of its reach is."""
    judgement = wrong_accelerator(marks.premise, backend, accelerator_for(backend, os.environ))
    if judgement is not None:
        item.stash[JUDGEMENT_KEY] = judgement
        skip_at_test(item, judgement.message)


def refuse(item: pytest.Item, marks: Marks) -> None:
    """Tests that get no world: a release declared out of reach, or a ``[fixed]`` variant outside the affected
    releases (reported by pytest as a skip at the test, since pytest has no other word for a test that did not run),
    and a world test with pytest's xunit-style methods (which fail it)."""
    version = installed_deepspeed()
    judgement = not_applicable(marks, version) or fix_not_needed(marks, version)
    if judgement is not None:
        item.stash[JUDGEMENT_KEY] = judgement
        skip_at_test(item, judgement.message)
    cls = getattr(item, "cls", None)
    found = [name for name in XUNIT_METHODS if callable(getattr(cls, name, None))]
    if marks.world is not None and cls is not None and found:
        fail(
            f"{item.nodeid}: {cls.__qualname__}.{found[0]} runs in the pytest process, not in the ranks, so what it "
            "sets on the instance or class never reaches them; in a world test use a fixture (its value is sent to "
            "every rank) or set up in the body"
        )


# ---- after the body -------------------------------------------------------------------------------------------


def _calls_for_verdict(exc: BaseException | None) -> bool:
    """Is ``exc`` an ending of the body the gates judge (a failure, a pass)? A skip or xfail stands as pytest's;
    Ctrl-C, pytest's exit and the like end the session, never judged (a test interrupted is no verdict). pytest's
    ``Failed`` (a world failed, a marker is wrong) derives from ``BaseException``, as ``xfail``'s does from it."""
    if isinstance(exc, (pytest.skip.Exception, pytest.xfail.Exception)):
        return False
    return exc is None or isinstance(exc, (Exception, pytest.fail.Exception))


def judge(item: pytest.Item, exc: BaseException | None, outcome: WorldOutcome | None, series: Series | None) -> None:
    """The verdict on the body's ending (``exc``; the world's ``outcome``, a nondeterministic repro's ``series``):
    returns when pytest's own outcome stands, else raises the concluded one.

    A harness error (no world ran) fails the test as such and is never judged against the gates.
    """
    __tracebackhide__ = True
    if not _calls_for_verdict(exc):
        return
    marks = item.stash.get(MARKS_KEY, Marks(None, (), None, None))
    if isinstance(exc, RunStops):
        pytest.exit(f"pytest-dsrepro: {exc}", returncode=pytest.ExitCode.USAGE_ERROR)
    if isinstance(exc, HarnessError):
        if marks.gates:
            item.stash[JUDGEMENT_KEY] = Judgement(Reason.HARNESS_ERROR, f"no world ran: {exc}")
        fail_harness("run this test's world", exc)
    if not marks.gates:
        return
    judgement = item.stash[JUDGEMENT_KEY] = _judgement(item.nodeid, marks, exc, outcome, series)
    item.config.hook.pytest_dsrepro_conclude(item=item, judgement=judgement, story=_story(exc))


def _judgement(
    nodeid: str, marks: Marks, exc: BaseException | None, outcome: WorldOutcome | None, series: Series | None
) -> Judgement:
    """The gates' judgement of the runs, with the prerequisites applied and what the body measured."""
    where = f"@pytest.mark.ds_version on {nodeid}"
    version = installed_deepspeed()
    if version is None:
        fail(f"{where}: DeepSpeed is not installed, so no release can be judged")
    runs = [o.failures for o in series.outcomes] if series is not None else [_failures(exc)]
    try:
        judgement = judge_runs(
            marks.gates, marks.variant, version, runs, where, marks.nondeterministic, series.seconds if series else 0
        )
    except MarkerError as error:
        fail(str(error))
    return _with_measurements(_with_prerequisites(judgement, marks, version), outcome)


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


def conclude(judgement: Judgement, story: str) -> bool:
    """The plugin's own outcome of a verdict: REPRODUCED is pytest's xfail, UNEXPECTED a failure saying what was
    expected, above the story; any other verdict is the body's own pass."""
    if judgement.verdict is Verdict.REPRODUCED:
        pytest.xfail(judgement.message)
    if judgement.verdict is Verdict.UNEXPECTED:
        fail(f"{judgement.message}\n\n{story}".rstrip())
    return True
