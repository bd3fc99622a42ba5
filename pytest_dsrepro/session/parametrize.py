"""Collection-time expansion: one test per ``ds_config`` entry, and ``[stock]``/``[fixed]`` when a fix is declared."""

from __future__ import annotations

import pytest

from ..core.configs import config_entry
from ..core.gates import FIXED, STOCK, common_fix, gates_of
from .markers import MarkerError


def _fail(message: str) -> None:
    raise pytest.fail.Exception(message, pytrace=False)


def configs(metafunc: pytest.Metafunc) -> None:
    marks = list(metafunc.definition.iter_markers("ds_config"))
    if not marks:
        return
    where = f"@pytest.mark.ds_config on {metafunc.definition.nodeid}"
    if len(marks) > 1:
        _fail(f"{where}: one ds_config marker per test; list every config in it")
    specs = marks[0].args
    if not specs or marks[0].kwargs:
        _fail(f"{where}: give presets and/or dicts as positional arguments, e.g. ds_config('zero3', {{...}})")
    if "ds_config" not in metafunc.fixturenames:
        _fail(f"{where}: the test uses neither the ds_config nor the ds_engine fixture, so the configs would be unused")
    named = [config_entry(spec, i) for i, spec in enumerate(specs)]
    metafunc.parametrize("ds_config", named, ids=[name for name, _ in named], indirect=True)


def variants(metafunc: pytest.Metafunc) -> None:
    try:
        fix = common_fix(gates_of(metafunc))
    except MarkerError as exc:
        _fail(str(exc))
    if fix is None:
        return
    if "ds_variant" not in metafunc.fixturenames:
        metafunc.fixturenames.append("ds_variant")
    metafunc.parametrize("ds_variant", [STOCK, FIXED], indirect=True)
