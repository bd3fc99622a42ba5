"""Collecting DeepSpeed's test modules: upstream's classes marked as worlds, and test files that need what the
installed release lacks told as NOT-APPLICABLE instead of collection errors.

Newer test files import what older releases do not have (a fix's new helper, a module added since): on such a
release the file cannot even be imported, and pytest would report a collection error, as if the run had broken. A run
of the whole suite, or of one of its shards, must go on and sort what it could not import with the other failures
(``UpstreamModule``).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from ..core import versions
from . import harness

#: The item standing for a whole test file that cannot be imported (no test of it was named on the command line).
WHOLE_FILE = "(module)"


def lacks(exc: BaseException) -> str | None:
    """The error of a test module's import that says the installed DeepSpeed lacks a name the tests use: an
    ``ImportError`` from a ``deepspeed`` module, or a missing attribute of one (anywhere in the exception's causes).
    None for anything else."""
    seen: set[int] = set()
    found: BaseException | None = exc
    while found is not None and id(found) not in seen:
        seen.add(id(found))
        if isinstance(found, ImportError) and _deepspeed(found.name):
            return _one_line(found)
        if isinstance(found, AttributeError) and _of_deepspeed(getattr(found, "obj", None)):
            return _one_line(found)
        found = found.__cause__ or found.__context__
    return None


def _deepspeed(module: object) -> bool:
    return isinstance(module, str) and (module == "deepspeed" or module.startswith("deepspeed."))


def _of_deepspeed(obj: object) -> bool:
    """A module of the installed DeepSpeed: by its name, or by its file, for one of its sources a test loads by path
    under a name of its own (``ops/test_op_builder.py`` loads ``op_builder/builder.py``, the release's own in the
    atlas's tree)."""
    if not isinstance(obj, ModuleType):
        return False
    if _deepspeed(obj.__name__):
        return True
    installed, file = getattr(sys.modules.get("deepspeed"), "__file__", None), getattr(obj, "__file__", None)
    if not (installed and file):
        return False
    return Path(file).resolve().is_relative_to(Path(installed).resolve().parent)


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def requested(args: Iterable[str], invoked: Path, path: Path) -> list[list[str]]:
    """The node ids the command line asked for inside the test file ``path``, each as its names after the file
    (``[]``: the whole file, or a directory holding it)."""
    found = []
    for arg in args:
        where, *names = arg.split("::")
        target = (invoked / where).resolve()
        if target == path.resolve() or (not names and target in path.resolve().parents):
            found.append(names)
    return found or [[]]


def import_error(text: str) -> str:
    """A test file's import error as its ERROR says it: the error's own line first (what a run's summary, its results
    and the failures file show), then pytest's whole text with the traceback."""
    lines = [re.sub(r"^E\s+", "", line.strip()) for line in text.splitlines() if line.strip()]
    return f"cannot be imported: {lines[-1] if lines else 'no error text'}\n\n{text}"


def not_applicable(reason: str) -> pytest.MarkDecorator:
    """What a test of a file that cannot be imported on the installed release is: NOT-APPLICABLE there, with why."""
    release = versions.installed_text("deepspeed")
    return pytest.mark.ds_not_applicable(f"=={release}", reason=f"cannot be collected: {reason}")


@dataclass(frozen=True)
class Instead:
    """What the items standing for the tests of a file that did not import are: marked (NOT-APPLICABLE, skipped), or
    failing at setup with the import's error."""

    mark: pytest.MarkDecorator | None = None
    error: str | None = None


class Unimportable(pytest.Item):
    """A test (or a whole file) that cannot be collected: marked with what that makes it (``not_applicable``, or
    pytest's ``skip`` with the reason of a file that skips itself), or an ERROR at setup with why."""

    cls = None  # DeepSpeed's conftest.py reads ``item.cls`` of every item it tears down

    def __init__(self, *, instead: Instead, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.error = instead.error
        if instead.mark is not None:
            self.add_marker(instead.mark)

    def setup(self) -> None:
        if self.error is not None:
            pytest.fail(self.error, pytrace=False)

    def runtest(self) -> None:
        raise AssertionError("its mark or its error ends it at setup")  # pragma: no cover

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.path, 0, self.name


class _Scope(pytest.Collector):
    """A class named on the command line in a file that cannot be imported: holds the test named in it."""

    def __init__(self, *, names: Sequence[str], instead: Instead, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.names = names
        self.instead = instead

    def collect(self) -> list[pytest.Item | pytest.Collector]:
        return [_placeholder(self, self.names, self.instead)]


def _placeholder(parent: pytest.Collector, names: Sequence[str], instead: Instead) -> pytest.Item | pytest.Collector:
    if len(names) > 1:
        return _Scope.from_parent(parent, name=names[0], names=names[1:], instead=instead)
    return Unimportable.from_parent(parent, name=names[0] if names else WHOLE_FILE, instead=instead)


@dataclass
class UpstreamSession:
    """The session's part of the upstream layer: upstream's harness replaced (undone when pytest ends) and the
    ``DistributedFixture`` names that have a fixture here."""

    config: pytest.Config
    monkeypatch: pytest.MonkeyPatch = field(default_factory=pytest.MonkeyPatch)
    fixtures: set[str] = field(default_factory=set)

    def prepare(self, module: ModuleType) -> None:
        """Before a module's tests are collected: upstream's harness replaced where its classes come from, and a
        fixture for each ``DistributedFixture`` class that pytest itself does not take for one (pytest >= 8.4)."""
        new: dict[str, Any] = {}
        for name, obj in vars(module).items():
            if isinstance(obj, type) and (harness.is_dist_test(obj) or harness.is_dist_fixture(obj)):
                harness.install(obj, self.monkeypatch)
            if harness.is_dist_fixture(obj) and name not in self.fixtures:
                self.fixtures.add(name)
                new[f"fixture_{name}"] = harness.distributed_fixture(name, obj)
        if new:  # plugin fixtures are visible to every test; each finds its own module's class by name
            holder = ModuleType(f"dsrepro_upstream_fixtures_{len(self.fixtures)}")
            vars(holder).update(new)
            self.config.pluginmanager.register(holder, holder.__name__)

    def close(self) -> None:
        self.monkeypatch.undo()


STATE = pytest.StashKey[UpstreamSession]()


class UpstreamModule(pytest.Module):
    """A test module of DeepSpeed's: its ``DistributedTest`` classes run in worlds (``harness``); an import that
    fails for a name the installed DeepSpeed lacks makes NOT-APPLICABLE items instead of a collection error, and any
    other import error an ERROR item, so that the run goes on.

    Each test the command line asked for in a file that cannot be imported on the installed release (or the file as a
    whole) becomes one item that the plugin judges NOT-APPLICABLE (``ds_not_applicable`` for the installed release),
    with the import error as its reason. Any other import error (a syntax error, a missing third-party package) is an
    ERROR, of an item in the file's name (or of each test asked for in it): pytest alone would stop the whole run at
    collection ("Interrupted: 1 error during collection").

    A file that skips itself as a whole on import (``pytest.skip(..., allow_module_level=True)``: DeepSpeed's fp16
    files where the accelerator lacks fp16) is pytest's to report when the file is asked for; a test asked for in it
    by node id becomes an item skipped with the file's reason, where pytest alone would end the run ("found no
    collectors", exit 4) and lose every other test's outcome with it: the atlas names tests by node id, on releases
    where their file skips.
    """

    def collect(self) -> list[pytest.Item | pytest.Collector]:
        try:
            self.obj  # noqa: B018 - imports the module, as pytest's own collect does first
        except pytest.skip.Exception as exc:  # the file skips itself as a whole
            named = [n for n in self._wanted() if n]
            if not exc.allow_module_level or not named:
                raise
            said = exc.msg or "the file skips itself"
            return self._instead(named, Instead(mark=pytest.mark.skip(reason=said)), f"skipped as a whole: {said}")
        except Exception as exc:  # noqa: BLE001 - whatever the import raised (pytest wraps ImportError in CollectError)
            reason = lacks(exc)
            if reason is not None and versions.installed_text("deepspeed") is not None:
                instead = Instead(mark=not_applicable(reason))
                return self._instead(self._wanted(), instead, f"cannot be imported: {reason}")
            text = str(exc) if isinstance(exc, self.CollectError) else f"{type(exc).__name__}: {exc}"
            return self._instead(self._wanted(), Instead(error=import_error(text)), "cannot be imported")
        self.config.stash[STATE].prepare(self.obj)
        children = list(super().collect())
        for child in children:
            if isinstance(child, pytest.Class) and harness.is_dist_test(child.obj):
                harness.mark_world_sizes(child.obj)
                child.add_marker(pytest.mark.ds_world(**harness.world(child.obj)))
        return children

    def _wanted(self) -> list[list[str]]:
        """The tests the command line asked for in this file (``requested``); read only for a file that did not
        import, not on every module's way through collection."""
        return requested(self.config.args, self.config.invocation_params.dir, self.path)

    def _instead(self, wanted: list[list[str]], instead: Instead, why: str) -> list[pytest.Item | pytest.Collector]:
        """An item for each test asked for (``[]``: the whole file) in a file that did not import."""
        # What pytest reads of a module later (``--collect-only`` prints its docstring) must not import it again.
        self.obj = ModuleType(self.path.stem, why)
        return [_placeholder(self, names, instead) for names in wanted]
