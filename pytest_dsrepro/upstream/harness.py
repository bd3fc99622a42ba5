"""DeepSpeed's own test harness (``tests/unit/common.py``: ``DistributedTest``, ``DistributedFixture``) read as this
plugin's worlds, through its public API only.

Upstream's classes say what world a test wants in class attributes (``world_size``, ``init_distributed``,
``set_dist_env``, ``exec_timeout``, ``backend``, ``reuse_dist_env``) and per method (``@pytest.mark.world_size(n)``);
here they become ``ds_world`` markers. The harness launches processes in two ``__call__`` methods only, replaced for
the session (``install``) by a test run as pytest runs it (in the plugin's world) and a fixture run in a world of its
own (``run_in_world``). Nothing of upstream's file is copied or edited; its classes are found by their names.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Iterator
from typing import Any

import pytest

#: Upstream's class names, the same in every release with this harness (0.14 to 0.19 and master).
EXEC, TEST, FIXTURE = "DistributedExec", "DistributedTest", "DistributedFixture"
#: Upstream's kill switch for reused worlds, honoured as its harness honours it.
NO_REUSE = "DS_DISABLE_REUSE_DIST_ENV"
#: Backends a ``backend`` class attribute may pin; others (``ccl``, ``hccl``) leave the plugin's choice.
BACKENDS = ("gloo", "nccl")


def _named(cls: type, name: str) -> type | None:
    return next((c for c in cls.__mro__ if c.__name__ == name), None)


def is_dist_test(obj: object) -> bool:
    """A ``DistributedTest`` subclass (upstream's flag ``is_dist_test``)."""
    return isinstance(obj, type) and bool(getattr(obj, "is_dist_test", False)) and _named(obj, TEST) is not None


def is_dist_fixture(obj: object) -> bool:
    """A ``DistributedFixture`` subclass (upstream's flag ``is_dist_fixture``), not the base class itself."""
    return isinstance(obj, type) and bool(getattr(obj, "is_dist_fixture", False)) and obj.__name__ != FIXTURE


def _set_by_test(cls: type, name: str) -> bool:
    """Did the test's own classes (below upstream's ``DistributedExec``) set ``name``?"""
    base = _named(cls, EXEC)
    for c in cls.__mro__:
        if c is base:
            return False
        if name in vars(c):
            return True
    return False


def world(cls: type, size: object = None) -> dict[str, Any]:
    """The ``ds_world`` arguments of an upstream test or fixture class: its size (``size`` in place of the class's,
    for a fixture's one world of a list), process group and launcher variables as ``init_distributed`` and
    ``set_dist_env`` say, its own ``exec_timeout`` and ``backend`` when it sets them (else the plugin's), ``reuse``
    as ``reuse_dist_env`` (off under ``DS_DISABLE_REUSE_DIST_ENV=1``, as upstream's harness does)."""
    size = cls.world_size if size is None else size  # type: ignore[attr-defined]
    found: dict[str, Any] = {
        "size": list(size) if isinstance(size, (list, tuple)) else size,
        "process_group": bool(getattr(cls, "init_distributed", True)),
        "launcher_env": bool(getattr(cls, "set_dist_env", True)),
        "reuse": bool(getattr(cls, "reuse_dist_env", False)) and os.environ.get(NO_REUSE, "0") != "1",
    }
    if _set_by_test(cls, "exec_timeout"):
        found["timeout"] = float(cls.exec_timeout)  # type: ignore[attr-defined]
    if _set_by_test(cls, "backend") and getattr(cls, "backend", None) in BACKENDS:
        found["backend"] = cls.backend  # type: ignore[attr-defined]
    return found


def method_world_sizes(cls: type) -> Iterator[tuple[Any, int]]:
    """``(function, size)`` for each test method with upstream's ``@pytest.mark.world_size(n)`` (the first such mark
    of the function itself, which is what upstream's harness reads)."""
    for name, value in inspect.getmembers(cls, inspect.isfunction):
        if not name.startswith("test"):
            continue
        sizes = [m.args[0] for m in getattr(value, "pytestmark", []) if m.name == "world_size" and m.args]
        if sizes:
            yield value, sizes[0]


def mark_world_sizes(cls: type) -> None:
    """Give each method that carries ``world_size(n)`` a ``ds_world(size=n)`` of its own (merged over the class's
    ``ds_world``), once: a method inherited by several classes is marked for all of them alike."""
    for function, size in method_world_sizes(cls):
        if not any(m.name == "ds_world" for m in getattr(function, "pytestmark", [])):
            pytest.mark.ds_world(size=size)(function)


def requires_accelerator_skip(cls: type | None) -> str | None:
    """Upstream's skip for ``requires_cuda_env`` classes where DeepSpeed's accelerator is not available (on a CPU
    DeepSpeed's CPU accelerator is, so nothing skips there), with upstream's reason."""
    if not getattr(cls, "requires_cuda_env", False):
        return None
    from deepspeed.accelerator import get_accelerator  # the tests' own modules imported it already

    return None if get_accelerator().is_available() else "only supported in accelerator environments."


def fixture_arguments(request: pytest.FixtureRequest, function: Any) -> dict[str, Any]:
    """What upstream's harness passes a fixture's ``run``: each of its arguments that pytest can resolve as a fixture
    for this test (the test must use the parametrized ones itself, as upstream documents)."""
    found = {}
    for name in inspect.signature(function).parameters:
        with contextlib.suppress(pytest.FixtureLookupError):  # an argument with a default, as upstream allows
            found[name] = request.getfixturevalue(name)
    return found


def run_test(self: Any, request: pytest.FixtureRequest) -> None:
    """In place of ``DistributedTest.__call__``, which upstream's conftest.py calls for every such test: run the
    test as pytest runs it, which the plugin does in the test's world. (The conftest then makes the test's own run a
    no-op, so the body runs once.)"""
    __tracebackhide__ = True
    request.node.runtest()


def run_fixture(self: Any, request: pytest.FixtureRequest) -> None:
    """In place of ``DistributedExec.__call__``, which runs a ``DistributedFixture`` (by name, and in the newer
    ``SomeFixture()(request)`` form): its ``run`` in a world of each of its sizes, one after the other."""
    __tracebackhide__ = True
    from ..api import run_in_world  # the pytest side of the public API, only where a fixture runs

    cls = type(self)
    skip = requires_accelerator_skip(cls)
    if skip is not None:
        pytest.skip(skip)
    kwargs = fixture_arguments(request, self.run)
    sizes = cls.world_size if isinstance(cls.world_size, (list, tuple)) else [cls.world_size]
    for size in sizes:
        options = world(cls, size)
        options.pop("reuse")  # a fixture's world is its own
        run_in_world(request, self.run, kwargs=kwargs, **options)


def install(cls: type, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Replace the ``__call__`` of upstream's harness found in ``cls``'s bases, for the session (``monkeypatch`` is
    undone when pytest ends). False when ``cls`` is not part of that harness.

    Upstream's conftest.py runs each ``DistributedTest`` by calling ``item.cls()(request)``, and a fixture written as
    ``SomeFixture()(request)`` calls the same ``__call__``: those two ``__call__`` methods are the one place where
    DeepSpeed's harness launches processes (``run_test``, ``run_fixture`` take their place)."""
    test, base = _named(cls, TEST), _named(cls, EXEC)
    done = False
    if test is not None and test.__dict__.get("__call__") is not run_test:
        monkeypatch.setattr(test, "__call__", run_test)
        done = True
    if base is not None and base.__dict__.get("__call__") is not run_fixture:
        monkeypatch.setattr(base, "__call__", run_fixture)
        done = True
    return done


def distributed_fixture(name: str, default: type) -> Any:
    """A pytest fixture named ``name`` that runs the test module's ``DistributedFixture`` class of that name (else
    ``default``, the class first seen under it). pytest >= 8.4 no longer takes upstream's classes for fixtures
    ("fixture not found"); this stands in for them, by the same call as their newer ``SomeFixture()(request)`` form.
    """

    def fixture(request: pytest.FixtureRequest) -> None:
        __tracebackhide__ = True
        found = getattr(request.module, name, None)
        cls: Any = found if is_dist_fixture(found) else default
        cls()(request)

    fixture.__name__ = name
    return pytest.fixture(fixture, name=name)
