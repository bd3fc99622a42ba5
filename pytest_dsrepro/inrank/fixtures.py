"""Fixtures that run in every rank: ``@rank_fixture``.

A pytest fixture runs once, in the pytest process, before the world exists. A fixture that needs its rank
(``ds_rank``), the world's process group, or a teardown in each rank is written as a rank fixture instead: pytest
resolves its arguments, and each rank sets it up before the body and tears it down after.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, overload

import pytest

F = TypeVar("F", bound=Callable[..., Any])

#: Every rank fixture function by (module, qualified name): the module is imported in the rank, which defines them.
_DEFINED: dict[tuple[str, str], Callable[..., Any]] = {}


@dataclass(frozen=True)
class RankFixture:
    """What a rank fixture is in the pytest process: its function, by name, and the arguments pytest resolved."""

    module: str
    qualname: str
    kwargs: dict[str, Any]

    def function(self) -> Callable[..., Any]:
        key = (self.module, self.qualname)
        if key not in _DEFINED:
            importlib.import_module(self.module)  # a conftest's fixture: its module was not imported in the rank yet
        return _DEFINED[key]


@overload
def rank_fixture(function: F) -> F: ...


@overload
def rank_fixture(*, name: str | None = None, autouse: bool = False) -> Callable[[F], F]: ...


def rank_fixture(function: F | None = None, *, name: str | None = None, autouse: bool = False) -> Any:
    """Declare a function-scoped fixture that runs in every rank::

        @rank_fixture
        def shard_dir(tmp_path, ds_rank):
            path = tmp_path / f"rank{ds_rank}"
            path.mkdir()
            yield path
            shutil.rmtree(path)

    In the pytest process it resolves its own arguments as any fixture does, then stands for itself: the test gets a
    :class:`RankFixture` (a picklable reference to the function, with those arguments). Each rank calls the function
    after rendezvous, with its own ``ds_rank``/``ds_world_size`` and after the repro's fixes, and tears it down after
    the body (generator fixtures), last set up first torn down. A failing setup or teardown fails that rank.

    ``autouse=True`` (or a rank fixture named in ``@pytest.mark.usefixtures``): it runs in the ranks of every world
    test in its scope (module, class, conftest.py), named by the test or not, before the ones the test names; a test
    that is not a world test has no ranks, and the fixture does nothing there (its arguments are then not even
    resolved: they are looked up when a world test uses it, so they cannot be parametrized fixtures)."""

    def declare(fn: F) -> Any:
        _DEFINED[(fn.__module__, fn.__qualname__)] = fn

        @functools.wraps(fn)  # pytest reads the arguments to resolve from the wrapped function's signature
        def reference(**kwargs: Any) -> RankFixture:
            return RankFixture(fn.__module__, fn.__qualname__, kwargs)

        def in_world_tests(request: pytest.FixtureRequest) -> RankFixture | None:
            """Autouse: its arguments are resolved for world tests only (``ds_rank`` exists nowhere else)."""
            if request.node.get_closest_marker("ds_world") is None:
                return None
            kwargs = {arg: request.getfixturevalue(arg) for arg in inspect.signature(fn).parameters}
            return RankFixture(fn.__module__, fn.__qualname__, kwargs)

        fixture = in_world_tests if autouse else reference
        return pytest.fixture(fixture, name=name or fn.__name__, autouse=autouse)

    return declare(function) if function is not None else declare


def _tear_down(generator: Iterator[Any], name: str) -> None:
    """The code after a rank fixture's ``yield``: run however the body ended, as pytest runs its fixtures' (a
    ``contextmanager`` would throw the body's exception in at the ``yield`` and skip it)."""
    try:
        next(generator)
    except StopIteration:
        return
    raise RuntimeError(f"rank fixture {name} yielded more than once")


def arguments(
    kwargs: dict[str, Any],
    stack: contextlib.ExitStack,
    substitute: Callable[[Any], Any],
    setup: Sequence[RankFixture] = (),
) -> dict[str, Any]:
    """The body's arguments in this rank: rank fixtures set up (each once, however many use it; teardowns pushed on
    ``stack``), and every other value given to ``substitute`` (which puts the rank's own values in place). ``setup``:
    rank fixtures the body does not name (autouse, ``usefixtures``), set up first, in pytest's order."""
    done: dict[int, Any] = {}  # by identity: one fixture used twice was pickled, and so unpickled, as one object

    def enter(value: Any) -> Any:
        if not isinstance(value, RankFixture):
            return substitute(value)
        if id(value) not in done:
            fn = value.function()
            args = {k: enter(v) for k, v in value.kwargs.items()}
            if inspect.isgeneratorfunction(fn):
                generator = fn(**args)
                done[id(value)] = next(generator)
                stack.callback(_tear_down, generator, value.qualname)
            else:
                done[id(value)] = fn(**args)
        return done[id(value)]

    for fixture in setup:
        enter(fixture)
    return {k: enter(v) for k, v in kwargs.items()}
