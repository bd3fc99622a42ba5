"""Runs in the fork server (``take``, before it forks a reusable world) and in its kept ranks (``rebound``, after each
test): the namespaces of every module a rank was forked with, and of their classes, as they were, so that between two
tests of a reuse scope every name a test rebound is found (``ds_world(reuse=True)``).

Whoever rebound a name, and to what, decides what becomes of it (``Rebound``; ``reuse_reset`` does it). Comparing is
the cost every kept test pays, so a kept rank reads each namespace's version rather than its objects (``Namespaces``).
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import operator
import os
import site
import sys
import sysconfig
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import BuiltinFunctionType, CodeType, MethodType, ModuleType
from typing import Any

#: Modules never compared: the program the fork server ran, and the plugin, whose rank side runs the test and keeps its
#: own state. (``sys`` is: torch's ``init_process_group`` wraps ``sys.excepthook`` again for every process group.)
SKIPPED = ("__main__", "__mp_main__", "pytest_dsrepro")
#: A class whose ``__dict__`` cannot be written (CPython's ``Py_TPFLAGS_IMMUTABLETYPE``): never compared.
IMMUTABLE_TYPE = 1 << 8
MISSING: Any = object()


@functools.cache
def _library_roots() -> tuple[str, ...]:
    """Where the standard library and the installed packages live (and the plugin): code anywhere else is the
    test's (not the interpreter's prefix itself: a project may live under ``/usr``)."""
    paths = sysconfig.get_paths()
    roots = {paths["stdlib"], paths["platstdlib"], paths["purelib"], paths["platlib"], *site.getsitepackages()}
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return tuple(sorted(os.path.join(os.path.realpath(r), "") for r in {*roots, site.getusersitepackages(), here} if r))


def is_library_file(path: str | None) -> bool:
    """Is ``path`` in the interpreter's or an installed package's tree (or no file at all: a builtin)?"""
    if not path or path.startswith("<"):
        return not path or path.startswith("<frozen")
    return os.path.realpath(path).startswith(_library_roots())


def _code(value: Any) -> CodeType | None:
    """The Python code behind a function, method, descriptor or partial (None for anything else)."""
    for _ in range(4):  # a property of a partial of a method is as deep as it gets
        if isinstance(value, (staticmethod, classmethod, MethodType)):
            value = value.__func__
        elif isinstance(value, functools.partial):
            value = value.func
        elif isinstance(value, property):
            value = value.fget
        else:
            break
    code = getattr(value, "__code__", None)
    return code if isinstance(code, CodeType) else None


def origin(value: Any) -> str | None:
    """The file that defined ``value``: its code's for a function, its class's module's for anything else (None: a
    builtin, or plain data). A ``unittest.mock`` object is a test's by definition: ``"<mock>"``."""
    code = _code(value)
    if code is not None:
        return code.co_filename
    cls = value if issubclass(type(value), type) else type(value)
    module_name = str(getattr(cls, "__module__", None) or "")
    if module_name.partition(".")[0] == "unittest" and "mock" in module_name:
        return "<mock>"
    return getattr(sys.modules.get(module_name), "__file__", None)


def by_test(value: Any) -> bool:
    """Did the test's own code make ``value`` (a function or class defined in its files, or a mock)?"""
    found = origin(value)
    return found == "<mock>" or not is_library_file(found)


def describe(value: Any) -> str:
    """``value`` in a few words: code by its name and where it was defined, a class by its name, anything else by its
    type (never by its own attributes: a mock makes up any it is asked for)."""
    code = _code(value)
    if code is not None:
        name = getattr(code, "co_qualname", code.co_name)  # Python 3.11's
        return f"{name} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"
    if issubclass(type(value), type):
        return f"the class {value.__qualname__}"
    if isinstance(value, BuiltinFunctionType):
        return f"the builtin {value.__qualname__}"
    return f"a {type(value).__qualname__}"


@dataclass(frozen=True)
class Rebound:
    """A name whose object is not the one the rank was forked with: ``where`` (``module.name``,
    ``module.Class.name``), what it was and what it is now (``MISSING``: deleted).

    The libraries rebind their own names as they run: torch hooks ``Optimizer.step`` on a first optimizer and wraps
    ``sys.excepthook`` for every process group, DeepSpeed swaps ``torch.nn.functional.linear`` for its memory-efficient
    one for the rest of the process and counts its parameters (``Init.param_id``); torch notes what it initialised
    (``torch.cuda._initialized``) and counts its groups. Code they swapped is put back (``code``, ``put_back``): a
    fresh rank has the forked function, and its test swaps it again as it runs. A value they set stays, as the next
    test's starting point: it may stand for state that cannot be undone (a CUDA context made). A name the test's own
    code rebound (to a function defined in the test's files, a ``unittest.mock`` object), or a module taken out of
    ``sys.modules``, cannot be proven gone: other code may hold the replacement since. It is a leftover
    (``by_test``), and the kept rank's world ends.
    """

    where: str
    namespace: Any  # a module's ``__dict__``, or a class
    name: str
    was: Any
    now: Any

    @property
    def by_test(self) -> bool:
        return self.now is MISSING or by_test(self.now)

    @property
    def code(self) -> bool:
        """Was code swapped (a function, a method, a class), rather than a value set (a flag, a counter, a cache)?"""
        return callable(self.was) or callable(self.now)

    def put_back(self) -> None:
        if issubclass(type(self.namespace), type):
            setattr(self.namespace, self.name, self.was)
        else:
            self.namespace[self.name] = self.was

    def __str__(self) -> str:
        if self.now is MISSING:
            return f"{self.where} was deleted"
        return f"{self.where} was replaced by {describe(self.now)}"


#: Where a dict's version tag is: after the object header (reference count, type) and ``ma_used``, on a 64-bit CPython.
TAG_OFFSET = 24


def _type_dict_offset() -> int | None:
    """Where a type object holds its ``tp_dict``, found on a class of its own; None where versions cannot be read
    here (another layout: the tag does not move when the dict is written)."""

    class Written:
        pass

    try:
        proxy = vars(Written)
        proxied = int(ctypes.c_void_p.from_address(id(proxy) + 16).value or 0)  # a mappingproxy's mapping
        size: int = type.__basicsize__  # type: ignore[assignment] # a type object's size (mypy reads a method)
        offsets = range(16, size, 8)
        offset = next(o for o in offsets if ctypes.c_void_p.from_address(id(Written) + o).value == proxied)
        probe: dict[str, int] = {}
        before = (_tag(id(probe)), _tag(proxied))
        probe["x"] = 1
        Written.x = 1  # type: ignore[attr-defined]
        after = (_tag(id(probe)), _tag(proxied))
        return offset if before[0] != after[0] and before[1] != after[1] else None
    except (StopIteration, ValueError, OSError):
        return None


def _tag(address: int) -> int:
    return int(ctypes.c_uint64.from_address(address + TAG_OFFSET).value)


@dataclass(frozen=True)
class _Saved:
    """One namespace as forked: its names and their objects, in order."""

    where: str
    namespace: Any  # a module's ``__dict__``, or a class (whose ``__dict__`` is a read-only proxy)
    names: tuple[str, ...]
    objects: tuple[object, ...]

    @classmethod
    def of(cls, where: str, namespace: Any) -> _Saved:
        found = vars(namespace) if issubclass(type(namespace), type) else namespace
        return cls(where, namespace, tuple(found), tuple(found.values()))

    def current(self) -> Mapping[str, object]:
        return vars(self.namespace) if issubclass(type(self.namespace), type) else self.namespace  # type: ignore[no-any-return]

    def unchanged(self) -> bool:
        now = self.current()
        return len(now) == len(self.objects) and all(map(operator.is_, now.values(), self.objects))

    def rebound(self) -> Iterator[Rebound]:
        """Names rebound or deleted since (names added are not: an import binds its submodule on its package)."""
        now = self.current()
        for name, was in zip(self.names, self.objects, strict=True):
            found = now.get(name, MISSING)
            if found is not was:
                yield Rebound(f"{self.where}.{name}", self.namespace, name, was, found)


def _compared(name: str) -> bool:
    return not any(name == s or name.startswith(s + ".") for s in SKIPPED)


def _classes(module: ModuleType, seen: set[int]) -> Iterator[type]:
    """The classes a module's namespace holds whose dict can be written, each class once across modules."""
    for value in list(vars(module).values()):
        if issubclass(type(value), type) and id(value) not in seen and not value.__flags__ & IMMUTABLE_TYPE:
            seen.add(id(value))
            yield value


@dataclass
class Namespaces:
    """The namespaces of a process's modules and their classes as they were (``take``), compared later
    (``rebound``); modules imported since join (``add_new``). ``tags``: where each one's version is read (empty where
    versions cannot be read here), ``versions``: what it read when saved.

    A ZeRO-3 rank is forked with ~3,300 modules and ~9,000 of their classes, holding ~210,000 names. Touching each
    object would cost a kept rank its share of the server's memory (a reference count written is a page copied) and
    ~0.1 s a test. So the server saves them before it forks (its own pages), and a kept rank reads only each
    namespace's version: CPython gives every dict a version tag that changes with each write to it (PEP 509), in the
    dict's header, read here with ``ctypes`` (checked on a dict and a class of its own first; where the layout
    differs, every namespace is compared object by object instead). A namespace whose version moved is compared name
    by name. Modules first imported since the fork join at the end of the test that imported them, as they then are;
    the test's own modules (outside the interpreter's and its packages' directories) never do: their globals live on
    from test to test, as in one pytest process.
    """

    modules: dict[str, ModuleType] = field(default_factory=dict)
    saved: list[_Saved] = field(default_factory=list)
    tags: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    classes: set[int] = field(default_factory=set)
    type_dict: int | None = field(default_factory=_type_dict_offset)
    added: list[str] = field(default_factory=list)  # modules saved after ``take``: imported by a test
    passed: set[str] = field(default_factory=set)  # modules imported since and never compared: the test's, the plugin's
    moved: list[int] = field(default_factory=list)  # the namespaces ``rebound`` last found moved
    #: ``sys.modules``'s version when its modules were last looked through: for new ones, for replaced ones
    looked: dict[str, int] = field(default_factory=dict)
    _gather: tuple[int, Any, Callable[[Any], tuple[int, ...]]] | None = field(default=None, repr=False)

    @classmethod
    def take(cls) -> Namespaces:
        found = cls()
        found.add(sorted(sys.modules.items()))
        found.added.clear()
        return found

    def add(self, modules: Iterable[tuple[str, object]]) -> None:
        for name, module in modules:
            if not isinstance(module, ModuleType) or name in self.modules or not _compared(name):
                continue
            self.modules[name] = module
            self.added.append(name)
            self._save(_Saved.of(name, vars(module)), id(vars(module)))
            for klass in _classes(module, self.classes):
                address = self._type_dict(klass)
                if address or self.type_dict is None:
                    self._save(_Saved.of(f"{klass.__module__}.{klass.__qualname__}", klass), address)

    def _save(self, saved: _Saved, address: int) -> None:
        self.saved.append(saved)
        if self.type_dict is not None:
            self.tags.append(address + TAG_OFFSET)
            self.versions.append(_tag(address))

    def _type_dict(self, klass: type) -> int:
        if self.type_dict is None:
            return 0
        return int(ctypes.c_void_p.from_address(id(klass) + self.type_dict).value or 0)

    def _modules_version(self) -> int | None:
        """``sys.modules``'s version: it moves when a module is imported, replaced or removed (None: not readable)."""
        return None if self.type_dict is None else _tag(id(sys.modules))

    def _new(self) -> tuple[list[tuple[str, ModuleType]], set[str]]:
        """Modules imported since and not yet looked at: those of the installed libraries, and the others' names."""
        version = self._modules_version()
        if version is not None and self.looked.get("new") == version:
            return [], set()
        new = [(n, m) for n, m in list(sys.modules.items()) if n not in self.modules and n not in self.passed]
        found = [(n, m) for n, m in new if isinstance(m, ModuleType) and _compared(n) and is_library_file(
            getattr(m, "__file__", None))]  # fmt: skip
        return found, {n for n, _ in new} - {n for n, _ in found}

    def new_modules(self) -> list[tuple[str, ModuleType]]:
        """Modules of the installed libraries imported since and not yet saved (the test's own never are)."""
        return self._new()[0]

    def add_new(self) -> None:
        """Modules imported since (those of the installed libraries), as they are now."""
        found, others = self._new()
        self.add(found)
        self.passed |= others
        version = self._modules_version()
        if version is not None:
            self.looked["new"] = version

    def rebound(self) -> list[Rebound]:
        """Every name rebound since it was saved, in the order saved: only namespaces whose version moved are looked
        into (all of them where versions cannot be read)."""
        if self.type_dict is None:
            self.moved = [i for i, saved in enumerate(self.saved) if not saved.unchanged()]
        else:
            self.moved = list(itertools.compress(range(len(self.tags)), map(operator.ne, self._read(), self.versions)))
        return [r for i in self.moved for r in self.saved[i].rebound()]

    def _read(self) -> tuple[int, ...]:
        """Every saved namespace's version now, read in one C loop (``operator.itemgetter`` over one ``ctypes`` array
        that spans them all: a view, nothing is copied), made again only when namespaces were added."""
        if self._gather is None or self._gather[0] != len(self.tags):
            base = min(self.tags)
            view = (ctypes.c_uint64 * ((max(self.tags) - base) // 8 + 1)).from_address(base)
            indexes = [(tag - base) // 8 for tag in self.tags]
            self._gather = len(self.tags), view, operator.itemgetter(*indexes, *indexes[:1])  # a tuple even for one
        _, view, gather = self._gather
        return gather(view)[: len(self.tags)]

    def replaced_modules(self) -> list[str]:
        """Modules saved that ``sys.modules`` no longer holds, or holds another object for."""
        version = self._modules_version()
        if version is not None and self.looked.get("replaced") == version:
            return []
        replaced = [name for name, module in self.modules.items() if sys.modules.get(name) is not module]
        if version is not None and not replaced:
            self.looked["replaced"] = version
        return replaced

    def refresh(self, moved: Iterable[int] | None = None) -> None:
        """Take what changed since as it is now (the namespaces whose version moved, or those ``moved`` says; modules
        imported since): the fork server before it forks again, a rank after the fork itself changed things
        (threading's locks), a kept rank after putting back what it put back."""
        if moved is None:
            self.rebound()
            moved = self.moved
        for i in moved:
            saved = self.saved[i]
            self.saved[i] = _Saved.of(saved.where, saved.namespace)
            if self.type_dict is not None:
                self.versions[i] = _tag(self.tags[i] - TAG_OFFSET)
        self.moved = []
        self.add_new()
