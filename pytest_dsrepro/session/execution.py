"""Running a test's body in its world: prepared at setup, executed in place of the test function, then judged.

Spawned worlds (the normal case) fork fresh ranks from the fork server; under an external launcher (torchrun,
SLURM) the pytest process already is a rank and the body runs right here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import os
import pickle
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import pytest
from packaging.version import Version

from ..core import source
from ..core.errors import HarnessError, MarkerError
from ..core.gates import (
    FIXED,
    Ending,
    Judgement,
    Nondeterministic,
    Reason,
    Verdict,
    ending,
    holding,
    installed_deepspeed,
    judge_runs,
)
from ..core.options import Settings
from ..core.outcome import ErrorInfo, RankResult, Status, WorldOutcome, describe_failure
from ..core.paths import unwritable
from ..core.world_spec import settle_backend
from ..inrank.fixtures import RankFixture
from ..worlds import comm_op, launcher, leases
from ..worlds.client import RunStops, WorldInterrupted, WorldRunner
from ..worlds.protocol import RankJob, TestRef
from . import markers, scan, settings
from .launched import LAUNCHED_KEY
from .stash import (
    JUDGEMENT_KEY,
    MARKS_KEY,
    OUTCOME_KEY,
    PREPARED_KEY,
    SERIES_KEY,
    SETTINGS_KEY,
    SOURCES_KEY,
    Marks,
    Prepared,
    Series,
)

RUNNER_KEY = pytest.StashKey[WorldRunner]()

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


def progress_line(config: pytest.Config) -> Callable[[str], None]:
    """A line on the terminal, now, even mid-test: ``pytest-dsrepro: <text>``.

    pytest captures a test's output at the file-descriptor level, so the line is written with capturing suspended,
    as pytest's own live logging does (the capture manager reached through the plugin manager, by its registered
    name, as pytest-timeout does). Silent where there is no terminal reporter (``-p no:terminal``, xdist workers).
    """

    def write(text: str) -> None:
        if not config.pluginmanager.has_plugin("terminalreporter"):
            return
        capture = config.pluginmanager.getplugin("capturemanager")
        suspended = getattr(capture, "global_and_fixture_disabled", contextlib.nullcontext)
        writer = config.get_terminal_writer()
        with suspended():
            writer.line()
            writer.line(f"pytest-dsrepro: {text}", bold=True)
            writer.flush()

    return write


def world_runner(config: pytest.Config, resolved: Settings) -> WorldRunner:
    return WorldRunner(
        resolved.cache_dir, resolved.startup_timeout, progress=progress_line(config), gpu_wait=resolved.gpu_wait
    )


@contextmanager
def starting_worlds(config: pytest.Config) -> Iterator[None]:
    """For a run whose tests are nearly all DeepSpeed worlds (``pytest_dsrepro.upstream``), around its earliest
    work: make the world runner and start its fork server, whose import of torch and DeepSpeed (seconds) then
    overlaps pytest's own and its collection. Should the block raise (the run ends before ``pytest_configure``, so
    before anything stops the server), the server is stopped. Not for a run that starts no world (collection only,
    help, an xdist controller), nor for a launcher's rank (no fork server there); bad options are left for
    ``pytest_configure`` to report, once."""
    known = config.known_args_namespace
    no_world = any(getattr(known, name, None) for name in ("collectonly", "help", "version", "numprocesses"))
    try:
        resolved = None if no_world or launcher.launched() else settings.resolve(config, namespace=known)
    except pytest.UsageError:
        resolved = None
    if resolved is None:
        yield
        return
    runner = config.stash[RUNNER_KEY] = world_runner(config, resolved)
    runner.launch()
    try:
        yield
    except BaseException:
        del config.stash[RUNNER_KEY]
        runner.close()
        raise


def check_cache(session: pytest.Session) -> None:
    """Once the run's tests are known, before the first: a cache directory that can serve no world stops a run that
    has world tests, in one line, rather than failing each of them; a read-only one that holds builds is said."""
    config = session.config
    if config.option.collectonly or not any(item.get_closest_marker("ds_world") for item in session.items):
        return
    cache = config.stash[SETTINGS_KEY].cache_dir
    why = unwritable(cache)
    if why is None:
        return
    if not comm_op.holds_builds(cache):
        raise pytest.UsageError(  # one line, as every startup error: pytest.exit() here reads "! Exit: ... !"
            f"pytest-dsrepro: the cache directory {cache} cannot be written ({why}) and holds no build of DeepSpeed's "
            "comm op for worlds to use: point --ds-cache-dir (or DSREPRO_CACHE_DIR) at a writable directory"
        )
    progress_line(config)(f"the cache directory {cache} cannot be written ({why}): worlds use the builds it holds")


def setup(item: pytest.Item) -> None:
    """Parse the markers once, and for a world test settle its backend before any fixture runs.

    Every input a test gives is checked before anything is spawned (a marker's arguments, a ``ds_config`` preset
    here; fixture values when the body is sent): on a cold cache the fork server's first start takes minutes.
    """
    try:
        marks = markers.parse(item, item.config.stash[SETTINGS_KEY])
        if not scan.active(item):  # a scan runs the user's config, not the repro's own
            markers.check_config(item, marks.premise)
    except MarkerError as exc:
        markers.fail(str(exc))
    item.stash[MARKS_KEY] = marks
    _refuse_where_not_applicable(item, marks)
    spec = marks.world
    if spec is None:
        scan.setup(item, marks, None)
        return
    _refuse_xunit_setup(item)
    launched_run = item.config.stash.get(LAUNCHED_KEY, None)
    if launched_run is not None:  # torchrun made this process a rank: lockstep, this node's devices
        item.stash[PREPARED_KEY] = launched_run.prepare(item, spec)
        scan.setup(item, marks, item.stash[PREPARED_KEY])
        return
    try:
        cuda_devices = item.config.stash[RUNNER_KEY].cuda_devices()
    except HarnessError as exc:
        markers.fail(f"pytest-dsrepro could not start its fork server: {exc}")
    backend, skip = settle_backend(spec.backend, spec.size, cuda_devices)
    if skip:
        pytest.skip(skip)
    item.stash[PREPARED_KEY] = Prepared(spec, backend)
    scan.setup(item, marks, item.stash[PREPARED_KEY])


def _refuse_where_not_applicable(item: pytest.Item, marks: Marks) -> None:
    """A release the test declares out of its reach: no world, the verdict NOT-APPLICABLE with the declared reason
    (reported by pytest as a skip, since pytest has no other word for a test that did not run)."""
    version = installed_deepspeed()
    found = holding(marks.not_applicable, version)
    if found:
        reasons = "; ".join(c.describe() for c in found)
        judgement = Judgement(Reason.NOT_APPLICABLE, f"not applicable on deepspeed {version}: {reasons}")
        item.stash[JUDGEMENT_KEY] = judgement
        path, line, _ = item.reportinfo()  # reported at the test, not here
        _raise_at(pytest.skip.Exception(judgement.message), str(path), (line or 0) + 1)


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


#: pytest's xunit-style methods of a test class: they run in the pytest process, so what they set never reaches ranks.
XUNIT_METHODS = ("setup_method", "teardown_method", "setup_class", "teardown_class")


def _refuse_xunit_setup(item: pytest.Item) -> None:
    cls = getattr(item, "cls", None)
    found = [name for name in XUNIT_METHODS if callable(getattr(cls, name, None))]
    if cls is not None and found:
        markers.fail(
            f"{item.nodeid}: {cls.__qualname__}.{found[0]} runs in the pytest process, not in the ranks, so what it "
            "sets on the instance or class never reaches them; in a world test use a fixture (its value is sent to "
            "every rank) or set up in the body"
        )


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
    marks = item.stash[MARKS_KEY]
    fixes = [c.fix for c in holding(marks.prerequisites, installed_deepspeed()) if c.fix is not None]
    fixes += [marks.fix] if marks.fix is not None and marks.variant == FIXED else []
    spec = prepared.spec
    uses = uses_deepspeed(item)
    deepspeed = uses and spec.process_group  # DeepSpeed's comm layer bound to the world's group
    setup = unnamed_rank_fixtures(item, kwargs)
    launched_run = item.config.stash.get(LAUNCHED_KEY, None)
    world: Callable[[int], WorldOutcome]
    if launched_run is not None:

        def world(run: int) -> WorldOutcome:
            return launched_run.run(function, kwargs, fixes, prepared, deepspeed=deepspeed, run=run, setup=setup)

    else:
        _check_unchanged(item)
        job = RankJob(
            test=_reference(item), payload=payload(item.nodeid, kwargs, fixes, setup), backend=prepared.backend,
            timeout=spec.timeout, deepspeed=deepspeed, warm=uses, process_group=spec.process_group,
            launcher_env=spec.launcher_env,
        )  # fmt: skip
        runner = item.config.stash[RUNNER_KEY]
        reuse = _reuse_scope(item, prepared) if marks.nondeterministic is None else None  # a series: fresh worlds

        def world(run: int) -> WorldOutcome:
            return run_spawned(runner, job, spec.size, reuse)

    plan = marks.nondeterministic
    outcome = world(0) if plan is None else _series(item, marks, plan, world)
    item.stash[OUTCOME_KEY] = outcome
    if outcome.passed:
        _warn_returned(item.nodeid, function, outcome)
        return
    declared = outcome.declared
    if declared is not None:
        declare(declared)
    raise WorldFailed(outcome)


def _series(
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


def declare(result: RankResult) -> NoReturn:
    """Skip or xfail the test as the body did in its rank, reported at the body's line."""
    __tracebackhide__ = True
    reason = result.detail
    exc = pytest.xfail.Exception(reason) if result.status is Status.XFAILED else pytest.skip.Exception(reason)
    if result.where is None:
        raise exc
    _raise_at(exc, *result.where)


def _raise_at(exc: BaseException, path: str, line: int) -> NoReturn:
    """Raise ``exc`` as if from ``path:line``: pytest reports a skip where its traceback ends, so the exception is
    raised from a one-line code object compiled with that file and line."""
    __tracebackhide__ = True
    exec(compile("\n" * (line - 1) + "raise exc", path, "exec"), {"exc": exc})
    raise AssertionError("unreachable")  # pragma: no cover - the exec above always raises


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


def unnamed_rank_fixtures(item: pytest.Function, kwargs: dict[str, Any]) -> tuple[RankFixture, ...]:
    """The rank fixtures of the test's closure that the body does not name (autouse, ``usefixtures``), in pytest's
    order: every rank sets them up before the body's own."""
    values = [item.funcargs.get(name) for name in item.fixturenames if name not in kwargs]
    return tuple(v for v in values if isinstance(v, RankFixture))


def _reuse_scope(item: pytest.Function, prepared: Prepared) -> str | None:
    """The tests that may run on the same ranks, one after another: those under the ``ds_world(reuse=True)`` marker's
    node (a class, a module; on a test function, its parametrized instances), in the same world."""
    spec = prepared.spec
    if not spec.reuse:
        return None
    node, _ = next(item.iter_markers_with_node("ds_world"))
    scope = node.nodeid if node is not item else f"{item.parent.nodeid if item.parent else ''}::{item.originalname}"
    return f"{scope} [{spec.size} {prepared.backend} {spec.timeout:g}s]"


def run_spawned(runner: WorldRunner, job: RankJob, size: int, reuse: str | None = None) -> WorldOutcome:
    """The world's outcome. A test failure raised meanwhile (pytest-timeout's) fails the test with its own words
    followed by the world's story, every rank's stack included, instead of a traceback through the plugin."""
    try:
        return runner.run(job, size, reuse)
    except leases.Busy as busy:  # other workers' or sessions' worlds held the GPUs for longer than --ds-gpu-wait
        pytest.skip(str(busy))
    except WorldInterrupted as interrupted:
        cause = interrupted.cause
        if isinstance(cause, pytest.fail.Exception):
            raise WorldFailed(interrupted.outcome, heading=str(cause.msg)) from None
        raise cause from None


def _reference(item: pytest.Function) -> TestRef:
    """The test by module file and qualified name: ranks import it themselves (functions are never pickled)."""
    module = item.module
    assert module is not None
    assert module.__file__ is not None
    cls = getattr(item, "cls", None)
    qualname = f"{cls.__qualname__}.{item.originalname}" if cls is not None else item.originalname
    return reference(module.__name__, module.__file__, qualname, item.config)


def reference(module: str, path: str, qualname: str, config: pytest.Config) -> TestRef:
    """A function (``qualname`` may name a method: the rank makes the instance) of the module at ``path``, with what
    a rank needs to import it as pytest did: ``sys.path``, the working directory, assertion rewriting."""
    rewrite = config.getoption("assertmode") == "rewrite"
    return TestRef(module, path, qualname, tuple(sys.path), os.getcwd(), rewrite)


def remember_source(item: pytest.Item) -> None:
    """Note what the item's file holds as pytest collects it (just after importing it)."""
    path = getattr(getattr(item, "module", None), "__file__", None)
    sources = item.config.stash.setdefault(SOURCES_KEY, {})
    if path is not None and path not in sources:
        sources[path] = _digest(path)


def _digest(path: str) -> str | None:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def _check_unchanged(item: pytest.Function) -> None:
    """Ranks import the test's file anew: refuse to run when it no longer holds the code pytest collected (edited
    while the run goes on), rather than run a body, fixes or markers pytest never saw."""
    path = item.module.__file__ if item.module is not None else None
    collected = item.config.stash.get(SOURCES_KEY, {})
    if path is not None and path in collected and _digest(path) != collected[path]:
        raise HarnessError(
            f"{path} changed since pytest collected it, so its ranks would run code pytest never saw; run pytest again"
        )


def uses_deepspeed(item: pytest.Item) -> bool:
    """Does the test use DeepSpeed: the plugin's engine fixtures, or DeepSpeed imported anywhere in its module? Its
    ranks then get DeepSpeed's comm layer bound, and start warm where the run has more than one such world."""
    if not isinstance(item, pytest.Function):
        return False
    return not {"ds_engine", "ds_config"}.isdisjoint(item.fixturenames) or imports_deepspeed(
        getattr(item.module, "__file__", None)
    )


def imports_deepspeed(path: str | None) -> bool:
    """Does the module at ``path`` import DeepSpeed (anywhere)?"""
    try:
        return path is not None and source.imports(Path(path).read_text(), "deepspeed")
    except OSError:
        return False


def plan_worlds(session: pytest.Session) -> None:
    """Once the run's tests are known, tell the world runner how many are worlds, and whether more than one world
    will use DeepSpeed (a ``ds_nondeterministic`` test runs a series of them): ``WorldRunner.plan``."""
    worlds = deepspeed_worlds = 0
    for item in session.items:
        if item.get_closest_marker("ds_world") is None:
            continue
        worlds += 1
        if deepspeed_worlds < 2 and uses_deepspeed(item):
            deepspeed_worlds += 2 if item.get_closest_marker("ds_nondeterministic") is not None else 1
    session.config.stash[RUNNER_KEY].plan(worlds, deepspeed_worlds)


#: pytest's own fixtures that live in the pytest process (they hold its capture, its logging, its request): what a
#: world test uses in their place. docs/writing-repros.md lists them too.
STAY_IN_PYTEST = {
    "capsys": "capture in the body with contextlib.redirect_stdout(io.StringIO()); a failing rank's own output is "
    "shown with the failure anyway",
    "capfd": "capture in the body (contextlib.redirect_stdout); a failing rank's own output is shown with the failure",
    "capsysbinary": "capture in the body (contextlib.redirect_stdout)",
    "capfdbinary": "capture in the body (contextlib.redirect_stdout)",
    "caplog": "add a logging.Handler in the body, or in a rank fixture (@rank_fixture) that yields it",
    "recwarn": "use warnings.catch_warnings(record=True) in the body",
    "request": "take the values you need through fixtures (their values are sent), or use a rank fixture",
    "pytestconfig": "read the options you need in a fixture and take its value",
    "tmp_path_factory": "take tmp_path (one directory for every rank), or a fixture that returns a path",
    "tmpdir_factory": "take tmp_path (one directory for every rank), or a fixture that returns a path",
}


def payload(where: str, kwargs: dict[str, Any], fixes: list[Any], setup: tuple[RankFixture, ...] = ()) -> bytes:
    """Pickle what the ranks need, naming the fixture that cannot travel instead of failing deep in pickle.

    Pickled once; each value is tried on its own only when that fails, to name the culprit.
    """
    staying = [name for name in kwargs if name in STAY_IN_PYTEST]
    if staying:
        name = staying[0]
        raise HarnessError(
            f"{where}: pytest's fixture {name!r} lives in the pytest process and cannot reach the ranks; in a "
            f"world test, {STAY_IN_PYTEST[name]}"
        )
    try:
        return pickle.dumps((kwargs, fixes, setup))
    except Exception:  # whatever pickle raises (it re-raises), the fixture is named below
        named = {**{f.qualname: f for f in setup}, **kwargs}
        for name, value in named.items():
            try:
                pickle.dumps(value)
            except Exception as exc:  # noqa: BLE001
                raise HarnessError(
                    f"{where}: fixture or parameter {name!r} cannot be sent to the ranks "
                    f"({type(exc).__name__}: {exc}); world tests receive only picklable values"
                ) from None
        raise


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
    """The verdict on the body's ending: returns when pytest's own outcome stands, else raises the judged one.

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
    story = _story(exc)
    if scan.active(item):
        scan.conclude(item, judgement, story)
        return
    if judgement.verdict is Verdict.REPRODUCED:
        pytest.xfail(judgement.message)
    if judgement.verdict is Verdict.UNEXPECTED:
        markers.fail(f"{judgement.message}\n\n{story}".rstrip())
