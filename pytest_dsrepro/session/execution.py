"""Running a test's body in its world, in place of the test function.

Setup parses the markers, refuses what gets no world (``verdicts.refuse``) and has the session's world backend
(``backends``) prepare a world test, refused too where that backend's accelerator is one its premise rules out; the
``ds_config`` fixture resolves the test's config for that world; at call the body runs in a world of that backend (a
nondeterministic repro: a series of them, for one verdict); how it ended goes to the judge (``verdicts.judge``).
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from ..core import configs
from ..core.configs import ResolvedConfig
from ..core.errors import MarkerError
from ..core.gates import Ending, ending, installed_deepspeed
from ..core.outcome import WorldOutcome
from . import markers, verdicts
from .backends import WORLD_BACKEND_KEY
from .markers import MARKS_KEY, Marks
from .rank_job import Prepared, body_call
from .settings import SETTINGS_KEY
from .verdicts import Series, WorldFailed

#: A world test's world, settled at setup: absent for a test that is no world test.
PREPARED_KEY = pytest.StashKey[Prepared]()
#: The ``ds_config`` fixture's value, as resolved for the test's world (``resolve_config``).
CONFIG_KEY = pytest.StashKey[ResolvedConfig]()
#: The world the body ran in (of a series, the one the user is shown).
OUTCOME_KEY = pytest.StashKey[WorldOutcome]()
#: A nondeterministic repro's series of worlds, for its one verdict.
SERIES_KEY = pytest.StashKey[Series]()


def setup(item: pytest.Item) -> None:
    """Parse the markers once, and for a world test have the session's world backend prepare it before any fixture
    runs.

    Every input a test gives is checked before anything is spawned (a marker's arguments, a ``ds_config`` preset
    here; fixture values when the body is sent): on a cold cache the fork server's first start takes minutes.
    """
    try:
        marks = markers.settle(item, item.config.stash[SETTINGS_KEY])
    except MarkerError as exc:
        verdicts.fail(str(exc))
    verdicts.refuse(item, marks)
    if marks.world is not None:
        prepared = item.stash[PREPARED_KEY] = item.config.stash[WORLD_BACKEND_KEY].prepare(item, marks.world)
        verdicts.refuse_accelerator(item, marks, prepared.backend)


def require_world(request: pytest.FixtureRequest, fixture: str) -> None:
    """A fixture that only a world's ranks can give fails a test that is no world test."""
    if PREPARED_KEY not in request.node.stash:
        verdicts.fail(f"{request.node.nodeid}: fixture {fixture!r} exists only in world tests (@pytest.mark.ds_world)")


def resolve_config(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The ``ds_config`` fixture's value: the test id's entry (or the config a plugin runs in its place,
    ``pytest_dsrepro_config``) resolved for the test's world, kept for the record (``CONFIG_KEY``)."""
    item = request.node
    param = getattr(request, "param", None)
    if param is None:
        verdicts.fail(f"{item.nodeid}: ds_config needs @pytest.mark.ds_config('zero3', ...) on the test")
    name, spec = param
    given = item.config.hook.pytest_dsrepro_config(item=item)
    spec = spec if given is None else given
    prepared = item.stash.get(PREPARED_KEY, None)
    size = prepared.spec.size if prepared else item.config.stash[SETTINGS_KEY].world_size
    try:
        resolved = configs.resolve(spec, name, size, prepared.backend if prepared else "gloo")
    except configs.ConfigError as exc:
        verdicts.fail(f"@pytest.mark.ds_config on {item.nodeid}: {exc}")
    item.stash[CONFIG_KEY] = resolved
    return resolved.config


def call(item: pytest.Function) -> Generator[None, object, object]:
    """pytest's call of a test, as a hook wrapper runs it: a world test's function replaced by its world while
    pytest calls it, then the ending judged (a pass too), whatever pytest's own call raised."""
    __tracebackhide__ = True
    with _in_world(item):
        try:
            result = yield
        except BaseException as exc:
            _judge(item, exc)
            raise
    _judge(item, None)
    return result


def _judge(item: pytest.Function, exc: BaseException | None) -> None:
    __tracebackhide__ = True
    verdicts.judge(item, exc, item.stash.get(OUTCOME_KEY, None), item.stash.get(SERIES_KEY, None))


@contextmanager
def _in_world(item: pytest.Function) -> Iterator[None]:
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
    world_backend = item.config.stash[WORLD_BACKEND_KEY]

    def world(run: int) -> WorldOutcome:
        return world_backend.run(call, prepared, run)

    marks = item.stash[MARKS_KEY]
    runs = marks.nondeterministic.runs if marks.nondeterministic is not None else None
    outcome = world(0) if runs is None else _series(item, marks, runs, world)
    item.stash[OUTCOME_KEY] = outcome
    if outcome.passed:
        _warn_returned(item.nodeid, function, outcome)
        return
    declared = outcome.declared
    if declared is not None:
        verdicts.declare(item, declared)
    raise WorldFailed(outcome)


def _series(item: pytest.Function, marks: Marks, runs: int, world: Callable[[int], WorldOutcome]) -> WorldOutcome:
    """A nondeterministic repro (``ds_nondeterministic``): up to ``runs`` worlds, one after the other on the
    same fork server, kept for the judge, which counts the runs that failed as declared; the one the user is shown.
    The series stops at a run that ended otherwise than passing or failing as declared (the verdict is UNEXPECTED
    then, whatever the others would do) or that the body skipped or xfailed."""
    version = installed_deepspeed()
    where = f"@pytest.mark.ds_version on {item.nodeid}"
    outcomes: list[WorldOutcome] = []
    started = time.monotonic()
    shown: WorldOutcome | None = None
    for run in range(runs):
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
