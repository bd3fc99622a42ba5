"""Collection-time expansion: one test per ``ds_config`` entry, one per size of ``ds_world(size=[1, 2])``, and
``[stock]``/``[fixed]`` when a fix is declared."""

from __future__ import annotations

import pytest

from ..core.errors import MarkerError
from ..core.gates import common_fix
from ..core.world_spec import size_id, world_sizes
from . import markers
from .stash import SCANNED_KEY, SETTINGS_KEY

_PARAM_TYPE = type(pytest.param(None))


def config_entry(spec: object, index: int) -> tuple[str, object]:
    """``(test id, preset name or dict)`` for one ``ds_config`` argument: a preset is its own id, a dict is
    ``config<N>`` unless given as ``pytest.param(dict, id="name")``."""
    if isinstance(spec, _PARAM_TYPE):
        value = spec.values[0] if len(spec.values) == 1 else spec.values
        return (spec.id if isinstance(spec.id, str) else config_entry(value, index)[0]), value
    return (spec if isinstance(spec, str) else f"config{index}"), spec


def expand(metafunc: pytest.Metafunc) -> None:
    """Every expansion of the test; a test the scan gave its config (``SCANNED_KEY``) gets neither its own configs
    nor its variants."""
    scanned = metafunc.definition.stash.get(SCANNED_KEY, False)
    if not scanned:
        configs(metafunc)
    sizes(metafunc)
    if not scanned:
        variants(metafunc)


def configs(metafunc: pytest.Metafunc) -> None:
    marks = list(metafunc.definition.iter_markers("ds_config"))
    if not marks:
        return
    where = f"@pytest.mark.ds_config on {metafunc.definition.nodeid}"
    if len(marks) > 1:
        markers.fail(f"{where}: one ds_config marker per test; list every config in it")
    specs = marks[0].args
    if not specs or marks[0].kwargs:
        markers.fail(f"{where}: give presets and/or dicts as positional arguments, e.g. ds_config('zero3', {{...}})")
    if "ds_config" not in metafunc.fixturenames:
        unused = "the test uses neither the ds_config nor the ds_engine fixture, so the configs would be unused"
        markers.fail(f"{where}: {unused}")
    named = [config_entry(spec, i) for i, spec in enumerate(specs)]
    metafunc.parametrize("ds_config", named, ids=[name for name, _ in named], indirect=True)


def sizes(metafunc: pytest.Metafunc) -> None:
    """``ds_world(size=[1, 2])``: one test per size (ids ``1rank``, ``2ranks``), the size its ``ds_world_size``
    parameter (``markers.parse`` reads it)."""
    world = markers.world_arguments(metafunc.definition)
    if world is None:
        return
    where = f"@pytest.mark.ds_world on {metafunc.definition.nodeid}"
    try:
        found = world_sizes(world[1].get("size"), metafunc.config.stash[SETTINGS_KEY].max_world_size, where)
    except MarkerError as exc:
        markers.fail(str(exc))
    if found is not None:
        _parametrize(metafunc, "ds_world_size", list(found), [size_id(n) for n in found])


def variants(metafunc: pytest.Metafunc) -> None:
    try:
        fix = common_fix(markers.gates(metafunc.definition))
    except MarkerError as exc:
        markers.fail(str(exc))
    if fix is not None:
        _parametrize(metafunc, "ds_variant", list(markers.VARIANTS))


def _parametrize(metafunc: pytest.Metafunc, fixture: str, values: list[object], ids: list[str] | None = None) -> None:
    """One test per value of the plugin's own ``fixture``, whether or not the test names it."""
    if fixture not in metafunc.fixturenames:
        metafunc.fixturenames.append(fixture)
    metafunc.parametrize(fixture, values, ids=ids, indirect=True)
