"""pytest-dsrepro: DeepSpeed distributed-training bugs as executable pytest tests in real N-rank worlds.

The public names are resolved on first use, so importing a subpackage (in the fork server, in a rank, in the
``dsrepro`` command) loads nothing else of the package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .core.gates import Verdict
    from .inrank.context import RankContext, current
    from .inrank.engine import ConfigRejected, EngineFactory
    from .inrank.fixtures import rank_fixture
    from .inrank.perf import Slowdown, slowdown
    from .session.execution import WorldFailed, starting_worlds
    from .session.inworld import run_in_world

__all__ = [
    "ConfigRejected", "EngineFactory", "RankContext", "Slowdown", "Verdict", "WorldFailed", "current", "rank_fixture",
    "run_in_world", "slowdown", "starting_worlds",
]  # fmt: skip

_WHERE = {
    "ConfigRejected": "inrank.engine",
    "EngineFactory": "inrank.engine",
    "RankContext": "inrank.context",
    "current": "inrank.context",
    "rank_fixture": "inrank.fixtures",
    "Slowdown": "inrank.perf",
    "slowdown": "inrank.perf",
    "Verdict": "core.gates",
    "WorldFailed": "session.execution",
    "starting_worlds": "session.execution",
    "run_in_world": "session.inworld",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
