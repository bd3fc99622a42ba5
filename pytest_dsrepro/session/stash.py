"""What the plugin keeps on ``config.stash`` and on each item's stash: one key per fact, typed, set once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest

from ..core.configs import ResolvedConfig
from ..core.gates import Condition, Fix, Judgement, Nondeterministic, VersionGate
from ..core.options import Settings
from ..core.outcome import WorldOutcome
from ..core.premises import Premise
from ..core.results import Finding
from ..core.world_spec import WorldSpec

if TYPE_CHECKING:  # the plugin objects kept on the stash; their modules import this one
    from .backends import Worlds
    from .scan_plugin import Scan


@dataclass(frozen=True)
class Marks:
    """A test's markers, parsed and validated once at setup (``markers.parse``)."""

    world: WorldSpec | None  # None: not a world test
    gates: tuple[VersionGate, ...]
    fix: Fix | None  # applied in every rank when variant == "fixed"
    variant: str | None  # "stock" or "fixed" when the gates declare a fix
    prerequisites: tuple[Condition, ...] = ()  # ds_prerequisite: fixes applied before the body on their releases
    not_applicable: tuple[Condition, ...] = ()  # ds_not_applicable: releases where the body does not run
    premise: Premise | None = None  # ds_premise: what a config must have for the bug to be possible
    nondeterministic: Nondeterministic | None = None  # ds_nondeterministic: runs per verdict, judged by their rate


@dataclass(frozen=True)
class Prepared:
    """A world test, ready to run: its world and the backend settled for the devices at hand."""

    spec: WorldSpec
    backend: str  # gloo or nccl


@dataclass(frozen=True)
class Series:
    """The worlds one nondeterministic verdict ran, in order, and their wall time all together."""

    outcomes: tuple[WorldOutcome, ...]
    seconds: float


@dataclass(frozen=True)
class ScanPlan:
    """What a scanned test's world runs: the user's config with the premise's settings on top, and those settings
    in words."""

    config: dict[str, Any]
    notes: tuple[str, ...]


# ---- the run's (config.stash) ---------------------------------------------------------------------------------

SETTINGS_KEY = pytest.StashKey[Settings]()
#: Where this run's worlds run, chosen once at configure (``backends.choose``).
WORLDS_KEY: pytest.StashKey[Worlds] = pytest.StashKey()
#: ``--ds-scan``'s plugin object: the user's config; absent outside a scan.
SCAN_KEY: pytest.StashKey[Scan] = pytest.StashKey()
#: Did the session end interrupted (Ctrl-C)? Then nothing is waited for at its end.
INTERRUPTED_KEY = pytest.StashKey[bool]()
#: Each test file's digest when pytest collected it: ranks import the file again, which must still be that code.
SOURCES_KEY = pytest.StashKey[dict[str, str | None]]()

# ---- a test function's definition (metafunc.definition.stash) -------------------------------------------------

#: The scan gave this test its config: neither its own configs nor its ``[fixed]`` variant are made.
SCANNED_KEY = pytest.StashKey[bool]()

# ---- each test's (item.stash) ---------------------------------------------------------------------------------

MARKS_KEY = pytest.StashKey[Marks]()
PREPARED_KEY = pytest.StashKey[Prepared]()
CONFIG_KEY = pytest.StashKey[ResolvedConfig]()
OUTCOME_KEY = pytest.StashKey[WorldOutcome]()
JUDGEMENT_KEY = pytest.StashKey[Judgement]()
SERIES_KEY = pytest.StashKey[Series]()
#: Where a skip the harness raised is reported (``skip_location``): the body's line in its rank, or the test's.
SKIP_AT_KEY = pytest.StashKey[tuple[str, int]]()
#: A scanned test's plan (its config); its verdict when decided at setup (no world ran for it).
SCAN_PLAN_KEY = pytest.StashKey[ScanPlan]()
SCAN_FINDING_KEY = pytest.StashKey[Finding]()
