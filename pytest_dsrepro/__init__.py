"""pytest-dsrepro: DeepSpeed distributed-training bugs as executable pytest tests in real N-rank worlds."""

from .engine import ConfigRejected, EngineFactory
from .gates import Verdict
from .outcome import WorldFailed
from .rank import RankContext, current

__all__ = ["ConfigRejected", "EngineFactory", "RankContext", "Verdict", "WorldFailed", "current"]
