"""``--ds-scan CONFIG``: a user's DeepSpeed config run through the catalogue, on the pytest side.

At configure the config is read and checked (``core.userconfig``: a usage error naming file:line:col or the key,
before anything starts). At collection each catalogued repro (a test with ``ds_repro``) gets one test id, ``[scan]``,
whose ``ds_config`` is the user's config; its own config ids and its ``[fixed]`` variant are not made, and tests
that are no repro are deselected. At setup the repro's ``ds_premise`` is judged on the config as written (``"auto"``
resolved for the world, before the CPU adaptations): a config that cannot meet it is NOT APPLICABLE with the
premise's words and no world; else the premise's ``sets`` go on top of the config, each said. After the body the
gates' judgement becomes the scan's verdict (``core.scan.finding``), which decides the pytest outcome: AFFECTED and
CANNOT TELL fail, NOT AFFECTED passes, NOT APPLICABLE skips.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, NoReturn

import pytest

from ..core import configs, userconfig
from ..core.gates import Judgement, Reason
from ..core.options import Settings
from ..core.results import Finding, ScanSource, ScanVerdict
from ..core.scan_verdicts import finding, not_applicable
from ..worlds.device_nodes import gpu_device_nodes
from . import markers
from .stash import Marks, Prepared

SCAN_KEY = pytest.StashKey[userconfig.UserConfig]()
#: A scanned test's verdict decided at setup (no world ran for it).
FINDING_KEY = pytest.StashKey[Finding]()
PLAN_KEY = pytest.StashKey["Plan"]()
#: The test id of a repro's one scanned test.
SCAN_ID = "scan"


@dataclass(frozen=True)
class Plan:
    """What a scanned test's world runs: the user's config with the premise's settings on top, and those settings
    in words."""

    config: dict[str, Any]
    notes: tuple[str, ...]


def configure(config: pytest.Config, settings: Settings) -> None:
    """Read the user's config once; whatever is wrong with it is a usage error now. On a machine with no GPU (or
    ``--ds-backend gloo``) the worlds are gloo, so what needs CUDA and has no CPU form is refused now too."""
    if settings.scan is None:
        return
    gloo = settings.backend == "gloo" or (settings.backend == "auto" and not gpu_device_nodes())
    try:
        config.stash[SCAN_KEY] = userconfig.load(settings.scan, "gloo" if gloo else None)
    except userconfig.UserConfigError as exc:
        raise pytest.UsageError(f"pytest-dsrepro: --ds-scan {exc}") from None


def source(config: pytest.Config) -> ScanSource | None:
    """The scanned config, as the run's record names it; None outside a scan."""
    user = config.stash.get(SCAN_KEY, None)
    return None if user is None else ScanSource(user.path, user.config, user.notes)


def active(node: pytest.Item) -> bool:
    """Is ``node`` (a test or a test function's definition) a repro scanned in this run?"""
    return SCAN_KEY in node.config.stash and node.get_closest_marker("ds_repro") is not None


def parametrize(metafunc: pytest.Metafunc) -> bool:
    """One ``[scan]`` test id whose ``ds_config`` is the user's config, in place of the repro's own; True when this
    test is scanned (then neither its configs nor its variants are made)."""
    if not active(metafunc.definition):
        return False
    if "ds_config" in metafunc.fixturenames:
        user = metafunc.config.stash[SCAN_KEY]
        metafunc.parametrize("ds_config", [(SCAN_ID, user.config)], ids=[SCAN_ID], indirect=True)
    return True


def deselect(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A scan runs the catalogue's repros only: other tests collected beside them are deselected."""
    if SCAN_KEY not in config.stash:
        return
    other = [item for item in items if not active(item)]
    if other:
        config.hook.pytest_deselected(items=other)
        items[:] = [item for item in items if active(item)]


def _skip(item: pytest.Item, found: Finding) -> NoReturn:
    item.stash[FINDING_KEY] = found
    raise pytest.skip.Exception(f"{found.verdict.value}: {found.detail}")


def _accelerator(prepared: Prepared) -> str:
    return "cuda" if prepared.backend == "nccl" else "cpu"


def setup(item: pytest.Item, marks: Marks, prepared: Prepared | None) -> None:
    """Judge the premise on the user's config; no world for a config that cannot meet it."""
    if not active(item):
        return
    if "ds_config" not in getattr(item, "fixturenames", ()):
        _skip(item, Finding(ScanVerdict.CANNOT_TELL, "the repro builds its own config (no ds_config): a user's "
                                                     "config cannot be run through it"))  # fmt: skip
    premise = marks.premise
    if premise is None:
        _skip(item, Finding(ScanVerdict.CANNOT_TELL, "the repro declares no ds_premise: what a config needs for its "
                                                     "bug is not known"))  # fmt: skip
    user = item.config.stash[SCAN_KEY]
    size = marks.world.size if marks.world is not None else 1
    written = configs.resolve(user.config, SCAN_ID, size, prepared.backend if prepared else "gloo").written
    unmet = list(premise.unmet(written))
    if premise.accelerator and prepared is not None and premise.accelerator != _accelerator(prepared):
        unmet.append(f"needs the {premise.accelerator} accelerator; these worlds use {_accelerator(prepared)}")
    if unmet:
        _skip(item, not_applicable(unmet))
    config = copy.deepcopy(user.config)
    item.stash[PLAN_KEY] = Plan(config, tuple(premise.apply(config)))


def config_spec(node: pytest.Item, name: str, spec: object) -> object:
    """What the ``ds_config`` fixture resolves: a scanned test's plan, else the test id's own entry."""
    plan = node.stash.get(PLAN_KEY, None)
    return plan.config if plan is not None and name == SCAN_ID else spec


def _fixed_in(item: pytest.Item) -> str | None:
    mark = item.get_closest_marker("ds_repro")
    value = mark.kwargs.get("fixed_in") if mark is not None else None
    return None if value is None else str(value)


def finding_of(item: pytest.Item, judgement: Judgement | None, error: str | None) -> Finding | None:
    """A scanned test's verdict for its record: decided at setup, else from the gates' judgement; a test that was
    never judged (a skip in the body, a missing extra, a marker error) is CANNOT TELL, with what it said."""
    if not active(item):
        return None
    decided = item.stash.get(FINDING_KEY, None)
    if decided is not None:
        return decided
    plan = item.stash.get(PLAN_KEY, None)
    notes = plan.notes if plan is not None else ()
    if judgement is None:
        return Finding(ScanVerdict.CANNOT_TELL, error or "it did not run", notes)
    return finding(judgement.reason, judgement.message, fixed_in=_fixed_in(item), rate=judgement.rate, notes=notes)


def conclude(item: pytest.Item, judgement: Judgement, story: str) -> None:
    """The pytest outcome of a scanned test from its verdict: returns for NOT AFFECTED (the body passed)."""
    found = finding_of(item, judgement, None)
    assert found is not None
    if found.verdict is ScanVerdict.NOT_AFFECTED:
        return
    if found.verdict is ScanVerdict.NOT_APPLICABLE:
        pytest.skip(f"{found.verdict.value}: {found.detail}")
    text = f"{found.verdict.value}: {found.detail}"
    if judgement.reason is not Reason.REPRODUCED:
        text += f"\n\n{story}".rstrip()
    markers.fail(text)
