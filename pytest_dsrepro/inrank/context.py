"""Who the running rank is, for repro bodies and the plugin's rank-side helpers (``pytest_dsrepro.current()``).

Set by the world's rank bootstrap (``worlds.rank.spawned_rank``) or, under an external launcher, by
``worlds.launched.launched_world``, for the duration of one test body.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

# Absolute, as in ``inrank.perf``: ``dsrepro export`` inlines ``measured`` into standalone scripts.
from pytest_dsrepro.core.outcome import Measurement
from pytest_dsrepro.core.world_spec import accelerator_for


@dataclass(frozen=True)
class RankContext:
    """The running rank, as the body and the plugin's rank-side fixtures see it."""

    rank: int
    world_size: int
    local_rank: int
    backend: str

    @property
    def device(self) -> str:
        """Where DeepSpeed puts this rank's engine, so where its data goes: ``cuda:LOCAL_RANK`` on the CUDA
        accelerator (NCCL worlds, or the user's ``DS_ACCELERATOR=cuda``), else ``cpu``."""
        cuda = accelerator_for(self.backend, os.environ) == "cuda"
        return f"cuda:{self.local_rank}" if cuda else "cpu"


_current: RankContext | None = None
_measured: list[Measurement] = []  # what the running body timed (``inrank.perf``), for its rank's report


def current() -> RankContext:
    """The context of the rank this code runs in; fails outside a world."""
    if _current is None:
        raise RuntimeError("not inside a pytest-dsrepro world: mark the test with @pytest.mark.ds_world")
    return _current


@contextmanager
def running(ctx: RankContext) -> Iterator[RankContext]:
    """Make ``ctx`` the current rank while a body runs (with nothing timed yet)."""
    global _current
    _current = ctx
    _measured.clear()
    try:
        yield ctx
    finally:
        _current = None


def measured(measurement: Measurement) -> None:
    """Keep what the running body timed: its rank's report carries it to the verdict."""
    _measured.append(measurement)


def measurements() -> tuple[Measurement, ...]:
    """What the last body to run in this process timed, in order."""
    return tuple(_measured)
