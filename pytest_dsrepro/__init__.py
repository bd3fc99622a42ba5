"""pytest-dsrepro: DeepSpeed distributed-training bugs as executable pytest tests in real N-rank worlds.

The public names live in ``pytest_dsrepro.api`` and are resolved from there on first use, so importing a subpackage
(in the fork server, in a rank, in the ``dsrepro`` command) loads nothing else of the package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .api import (
        ConfigRejected,
        EngineFactory,
        RankContext,
        Slowdown,
        Verdict,
        WorldFailed,
        current,
        rank_fixture,
        run_in_world,
        slowdown,
        starting_worlds,
    )

__all__ = [
    "ConfigRejected", "EngineFactory", "RankContext", "Slowdown", "Verdict", "WorldFailed", "current", "rank_fixture",
    "run_in_world", "slowdown", "starting_worlds",
]  # fmt: skip


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import api

    return getattr(api, name)
