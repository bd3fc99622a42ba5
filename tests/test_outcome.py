"""How rank endings are grouped and told: pure functions on plain data."""

from __future__ import annotations

from pytest_dsrepro.core.outcome import (
    PHASES,
    ErrorInfo,
    RankResult,
    Status,
    WorldOutcome,
    describe_failure,
    phases,
    rank_ranges,
)


def test_rank_ranges() -> None:
    assert rank_ranges([3]) == "rank 3"
    assert rank_ranges([1, 0]) == "ranks 0-1"
    assert rank_ranges([0, 1, 2, 5, 7, 8]) == "ranks 0-2,5,7-8"


def _failed(rank: int, exc: BaseException, tb: str = "Traceback: same") -> RankResult:
    return RankResult(rank, Status.FAILED, error=ErrorInfo.from_exception(exc, tb), output=f"out {rank}")


def test_identical_failures_are_told_once_with_each_rank_output() -> None:
    outcome = WorldOutcome(
        4,
        "gloo",
        (
            _failed(0, AttributeError("x")),
            _failed(1, AttributeError("x")),
            RankResult(2, Status.CRASHED, detail="killed by signal SIGSEGV"),
            RankResult(3, Status.STOPPED, detail="still running 2s after ranks 0-1 failed", output="ignored"),
        ),
        1.25,
    )
    text = describe_failure(outcome)
    assert text.splitlines()[0] == (
        "ranks 0-1: AttributeError: x; rank 2: crashed: killed by signal SIGSEGV; "
        "rank 3: stopped: still running 2s after ranks 0-1 failed"
    )
    assert text.splitlines()[1] == "(4-rank gloo world, 1.2s)"
    assert text.count("Traceback: same") == 1
    assert "out 0" in text
    assert "out 1" in text
    assert "ignored" not in text
    assert [r.rank for r in outcome.failures] == [0, 1, 2]  # a stopped rank is a consequence, not a failure


def test_exception_types_match_by_mro_without_importing() -> None:
    class Custom(KeyError):
        pass

    info = ErrorInfo.from_exception(Custom("k"), "")
    assert info.is_instance_of(KeyError)
    assert info.is_instance_of(LookupError)
    assert not info.is_instance_of(AttributeError)
    assert info.summary == "Custom: 'k'"


def test_skip_only_when_nothing_else_went_wrong() -> None:
    skipped = RankResult(0, Status.SKIPPED, detail="no GPU")
    assert WorldOutcome(2, "gloo", (skipped, RankResult(1, Status.PASSED)), 0).declared == skipped
    assert WorldOutcome(2, "gloo", (skipped, _failed(1, KeyError())), 0).declared is None


def test_a_phase_ends_when_its_slowest_rank_ends_it() -> None:
    """Rank 1 starts late and rank 0 loads late: each phase is counted from the slowest rank's end of the last."""
    marks = [(1.0, 1.1, 1.5, 1.6, 2.0), (1.2, 1.3, 1.4, 1.7, 2.5)]
    told = phases(0.5, marks, 2.75)
    assert [name for name, _ in told] == list(PHASES)
    assert [round(s, 3) for _, s in told] == [0.7, 0.1, 0.2, 0.2, 0.8, 0.25]
