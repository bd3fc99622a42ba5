"""pytest-dsrepro: DeepSpeed distributed-training bugs as executable pytest tests in real N-rank worlds."""

from .inrank.engine import ConfigRejected, EngineFactory
from .core.gates import Verdict
from .core.outcome import WorldFailed
from .worlds.rank import RankContext, current

__all__ = ["ConfigRejected", "EngineFactory", "RankContext", "Verdict", "WorldFailed", "current"]
