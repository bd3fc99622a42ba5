"""ds_version gates: the pure verdict function, marker validation, and every outcome end to end in real worlds."""

from __future__ import annotations

import re

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from conftest import RunPytest, assert_clear_error, deepspeed_version, run_marked
from pytest_dsrepro.core import results
from pytest_dsrepro.core.errors import MarkerError
from pytest_dsrepro.core.gates import FIXED, STOCK, Reason, Verdict, VersionGate, judge, oldest_first, parse_gate
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
        ("0.16.4", STOCK, [], Verdict.FIXED, "not affected: passes on deepspeed 0.16.4"),
        (
            "0.16.4",
            STOCK,
            [_error(AttributeError("no epilogue"))],
            Verdict.UNEXPECTED,
            "regression: deepspeed 0.16.4 is outside the affected range (<0.16.4) but rank 0: AttributeError: no epilogue",
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
    ids=["reproduced", "did-not-reproduce", "wrong-message", "crash", "fixed", "regression", "with-fix", "fix-fails"],
)
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


@pytest.mark.parametrize(
    ("reason", "verdict", "body_failed"),
    [
        (Reason.REPRODUCED, Verdict.REPRODUCED, True),
        (Reason.NOT_AFFECTED, Verdict.FIXED, False),
        (Reason.FIX_HOLDS, Verdict.PASSES_WITH_FIX, False),
        (Reason.DID_NOT_REPRODUCE, Verdict.UNEXPECTED, False),
        (Reason.FAILED_DIFFERENTLY, Verdict.UNEXPECTED, True),
        (Reason.REGRESSION, Verdict.UNEXPECTED, True),
        (Reason.FIX_DOES_NOT_HOLD, Verdict.UNEXPECTED, True),
        (Reason.HARNESS_ERROR, Verdict.UNEXPECTED, None),
        (Reason.NOT_APPLICABLE, Verdict.NOT_APPLICABLE, None),
    ],
)
def test_every_reason_has_one_verdict(reason: Reason, verdict: Verdict, body_failed: bool | None) -> None:
    assert (reason.verdict, reason.body_failed) == (verdict, body_failed)


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
    result.assert_outcomes(passed=3, failed=4, xfailed=2)
    result.stdout.fnmatch_lines_random(
        [
            f"*::test_reproduces?stock? XFAIL (REPRODUCED on deepspeed {V}: ranks 0-1: AttributeError: *epilogue*)*",
            "*::test_reproduces?fixed? PASSED*",
            "*::test_fixed_release?stock? PASSED*",
            "*::test_fixed_release?fixed? PASSED*",
        ]
    )
    result.stdout.fnmatch_lines_random(
        [
            f"did not reproduce on deepspeed {V}: expected AttributeError on deepspeed=={V}, but it passed",
            f"failed differently on deepspeed {V}: expected AttributeError matching 'epilogue' on deepspeed=={V}, "
            "got ranks 0-1: KeyError: 'not the bug'",
            f"regression: deepspeed {V} is outside the affected range (<0.0.1) but ranks 0-1: AttributeError: broken where it should work",
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
    assert older.message.startswith("failed on deepspeed 0.14.4, older than the affected range (>=0.15.4,<0.16.2)")
    newer = judge([gate], STOCK, Version("0.16.2"), failed, "where")
    assert newer.reason is Reason.REGRESSION
    assert "outside the affected range (>=0.15.4,<0.16.2)" in newer.message


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
