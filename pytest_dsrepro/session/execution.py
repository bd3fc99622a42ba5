"""Running a test's body in its world: prepared at setup, executed in place of pytest's own call.

Spawned worlds (the normal case) fork fresh ranks from the fork server; under an external launcher (torchrun,
SLURM) the pytest process already is a rank and the body runs right here.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from dataclasses import dataclass
from typing import Any

import pytest

from ..worlds import launcher
from ..core.gates import FIXED, Verdict, common_fix, gates_of, installed_deepspeed, judge
from .markers import MarkerError, WorldSpec, settle_backend, world_spec
from ..core.outcome import ErrorInfo, RankResult, Status, WorldFailed, WorldOutcome, describe_failure
from ..worlds.rank import RankJob, TestRef
from .recording import JUDGEMENT_KEY
from .settings import SETTINGS_KEY
from ..worlds.client import WorldRunner

RUNNER_KEY = pytest.StashKey[WorldRunner]()


@dataclass(frozen=True)
class Prepared:
    spec: WorldSpec
    backend: str  # settled: gloo or nccl


PREPARED_KEY = pytest.StashKey[Prepared]()
OUTCOME_KEY = pytest.StashKey[WorldOutcome]()


def variant_of(item: pytest.Item) -> str | None:
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("ds_variant") if callspec is not None else None


def setup(item: pytest.Item) -> None:
    """Validate the world marker and settle the backend before any fixture runs (skips NCCL without GPUs)."""
    try:
        spec = world_spec(item, item.config.stash[SETTINGS_KEY])
    except MarkerError as exc:
        pytest.fail(str(exc), pytrace=False)
    if spec is None:
        return
    world = launcher.launched()
    if world is not None:
        if spec.size != world.world_size:
            pytest.skip(f"needs a {spec.size}-rank world; the launcher started {world.world_size} ranks")
        cuda_devices = launcher.cuda_devices()
    else:
        cuda_devices = item.config.stash[RUNNER_KEY].facts().cuda_devices
    backend, skip = settle_backend(spec.backend, spec.size, cuda_devices)
    if skip:
        pytest.skip(skip)
    item.stash[PREPARED_KEY] = Prepared(spec, backend)


def _payload(item: pytest.Function, kwargs: dict[str, Any], fixes: list[Any]) -> bytes:
    """Pickle what the ranks need, naming the fixture that cannot travel instead of failing deep in pickle."""
    for name, value in kwargs.items():
        try:
            pickle.dumps(value)
        except Exception as exc:  # noqa: BLE001 - whatever pickle raises, the fixture is named
            raise pytest.fail.Exception(
                f"{item.nodeid}: fixture or parameter {name!r} cannot be sent to the ranks "
                f"({type(exc).__name__}: {exc}); world tests receive only picklable values",
                pytrace=False,
            ) from None
    return pickle.dumps((kwargs, fixes))


def test_kwargs(item: pytest.Function) -> dict[str, Any]:
    """The arguments pytest would pass to the test function (as its own ``pytest_pyfunc_call`` computes them)."""
    return {name: item.funcargs[name] for name in item._fixtureinfo.argnames}


def fixes_of(item: pytest.Function) -> list[Any]:
    fix = common_fix(gates_of(item))
    return [fix] if fix is not None and variant_of(item) == FIXED else []


def call(item: pytest.Function) -> bool | None:
    """Run the body in its world; None leaves non-world tests to pytest."""
    prepared = item.stash.get(PREPARED_KEY, None)
    if prepared is None:
        return None
    kwargs, fixes = test_kwargs(item), fixes_of(item)
    if launcher.launched() is not None:
        outcome = launcher.run_here(item.obj, kwargs, fixes, prepared.spec, prepared.backend)
    else:
        module = item.module
        assert module is not None and module.__file__ is not None
        job = RankJob(
            test=TestRef(module.__name__, module.__file__, _qualname(item), tuple(sys.path), os.getcwd()),
            payload=_payload(item, kwargs, fixes),
            backend=prepared.backend,
            timeout=prepared.spec.timeout,
        )
        outcome = item.config.stash[RUNNER_KEY].run(job, prepared.spec.size)
    item.stash[OUTCOME_KEY] = outcome
    if outcome.passed:
        return True
    reason = outcome.skip_reason
    if reason is not None:
        pytest.skip(reason)
    raise WorldFailed(outcome)


def _qualname(item: pytest.Function) -> str:
    cls = getattr(item, "cls", None)
    name = item.originalname
    return f"{cls.__qualname__}.{name}" if cls is not None else name


def _failures(exc: BaseException | None) -> tuple[RankResult, ...]:
    if exc is None:
        return ()
    if isinstance(exc, WorldFailed):
        return exc.outcome.failures
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return (RankResult(0, Status.FAILED, error=ErrorInfo.from_exception(exc, text)),)


def judge_call(item: pytest.Function, exc: BaseException | None) -> None:
    """Turn the body's ending into the gate's verdict: xfail when reproduced, a failure when unexpected."""
    gates = gates_of(item)
    if not gates or isinstance(exc, (pytest.skip.Exception, pytest.xfail.Exception)):
        if exc is not None:
            raise exc
        return
    where = f"@pytest.mark.ds_version on {item.nodeid}"
    version = installed_deepspeed()
    if version is None:
        pytest.fail(f"{where}: DeepSpeed is not installed, so no release can be judged", pytrace=False)
    try:
        judgement = judge(gates, variant_of(item), version, _failures(exc), where)
    except MarkerError as error:
        pytest.fail(str(error), pytrace=False)
    item.stash[JUDGEMENT_KEY] = judgement
    if judgement.verdict is Verdict.REPRODUCED:
        pytest.xfail(judgement.message)
    if judgement.verdict is Verdict.UNEXPECTED:
        story = describe_failure(exc.outcome) if isinstance(exc, WorldFailed) else ""
        if exc is not None and not story:
            story = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        raise pytest.fail.Exception(f"{judgement.message}\n\n{story}".rstrip(), pytrace=False) from exc
