"""Backporting an upstream fix onto an installed DeepSpeed release, for a repro's ``fix=``.

An upstream fix is a source diff, so ``backport`` applies one: it recompiles a module's source with regex edits,
finds (by comparing the syntax trees) every function and method the edits changed, and installs exactly those,
decorators and all, through a ``pytest.MonkeyPatch``. An edit that matches nothing fails loudly: a backport that
silently did nothing would make a repro's ``[fixed]`` variant a lie.

A fix runs on every release, so it first asks whether the installed one already has the fix: ``release_has``.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import types
from collections.abc import Iterator, Sequence
from typing import Any

import pytest


class BackportError(Exception):
    """The edits do not fit the installed source (it moved, or the fix is already there)."""


def release_has(where: Any, *lines: str) -> bool:
    """Does the installed release have it? True when the source of ``where`` (a function, method, class or module,
    or a module by its dotted name) holds every one of ``lines``: a fix's own lines, which a fix guard looks for
    before it patches. Indentation and runs of spaces do not count (a line a formatter re-spaced or a refactor
    re-indented is the same line); line ends do. ``BackportError`` when there is no source to read (compiled code,
    a release shipped without it): the guard cannot tell, and says so, rather than patch blind."""
    obj = importlib.import_module(where) if isinstance(where, str) else where
    try:
        source = inspect.getsource(obj)
    except (OSError, TypeError) as exc:
        name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or repr(obj)
        raise BackportError(f"release_has(): the source of {name} cannot be read ({exc}), so whether this release "
                            "has the fix cannot be told") from None  # fmt: skip
    flat = _spaced(source)
    return all(_spaced(line) in flat for line in lines)


def _spaced(text: str) -> str:
    """``text`` with each line's indentation gone and its runs of spaces and tabs made one space."""
    return "\n".join(" ".join(line.split()) for line in text.split("\n"))


def _attribute(class_name: str, name: str) -> str:
    """The name a method is stored under: ``__private`` methods are mangled to ``_Class__private``."""
    if name.startswith("__") and not name.endswith("__"):
        return f"_{class_name.lstrip('_')}{name}"
    return name


def _definitions(source: str) -> dict[str, str]:
    """``{"func": dump, "Class.method": dump}`` for the module's top-level functions and methods."""
    found = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found[node.name] = ast.dump(node)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found[f"{node.name}.{_attribute(node.name, item.name)}"] = ast.dump(item)
    return found


def _functions_within(obj: Any, seen: set[int] | None = None) -> Iterator[types.FunctionType]:
    """A function and every function its closures hold (what decorators wrap)."""
    seen = set() if seen is None else seen
    if not inspect.isfunction(obj) or id(obj) in seen:
        return
    seen.add(id(obj))
    yield obj
    for cell in obj.__closure__ or ():
        try:
            yield from _functions_within(cell.cell_contents, seen)
        except ValueError:  # an empty cell
            continue


def _point_super_at(new_class: type, live_class: type) -> None:
    """Methods compiled in ``new_class`` share one ``__class__`` cell; make ``super()`` there mean the live class."""
    for member in vars(new_class).values():
        for fn in _functions_within(member):
            if "__class__" in fn.__code__.co_freevars and fn.__closure__:
                fn.__closure__[fn.__code__.co_freevars.index("__class__")].cell_contents = live_class
                return


def backport(monkeypatch: pytest.MonkeyPatch, module_name: str, edits: Sequence[tuple[str, str]]) -> list[str]:
    """Apply regex ``edits`` (pattern, replacement) to ``module_name``'s source; return what was patched.

    The new code looks up its globals in a namespace that maps every other name to the live module's objects, and its
    ``super()`` cell holds the live class (``_point_super_at``), so DeepSpeed keeps seeing one consistent module."""
    if not isinstance(module_name, str):
        given = f"the module object {module_name.__name__!r}" if inspect.ismodule(module_name) else repr(module_name)
        raise TypeError(
            f"backport(): module_name must be the module's dotted name as a string, such as "
            f"'deepspeed.runtime.engine', not {given}: the source it recompiles is found by that name"
        )
    module = importlib.import_module(module_name)
    original = inspect.getsource(module)
    source = original
    for pattern, replacement in edits:
        source, count = re.subn(pattern, replacement, source)
        if not count:
            raise BackportError(f"{module_name}: {pattern!r} matches nothing in the installed source")
    before, after = _definitions(original), _definitions(source)
    changed = sorted(name for name, dump in after.items() if before.get(name) != dump)
    if not changed:
        raise BackportError(f"{module_name}: the edits changed no function or method")
    namespace: dict[str, Any] = dict(vars(module))
    exec(compile(source, module.__file__ or module_name, "exec"), namespace)  # that is what a backport is
    new_objects = {}
    for qualname in changed:
        owner, _, attr = qualname.rpartition(".")
        new_objects[qualname] = vars(namespace[owner])[attr] if owner else namespace[attr]
        if owner:
            _point_super_at(namespace[owner], getattr(module, owner))
    # Everything but the patched functions resolves to the live objects (classes, module state, helpers).
    namespace.update({k: v for k, v in vars(module).items() if k not in changed})
    for qualname, new in new_objects.items():
        owner, _, attr = qualname.rpartition(".")
        monkeypatch.setattr(getattr(module, owner) if owner else module, attr, new)
    return changed
