"""JSON from outside (results files, configs, caches, manifests, a config pasted in a log), read one way: what the
standard library would turn into a traceback, a hang or a value no reader expects is a ``BadJSON`` (a
``ValueError``) whose message is one line.

- Nesting deeper than ``MAX_DEPTH`` (the standard library recurses, and ends in ``RecursionError``).
- Integers of more than ``MAX_DIGITS`` digits (Python refuses 4300 and more with a message of its own, and takes
  the square of the length below that), and floats that overflow to infinity (``1e999``).
- ``NaN``, ``Infinity`` and ``-Infinity``, which are no JSON at all.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_DEPTH = 100
MAX_DIGITS = 100
#: A JSON string (skipped when counting brackets), or a bracket.
_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)


class BadJSON(ValueError):
    """JSON that is well formed but that no reader of it can use; its message is one line."""


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_DIGITS:
        raise BadJSON(f"a number of {len(text.lstrip('-'))} digits (at most {MAX_DIGITS})")
    return int(text)


def _float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise BadJSON(f"a number out of range ({text[:20]}{'...' if len(text) > 20 else ''})")
    return value


def _constant(name: str) -> Any:
    raise BadJSON(f"{name} (not a JSON number)")


_DECODER = json.JSONDecoder(parse_int=_int, parse_float=_float, parse_constant=_constant)


def depth(text: str) -> int:
    """How deep the brackets of ``text`` nest (strings skipped), in one pass."""
    deepest = level = 0
    for m in _TOKENS.finditer(text):
        token = m[0]
        if token in "[{":
            level += 1
            deepest = max(deepest, level)
        elif token in "]}":
            level -= 1
    return deepest


def _check_depth(text: str) -> None:
    nested = depth(text)
    if nested > MAX_DEPTH:
        raise BadJSON(f"nested {nested} deep (at most {MAX_DEPTH})")


def loads(text: str) -> Any:
    """``text`` as JSON (``json.loads``), or ``json.JSONDecodeError`` / ``BadJSON``, each a ``ValueError``."""
    _check_depth(text)
    return _DECODER.decode(text)


def _nesting(value: Any) -> int:
    """How deep a decoded value nests, walked without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        node, level = todo.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, level)
            todo += [(child, level + 1) for child in (node.values() if isinstance(node, dict) else node)]
    return deepest


def raw_decode(text: str, start: int = 0) -> tuple[Any, int]:
    """The JSON value that starts at ``text[start]`` and where it ends (``JSONDecoder.raw_decode``)."""
    try:
        value, end = _DECODER.raw_decode(text, start)
    except RecursionError:
        raise BadJSON(f"nested deeper than {MAX_DEPTH}") from None
    if _nesting(value) > MAX_DEPTH:
        raise BadJSON(f"nested {_nesting(value)} deep (at most {MAX_DEPTH})")
    return value, end
