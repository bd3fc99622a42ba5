"""The markers: documented once (``pytest --markers``), parsed and validated once per test into ``Marks``, kept on
the item's stash for every later phase."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import pytest

from ..core import configs, premises
from ..core.configs import PRESETS
from ..core.errors import MarkerError
from ..core.faces import Face
from ..core.faces import parse_all as parse_faces
from ..core.gates import (
    FIXED,
    STOCK,
    Condition,
    Fix,
    Nondeterministic,
    VersionGate,
    common_fix,
    parse_condition,
    parse_gates,
    parse_nondeterministic,
)
from ..core.options import Settings
from ..core.premises import Premise, own_config_problem
from ..core.results import REPRO_PARAMETERS, Origin
from ..core.world_spec import WorldSpec, world_spec


@dataclass(frozen=True)
class Marks:
    """A test's markers, parsed and validated once at setup (``settle``)."""

    world: WorldSpec | None  # None: not a world test
    gates: tuple[VersionGate, ...]
    fix: Fix | None  # applied in every rank when variant == "fixed"
    variant: str | None  # "stock" or "fixed" when the gates declare a fix
    prerequisites: tuple[Condition, ...] = ()  # ds_prerequisite: fixes applied before the body on their releases
    not_applicable: tuple[Condition, ...] = ()  # ds_not_applicable: releases where the body does not run
    premise: Premise | None = None  # ds_premise: what a config must have for the bug to be possible
    nondeterministic: Nondeterministic | None = None  # ds_nondeterministic: runs per verdict, judged by their rate


#: What a test's markers said, once its setup parsed them (absent when they were wrong: its setup failed saying so).
MARKS_KEY = pytest.StashKey[Marks]()


class GivenConfig(NamedTuple):
    """A ``ds_config`` entry a plugin gave the test in place of its own (``parametrize.give_config``): that plugin
    judges it against the repro's premise, so setup does not (``check_config``)."""

    name: str
    config: dict[str, Any]


MARKERS = {
    "ds_world": "ds_world(size=None, backend=None, timeout=None, reuse=False, process_group=True, launcher_env=True): "
    "run the test body in every rank of a fresh torch.distributed world started by pytest-dsrepro (size defaults to "
    "--ds-world-size, backend to --ds-backend, timeout to --ds-timeout; a list of sizes makes one test per size). "
    "reuse=True (on a class or module): its tests run one after another on the same ranks, each with a fresh "
    "process group and environment; a hang or crash discards the ranks (a failure too in an NCCL world). "
    "process_group=False: no default "
    "process group (nor DeepSpeed's comm layer bound); launcher_env=False: no RANK, WORLD_SIZE, MASTER_ADDR, ... "
    "variables. Markers on the module, class and function merge, the closest setting each argument. Fixtures ds_rank "
    "and ds_world_size tell a rank who it is.",
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
    "ds_nondeterministic": "ds_nondeterministic(runs, failures=1): the bug shows in some runs only (a race), so each "
    "verdict runs the body `runs` times, each in a fresh world, and is judged by its rate: REPRODUCED when at least "
    "`failures` runs fail as declared (said as 'REPRODUCED 9/20'), FIXED and PASSES-WITH-FIX only when none fails.",
    "ds_repro": "ds_repro(id, title, upstream, fix_ref=None, fixed_in=None, root_cause=''): catalogue metadata of a "
    "repro module: upstream issue, first fixed release (None: unfixed), root cause.",
    "ds_premise": f"ds_premise({'=, '.join(premises.PARAMETERS)}=): what a DeepSpeed config must have for the "
    "repro's bug to be possible (ZeRO stage, precision fp32/fp16/bf16, offload devices, an optimizer section or not, "
    "gradient accumulation as a number or '>=3', other dotted keys); `sets` (with `because`) is what a scan puts on "
    "top of a user's config. Checked against the repro's own configs at setup; used by --ds-scan.",
    "ds_seen": "ds_seen(where, raises=None, match=None, frames=(), words=(), gpu=False): one face users meet the "
    "repro's bug in, seen at the link `where`: the exception's name as printed, a pattern of its message, DeepSpeed "
    "functions it raises through ('function' or 'file.py:function'), phrases its reports use; gpu=True: seen on GPUs "
    "(NCCL). Evidence for dsrepro triage, shown by dsrepro list and the report; never a gate (ds_version is).",
    "ds_origin": "ds_origin(project, revision, described=None): the test comes from another project's test-suite "
    "at that revision (`-p pytest_dsrepro.upstream` marks DeepSpeed's own tests so); results and the matrix name it.",
}
VARIANTS = (STOCK, FIXED)


def register(config: pytest.Config) -> None:
    for text in MARKERS.values():
        config.addinivalue_line("markers", text)


def gates(node: pytest.Item) -> tuple[VersionGate, ...]:
    """Every ``ds_version`` marker of a test or a test function's definition, validated (``MarkerError``)."""
    marks = [(m.args, dict(m.kwargs)) for m in node.iter_markers("ds_version")]
    return parse_gates(marks, f"@pytest.mark.ds_version on {node.nodeid}")


def faces(node: pytest.Item) -> tuple[Face, ...]:
    """Every ``ds_seen`` marker of a test, validated (``MarkerError`` naming the marker, the test and the value)."""
    marks = [(m.args, m.kwargs) for m in node.iter_markers("ds_seen")]
    return parse_faces(marks, f"@pytest.mark.ds_seen on {node.nodeid}")


def conditions(node: pytest.Item, name: str) -> tuple[Condition, ...]:
    """Every ``ds_prerequisite`` or ``ds_not_applicable`` marker of a test, validated (``MarkerError``)."""
    where = f"@pytest.mark.{name} on {node.nodeid}"
    with_fix = name == "ds_prerequisite"
    return tuple(parse_condition(m.args, dict(m.kwargs), where, with_fix=with_fix) for m in node.iter_markers(name))


def premise(node: pytest.Item) -> Premise | None:
    """A repro's ``ds_premise`` (the closest one: the module's, unless a test declares its own), validated."""
    mark = node.get_closest_marker("ds_premise")
    if mark is None:
        return None
    return premises.parse(mark.args, mark.kwargs, f"@pytest.mark.ds_premise on {node.nodeid}")


def nondeterministic(item: pytest.Item, gated: bool, world: bool) -> Nondeterministic | None:
    """A test's ``ds_nondeterministic`` marker, validated: one per test, on a gated world test."""
    marks = list(item.iter_markers("ds_nondeterministic"))
    if not marks:
        return None
    where = f"@pytest.mark.ds_nondeterministic on {item.nodeid}"
    if len(marks) > 1:
        raise MarkerError(f"{where}: one marker per test (it has {len(marks)}), with the runs and failures it needs")
    if not gated:
        raise MarkerError(f"{where}: a rate is judged against the test's ds_version gates, and it has none")
    if not world:
        raise MarkerError(f"{where}: each run is a fresh world, and this is no world test (add @pytest.mark.ds_world)")
    return parse_nondeterministic(marks[0].args, dict(marks[0].kwargs), where)


def variant(item: pytest.Item) -> str | None:
    """``"stock"`` or ``"fixed"`` for tests whose ``ds_version`` declares a fix (see ``parametrize.variants``)."""
    callspec = getattr(item, "callspec", None)
    value = callspec.params.get("ds_variant") if callspec is not None else None
    return value if value in VARIANTS else None


def settle(item: pytest.Item, settings: Settings) -> Marks:
    """At setup: the test's markers parsed and its own ``ds_config`` entry checked against them, then kept on its
    stash (``MARKS_KEY``); ``MarkerError`` when one is wrong, and nothing kept."""
    marks = parse(item, settings)
    check_config(item, marks.premise)
    item.stash[MARKS_KEY] = marks
    return marks


def parse(item: pytest.Item, settings: Settings) -> Marks:
    """The test's markers, validated; ``MarkerError`` names the marker, the test and the value."""
    found = gates(item)
    check_repro(item)
    faces(item)
    origin(item)
    world = world_arguments(item)
    spec = None
    if world is not None:
        args, kwargs = world
        callspec = getattr(item, "callspec", None)
        if (
            isinstance(kwargs.get("size"), (list, tuple))
            and callspec is not None
            and "ds_world_size" in callspec.params
        ):
            kwargs["size"] = callspec.params["ds_world_size"]  # one of the sizes (``parametrize.sizes``)
        spec = world_spec(args, kwargs, settings, f"@pytest.mark.ds_world on {item.nodeid}")
    return Marks(
        world=spec, gates=found, fix=common_fix(found), variant=variant(item),
        prerequisites=conditions(item, "ds_prerequisite"), not_applicable=conditions(item, "ds_not_applicable"),
        premise=premise(item),
        nondeterministic=nondeterministic(item, bool(found), spec is not None),
    )  # fmt: skip


def world_arguments(node: pytest.Item) -> tuple[tuple[object, ...], dict[str, object]] | None:
    """A test's ``ds_world`` markers merged, the closest setting each argument (function over class over module; an
    argument given as None sets nothing); None when it has none."""
    found = list(node.iter_markers("ds_world"))
    if not found:
        return None
    args: tuple[object, ...] = ()
    kwargs: dict[str, object] = {}
    for mark in reversed(found):
        args += mark.args
        kwargs.update((k, v) for k, v in mark.kwargs.items() if v is not None)
    return args, kwargs


def origin(item: pytest.Item) -> Origin | None:
    """Where the test came from (``ds_origin``), validated (``MarkerError``); None for a test of this project."""
    mark = item.get_closest_marker("ds_origin")
    if mark is None:
        return None
    try:
        return Origin.from_marker(mark.args, mark.kwargs)
    except ValueError as exc:
        raise MarkerError(f"@pytest.mark.ds_origin on {item.nodeid}: {exc}") from None


def check_config(item: pytest.Item, premise: Premise | None = None) -> None:
    """This test id's ``ds_config`` entry is a known preset or a dict (what the ``ds_config`` fixture would refuse,
    refused before the fork server starts), and meets the repro's ``ds_premise``: a repro whose own config cannot
    show its bug, or that runs without the settings a scan would give a user's config, is a defect. A config a plugin
    gave the test (``GivenConfig``) is that plugin's to judge."""
    callspec = getattr(item, "callspec", None)
    param = callspec.params.get("ds_config") if callspec is not None else None
    if isinstance(param, GivenConfig) or not isinstance(param, tuple) or len(param) != 2:
        return
    name, spec = param
    try:
        resolved = configs.resolve(spec, name, 1, "gloo")
    except configs.ConfigError as exc:
        raise MarkerError(f"@pytest.mark.ds_config on {item.nodeid}: {exc}") from None
    problem = None if premise is None else own_config_problem(premise, name, resolved.written, resolved.config)
    if problem is not None:
        raise MarkerError(f"@pytest.mark.ds_premise on {item.nodeid}: {problem}")


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
