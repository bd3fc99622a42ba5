"""Frozen dataclasses written as JSON and read back by their type hints, every field checked, every error naming the
field and where it is (``tests[3] (t.py::x).measurements[0]: 'limit' must be a number >= 0, not a string``).

Every declared field must be present (null where the type allows it) and no other may be: a writer that drifts from
its schema is caught at the first file it writes, not by a reader that silently finds nothing. What a field holds
beyond its type is said where it is declared (``Annotated[int, Least(1)]``, :data:`Seconds`, ``OneOf``); a record
whose fields disagree with each other raises :class:`Inconsistent` from its ``__post_init__``, which :func:`read`
tells with its place. A record class may name the field that identifies it in messages (``named_by = "nodeid"``).
Pure: the standard library only.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import functools
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

__all__ = ["Inconsistent", "Least", "OneOf", "Seconds", "read", "written"]

R = TypeVar("R")


@dataclass(frozen=True)
class Least:
    """A whole number's least value (0 where a field says nothing)."""

    value: int


@dataclass(frozen=True)
class OneOf:
    """The strings a field may be."""

    choices: tuple[str, ...]


@dataclass(frozen=True)
class _Unit:
    unit: str


#: A duration: read as "a number of seconds >= 0".
Seconds = Annotated[float, _Unit("seconds")]


class Inconsistent(ValueError):
    """A record whose fields disagree with each other (``about``: the record, for a message read outside a file)."""

    def __init__(self, problem: str, about: str | None = None) -> None:
        super().__init__(f"{about}: {problem}" if about else problem)
        self.problem = problem


def read(cls: type[R], data: object, where: str, inside: str | None = None) -> R:
    """A ``cls`` from its JSON object; ``ValueError`` naming the field and ``where`` the object is. ``inside``: how the
    places of the records it holds begin (``where``, unless it is the whole file: ``""``)."""
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be an object, not {_kind(data)}")
    if isinstance(label := data.get(getattr(cls, "named_by", None)), str):
        where = f"{where} ({label})"
    hints = _hints(typing.cast(type, cls))
    for problem, names in (
        ("missing", [n for n in hints if n not in data]),
        ("unknown", sorted(set(data) - set(hints))),
    ):
        if names:
            raise ValueError(f"{where}: {problem} field{'s' * (len(names) > 1)} {', '.join(map(repr, names))}")
    prefix = where if inside is None else inside
    values = {
        name: _value(hint, data[name], where, name, f"{prefix}.{name}" if prefix else name)
        for name, hint in hints.items()
    }
    try:
        return cls(**values)
    except Inconsistent as exc:
        raise ValueError(f"{where}: {exc.problem}") from None


def written(record: Any) -> dict[str, Any]:
    """A record as its JSON object: fields in order, enums by value, tuples as lists, times to the second."""
    return {f.name: _json(getattr(record, f.name)) for f in dataclasses.fields(record)}


def _json(value: object) -> object:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return written(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return [_json(item) for item in value]
    if isinstance(value, datetime.datetime):
        return value.isoformat(timespec="seconds")
    return value


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """A record's fields and their types, in order (asked for every record read, so kept per class)."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


_KINDS: dict[type, str] = {dict: "an object", list: "a list", str: "a string"}


def _kind(value: object) -> str:
    return "null" if value is None else _KINDS.get(type(value), repr(value))


@dataclass(frozen=True)
class _Field:
    """One field's value being read: the place of its record, its name, its own place, what its annotation says."""

    where: str
    name: str
    path: str
    value: Any
    optional: bool
    rule: object

    def bad(self, expected: str) -> ValueError:
        return ValueError(f"{self.where}: {self.name!r} must be {expected}, not {_kind(self.value)}")

    def number(self, whole: bool, least: float) -> bool:
        value = self.value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (whole and isinstance(value, float)):
            return False
        return value >= least


def _value(hint: Any, value: object, where: str, name: str, path: str) -> object:
    """``value`` of field ``name`` (typed ``hint``) of the record at ``where``; ``path``: the field's own place."""
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType)
    if optional:
        (hint,) = (arg for arg in typing.get_args(hint) if arg is not type(None))
        if value is None:
            return None
    rule = None
    if typing.get_origin(hint) is Annotated:
        hint, rule = hint.__origin__, hint.__metadata__[0]
    field = _Field(where, name, path, value, optional, rule)
    choices = rule.choices if isinstance(rule, OneOf) else tuple(m.value for m in hint) if _is_enum(hint) else None
    if choices is not None:
        if value not in choices:
            raise ValueError(f"{where}: {name!r} is {value!r}, not one of {', '.join(choices)}")
        return hint(value)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        if optional and not isinstance(value, dict):
            raise field.bad("an object or null")
        return read(hint, value, path)
    simple = _SIMPLE.get(hint) or _SIMPLE[typing.get_origin(hint)]
    return simple(field, hint)


def _text(field: _Field, hint: Any) -> object:
    if not isinstance(field.value, str):
        raise field.bad("a string")
    return field.value if hint is str else _time(field)


def _flag(field: _Field, hint: Any) -> object:
    if not isinstance(field.value, bool):
        raise field.bad("true or false")
    return field.value


def _whole(field: _Field, hint: Any) -> object:
    least = field.rule.value if isinstance(field.rule, Least) else 0
    if not field.number(True, least):
        raise field.bad(f"a whole number >= {least}" + " or null" * field.optional)
    return field.value


def _real(field: _Field, hint: Any) -> object:
    if not field.number(False, 0.0):
        raise field.bad(f"a number of {field.rule.unit} >= 0" if isinstance(field.rule, _Unit) else "a number >= 0")
    return float(field.value)


def _object(field: _Field, hint: Any) -> object:
    if not isinstance(field.value, dict):
        raise field.bad("an object or null" if field.optional else "an object")
    return field.value


def _items(field: _Field, hint: Any) -> object:
    """A list, read as a tuple: of strings, or of records (each at its place, ``ranks[3]``)."""
    item = typing.get_args(hint)[0]  # tuple[item, ...]
    value = field.value
    if item is str:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise field.bad("a list of strings")
        return tuple(value)
    if not isinstance(value, list):
        raise field.bad("a list")
    return tuple(read(item, v, f"{field.path}[{i}]") for i, v in enumerate(value))


#: How a field of each plain type (or generic origin) is read.
_SIMPLE: dict[object, Callable[[_Field, Any], object]] = {
    str: _text,
    datetime.datetime: _text,
    bool: _flag,
    int: _whole,
    float: _real,
    dict: _object,
    tuple: _items,
}


def _is_enum(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, enum.Enum)


def _time(field: _Field) -> datetime.datetime:
    """An ISO 8601 time; one without a zone is UTC's."""
    try:
        when = datetime.datetime.fromisoformat(field.value)
    except ValueError:
        raise ValueError(f"{field.where}: {field.name!r} is {field.value!r}, not an ISO 8601 time") from None
    return when if when.tzinfo else when.replace(tzinfo=datetime.timezone.utc)
