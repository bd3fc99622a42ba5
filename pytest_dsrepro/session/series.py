"""A nondeterministic repro's series (``ds_nondeterministic``): up to ``runs`` worlds for one verdict, kept for the
judge, which counts the runs that failed as declared."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from ..core.errors import MarkerError
from ..core.gates import Ending, Nondeterministic, ending, installed_deepspeed
from ..core.outcome import WorldOutcome
from .stash import SERIES_KEY, Marks, Series


def run_series(
    item: pytest.Function, marks: Marks, plan: Nondeterministic, world: Callable[[int], WorldOutcome]
) -> WorldOutcome:
    """Up to ``plan.runs`` worlds, one after the other on the same fork server, kept for the judge; the one the
    user is shown. The series stops at a run that ended otherwise than passing or failing as declared (the verdict
    is UNEXPECTED then, whatever the others would do) or that the body skipped or xfailed."""
    version = installed_deepspeed()
    where = f"@pytest.mark.ds_version on {item.nodeid}"
    outcomes: list[WorldOutcome] = []
    started = time.monotonic()
    shown: WorldOutcome | None = None
    for run in range(plan.runs):
        outcome = world(run)
        outcomes.append(outcome)
        if outcome.declared is not None:
            shown = outcome
            break
        try:
            how = ending(marks.gates, marks.variant, version, outcome.failures, where) if version else Ending.OTHER
        except MarkerError:  # ranges that overlap: the judge says so
            how = Ending.OTHER
        if how is Ending.OTHER:
            shown = outcome
            break
        if shown is None and how is Ending.DECLARED:
            shown = outcome
    item.stash[SERIES_KEY] = Series(tuple(outcomes), time.monotonic() - started)
    return shown or outcomes[-1]
