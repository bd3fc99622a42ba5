"""Performance regressions as verdicts: time the work a bug made slow against a reference in the same run.

Nothing fails in a slowdown, so a repro asserts one with :func:`slowdown`, and a busy machine must not flip it.
The measurement travels in the rank's report: the verdict, the terminal, the results file, the report and JUnit
say what was measured, against what, and with what margin. Torch is imported inside functions only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

# Absolute imports: ``dsrepro export`` inlines what a repro uses from pytest_dsrepro into a standalone script, and
# it follows the package's absolute imports only.
from pytest_dsrepro.core.outcome import Measurement
from pytest_dsrepro.inrank.context import measured
from pytest_dsrepro.inrank.devices import rank_device


class Slowdown(AssertionError):
    """The subject took ``limit`` times its reference or more: the performance regression, as ``raises=`` names it."""


def _least_of_world(seconds: float, reference_seconds: float) -> tuple[float, float]:
    """The slowest rank's least times, in every rank (as they are when no process group is up): one number for the
    world (an all-reduce), so the ranks decide together and never half of a world fails."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return seconds, reference_seconds
    both = torch.tensor([seconds, reference_seconds], dtype=torch.float64, device=rank_device())  # NCCL: on the GPU
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return float(both[0]), float(both[1])


#: The clocks a measurement can use: the calling thread's CPU time (what the code itself costs: the time other
#: processes take from a busy machine, and the time spent waiting in a collective for another rank, are not
#: counted), or wall time (what a user waits; a busy machine inflates it).
CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.thread_time, "wall": time.perf_counter}


def _timed(work: Callable[[], object], clock: Callable[[], float]) -> float:
    started = clock()
    work()
    return clock() - started


def _least_times(
    subject: Callable[[], object], reference: Callable[[], object], repeats: int, warmup: int, tick: Callable[[], float]
) -> tuple[float, float]:
    """The least time of each over ``repeats`` interleaved calls, after ``warmup`` untimed ones; which goes first
    alternates, so that neither always runs on what the other left warm (caches, allocator). Interleaved, load that
    comes and goes hits both; and load only ever adds time, so the quickest of several runs is the closest to the
    code's own."""
    for _ in range(warmup):
        subject()
        reference()
    best = best_reference = math.inf
    for i in range(repeats):
        if i % 2:
            best_reference = min(best_reference, _timed(reference, tick))
            best = min(best, _timed(subject, tick))
        else:
            best = min(best, _timed(subject, tick))
            best_reference = min(best_reference, _timed(reference, tick))
    return best, best_reference


def slowdown(
    subject: Callable[[], object],
    reference: Callable[[], object],
    *,
    what: str,
    against: str,
    limit: float,
    repeats: int = 5,
    warmup: int = 1,
    clock: str = "cpu",
) -> Measurement:
    """Time ``subject`` against ``reference`` (each called ``warmup`` times untimed, then ``repeats`` times,
    interleaved); raise :class:`Slowdown` when the subject took ``limit`` times the reference or more.

    ``what`` and ``against`` say in words what the two do (``"backward of 256 tensors"``, ``"8 backwards of 32
    tensors"``). ``clock``: ``"cpu"`` (the calling thread's CPU time, the default: a slowdown in the code's own work
    is measured as the code's work, whatever else the machine runs) or ``"wall"`` (for a slowdown in waiting: I/O,
    communication). Call it in every rank: the ranks agree on the slowest rank's times (``_least_of_world``).

    A busy machine must not flip the verdict: the reference is the same kind of work done the way the bug does not
    slow down (for an O(n) cost per hook, the same number of hooks in smaller backwards), so the ratio is about the
    code, not about the machine; each time is the least of interleaved runs (``_least_times``); and the repro chooses
    ``limit`` far from both sides, between what healthy and affected releases measure, the margin (how far over the
    measured ratio would have to move to flip the verdict) reported every time.
    """
    if not (limit > 0 and math.isfinite(limit)) or repeats < 1 or warmup < 0 or clock not in CLOCKS:
        raise ValueError(
            f"slowdown: limit={limit!r} must be a ratio > 0, repeats={repeats!r} >= 1, warmup >= 0, clock={clock!r} "
            f"one of {', '.join(CLOCKS)}"
        )
    best, best_reference = _least_of_world(*_least_times(subject, reference, repeats, warmup, CLOCKS[clock]))
    measurement = Measurement(what, against, best, best_reference, limit, repeats, clock)
    measured(measurement)
    if measurement.slow:
        raise Slowdown(f"{what} took {measurement.ratio:.2f}x {against} (limit {limit:g}x)")
    return measurement
