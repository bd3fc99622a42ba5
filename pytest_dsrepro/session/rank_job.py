"""What a world runs (``WorldCall``: a test's body or a ``run_in_world`` function, with its arguments, fixes and
rank fixtures), and the one place that makes a spawned rank's job of it (``rank_job``)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ..core import source
from ..core.gates import FIXED, Fix, holding, installed_deepspeed
from ..inrank.fixtures import RankFixture
from ..worlds.protocol import RankJob, TestRef
from .payload import payload
from .stash import MARKS_KEY, Prepared


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


def body_call(
    item: pytest.Function, function: Callable[..., Any], kwargs: dict[str, Any], prepared: Prepared
) -> WorldCall:
    """A world test's body: the fixes of its prerequisites and of its ``[fixed]`` variant, the rank fixtures it does
    not name; its reuse scope unless it is a nondeterministic series (fresh worlds, each run)."""
    marks = item.stash[MARKS_KEY]
    fixes = [c.fix for c in holding(marks.prerequisites, installed_deepspeed()) if c.fix is not None]
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
