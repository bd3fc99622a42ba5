"""What a world runs (``WorldCall``: a test's body or a ``run_in_world`` function, with its arguments, fixes and
rank fixtures), and the one place that makes a spawned rank's job of it (``rank_job``): the function by reference
(ranks import its file anew, which must still hold the code pytest collected), the rest pickled once (``payload``)."""

from __future__ import annotations

import hashlib
import os
import pickle
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ..core import source
from ..core.errors import HarnessError
from ..core.gates import FIXED, Fix, holding, installed_deepspeed
from ..core.world_spec import WorldSpec
from ..inrank.fixtures import RankFixture
from ..worlds.protocol import RankJob, TestRef
from .markers import MARKS_KEY

#: Each test file's digest when pytest collected it (``remember``): ranks import the file again, which must still be
#: that code.
SOURCES_KEY = pytest.StashKey[dict[str, str | None]]()

#: pytest's own fixtures that live in the pytest process (they hold its capture, its logging, its request): what a
#: world test uses in their place. docs/writing-repros.md lists them too, and says why.
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


@dataclass(frozen=True)
class Prepared:
    """A world test, ready to run: its world and the backend settled for the devices at hand."""

    spec: WorldSpec
    backend: str  # gloo or nccl


@dataclass(frozen=True)
class WorldCall:
    """``function(**kwargs)`` in every rank, after the ``fixes`` and the rank fixtures in ``setup``."""

    where: str  # the test's node id, or the ``run_in_world`` call in words: what an error names
    function: Callable[..., Any]  # a launched rank calls it in place; spawned ranks import ``test``
    test: TestRef
    kwargs: dict[str, Any]
    fixes: tuple[Fix, ...] = ()
    setup: tuple[RankFixture, ...] = ()
    uses_deepspeed: bool = False  # DeepSpeed's comm layer bound in a world with a process group; a warm fork server
    reuse: str | None = None  # the tests that may run on the same spawned ranks, one after another


def rank_job(call: WorldCall, prepared: Prepared) -> RankJob:
    """The job every rank of a spawned world runs: the function by reference, the rest pickled (``payload``)."""
    spec = prepared.spec
    return RankJob(
        test=call.test, payload=payload(call.where, call.kwargs, call.fixes, call.setup), backend=prepared.backend,
        timeout=spec.timeout, deepspeed=call.uses_deepspeed and spec.process_group, warm=call.uses_deepspeed,
        process_group=spec.process_group, launcher_env=spec.launcher_env,
    )  # fmt: skip


def payload(where: str, kwargs: dict[str, Any], fixes: Sequence[Any], setup: tuple[RankFixture, ...] = ()) -> bytes:
    """Pickle what the ranks need, naming the fixture that cannot travel instead of failing deep in pickle; pytest's
    process-bound fixtures (``STAY_IN_PYTEST``) are refused with what to use instead.

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
        return pickle.dumps((kwargs, list(fixes), setup))
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


def body_call(
    item: pytest.Function, function: Callable[..., Any], kwargs: dict[str, Any], prepared: Prepared
) -> WorldCall:
    """A world test's body: the fixes of its prerequisites and of its ``[fixed]`` variant, the rank fixtures it does
    not name; its reuse scope unless it is a nondeterministic series (fresh worlds, each run)."""
    marks = item.stash[MARKS_KEY]
    # The installed release comes from its metadata (a walk of sys.path): read only where a prerequisite asks.
    held = holding(marks.prerequisites, installed_deepspeed()) if marks.prerequisites else ()
    fixes = [c.fix for c in held if c.fix is not None]
    fixes += [marks.fix] if marks.fix is not None and marks.variant == FIXED else []
    return WorldCall(
        item.nodeid, function, _test_reference(item), kwargs, tuple(fixes), unnamed_rank_fixtures(item, kwargs),
        uses_deepspeed(item), reuse=_reuse_scope(item, prepared) if marks.nondeterministic is None else None,
    )  # fmt: skip


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


def _test_reference(item: pytest.Function) -> TestRef:
    """The test by module file and qualified name: ranks import it themselves (functions are never pickled)."""
    module = item.module
    assert module is not None
    assert module.__file__ is not None
    cls = getattr(item, "cls", None)
    qualname = f"{cls.__qualname__}.{item.originalname}" if cls is not None else item.originalname
    return reference(module.__name__, module.__file__, qualname, item.config)


def remember(item: pytest.Item) -> None:
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


def check_unchanged(config: pytest.Config, path: str) -> None:
    """Refuse to run ranks that import ``path`` when it no longer holds the code pytest collected (edited while the
    run goes on), rather than run a body, fixes or markers pytest never saw."""
    collected = config.stash.get(SOURCES_KEY, {})
    if path in collected and _digest(path) != collected[path]:
        raise HarnessError(
            f"{path} changed since pytest collected it, so its ranks would run code pytest never saw; run pytest again"
        )


def reference(module: str, path: str, qualname: str, config: pytest.Config) -> TestRef:
    """A function (``qualname`` may name a method: the rank makes the instance) of the module at ``path``, with what
    a rank needs to import it as pytest did: ``sys.path``, the working directory, assertion rewriting."""
    rewrite = config.getoption("assertmode") == "rewrite"
    return TestRef(module, path, qualname, tuple(sys.path), os.getcwd(), rewrite)


_IMPORTS_DEEPSPEED = pytest.StashKey[bool]()


def uses_deepspeed(item: pytest.Item) -> bool:
    """Does the test use DeepSpeed: the plugin's engine fixtures, or DeepSpeed imported anywhere in its module? Its
    ranks then get DeepSpeed's comm layer bound, and start warm where the run has more than one such world.

    A module is read once, on its node, however many tests it holds: DeepSpeed's test files run to thousands of lines
    and hundreds of tests, each of which asks (13 s of reading over its whole suite, else)."""
    if not isinstance(item, pytest.Function):
        return False
    if not {"ds_engine", "ds_config"}.isdisjoint(item.fixturenames):
        return True
    module = item.getparent(pytest.Module)
    if module is None:
        return False
    if _IMPORTS_DEEPSPEED not in module.stash:
        module.stash[_IMPORTS_DEEPSPEED] = imports_deepspeed(str(module.path))
    return module.stash[_IMPORTS_DEEPSPEED]


def imports_deepspeed(path: str | None) -> bool:
    """Does the module at ``path`` import DeepSpeed (anywhere)?"""
    try:
        return path is not None and source.imports(Path(path).read_text(), "deepspeed")
    except OSError:
        return False
