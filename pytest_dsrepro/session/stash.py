"""What the plugin keeps on ``config.stash`` and on each item's stash: one key per fact, typed, set once."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from ..core.configs import ResolvedConfig
from ..core.gates import Condition, Fix, Judgement, Nondeterministic, VersionGate
from ..core.options import Settings
from ..core.outcome import WorldOutcome
from ..core.premises import Premise
from ..core.world_spec import WorldSpec


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


SETTINGS_KEY = pytest.StashKey[Settings]()
MARKS_KEY = pytest.StashKey[Marks]()
PREPARED_KEY = pytest.StashKey[Prepared]()
CONFIG_KEY = pytest.StashKey[ResolvedConfig]()
OUTCOME_KEY = pytest.StashKey[WorldOutcome]()
#: Did the session end interrupted (Ctrl-C)? Then nothing is waited for at its end.
INTERRUPTED_KEY = pytest.StashKey[bool]()
JUDGEMENT_KEY = pytest.StashKey[Judgement]()
SERIES_KEY = pytest.StashKey[Series]()
#: Each test file's digest when pytest collected it: ranks import the file again, which must still be that code.
SOURCES_KEY = pytest.StashKey[dict[str, str | None]]()
