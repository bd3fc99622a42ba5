"""What crosses from pytest into the ranks of a spawned world: the body's arguments, fixes and rank fixtures, pickled
once; pytest's own fixtures that cannot cross are refused, each saying what a world test uses instead."""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

from ..core.errors import HarnessError
from ..inrank.fixtures import RankFixture

#: pytest's own fixtures that live in the pytest process (they hold its capture, its logging, its request): what a
#: world test uses in their place. docs/writing-repros.md lists them too, and says why.
STAY_IN_PYTEST = {
    "capsys": "capture in the body with contextlib.redirect_stdout(io.StringIO()); a failing rank's own output is "
    "shown with the failure anyway",
    "capfd": "capture in the body (contextlib.redirect_stdout); a failing rank's own output is shown with the failure",
    "capsysbinary": "capture in the body (contextlib.redirect_stdout)",
    "capfdbinary": "capture in the body (contextlib.redirect_stdout)",
    "caplog": "add a logging.Handler in the body, or in a rank fixture (@rank_fixture) that yields it",
    "recwarn": "use warnings.catch_warnings(record=True) in the body",
    "request": "take the values you need through fixtures (their values are sent), or use a rank fixture",
    "pytestconfig": "read the options you need in a fixture and take its value",
    "tmp_path_factory": "take tmp_path (one directory for every rank), or a fixture that returns a path",
    "tmpdir_factory": "take tmp_path (one directory for every rank), or a fixture that returns a path",
}


def payload(where: str, kwargs: dict[str, Any], fixes: Sequence[Any], setup: tuple[RankFixture, ...] = ()) -> bytes:
    """Pickle what the ranks need, naming the fixture that cannot travel instead of failing deep in pickle.

    Pickled once; each value is tried on its own only when that fails, to name the culprit.
    """
    staying = [name for name in kwargs if name in STAY_IN_PYTEST]
    if staying:
        name = staying[0]
        raise HarnessError(
            f"{where}: pytest's fixture {name!r} lives in the pytest process and cannot reach the ranks; in a "
            f"world test, {STAY_IN_PYTEST[name]}"
        )
    try:
        return pickle.dumps((kwargs, list(fixes), setup))
    except Exception:  # whatever pickle raises (it re-raises), the fixture is named below
        named = {**{f.qualname: f for f in setup}, **kwargs}
        for name, value in named.items():
            try:
                pickle.dumps(value)
            except Exception as exc:  # noqa: BLE001
                raise HarnessError(
                    f"{where}: fixture or parameter {name!r} cannot be sent to the ranks "
                    f"({type(exc).__name__}: {exc}); world tests receive only picklable values"
                ) from None
        raise
