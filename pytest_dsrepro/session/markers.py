"""The markers: documented once (``pytest --markers``), parsed and validated once per test into ``Marks``."""

from __future__ import annotations

from typing import NoReturn

import pytest

from ..core import configs
from ..core.configs import PRESETS
from ..core.errors import MarkerError
from ..core.gates import FIXED, STOCK, Condition, VersionGate, common_fix, parse_condition, parse_gates
from ..core.options import Settings
from ..core.results import REPRO_PARAMETERS
from ..core.worlds import world_spec
from .stash import Marks

MARKERS = {
    "ds_world": "ds_world(size=None, backend=None, timeout=None, reuse=False): run the test body in every rank of a "
    "fresh torch.distributed world started by pytest-dsrepro (size defaults to --ds-world-size, backend to "
    "--ds-backend, timeout to --ds-timeout). Fixtures ds_rank and ds_world_size tell a rank who it is. "
    "reuse=True (on a class or module): its tests run one after another on the same ranks, each with a fresh "
    "process group and environment; a failure, hang or crash discards the ranks.",
    "ds_config": "ds_config(*presets_or_dicts): parametrize the ds_config fixture with named DeepSpeed presets "
    f"({', '.join(PRESETS)}) and/or config dicts; each becomes its own test id.",
    "ds_version": "ds_version(affected, raises, match=None, fix=None): the bug affects DeepSpeed releases in the "
    "PEP 440 specifier set `affected`: there the test must fail with `raises` (message matching `match`), "
    "elsewhere it must pass. `fix` (a callable taking a pytest.MonkeyPatch, or 'module:name') adds a [fixed] "
    "variant that applies it in every rank and must pass on every release. Several markers may cover disjoint ranges.",
    "ds_prerequisite": "ds_prerequisite(releases, fix, reason): on DeepSpeed releases in the PEP 440 specifier set "
    "`releases`, another bug masks this one, so `fix` (a callable taking a pytest.MonkeyPatch, or 'module:name') is "
    "applied in every rank before the body, in every variant; the verdict and the matrix say so, with `reason`.",
    "ds_not_applicable": "ds_not_applicable(releases, reason): on DeepSpeed releases in `releases` the test does not "
    "run (the API it needs is missing, another bug makes it meaningless); its verdict there is NOT-APPLICABLE, with "
    "`reason`, never a silent skip.",
    "ds_repro": "ds_repro(id, title, upstream, fix_ref=None, fixed_in=None, root_cause=''): catalogue metadata of a "
    "repro module: upstream issue, first fixed release (None: unfixed), root cause.",
}
VARIANTS = (STOCK, FIXED)


def fail(message: str) -> NoReturn:
    """Fail the test (or its collection) with ``message`` alone: no traceback, no chained exception printed twice."""
    raise pytest.fail.Exception(message, pytrace=False) from None


def register(config: pytest.Config) -> None:
    for text in MARKERS.values():
        config.addinivalue_line("markers", text)


def gates(node: pytest.Item) -> tuple[VersionGate, ...]:
    """Every ``ds_version`` marker of a test or a test function's definition, validated (``MarkerError``)."""
    marks = [(m.args, dict(m.kwargs)) for m in node.iter_markers("ds_version")]
    return parse_gates(marks, f"@pytest.mark.ds_version on {node.nodeid}")


def conditions(node: pytest.Item, name: str) -> tuple[Condition, ...]:
    """Every ``ds_prerequisite`` or ``ds_not_applicable`` marker of a test, validated (``MarkerError``)."""
    where = f"@pytest.mark.{name} on {node.nodeid}"
    with_fix = name == "ds_prerequisite"
    return tuple(parse_condition(m.args, dict(m.kwargs), where, with_fix=with_fix) for m in node.iter_markers(name))


def variant(item: pytest.Item) -> str | None:
    """``"stock"`` or ``"fixed"`` for tests whose ``ds_version`` declares a fix (see ``parametrize.variants``)."""
    callspec = getattr(item, "callspec", None)
    value = callspec.params.get("ds_variant") if callspec is not None else None
    return value if value in VARIANTS else None


def parse(item: pytest.Item, settings: Settings) -> Marks:
    """The test's markers, validated; ``MarkerError`` names the marker, the test and the value."""
    found = gates(item)
    check_repro(item)
    world = item.get_closest_marker("ds_world")
    spec = None
    if world is not None:
        spec = world_spec(world.args, world.kwargs, settings, f"@pytest.mark.ds_world on {item.nodeid}")
    return Marks(
        world=spec, gates=found, fix=common_fix(found), variant=variant(item),
        prerequisites=conditions(item, "ds_prerequisite"), not_applicable=conditions(item, "ds_not_applicable"),
    )  # fmt: skip


def check_config(item: pytest.Item) -> None:
    """This test id's ``ds_config`` entry is a known preset or a dict (what the ``ds_config`` fixture would refuse,
    refused before the fork server starts)."""
    callspec = getattr(item, "callspec", None)
    param = callspec.params.get("ds_config") if callspec is not None else None
    if not isinstance(param, tuple) or len(param) != 2:
        return
    name, spec = param
    try:
        configs.resolve(spec, name, 1, "gloo")
    except configs.ConfigError as exc:
        raise MarkerError(f"@pytest.mark.ds_config on {item.nodeid}: {exc}") from None


def check_repro(item: pytest.Item) -> None:
    """A ``ds_repro`` marker names only the catalogue's fields: a misspelt one would silently vanish from reports."""
    mark = item.get_closest_marker("ds_repro")
    if mark is None:
        return
    unknown = sorted(set(mark.kwargs) - set(REPRO_PARAMETERS))
    if unknown or len(mark.args) > len(REPRO_PARAMETERS):
        extra = unknown or [repr(a) for a in mark.args[len(REPRO_PARAMETERS) :]]
        raise MarkerError(
            f"@pytest.mark.ds_repro on {item.nodeid}: unexpected argument(s) {', '.join(extra)}; "
            f"takes {', '.join(REPRO_PARAMETERS)}"
        )
