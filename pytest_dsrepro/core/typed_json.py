"""Frozen dataclasses written as JSON and read back by their type hints, every field checked, every error naming the
field and where it is (``tests[3] (t.py::x).measurements[0]: 'limit' must be a number >= 0, not a string``).

Every declared field must be present (null where the type allows it) and no other may be: a writer that drifts from
its schema is caught at the first file it writes, not by a reader that silently finds nothing. What a field holds
beyond its type is said where it is declared (``Annotated[int, Least(1)]``, :data:`Seconds`, ``OneOf``), or, for a
record defined where no schema is known, where the schema holds it (``Annotated[Measurement, Fields(...)]``); a
record whose fields disagree with each other raises :class:`Inconsistent` from its ``__post_init__``, which
:func:`read` tells with its place. Pure: the standard library only.
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

__all__ = ["Fields", "Inconsistent", "Least", "OneOf", "Seconds", "Unit", "read", "written"]

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
class Unit:
    """What a number counts, for its messages (``a number of seconds >= 0``)."""

    unit: str


#: A duration: read as "a number of seconds >= 0".
Seconds = Annotated[float, Unit("seconds")]


@dataclass(frozen=True, init=False)
class Fields:
    """What the fields of a record defined elsewhere hold beyond their types, said where a schema holds the record
    (``Annotated[Measurement, Fields(repeats=Least(1))]``): the record's own module stays free of any schema."""

    rules: tuple[tuple[str, object], ...]

    def __init__(self, **rules: object) -> None:
        object.__setattr__(self, "rules", tuple(rules.items()))


class Inconsistent(ValueError):
    """A record whose fields disagree with each other (``about``: the record, for a message read outside a file)."""

    def __init__(self, problem: str, about: str | None = None) -> None:
        super().__init__(f"{about}: {problem}" if about else problem)
        self.problem = problem


def read(cls: type[R], data: object, where: str, inside: str | None = None, fields: Fields | None = None) -> R:
    """A ``cls`` from its JSON object; ``ValueError`` naming the field and ``where`` the object is. ``inside``: how the
    places of the records it holds begin (``where``, unless it is the whole file: ``""``); ``fields``: what its
    fields hold beyond their types, where its class does not say. A record class may name the field that identifies
    it in messages (``named_by = "nodeid"``)."""
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be an object, not {_told(data)}")
    if isinstance(label := data.get(getattr(cls, "named_by", None)), str):
        where = f"{where} ({label})"
    readers = _readers(typing.cast(type, cls), fields)
    if len(data) != len(readers) or not all(name in data for name in readers):
        for problem, names in (
            ("missing", [n for n in readers if n not in data]),
            ("unknown", sorted(set(data) - set(readers))),
        ):
            if names:
                raise ValueError(f"{where}: {problem} field{'s' * (len(names) > 1)} {', '.join(map(repr, names))}")
    prefix = where if inside is None else inside
    values = {name: reader(data[name], where, prefix) for name, reader in readers.items()}
    try:
        return cls(**values)
    except Inconsistent as exc:
        raise ValueError(f"{where}: {exc.problem}") from None


def written(record: object) -> dict[str, Any]:
    """A record as its JSON object: fields in order, enums by value, tuples as lists, times to the second."""
    return {name: _json(getattr(record, name)) for name in _names(typing.cast(type, type(record)))}


@functools.cache
def _names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def _json(value: object) -> object:
    if isinstance(value, enum.Enum):
        return value.value
    if value is None or isinstance(value, (str, int, float, dict)):
        return value
    if isinstance(value, tuple):
        return [_json(item) for item in value]
    if isinstance(value, datetime.datetime):
        return value.isoformat(timespec="seconds")
    return written(value)  # a record


#: How one field is read: its JSON value, the place of its record, how the places of what it holds begin.
_Reader = Callable[[Any, str, str], object]


@functools.cache
def _readers(cls: type, fields: Fields | None) -> dict[str, _Reader]:
    """A record's fields, in order, each with its reader: made once per class (and ``fields``) from its type hints."""
    hints = typing.get_type_hints(cls, include_extras=True)
    rules = dict(fields.rules) if fields is not None else {}
    return {f.name: _reader(f.name, hints[f.name], rules.get(f.name)) for f in dataclasses.fields(cls)}


_KINDS: dict[type, str] = {dict: "an object", list: "a list", str: "a string"}


def _annotated(hint: Any) -> tuple[Any, object]:
    """``Annotated[hint, rule]`` as ``(hint, rule)``; a plain hint with no rule."""
    return typing.get_args(hint)[:2] if typing.get_origin(hint) is Annotated else (hint, None)


def _told(value: object) -> str:
    """A JSON value as a message names it: ``null``, ``an object``, ``a list``, ``a string``, else itself."""
    return "null" if value is None else _KINDS.get(type(value), repr(value))


def _reader(name: str, hint: Any, rule: object = None) -> _Reader:
    """How field ``name``, typed ``hint`` (``X | None``: null allowed; ``Annotated``: what it says, unless ``rule``
    does), is read."""
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType)
    if optional:
        (hint,) = (arg for arg in typing.get_args(hint) if arg is not type(None))
    hint, said = _annotated(hint)
    field = _Field(name, optional, said if rule is None else rule)
    rule = field.rule
    if isinstance(rule, OneOf) or (isinstance(hint, type) and issubclass(hint, enum.Enum)):
        choices = rule.choices if isinstance(rule, OneOf) else tuple(m.value for m in hint)
        plain = functools.partial(field.choice, choices, hint)
    elif isinstance(hint, type) and dataclasses.is_dataclass(hint):
        plain = functools.partial(field.record, hint)
    else:
        plain = functools.partial(_PLAIN.get(hint) or _PLAIN[typing.get_origin(hint)], field, hint)
    if not optional:
        return plain

    def or_null(value: Any, where: str, prefix: str) -> object:
        return None if value is None else plain(value, where, prefix)

    return or_null


@dataclass(frozen=True)
class _Field:
    """One field of a record class: its name, whether it may be null, what its annotation says beyond its type."""

    name: str
    optional: bool
    rule: object

    def bad(self, value: object, where: str, expected: str) -> ValueError:
        return ValueError(f"{where}: {self.name!r} must be {expected}, not {_told(value)}")

    def path(self, prefix: str) -> str:
        """The field's own place, for what it holds (``tests[0] (t.py::x).rate``)."""
        return f"{prefix}.{self.name}" if prefix else self.name

    def choice(self, choices: tuple[str, ...], hint: Any, value: Any, where: str, prefix: str) -> object:
        if value not in choices:
            raise ValueError(f"{where}: {self.name!r} is {value!r}, not one of {', '.join(choices)}")
        return hint(value)

    def record(self, hint: Any, value: Any, where: str, prefix: str) -> object:
        if self.optional and not isinstance(value, dict):
            raise self.bad(value, where, "an object or null")
        return read(hint, value, self.path(prefix), fields=self.rule if isinstance(self.rule, Fields) else None)


def _text(field: _Field, hint: Any, value: Any, where: str, prefix: str) -> object:
    if not isinstance(value, str):
        raise field.bad(value, where, "a string")
    if hint is str:
        return value
    try:  # an ISO 8601 time; one without a zone is UTC's
        when = datetime.datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(f"{where}: {field.name!r} is {value!r}, not an ISO 8601 time") from None
    return when if when.tzinfo else when.replace(tzinfo=datetime.timezone.utc)


def _flag(field: _Field, hint: Any, value: Any, where: str, prefix: str) -> object:
    if not isinstance(value, bool):
        raise field.bad(value, where, "true or false")
    return value


def _whole(field: _Field, hint: Any, value: Any, where: str, prefix: str) -> object:
    least = field.rule.value if isinstance(field.rule, Least) else 0
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise field.bad(value, where, f"a whole number >= {least}" + " or null" * field.optional)
    return value


def _real(field: _Field, hint: Any, value: Any, where: str, prefix: str) -> object:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:  # nor NaN
        unit = f" of {field.rule.unit}" if isinstance(field.rule, Unit) else ""
        raise field.bad(value, where, f"a number{unit} >= 0")
    return float(value)


def _object(field: _Field, hint: Any, value: Any, where: str, prefix: str) -> object:
    if not isinstance(value, dict):
        raise field.bad(value, where, "an object or null" if field.optional else "an object")
    return value


def _items(field: _Field, hint: Any, value: Any, where: str, prefix: str) -> object:
    """A list, read as a tuple: of strings, or of records (each at its place, ``ranks[3]``)."""
    item, rule = _annotated(typing.get_args(hint)[0])  # tuple[item, ...]
    if item is str:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise field.bad(value, where, "a list of strings")
        return tuple(value)
    if not isinstance(value, list):
        raise field.bad(value, where, "a list")
    path = field.path(prefix)
    fields = rule if isinstance(rule, Fields) else None
    return tuple(read(item, v, f"{path}[{i}]", fields=fields) for i, v in enumerate(value))


#: How a field of each plain type (or generic origin: ``dict[...]``, ``tuple[...]``) is read.
_PLAIN: dict[object, Callable[[_Field, Any, Any, str, str], object]] = {
    str: _text,
    datetime.datetime: _text,
    bool: _flag,
    int: _whole,
    float: _real,
    dict: _object,
    tuple: _items,
}
