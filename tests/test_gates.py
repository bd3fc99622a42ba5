"""ds_version gates: the pure verdict function, marker validation, and every outcome end to end in real worlds."""

from __future__ import annotations

import re

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from conftest import RunPytest, assert_clear_error, deepspeed_version, run_marked
from pytest_dsrepro.core import results
from pytest_dsrepro.core.errors import MarkerError
from pytest_dsrepro.core.gates import (
    FIXED,
    STOCK,
    Ending,
    Nondeterministic,
    Reason,
    Verdict,
    VersionGate,
    ending,
    judge,
    judge_runs,
    oldest_first,
    parse_gate,
    parse_nondeterministic,
)
from pytest_dsrepro.core.outcome import ErrorInfo, RankResult, Status
from pytest_dsrepro.session import markers


def _error(exc: BaseException) -> RankResult:
    return RankResult(0, Status.FAILED, error=ErrorInfo.from_exception(exc, "tb"))


GATE = VersionGate(SpecifierSet("<0.16.4"), AttributeError, match="epilogue")


@pytest.mark.parametrize(
    ("version", "variant", "failures", "verdict", "message"),
    [
        (
            "0.16.3",
            STOCK,
            [_error(AttributeError("no epilogue"))],
            Verdict.REPRODUCED,
            "REPRODUCED on deepspeed 0.16.3: rank 0: AttributeError: no epilogue",
        ),
        (
            "0.16.3",
            STOCK,
            [],
            Verdict.UNEXPECTED,
            "did not reproduce on deepspeed 0.16.3: expected AttributeError matching 'epilogue' on deepspeed<0.16.4, but it passed",
        ),
        (
            "0.16.3",
            STOCK,
            [_error(AttributeError("other"))],
            Verdict.UNEXPECTED,
            "failed differently on deepspeed 0.16.3: expected AttributeError matching 'epilogue' on deepspeed<0.16.4, got rank 0: AttributeError: other",
        ),
        (
            "0.16.3",
            STOCK,
            [RankResult(1, Status.CRASHED, detail="killed by signal SIGSEGV")],
            Verdict.UNEXPECTED,
            "failed differently on deepspeed 0.16.3: expected AttributeError matching 'epilogue' on deepspeed<0.16.4, got rank 1: crashed: killed by signal SIGSEGV",
        ),
        ("0.16.4", STOCK, [], Verdict.FIXED, "fixed: passes on deepspeed 0.16.4, after the affected range (<0.16.4)"),
        (
            "0.16.4",
            STOCK,
            [_error(AttributeError("no epilogue"))],
            Verdict.UNEXPECTED,
            "regression: failed with the declared error on deepspeed 0.16.4, outside the affected range (<0.16.4): "
            "rank 0: AttributeError: no epilogue",
        ),
        (
            "0.16.4",
            STOCK,
            [_error(KeyError("setup mistake"))],
            Verdict.UNEXPECTED,
            "fails outside the affected range (<0.16.4) on deepspeed 0.16.4, not with the declared error "
            "(AttributeError matching 'epilogue'): rank 0: KeyError: 'setup mistake'",
        ),
        ("0.16.3", FIXED, [], Verdict.PASSES_WITH_FIX, "passes with the fix on deepspeed 0.16.3"),
        (
            "0.16.3",
            FIXED,
            [_error(KeyError("x"))],
            Verdict.UNEXPECTED,
            "the fix does not hold on deepspeed 0.16.3: rank 0: KeyError: 'x'",
        ),
    ],
    ids=["reproduced", "did-not-reproduce", "wrong-message", "crash", "fixed", "regression", "outside", "with-fix",
         "fix-fails"],
)  # fmt: skip
def test_judge(version: str, variant: str, failures: list[RankResult], verdict: Verdict, message: str) -> None:
    judgement = judge([GATE], variant, Version(version), failures, "here")
    assert judgement.verdict is verdict
    assert judgement.message == message


def test_subclasses_match_raises() -> None:
    gate = VersionGate(SpecifierSet(">=0"), LookupError)
    assert judge([gate], None, Version("1.0"), [_error(KeyError("k"))], "here").verdict is Verdict.REPRODUCED


def test_overlapping_ranges_are_an_error() -> None:
    gates = [VersionGate(SpecifierSet("<0.18"), AttributeError), VersionGate(SpecifierSet(">=0.17"), AttributeError)]
    with pytest.raises(MarkerError, match=r"ranges overlap at deepspeed 0.17.5: '<0.18', '>=0.17'"):
        judge(gates, STOCK, Version("0.17.5"), [], "here")


def test_overlapping_ranges_are_said_by_the_stock_run_and_the_fix_still_runs(
    pytester: pytest.Pytester, run: RunPytest
) -> None:
    """Ranges that overlap at the installed release hold it, so the ``[fixed]`` variant runs its world there (it is
    not the release a fix has nothing to do on); the ``[stock]`` run says the overlap in the marker's words, and no
    setup ends in a traceback."""
    pytester.makepyfile(
        """
        import json
        import pytest

        def patch(monkeypatch):
            monkeypatch.setattr(json, "patched", True, raising=False)

        @pytest.mark.ds_world
        @pytest.mark.ds_version(affected="<99", raises=KeyError, fix=patch)
        @pytest.mark.ds_version(affected=">=0.1", raises=KeyError)
        def test_overlap(ds_rank):
            if not getattr(json, "patched", False):
                raise KeyError("unpatched")
        """
    )
    result = run("--ds-world-size", "1")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*ds_version ranges overlap at deepspeed *: '>=0.1', '<99'*"])
    result.stdout.fnmatch_lines(["PASSES-WITH-FIX  *::test_overlap[[]fixed[]]"])
    assert "Traceback" not in result.stdout.str()


def test_markers_are_read_from_every_ds_version_marker(pytester: pytest.Pytester) -> None:
    item, _ = pytester.getitems(
        """
        import pytest

        def fix(monkeypatch):
            pass

        @pytest.mark.ds_version("<0.18.3", raises=AttributeError, match="backward", fix=fix)
        @pytest.mark.ds_version(affected=">=0.18.3", raises=AttributeError, fix=fix)
        def test_x():
            pass
        """
    )
    gates = markers.gates(item)
    assert {str(g.affected) for g in gates} == {"<0.18.3", ">=0.18.3"}
    assert all(g.fix is not None and g.fix.__name__ == "fix" for g in gates)


def _fix(monkeypatch: pytest.MonkeyPatch) -> None:
    pass


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((), {"affected": "<<0.1", "raises": AttributeError}, "affected='<<0.1' is not a valid PEP 440 specifier"),
        ((), {"affected": "<0.1", "raises": "AttributeError"}, "raises='AttributeError' must be an exception type"),
        ((), {"affected": "<0.1", "raises": int}, "raises=<class 'int'> must be an exception type"),
        ((), {"affected": "<0.1", "raises": KeyError, "match": "("}, "match='(' is not a valid regular expression"),
        (
            (),
            {"affected": "<0.1", "raises": KeyError, "fix": "no_such_module:patch"},
            "fix='no_such_module:patch' cannot be imported (ModuleNotFoundError",
        ),
        ((), {"affected": "<0.1", "raises": KeyError, "fix": 42}, "fix=42 is not callable"),
        ((), {"affected": "<0.1", "raises": KeyError, "typo": 1}, "takes affected, raises=, match=, fix="),
        (("<0.1", ">0.2"), {"raises": KeyError}, "takes affected, raises=, match=, fix="),
        ((), {"raises": KeyError}, "affected=None must be a PEP 440 specifier string"),
    ],
)
def test_bad_ds_version_arguments_are_named(args: tuple[object, ...], kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(MarkerError, match="^here: " + re.escape(message)):
        parse_gate(args, kwargs, "here")


def test_a_good_gate_loads_its_fix_by_name() -> None:
    gate = parse_gate(("<0.1",), {"raises": KeyError, "fix": f"{__name__}:_fix"}, "here")
    assert gate.fix is _fix
    assert gate.describe() == "KeyError on deepspeed<0.1"


def test_a_bad_ds_version_is_a_collection_error_naming_test_and_argument(
    pytester: pytest.Pytester, run: RunPytest
) -> None:
    result = run_marked(pytester, run, "ds_version(affected='<<0.1', raises=AttributeError)")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    assert_clear_error(result, "ds_version", "affected='<<0.1' is not a valid PEP 440 specifier")


#: Every reason, its verdict, and whether the body failed (None: no body ran).
REASONS = [
    (Reason.REPRODUCED, Verdict.REPRODUCED, True),
    (Reason.NOT_AFFECTED, Verdict.FIXED, False),
    (Reason.NOT_YET_AFFECTED, Verdict.NOT_YET_AFFECTED, False),
    (Reason.FIX_HOLDS, Verdict.PASSES_WITH_FIX, False),
    (Reason.DID_NOT_REPRODUCE, Verdict.UNEXPECTED, False),
    (Reason.FAILED_DIFFERENTLY, Verdict.UNEXPECTED, True),
    (Reason.REGRESSION, Verdict.UNEXPECTED, True),
    (Reason.BEFORE_AFFECTED, Verdict.UNEXPECTED, True),
    (Reason.OUTSIDE_RANGE, Verdict.UNEXPECTED, True),
    (Reason.FIX_DOES_NOT_HOLD, Verdict.UNEXPECTED, True),
    (Reason.FIX_RAISED, Verdict.UNEXPECTED, None),
    (Reason.HARNESS_ERROR, Verdict.UNEXPECTED, None),
    (Reason.NOT_APPLICABLE, Verdict.NOT_APPLICABLE, None),
]


@pytest.mark.parametrize(("reason", "verdict", "body_failed"), REASONS)
def test_every_reason_has_one_verdict(reason: Reason, verdict: Verdict, body_failed: bool | None) -> None:
    assert (reason.verdict, reason.body_failed) == (verdict, body_failed)


def test_every_reason_is_listed_above() -> None:
    assert {reason for reason, _, _ in REASONS} == set(Reason)


def test_affected_ranges_read_oldest_first() -> None:
    assert oldest_first([">=0.19.5", "<0.18.3", ">=0.18.3,<0.19.5", "<<bad"]) == [
        "<0.18.3",
        ">=0.18.3,<0.19.5",
        ">=0.19.5",
        "<<bad",
    ]


def test_different_fixes_are_refused(pytester: pytest.Pytester, run: RunPytest) -> None:
    pytester.makepyfile(
        """
        import pytest

        def fix_a(monkeypatch): pass
        def fix_b(monkeypatch): pass

        @pytest.mark.ds_version("<0.1", raises=KeyError, fix=fix_a)
        @pytest.mark.ds_version(">=0.1", raises=KeyError, fix=fix_b)
        def test_gated():
            pass
        """
    )
    result = run()
    result.stdout.fnmatch_lines(["*markers name different fixes; one test has one fix*"])


GATED = """
import pytest

def patch_engine(monkeypatch):
    import json
    monkeypatch.setattr(json, "epilogue", lambda: "done", raising=False)

def does_nothing(monkeypatch):
    pass

def call_epilogue():
    import json
    return json.epilogue()  # AttributeError unless patched

@pytest.mark.ds_world
@pytest.mark.ds_version(affected="=={V}", raises=AttributeError, match="epilogue", fix=patch_engine)
def test_reproduces(ds_rank):
    assert call_epilogue() == "done"

@pytest.mark.ds_world
@pytest.mark.ds_version(affected="=={V}", raises=AttributeError)
def test_does_not_reproduce(ds_rank):
    pass

@pytest.mark.ds_world
@pytest.mark.ds_version(affected="=={V}", raises=AttributeError, match="epilogue")
def test_fails_differently(ds_rank):
    raise KeyError("not the bug")

@pytest.mark.ds_world
@pytest.mark.ds_version(affected="<0.0.1", raises=AttributeError)
def test_regression(ds_rank):
    raise AttributeError("broken where it should work")

@pytest.mark.ds_world
@pytest.mark.ds_version(affected="<0.0.1", raises=AttributeError, fix=patch_engine)
def test_fixed_release(ds_rank):
    pass

@pytest.mark.ds_world
@pytest.mark.ds_version(affected="=={V}", raises=AttributeError, fix=does_nothing)
def test_fix_does_not_hold(ds_rank):
    raise AttributeError("still broken")
"""


def test_every_gate_outcome_in_real_worlds(pytester: pytest.Pytester, run: RunPytest) -> None:
    V = deepspeed_version()
    pytester.makepyfile(GATED.replace("{V}", V))
    result = run("-rxXs", "-v")
    result.assert_outcomes(passed=2, failed=4, xfailed=2, skipped=1)
    result.stdout.fnmatch_lines_random(
        [
            f"*::test_reproduces?stock? XFAIL (REPRODUCED on deepspeed {V}: ranks 0-1: AttributeError: *epilogue*)*",
            "*::test_reproduces?fixed? PASSED*",
            "*::test_fixed_release?stock? PASSED*",
            "*::test_fixed_release?fixed? SKIPPED*",
        ]
    )
    # a fix is for the affected releases: outside them the [stock] run is the test, and no world starts (said whole
    # in the verdicts, which pytest's -v line cuts to the terminal's width)
    result.stdout.fnmatch_lines(
        [
            f"NOT-APPLICABLE   *::test_fixed_release[[]fixed[]]  -- not applicable on deepspeed {V}: the fix is for "
            "the affected releases (<0.0.1); here the [[]stock[]] run is the test"
        ]
    )
    result.stdout.fnmatch_lines_random(
        [
            f"did not reproduce on deepspeed {V}: expected AttributeError on deepspeed=={V}, but it passed",
            f"failed differently on deepspeed {V}: expected AttributeError matching 'epilogue' on deepspeed=={V}, "
            "got ranks 0-1: KeyError: 'not the bug'",
            f"regression: failed with the declared error on deepspeed {V}, outside the affected range (<0.0.1): "
            "ranks 0-1: AttributeError: broken where it should work",
            f"the fix does not hold on deepspeed {V}: ranks 0-1: AttributeError: still broken",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            f"*= dsrepro verdicts (deepspeed {V}) =*",
            "REPRODUCED       *::test_reproduces[[]stock[]]",
            "PASSES-WITH-FIX  *::test_reproduces[[]fixed[]]",
            "UNEXPECTED       *::test_does_not_reproduce  -- did not reproduce on deepspeed *",
        ]
    )
    # failed differently, regression, fix does not hold: each rank story is told once, not again as a chained cause
    assert result.stdout.str().count("---- ranks 0-1: traceback ----") == 3


PARTIAL = """
import time
import pytest
import torch
import torch.distributed as dist

@pytest.mark.ds_world
@pytest.mark.ds_version(affected=">=0", raises=ValueError, match="boom")
def test_some_ranks(ds_rank):
    if ds_rank == 1:
        raise ValueError("boom")
    dist.barrier()  # rank 0 waits for rank 1, which never comes: gloo tells it the peer is gone

@pytest.mark.ds_world(size=3)
@pytest.mark.ds_version(affected=">=0", raises=ValueError, match="boom")
def test_some_ranks_then_another_error(ds_rank):
    if ds_rank == 1:
        raise ValueError("boom")
    if ds_rank == 2:
        time.sleep(0.5)  # after rank 1 (the order the story tells), still on its own: not a lost peer
        raise KeyError("not the bug")
    dist.all_reduce(torch.ones(8))
"""


def test_a_bug_in_some_ranks_reproduces(pytester: pytest.Pytester, run: RunPytest) -> None:
    """Rank 1 raises the bug while rank 0 waits in a barrier and dies of gloo's lost connection: judged on rank 1,
    REPRODUCED, rank 0 named as collateral; a rank that fails on its own with another error still counts."""
    pytester.makepyfile(PARTIAL)
    result = run("-rx")
    result.assert_outcomes(xfailed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "XFAIL *::test_some_ranks - REPRODUCED on deepspeed *: rank 1: ValueError: boom; collateral: rank 0 then "
            "lost a peer",
        ]
    )
    result.stdout.fnmatch_lines(["*failed differently on deepspeed *: expected ValueError matching 'boom' on "
                                 "deepspeed>=0, got rank 1: ValueError: boom; rank 2: KeyError: 'not the bug'; "
                                 "collateral: rank 0 then lost a peer*"])  # fmt: skip


def test_a_harness_error_is_never_judged_as_the_bug(pytester: pytest.Pytester, run: RunPytest) -> None:
    """``raises=Exception`` covers everything a body can raise, but not a world that never ran."""
    pytester.makepyfile(
        """
        import threading
        import pytest

        @pytest.fixture
        def lock():
            return threading.Lock()

        @pytest.mark.ds_world
        @pytest.mark.ds_version(affected=">=0", raises=Exception)
        def test_gated(lock):
            raise RuntimeError("the bug")
        """
    )
    result = run()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*pytest-dsrepro could not run this test's world: *::test_gated: fixture or parameter 'lock' cannot be "
            "sent to the ranks (TypeError: *",
            "*= dsrepro verdicts *",
            "UNEXPECTED  *::test_gated  -- no world ran: *",
        ]
    )
    assert "REPRODUCED" not in result.stdout.str()


def test_a_misspelt_ds_repro_field_is_refused(pytester: pytest.Pytester) -> None:
    item = pytester.getitem(
        """
        import pytest

        @pytest.mark.ds_repro(id="x", fixed="0.16.4")
        def test_func():
            pass
        """
    )
    with pytest.raises(
        MarkerError, match=r"ds_repro on .*::test_func: unexpected argument\(s\) fixed; takes id, title"
    ):
        markers.check_repro(item)


def test_ranges_are_told_as_written_and_older_releases_are_not_regressions() -> None:
    gate = parse_gate((">=0.15.4,<0.16.2",), {"raises": KeyError}, "where")
    assert gate.describe() == "KeyError on deepspeed>=0.15.4,<0.16.2"
    failed = [_error(KeyError("k"))]
    older = judge([gate], STOCK, Version("0.14.4"), failed, "where")
    assert older.reason is Reason.BEFORE_AFFECTED
    assert older.verdict is Verdict.UNEXPECTED
    assert older.message.startswith(
        "failed with the declared error on deepspeed 0.14.4, older than the affected range (>=0.15.4,<0.16.2): the "
        "bug may be older than declared"
    )
    newer = judge([gate], STOCK, Version("0.16.2"), failed, "where")
    assert newer.reason is Reason.REGRESSION
    assert "outside the affected range (>=0.15.4,<0.16.2)" in newer.message


def test_before_and_after_the_range_are_different_words() -> None:
    """A stock pass older than every affected range is NOT-YET-AFFECTED; after (or between) them it is FIXED."""
    gates = [parse_gate((">=0.15.4,<0.16.2",), {"raises": KeyError}, "w"),
             parse_gate((">=0.17.0,<0.18",), {"raises": KeyError}, "w")]  # fmt: skip
    said = {v: judge(gates, STOCK, Version(v), [], "w") for v in ("0.14.4", "0.16.5", "0.18.1")}
    assert [j.verdict for j in said.values()] == [Verdict.NOT_YET_AFFECTED, Verdict.FIXED, Verdict.FIXED]
    assert said["0.14.4"].message == (
        "not yet affected: passes on deepspeed 0.14.4, older than the affected range (>=0.15.4,<0.16.2 or "
        ">=0.17.0,<0.18)"
    )
    assert said["0.18.1"].message.startswith("fixed: passes on deepspeed 0.18.1, after the affected range")
    assert judge(gates, FIXED, Version("0.14.4"), [], "w").verdict is Verdict.PASSES_WITH_FIX


def test_outside_the_range_only_the_declared_error_is_a_regression() -> None:
    """A different error outside the range (a setup mistake) is said as such, before the range and after it."""
    gates = [parse_gate(("==0.16.0",), {"raises": AttributeError, "match": "epilogue"}, "w"),
             parse_gate(("==0.17.0",), {"raises": KeyError}, "w")]  # fmt: skip
    other = [_error(AttributeError("module 'x' has no attribute 'startswith'"))]
    for version in ("0.15.4", "0.18.0"):
        judgement = judge(gates, STOCK, Version(version), other, "w")
        assert judgement.reason is Reason.OUTSIDE_RANGE
        assert judgement.message == (
            f"fails outside the affected range (==0.16.0 or ==0.17.0) on deepspeed {version}, not with the declared "
            "error (AttributeError matching 'epilogue' or KeyError): rank 0: AttributeError: module 'x' has no "
            "attribute 'startswith'"
        )
    assert judge(gates, STOCK, Version("0.18.0"), [_error(KeyError("k"))], "w").reason is Reason.REGRESSION
    assert judge(gates, STOCK, Version("0.15.4"), [_error(KeyError("k"))], "w").reason is Reason.BEFORE_AFFECTED


def _lost_peer(rank: int, at: float = 0.2) -> RankResult:
    text = "[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:438: Connection reset by peer. This is typically"
    return RankResult(rank, Status.FAILED, error=ErrorInfo.from_exception(RuntimeError(text), "tb"), at=at)


def test_a_bug_in_some_ranks_is_judged_on_the_ranks_that_failed_first() -> None:
    """Rank 1 raises the bug; rank 0, waiting in a collective, dies of gloo's lost connection: REPRODUCED, and the
    collateral rank is named as such; its error alone never decides."""
    gate = VersionGate(SpecifierSet(">=0"), ValueError, match="boom")
    boom = RankResult(1, Status.FAILED, error=ErrorInfo.from_exception(ValueError("boom"), "tb"), at=0.1)
    judgement = judge([gate], STOCK, Version("1.0"), [_lost_peer(0), boom], "w")
    assert judgement.verdict is Verdict.REPRODUCED
    assert (
        judgement.message
        == "REPRODUCED on deepspeed 1.0: rank 1: ValueError: boom; collateral: rank 0 then lost a peer"
    )
    other = RankResult(1, Status.FAILED, error=ErrorInfo.from_exception(KeyError("k"), "tb"), at=0.1)
    assert judge([gate], STOCK, Version("1.0"), [_lost_peer(0), other], "w").reason is Reason.FAILED_DIFFERENTLY
    crashed = RankResult(1, Status.CRASHED, detail="killed by signal SIGSEGV", at=0.1)
    assert judge([gate], STOCK, Version("1.0"), [_lost_peer(0), crashed], "w").reason is Reason.FAILED_DIFFERENTLY
    # Every rank lost a peer (one passed and left early): nothing failed first, so all of them are judged.
    assert judge([gate], STOCK, Version("1.0"), [_lost_peer(0), _lost_peer(1)], "w").reason is Reason.FAILED_DIFFERENTLY


def _fix_raised(rank: int) -> RankResult:
    exc = AttributeError("module 'deepspeed' has no attribute 'startswith'")
    return RankResult(rank, Status.FAILED, error=ErrorInfo.from_exception(exc, "tb"), fix="repro.wait_on_every_handle")


@pytest.mark.parametrize("variant", [STOCK, FIXED])
def test_a_fix_that_raises_is_its_own_reason(variant: str) -> None:
    """The fix was never applied: not 'the fix does not hold', and never REPRODUCED, even with raises=Exception."""
    gate = VersionGate(SpecifierSet(">=0"), Exception)
    judgement = judge([gate], variant, Version("1.0"), [_fix_raised(0), _fix_raised(1)], "w")
    assert judgement.reason is Reason.FIX_RAISED
    assert judgement.message == (
        "the fix raised on deepspeed 1.0, so it was never applied and the body never ran "
        "(repro.wait_on_every_handle): ranks 0-1: AttributeError: module 'deepspeed' has no attribute 'startswith'"
    )


RACE = VersionGate(SpecifierSet("<0.19.8"), AssertionError, match="read after step")


def _race(rank: int = 0) -> RankResult:
    return RankResult(rank, Status.FAILED, error=ErrorInfo.from_exception(AssertionError("read after step"), "tb"))


def _series(failing: int, runs: int = 20, other: RankResult | None = None) -> list[list[RankResult]]:
    series: list[list[RankResult]] = [[_race()] if i < failing else [] for i in range(runs)]
    if other is not None:
        series.append([other])
    return series


@pytest.mark.parametrize(
    ("version", "variant", "runs", "failures", "reason", "label", "message"),
    [
        ("0.19.7", STOCK, _series(9), 1, Reason.REPRODUCED, "9/20",
         "REPRODUCED on deepspeed 0.19.7 (9/20 runs failed as declared, 1 needed): rank 0: AssertionError: read after "
         "step"),
        ("0.19.7", STOCK, _series(1), 2, Reason.DID_NOT_REPRODUCE, "1/20",
         "did not reproduce on deepspeed 0.19.7 (1/20 runs failed as declared, 2 needed): expected AssertionError "
         "matching 'read after step' on deepspeed<0.19.8; the first run that did: rank 0: AssertionError: read after "
         "step"),
        ("0.19.7", STOCK, _series(0), 1, Reason.DID_NOT_REPRODUCE, "0/20",
         "did not reproduce on deepspeed 0.19.7 (0/20 runs failed as declared, 1 needed): expected AssertionError "
         "matching 'read after step' on deepspeed<0.19.8, but it passed"),
        ("0.19.8", STOCK, _series(0), 1, Reason.NOT_AFFECTED, "0/20",
         "fixed: passes on deepspeed 0.19.8 (0/20 runs failed as declared), after the affected range (<0.19.8)"),
        ("0.19.8", STOCK, _series(1), 1, Reason.REGRESSION, "1/20",
         "regression: failed with the declared error on deepspeed 0.19.8 (1/20 runs failed as declared), outside the "
         "affected range (<0.19.8): rank 0: AssertionError: read after step"),
        ("0.19.7", FIXED, _series(0), 1, Reason.FIX_HOLDS, "0/20",
         "passes with the fix on deepspeed 0.19.7 (0/20 runs failed as declared)"),
        ("0.19.7", FIXED, _series(3), 1, Reason.FIX_DOES_NOT_HOLD, "3/20",
         "the fix does not hold on deepspeed 0.19.7 (3/20 runs failed as declared): rank 0: AssertionError: read "
         "after step"),
        ("0.19.7", STOCK, _series(3, runs=4, other=_error(KeyError("k"))), 1, Reason.FAILED_DIFFERENTLY, "3/5",
         "failed differently on deepspeed 0.19.7 (run 5 of 20 ended otherwise, so the runs stopped; 3 failed as "
         "declared before it): expected AssertionError matching 'read after step' on deepspeed<0.19.8, got rank 0: "
         "KeyError: 'k'"),
    ],
    ids=["reproduced", "too-rare", "never", "fixed", "regression", "fix-holds", "fix-fails-sometimes", "stopped"],
)  # fmt: skip
def test_a_nondeterministic_verdict_is_judged_by_its_rate(
    version: str, variant: str, runs: list[list[RankResult]], failures: int, reason: Reason, label: str, message: str
) -> None:
    judgement = judge_runs([RACE], variant, Version(version), runs, "w", Nondeterministic(20, failures), seconds=12.5)
    assert (judgement.reason, str(judgement.rate), judgement.message) == (reason, label, message)
    assert judgement.rate is not None
    assert (judgement.rate.planned, judgement.rate.needed, judgement.rate.seconds) == (20, failures, 12.5)


def test_a_series_stops_only_where_the_verdict_can_no_longer_change() -> None:
    """The declared error goes on being counted (it is the rate); anything else ends the series."""
    gate = [RACE]
    assert ending(gate, STOCK, Version("0.19.7"), [_race()], "w") is Ending.DECLARED
    assert ending(gate, FIXED, Version("0.19.7"), [_race()], "w") is Ending.DECLARED
    assert ending(gate, STOCK, Version("0.19.8"), [], "w") is Ending.PASSED
    assert ending(gate, STOCK, Version("0.19.7"), [_error(KeyError("k"))], "w") is Ending.OTHER
    assert ending(gate, FIXED, Version("0.19.7"), [RankResult(0, Status.HUNG)], "w") is Ending.OTHER
    assert ending(gate, FIXED, Version("0.19.7"), [_fix_raised(0)], "w") is Ending.OTHER
    assert ending(gate, STOCK, Version("0.19.7"), [_lost_peer(0), _race(1)], "w") is Ending.DECLARED


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((), {}, "runs=None must be the number of runs per verdict, a whole number 2 to 1000"),
        ((1,), {}, "runs=1 must be the number of runs per verdict"),
        ((True,), {}, "runs=True must be the number of runs per verdict"),
        ((20,), {"failures": 0}, "failures=0 must say how many of the 20 runs failing as declared make REPRODUCED, "
         "a whole number 1 to 20"),
        ((20, 21), {}, "failures=21 must say how many of the 20 runs"),
        ((20,), {"runs": 3}, "takes runs, failures=; got (20,) ['runs']"),
        ((), {"runs": 20, "rate": 0.5}, "takes runs, failures=; got () ['rate', 'runs']"),
    ],
)  # fmt: skip
def test_bad_ds_nondeterministic_arguments_are_named(
    args: tuple[object, ...], kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(MarkerError, match="^here: " + re.escape(message)):
        parse_nondeterministic(args, kwargs, "here")
    assert parse_nondeterministic((20,), {"failures": 2}, "here") == Nondeterministic(20, 2)


CONDITIONS = """
import json
import os
import pytest

def add_epilogue(monkeypatch):
    monkeypatch.setattr(json, "epilogue", lambda: "done", raising=False)

@pytest.mark.ds_world
@pytest.mark.ds_prerequisite("=={V}", fix=add_epilogue, reason="bug X (PR #1) breaks every engine here")
@pytest.mark.ds_version(affected="<0.0.1", raises=AttributeError)
def test_masked_here(ds_rank):
    assert json.epilogue() == "done"

@pytest.mark.ds_world
@pytest.mark.ds_prerequisite("<0.0.1", fix=add_epilogue, reason="bug X breaks old releases")
@pytest.mark.ds_version(affected="=={V}", raises=AttributeError, match="epilogue")
def test_prerequisite_elsewhere(ds_rank):
    json.epilogue()

@pytest.mark.ds_world
@pytest.mark.ds_not_applicable("=={V}", reason="the API it needs is missing here")
@pytest.mark.ds_version(affected="=={V}", raises=AttributeError)
def test_not_applicable(ds_rank):
    os.kill(os.getpid(), 9)  # never runs: no world is started

@pytest.mark.ds_world
@pytest.mark.ds_not_applicable("<0.0.1", reason="not here")
def test_applicable(ds_rank):
    pass
"""


def test_prerequisites_and_not_applicable_in_real_worlds(
    pytester: pytest.Pytester, run: RunPytest, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A prerequisite fix runs before the body only on its releases, and every record says it ran; a release the
    repro declares out of reach starts no world and is NOT-APPLICABLE with its reason, in every output."""
    V = deepspeed_version()
    pytester.makepyfile(CONDITIONS.replace("{V}", V))
    out = tmp_path_factory.mktemp("results")
    result = run("-rxs", f"--ds-results={out}", f"--ds-report={out / 'report.md'}")
    result.assert_outcomes(passed=2, skipped=1, xfailed=1)
    result.stdout.fnmatch_lines(
        ["SKIPPED [[]1[]] test_prerequisites_and_not_applicable_in_real_worlds.py:20: not applicable *"]
    )
    result.stdout.fnmatch_lines(
        [
            f"*= dsrepro verdicts (deepspeed {V}) =*",
            f"FIXED           *::test_masked_here  (prerequisite fix for deepspeed=={V}: bug X (PR #1) breaks every "
            "engine here)",
            "REPRODUCED      *::test_prerequisite_elsewhere",
            f"NOT-APPLICABLE  *::test_not_applicable  -- not applicable on deepspeed {V}: deepspeed=={V}: the API it "
            "needs is missing here",
        ]
    )
    assert "test_applicable" not in result.stdout.str().split("dsrepro verdicts")[1]  # ungated, not applicable
    (path,) = out.glob("*.json")
    records = {t.nodeid.split("::")[1]: t for t in results.read(path).tests}
    assert records["test_masked_here"].prerequisites == (f"deepspeed=={V}: bug X (PR #1) breaks every engine here",)
    assert records["test_prerequisite_elsewhere"].prerequisites == ()
    na = records["test_not_applicable"]
    assert (na.verdict, na.reason, na.outcome, na.world_size) == (
        Verdict.NOT_APPLICABLE, Reason.NOT_APPLICABLE, "skipped", None,
    )  # fmt: skip
    report = (out / "report.md").read_text()
    assert f"- **Prerequisite:** another bug's fix was applied in every rank first, for deepspeed=={V}: bug X" in report
    assert "| NOT-APPLICABLE |" in report


@pytest.mark.parametrize(
    ("marker", "message"),
    [
        ("ds_not_applicable('<0.1')", "reason= must say why, in words (a masking bug, a missing API); got None"),
        (
            "ds_not_applicable('<0.1', reason='x', fix=print)",
            "takes releases, reason=; got ('<0.1',) ['fix', 'reason']",
        ),
        ("ds_not_applicable('0.1', reason='x')", "releases='0.1' is not a valid PEP 440 specifier"),
        ("ds_prerequisite('<0.1', reason='masked')", "fix= is required: the patch applied before the body on <0.1"),
        ("ds_prerequisite('<0.1', fix='os:nope', reason='m')", "fix='os:nope' cannot be imported (AttributeError"),
    ],
)
def test_bad_conditions_are_named(pytester: pytest.Pytester, run: RunPytest, marker: str, message: str) -> None:
    result = run_marked(pytester, run, marker)
    assert_clear_error(result, marker.partition("(")[0], message.replace("[", "[[]"))
