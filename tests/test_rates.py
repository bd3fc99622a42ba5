"""Verdicts for bugs that do not fail every time or do not fail at all: races judged by their rate over a series of
worlds (``ds_nondeterministic``), and slowdowns judged by a measurement against a reference timed in the same run
(``pytest_dsrepro.slowdown``). Both end to end in real worlds, as a user reads them: terminal, results, report,
JUnit; the measuring helper and the marker's validation as plain functions."""

from __future__ import annotations

import json
import math
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import RunPytest, deepspeed_version
from pytest_dsrepro.core import results
from pytest_dsrepro.core.gates import Reason, Verdict
from pytest_dsrepro.core.outcome import Measurement
from pytest_dsrepro.inrank import context
from pytest_dsrepro.inrank.context import RankContext
from pytest_dsrepro.inrank.perf import Slowdown, slowdown

#: Runs 3, 6 and 9 of ten fail "as declared" (the race), the others pass: a rate the test knows in advance.
RACE = """
import pytest
import torch.distributed as dist

def wait_for_it(monkeypatch):
    monkeypatch.setenv("RACE_FIXED", "1")

def run_number(ds_rank, counter):
    if ds_rank == 0:
        counter.write_text(str(int(counter.read_text() or 0) + 1) if counter.exists() else "1")
    dist.barrier()
    return int(counter.read_text())

@pytest.mark.ds_world
@pytest.mark.ds_nondeterministic(runs=10, failures={failures})
@pytest.mark.ds_version(affected="{affected}", raises=AssertionError, match="race seen", fix=wait_for_it)
def test_race(ds_rank, ds_variant, tmp_path):
    import os
    n = run_number(ds_rank, tmp_path / f"runs-{ds_variant}")
    seen = n % 3 == 0 and "RACE_FIXED" not in os.environ
    assert not seen, f"race seen in run {n}"

@pytest.mark.ds_world
@pytest.mark.ds_nondeterministic(runs=10)
@pytest.mark.ds_version(affected="{affected}", raises=AssertionError, match="race seen")
def test_race_then_a_crash(ds_rank, tmp_path):
    import os
    n = run_number(ds_rank, tmp_path / "runs")
    if n == 2:
        os._exit(3)  # a crash in run 2: the verdict is UNEXPECTED whatever the others do, so the runs stop
    assert n != 1, f"race seen in run {n}"
"""


def _records(out: Path) -> dict[str, results.TestRecord]:
    (path,) = out.glob("*.json")
    return {t.nodeid.split("::")[1]: t for t in results.read(path).tests}


def _junit(path: Path) -> dict[str, dict[str, str]]:
    cases = ET.parse(path).getroot().iter("testcase")
    return {c.get("name", ""): {p.get("name", ""): p.get("value", "") for p in c.iter("property")} for c in cases}


def test_a_race_is_judged_by_its_rate_in_every_output(
    pytester: pytest.Pytester, run: RunPytest, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """3 of 10 runs fail as declared: REPRODUCED 3/10 (2 needed); the fix's 10 runs all pass: PASSES-WITH-FIX 0/10;
    a crash in run 2 stops that series there: UNEXPECTED, its story shown. Every output says the rate."""
    pytester.makepyfile(test_race=RACE.replace("{failures}", "2").replace("{affected}", ">=0"))
    out = tmp_path_factory.mktemp("results")
    result = run("-rx", f"--ds-results={out}", f"--ds-report={out / 'report.md'}", f"--junitxml={out / 'j.xml'}")
    result.assert_outcomes(xfailed=1, passed=1, failed=1)
    V = deepspeed_version()
    result.stdout.fnmatch_lines(
        [
            f"XFAIL *::test_race[[]stock[]] - REPRODUCED on deepspeed {V} (3/10 runs failed as declared, 2 needed): "
            "ranks 0-1: AssertionError: race seen in run 3",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            f"*failed differently on deepspeed {V} (run 2 of 10 ended otherwise, so the runs stopped; 1 failed as "
            f"declared before it): expected AssertionError matching 'race seen' on deepspeed>=0, got ranks 0-1: crashed: "
            "exit code 3*",
            f"*= dsrepro verdicts (deepspeed {V}) =*",
            "REPRODUCED 3/10       *::test_race[[]stock[]]",
            "PASSES-WITH-FIX 0/10  *::test_race[[]fixed[]]",
            "UNEXPECTED 1/2        *::test_race_then_a_crash  -- failed differently *",
        ]
    )
    records = _records(out)
    stock, fixed, crash = records["test_race[stock]"], records["test_race[fixed]"], records["test_race_then_a_crash"]
    assert (stock.verdict, stock.reason) == (Verdict.REPRODUCED, Reason.REPRODUCED)
    assert stock.rate is not None
    assert fixed.rate is not None
    assert crash.rate is not None
    assert (stock.rate.runs, stock.rate.planned, stock.rate.failed, stock.rate.needed) == (10, 10, 3, 2)
    assert 0 < stock.rate.seconds < stock.duration
    assert (fixed.verdict, str(fixed.rate)) == (Verdict.PASSES_WITH_FIX, "0/10")
    assert (crash.reason, crash.rate.runs, crash.rate.failed) == (Reason.FAILED_DIFFERENTLY, 2, 1)
    assert stock.ranks[0].error.startswith("AssertionError: race seen in run 3")  # the run the user is shown
    report = (out / "report.md").read_text()
    assert "| `test_race.py::test_race[stock]` | REPRODUCED 3/10 | xfailed |" in report
    assert "### REPRODUCED 3/10: `test_race.py::test_race[stock]`" in report
    assert (
        "- **Rate:** 3 of 10 runs failed as declared (the bug is nondeterministic: REPRODUCED needs 2 of 10" in report
    )
    stopped = (
        "- **Rate:** 1 of 2 runs failed as declared (the bug is nondeterministic: REPRODUCED needs 1 of 10, FIXED and "
        "PASSES-WITH-FIX need 0); the runs stopped at run 2 of 10"
    )
    assert stopped in report
    junit = _junit(out / "j.xml")
    assert junit["test_race[stock]"]["dsrepro.rate"] == "3/10"
    assert junit["test_race[fixed]"]["dsrepro.rate"] == "0/10"


def test_a_race_that_shows_too_rarely_does_not_reproduce_and_one_failure_is_not_fixed(
    pytester: pytest.Pytester, run: RunPytest
) -> None:
    """4 needed, 3 seen: did not reproduce. Outside the range a single failing run of ten is not FIXED."""
    pytester.makepyfile(RACE.replace("{failures}", "4").replace("{affected}", ">=0"))
    result = run("-k", "test_race and not crash")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(["UNEXPECTED 3/10       *::test_race[[]stock[]]  -- did not reproduce on deepspeed * "
                                 "(3/10 runs failed as declared, 4 needed)*"])  # fmt: skip
    pytester.makepyfile(RACE.replace("{failures}", "1").replace("{affected}", "<0.0.1"))
    result = run("-k", "test_race and not crash")
    result.assert_outcomes(failed=1, skipped=1)  # [fixed]: not applicable outside the affected range
    result.stdout.fnmatch_lines(["UNEXPECTED 3/10  *::test_race[[]stock[]]  -- regression: failed with the "
                                 "declared error on deepspeed * (3/10 runs failed as declared), outside the affected "
                                 "range (<0.0.1)*"])  # fmt: skip


@pytest.mark.parametrize(
    ("marker", "message"),
    [
        ("ds_nondeterministic(runs=1)", "runs=1 must be the number of runs per verdict, a whole number 2 to 1000"),
        ("ds_nondeterministic(20, failures=30)", "failures=30 must say how many of the 20 runs failing as declared"),
        ("ds_nondeterministic(runs=20)", "a rate is judged against the test's ds_version gates, and it has none"),
    ],
)
def test_a_bad_ds_nondeterministic_is_named_before_any_world(
    pytester: pytest.Pytester, run: RunPytest, marker: str, message: str
) -> None:
    pytester.makepyfile(
        f"""
        import os
        import pytest

        @pytest.mark.ds_world
        @pytest.mark.{marker}
        {"@pytest.mark.ds_version(affected='>=0', raises=KeyError)" if "runs=20)" not in marker else ""}
        def test_marked(ds_rank):
            os.kill(os.getpid(), 9)  # never runs
        """
    )
    result = run()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines([f"*@pytest.mark.ds_nondeterministic on *::test_marked: {message}*"])
    assert "Traceback" not in result.stdout.str()


SLOW = """
import time
import pytest
from pytest_dsrepro import Slowdown, slowdown

def nap(seconds):
    return lambda: time.sleep(seconds)

@pytest.mark.ds_world
@pytest.mark.ds_version(affected=">=0", raises=Slowdown, match="20 ms nap")
def test_slow(ds_rank):
    slowdown(nap(0.02), nap(0.004), what="a 20 ms nap", against="a 4 ms nap", limit=2.0, clock="wall")

@pytest.mark.ds_world
@pytest.mark.ds_version(affected="<0.0.1", raises=Slowdown)
def test_not_slow(ds_rank):
    slowdown(nap(0.004), nap(0.004), what="a 4 ms nap", against="another 4 ms nap", limit=2.0, clock="wall")
"""


def test_a_slowdown_is_judged_by_its_measurement_in_every_output(
    pytester: pytest.Pytester, run: RunPytest, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """5x its reference with a 2x limit: REPRODUCED; 1x: FIXED. Each verdict says what was measured, against
    what, the limit and the margin, in the terminal, the results, the report and JUnit."""
    pytester.makepyfile(SLOW)
    out = tmp_path_factory.mktemp("results")
    result = run("-rx", f"--ds-results={out}", f"--ds-report={out / 'report.md'}", f"--junitxml={out / 'j.xml'}")
    result.assert_outcomes(xfailed=1, passed=1)
    result.stdout.fnmatch_lines(
        [
            "XFAIL *::test_slow - REPRODUCED on deepspeed *: ranks 0-1: Slowdown: a 20 ms nap took *x a 4 ms nap "
            "(limit 2x); measured: a 20 ms nap took *x a 4 ms nap (2?.? ms against ?.? ms of wall time, least of 5; "
            "limit 2x: slow, margin *x)",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "REPRODUCED  *::test_slow  (timed *x its reference (limit 2x, margin *x))",
            "FIXED       *::test_not_slow  (timed ?.??x its reference (limit 2x, margin *x))",
        ]
    )
    records = _records(out)
    (slow,), (fast,) = records["test_slow"].measurements, records["test_not_slow"].measurements
    assert (slow.what, slow.reference, slow.limit, slow.repeats, slow.clock) == (
        "a 20 ms nap",
        "a 4 ms nap",
        2,
        5,
        "wall",
    )
    assert slow.seconds >= 0.02
    assert slow.reference_seconds >= 0.004
    assert slow.slow  # 20 ms against 4 ms: 5x, far over the 2x limit even on a busy machine
    assert slow.margin > 1.5
    assert not fast.slow
    assert fast.margin > 1.2
    report = (out / "report.md").read_text()
    assert "- **Measured:** a 20 ms nap: 2" in report
    assert "(the least of 5 interleaved runs each, the slowest rank's)" in report
    junit = _junit(out / "j.xml")
    assert float(junit["test_slow"]["dsrepro.margin"]) == pytest.approx(slow.margin, abs=0.01)
    assert junit["test_not_slow"]["dsrepro.measured"].startswith("a 4 ms nap took 1.")
    assert json.loads((next(out.glob("*.json"))).read_text())["tests"][0]["measurements"][0]["limit"] == 2.0


def test_slowdown_times_interleaved_keeps_the_least_and_raises_at_the_limit() -> None:
    """Outside a world (no process group) the times are this process's; the measurement is kept for the rank's
    report; at or over the limit it raises Slowdown, which is an AssertionError."""
    calls: list[str] = []

    def work(name: str, seconds: float) -> Callable[[], object]:
        return lambda: (calls.append(name), time.sleep(seconds))

    with context.running(RankContext(0, 1, 0, "gloo")):
        with pytest.raises(Slowdown, match=r"^slow took \d\.\d\dx fast \(limit 2x\)$"):
            slowdown(work("s", 0.01), work("r", 0.002), what="slow", against="fast", limit=2, repeats=3, clock="wall")
        assert calls == ["s", "r", "s", "r", "r", "s", "s", "r"]  # one warm-up each, then alternating order
        measured = slowdown(work("a", 0.002), work("b", 0.002), what="a", against="b", limit=3, repeats=2)
        assert context.measurements() == (context.measurements()[0], measured)
    assert issubclass(Slowdown, AssertionError)
    with pytest.raises(ValueError, match=r"limit=0 must be a ratio > 0, .* clock='gpu' one of cpu, wall"):
        slowdown(work("x", 0), work("y", 0), what="x", against="y", limit=0, clock="gpu")


def _spin(seconds: float) -> Callable[[], object]:
    """CPU work for about ``seconds`` of this thread's CPU time."""

    def spin() -> None:
        until = time.thread_time() + seconds
        while time.thread_time() < until:
            pass

    return spin


def test_the_cpu_clock_counts_the_work_not_the_waiting() -> None:
    """The default clock is the thread's CPU time: 20 ms of work is 4x 5 ms of work, however long either waited
    (a busy machine, a collective waiting for another rank); wall time would call the sleeper the slow one."""
    with context.running(RankContext(0, 1, 0, "gloo")):
        with pytest.raises(Slowdown):
            slowdown(_spin(0.02), _spin(0.005), what="work", against="less work", limit=2.5, repeats=3)
        waits = slowdown(lambda: time.sleep(0.03), _spin(0.005), what="a wait", against="work", limit=2, repeats=3)
    assert waits.clock == "cpu"
    assert waits.ratio < 0.5
    assert "of CPU time, least of 3" in waits.describe()


@pytest.mark.parametrize(
    ("seconds", "reference", "limit", "ratio", "slow", "margin"),
    [(0.8, 0.1, 3.0, 8.0, True, 8 / 3), (0.1, 0.1, 3.0, 1.0, False, 3.0), (0.75, 0.25, 3.0, 3.0, True, 1.0),
     (0.1, 0.0, 3.0, math.inf, True, math.inf)],
)  # fmt: skip
def test_a_measurement_says_how_far_it_is_from_flipping(
    seconds: float, reference: float, limit: float, ratio: float, slow: bool, margin: float
) -> None:
    m = Measurement("x", "y", seconds, reference, limit, 5)
    assert (m.ratio, m.slow, m.margin) == (pytest.approx(ratio), slow, pytest.approx(margin))
