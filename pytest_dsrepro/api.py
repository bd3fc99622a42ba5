"""The public API: every name that tests, conftest files and other plugins (``pytest_dsrepro.upstream``) import.

``pytest_dsrepro`` re-exports these names lazily, so that importing one of its subpackages (in the fork server, in a
rank, in the ``dsrepro`` command) loads nothing else; this module imports them plainly, so that the import contracts
(pyproject.toml) see what a user of the API depends on.
"""

from __future__ import annotations

from .core.gates import Verdict
from .inrank.context import RankContext, current
from .inrank.engine import ConfigRejected, EngineFactory
from .inrank.fixtures import rank_fixture
from .inrank.perf import Slowdown, slowdown
from .session.backends import starting_worlds
from .session.inworld import run_in_world
from .session.verdicts import WorldFailed

__all__ = [
    "ConfigRejected", "EngineFactory", "RankContext", "Slowdown", "Verdict", "WorldFailed", "current", "rank_fixture",
    "run_in_world", "slowdown", "starting_worlds",
]  # fmt: skip
