"""``run_in_world``: a callable run in every rank of a world of its own, from a fixture (or a test in the pytest
process), apart from the test's own world.

What a test's ``ds_world`` marker gives its body, this gives any function: fresh ranks forked by the fork server,
rank fixtures set up in each rank, every rank's story when it fails, the world's timeout. A checkpoint saved by four
ranks and loaded by two is a fixture that runs the save in a 4-rank world and a 2-rank test that loads it.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest

from ..core.errors import HarnessError, MarkerError
from ..core.world_spec import WorldSpec, world_spec
from ..inrank.fixtures import RankFixture
from ..worlds.protocol import RankValue
from . import verdicts
from .backends import WORLD_BACKEND_KEY
from .rank_job import WorldCall, imports_deepspeed, reference
from .settings import SETTINGS_KEY
from .verdicts import WorldFailed


def run_in_world(
    request: pytest.FixtureRequest,
    function: Callable[..., object],
    *,
    size: int,
    kwargs: Mapping[str, Any] | None = None,
    usefixtures: Sequence[str] = (),
    backend: str | None = None,
    timeout: float | None = None,
    process_group: bool = True,
    launcher_env: bool = True,
) -> None:
    """Run ``function(**kwargs)`` in every rank of a fresh world of ``size`` ranks, and return once every rank did.

    ``function`` is found by the ranks by name, as test bodies are: a function defined at the top level of a module
    (a test module, a ``conftest.py``, an importable module), or a method of a top-level class, which each rank calls
    on a fresh instance made without arguments (as pytest makes test classes). ``kwargs`` are pickled and sent; rank
    fixtures among them (``request.getfixturevalue("name")``) are set up in each rank, as are the rank fixtures named
    in ``usefixtures``, before the call. A function that takes ``ds_rank``, ``ds_world_size`` or ``ds_device`` gets
    each rank's own.
    ``backend``, ``timeout``, ``process_group`` and ``launcher_env`` are those of ``ds_world``.

    A rank that fails fails the caller with every rank's story (``WorldFailed``: in a fixture, the test errors at
    setup); a ``pytest.skip()`` in the ranks skips the caller. Nothing comes back: ranks hand results on through
    files (``tmp_path`` is the same directory in every rank).
    """
    __tracebackhide__ = True
    options: dict[str, object] = {"size": size, "backend": backend, "timeout": timeout}
    options.update(process_group=process_group, launcher_env=launcher_env)
    where, spec, call = _planned(request, function, kwargs or {}, usefixtures, options)
    world_backend = request.config.stash[WORLD_BACKEND_KEY]
    try:
        outcome = world_backend.run(call, world_backend.own_world(spec, where))
    except HarnessError as exc:
        verdicts.fail_harness(f"run the world of {where}", exc)
    if outcome.passed:
        return
    if outcome.declared is not None:
        verdicts.declare(request.node, outcome.declared)
    raise WorldFailed(outcome, heading=f"the {spec.size}-rank world of {where} failed:")


def _planned(
    request: pytest.FixtureRequest,
    function: Callable[..., object],
    kwargs: Mapping[str, Any],
    usefixtures: Sequence[str],
    options: dict[str, object],
) -> tuple[str, WorldSpec, WorldCall]:
    """The call in words (what an error names), its world, and what the world runs: ``function`` as the ranks import
    it, with its arguments and rank fixtures. An argument that cannot be met fails the caller, naming it."""
    __tracebackhide__ = True
    module_name, qualname = _qualified(function)
    where = f"run_in_world({qualname}) in {request.node.nodeid}"
    try:
        spec = world_spec((), options, request.config.stash[SETTINGS_KEY], where)
        module, qualname, path = _importable(function, module_name, qualname, where)
        setup = _rank_fixtures(request, usefixtures, where)
    except MarkerError as exc:
        verdicts.fail(str(exc))
    test = reference(module, path, qualname, request.config)
    arguments = {**_rank_values(function), **kwargs}
    return where, spec, WorldCall(where, function, test, arguments, setup=setup, uses_deepspeed=imports_deepspeed(path))


def _qualified(function: Callable[..., object]) -> tuple[str, str]:
    """``(module, qualified name)`` of a function, or of a bound method by its instance's class (a method defined
    in a base class is found through the class the caller's instance has)."""
    owner = getattr(function, "__self__", None)
    if owner is not None and not isinstance(owner, type) and not inspect.ismodule(owner):
        cls = type(owner)
        return cls.__module__, f"{cls.__qualname__}.{function.__name__}"
    return getattr(function, "__module__", "?"), getattr(function, "__qualname__", repr(function))


def _importable(function: object, module_name: str, qualname: str, where: str) -> tuple[str, str, str]:
    """``(module, qualified name, file)`` by which the ranks import ``function``: refused, naming it, when a rank
    could not find it there (a nested function, a lambda, a module without a file)."""
    module = sys.modules.get(module_name)
    path = getattr(module, "__file__", None)
    if "<" in qualname or module is None or path is None:
        raise MarkerError(
            f"{where}: the ranks find the function by its module and name, so it must be defined at the top level of "
            f"a module with a file (or be a method of a top-level class); {qualname} in {module_name} is not"
        )
    found: Any = module
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if found is None:
        raise MarkerError(f"{where}: {module_name} has no {qualname}, so the ranks could not find {function!r}")
    return module_name, qualname, path


def _rank_values(function: Callable[..., object]) -> dict[str, RankValue]:
    """``ds_rank``/``ds_world_size``/``ds_device`` for a function that takes them: each rank's own, as the body gets
    them."""
    try:
        names = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return {}
    return {
        name: RankValue(name.removeprefix("ds_")) for name in ("ds_rank", "ds_world_size", "ds_device") if name in names
    }


def _rank_fixtures(request: pytest.FixtureRequest, names: Sequence[str], where: str) -> tuple[RankFixture, ...]:
    found = []
    for name in names:
        value = request.getfixturevalue(name)
        if not isinstance(value, RankFixture):
            raise MarkerError(f"{where}: usefixtures names {name!r}, which is not a rank fixture (@rank_fixture)")
        found.append(value)
    return tuple(found)
