"""TOML from outside (the fix ledger's files, a failures file), read one way: what ``tomllib`` would turn into a
traceback (``RecursionError`` on arrays nested thousands deep, the ``ValueError`` of ``int()`` on 4300 digits and
more) is a ``TOMLDecodeError`` too, whose message is one line, for the readers' own handlers to name the file."""

from __future__ import annotations

import sys
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 reads TOML with tomli, its backport
    import tomli as tomllib

TOMLDecodeError = tomllib.TOMLDecodeError


def loads(text: str) -> dict[str, Any]:
    """``text`` as TOML (``tomllib.loads``), or ``TOMLDecodeError`` (a ``ValueError``) saying what is wrong."""
    try:
        data: dict[str, Any] = tomllib.loads(text)
    except TOMLDecodeError:
        raise
    except RecursionError:
        raise TOMLDecodeError("nested too deep (arrays or tables inside each other hundreds of times)") from None
    except ValueError as exc:  # int() of thousands of digits
        raise TOMLDecodeError(" ".join(str(exc).split(";")[0].split())) from None
    return data
