"""Collection time: a test function parametrized into one test per ``ds_config`` entry, one per size of
``ds_world(size=[1, 2])``, and ``[stock]``/``[fixed]`` when a fix is declared (a plugin may give a test its config
instead: ``give_config``); then this process's share of the collected tests (``--ds-shard I/N``)."""

from __future__ import annotations

from typing import Any

import pytest

from ..core.errors import MarkerError
from ..core.gates import common_fix
from ..core.world_spec import size_id, world_sizes
from . import markers
from .markers import GivenConfig
from .settings import SETTINGS_KEY
from .verdicts import fail

_PARAM_TYPE = type(pytest.param(None))

#: A plugin gave this test function its config (``give_config``): neither its own configs nor its ``[fixed]`` variant
#: are made.
GIVEN_KEY = pytest.StashKey[bool]()


def config_entry(spec: object, index: int) -> tuple[str, object]:
    """``(test id, preset name or dict)`` for one ``ds_config`` argument: a preset is its own id, a dict is
    ``config<N>`` unless given as ``pytest.param(dict, id="name")``."""
    if isinstance(spec, _PARAM_TYPE):
        value = spec.values[0] if len(spec.values) == 1 else spec.values
        return (spec.id if isinstance(spec.id, str) else config_entry(value, index)[0]), value
    return (spec if isinstance(spec, str) else f"config{index}"), spec


def give_config(metafunc: pytest.Metafunc, name: str, config: dict[str, Any]) -> None:
    """For a plugin, before ``expand`` (``tryfirst``): the test's one ``ds_config`` is ``config`` (test id ``name``),
    in place of its own configs and variants, which are not made (nor for a test that takes no ``ds_config``)."""
    metafunc.definition.stash[GIVEN_KEY] = True
    if "ds_config" in metafunc.fixturenames:
        metafunc.parametrize("ds_config", [GivenConfig(name, config)], ids=[name], indirect=True)


def expand(metafunc: pytest.Metafunc) -> None:
    """Every expansion of the test; a test a plugin gave its config (``give_config``) gets neither its own configs
    nor its variants."""
    given = metafunc.definition.stash.get(GIVEN_KEY, False)
    if not given:
        configs(metafunc)
    sizes(metafunc)
    if not given:
        variants(metafunc)


def configs(metafunc: pytest.Metafunc) -> None:
    marks = list(metafunc.definition.iter_markers("ds_config"))
    if not marks:
        return
    where = f"@pytest.mark.ds_config on {metafunc.definition.nodeid}"
    if len(marks) > 1:
        fail(f"{where}: one ds_config marker per test; list every config in it")
    specs = marks[0].args
    if not specs or marks[0].kwargs:
        fail(f"{where}: give presets and/or dicts as positional arguments, e.g. ds_config('zero3', {{...}})")
    if "ds_config" not in metafunc.fixturenames:
        unused = "the test uses neither the ds_config nor the ds_engine fixture, so the configs would be unused"
        fail(f"{where}: {unused}")
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
        fail(str(exc))
    if found is not None:
        _parametrize(metafunc, "ds_world_size", list(found), [size_id(n) for n in found])


def variants(metafunc: pytest.Metafunc) -> None:
    try:
        fix = common_fix(markers.gates(metafunc.definition))
    except MarkerError as exc:
        fail(str(exc))
    if fix is not None:
        _parametrize(metafunc, "ds_variant", list(markers.VARIANTS))


def _parametrize(metafunc: pytest.Metafunc, fixture: str, values: list[object], ids: list[str] | None = None) -> None:
    """One test per value of the plugin's own ``fixture``, whether or not the test names it."""
    if fixture not in metafunc.fixturenames:
        metafunc.fixturenames.append(fixture)
    metafunc.parametrize(fixture, values, ids=ids, indirect=True)


def select(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``--ds-shard I/N``: keep every N-th item, starting with the I-th, in their order, so that N machines (or
    processes) share one run, each with worlds of its own (``dsrepro matrix`` merges their results files); the others
    are deselected (pytest counts them as such).

    Every N-th item rather than contiguous blocks: a catalogue's slow repros sit together in its files.
    """
    shard = config.stash[SETTINGS_KEY].shard
    if shard is None:
        return
    index, count = shard
    kept = [item for i, item in enumerate(items) if i % count == index - 1]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[item for i, item in enumerate(items) if i % count != index - 1])
        items[:] = kept
