"""Verdicts in JUnit XML (pytest's own ``--junitxml``) as ``<property>`` elements, and reruns recorded once.

junitxml writes a testcase's properties from its teardown report; the collector adds them there. With
pytest-rerunfailures, an attempt that is run again keeps only a ``dsrepro.rerun`` property and the last attempt is
the one recorded, with the attempt count, in the JUnit XML, the results file, the report and the terminal summary.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from conftest import RunPytest, deepspeed_version
from pytest_dsrepro.core.gates import Reason, Verdict
from pytest_dsrepro.core.results import ReproMeta, TestRecord
from pytest_dsrepro.session.recording import PROPERTY, RecordedTests, junit_properties

RECORD = TestRecord(nodeid="t.py::test[zero3-stock]", repro=ReproMeta("demo"), variant="stock",
                    verdict=Verdict.REPRODUCED, reason=Reason.REPRODUCED, outcome="xfailed", error="x", duration=1.0,
                    config=None, world_size=2)  # fmt: skip


def _report(when: str, outcome: str, record: TestRecord | None = None, rerun: int = 0) -> pytest.TestReport:
    props = [(PROPERTY, record.to_json())] if record else []
    report = pytest.TestReport(RECORD.nodeid, ("t.py", 1, "test"), {}, outcome, None, when, user_properties=props)
    if rerun:
        report.rerun = rerun  # what pytest-rerunfailures sets on every report it logs
    return report


def test_properties_of_a_record() -> None:
    assert junit_properties(RECORD, "0.19.8") == [
        ("dsrepro.verdict", "REPRODUCED"), ("dsrepro.reason", "reproduced"), ("dsrepro.deepspeed", "0.19.8"),
        ("dsrepro.repro", "demo"), ("dsrepro.variant", "stock"), ("dsrepro.ranks", "2"), ("dsrepro.attempts", "1"),
    ]  # fmt: skip


def test_a_rerun_attempt_is_dropped_and_the_last_one_counted() -> None:
    run = RecordedTests()
    failed = TestRecord(**{**RECORD.__dict__, "verdict": Verdict.UNEXPECTED, "reason": Reason.FAILED_DIFFERENTLY,
                           "outcome": "failed"})  # fmt: skip
    for report in (_report("setup", "passed"), _report("call", "rerun", failed), _report("teardown", "passed")):
        run.add(report)
        props = run.junit_properties(report, "0.19.8")
    assert run.tests == []
    assert props == [("dsrepro.rerun", "attempt 1 failed and was run again; the last attempt counts")]
    for report in (_report("setup", "passed", rerun=1), _report("call", "skipped", RECORD, rerun=1),
                   _report("teardown", "passed", rerun=1)):  # fmt: skip
        run.add(report)
        props = run.junit_properties(report, "0.19.8")
    assert [(t.verdict, t.attempts) for t in run.tests] == [(Verdict.REPRODUCED, 2)]
    assert ("dsrepro.attempts", "2") in props
    assert ("dsrepro.verdict", "REPRODUCED") in props
    assert run.summary_lines() == ["REPRODUCED  t.py::test[zero3-stock]  (2 attempts)"]


REPROS = """
import pathlib

import pytest

pytestmark = [pytest.mark.ds_repro(id="demo-bug", title="A demo bug"), pytest.mark.ds_world]


def patch(monkeypatch):
    import json
    monkeypatch.setattr(json, "epilogue", lambda: None, raising=False)


@pytest.mark.ds_config("zero2")
@pytest.mark.ds_version(affected=">=0.1", raises=AttributeError, match="epilogue", fix=patch)
def test_demo(ds_config, ds_rank):
    import json
    json.epilogue()


@pytest.mark.ds_version(affected="<0.1", raises=AttributeError)
def test_long_fixed(ds_rank):
    pass


@pytest.mark.ds_version(affected=">=0.1", raises=KeyError, match="lost")
def test_flaky(ds_rank):
    flag = pathlib.Path(f"attempted-{ds_rank}")  # the ranks run in the test's directory
    if not flag.exists():
        flag.touch()
        raise ValueError("a gloo hiccup on the first attempt")
    raise KeyError("lost")
"""


def _testcases(path: Path) -> list[tuple[str, dict[str, str], list[str]]]:
    """Each testcase: its name, its properties, and the tags of what it holds besides them."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        props = {p.get("name", ""): p.get("value", "") for p in case.iter("property")}
        cases.append((case.get("name", ""), props, [c.tag for c in case if c.tag != "properties"]))
    return cases


@pytest.mark.parametrize("xdist", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_junit_properties_and_reruns(pytester: pytest.Pytester, run: RunPytest, xdist: list[str]) -> None:
    pytester.makepyfile(test_demo=REPROS, test_plain="def test_not_a_world():\n    pass\n")
    xml, out = pytester.path / "junit.xml", pytester.path / "out"
    result = run(f"--junitxml={xml}", "--reruns", "1", f"--ds-results={out}", f"--ds-report={out / 'r.md'}", *xdist)
    assert result.parseoutcomes() == {"passed": 3, "xfailed": 2, "rerun": 1}
    ds = deepspeed_version()
    cases = _testcases(xml)
    by_name: dict[str, list[tuple[dict[str, str], list[str]]]] = {}
    for name, props, tags in cases:
        by_name.setdefault(name, []).append((props, tags))

    ((stock, stock_tags),) = by_name["test_demo[zero2-stock]"]
    assert stock == {"dsrepro.verdict": "REPRODUCED", "dsrepro.reason": "reproduced", "dsrepro.deepspeed": ds,
                     "dsrepro.repro": "demo-bug", "dsrepro.variant": "stock", "dsrepro.ranks": "2",
                     "dsrepro.attempts": "1"}  # fmt: skip
    assert stock_tags == ["skipped"]
    ((fixed, fixed_tags),) = by_name["test_demo[zero2-fixed]"]
    assert (fixed["dsrepro.verdict"], fixed["dsrepro.reason"], fixed["dsrepro.variant"]) == (
        "PASSES-WITH-FIX", "fix-holds", "fixed")  # fmt: skip
    assert fixed_tags == []  # a pass: only the properties tell it from any other pass
    ((long_fixed, _),) = by_name["test_long_fixed"]
    assert (long_fixed["dsrepro.verdict"], long_fixed["dsrepro.reason"]) == ("FIXED", "not-affected")
    ((plain, _),) = by_name["test_not_a_world"]
    assert plain == {}  # not this plugin's business

    # The flaky test: junitxml writes one testcase per attempt; only the last carries the verdict.
    (first, _), (last, last_tags) = by_name["test_flaky"]
    assert first == {"dsrepro.rerun": "attempt 1 failed and was run again; the last attempt counts"}
    assert (last["dsrepro.verdict"], last["dsrepro.attempts"]) == ("REPRODUCED", "2")
    assert last_tags == ["skipped"]

    # Recorded once everywhere else: the results file, the report, the terminal summary.
    (path,) = out.glob("*.json")
    tests = [t for t in json.loads(path.read_text())["tests"] if t["nodeid"] == "test_demo.py::test_flaky"]
    assert [(t["verdict"], t["attempts"]) for t in tests] == [("REPRODUCED", 2)]
    assert (out / "r.md").read_text().count("### REPRODUCED: `test_demo.py::test_flaky`") == 1
    assert "UNEXPECTED" not in result.stdout.str().split("dsrepro verdicts")[1]
    result.stdout.fnmatch_lines(["REPRODUCED * test_demo.py::test_flaky  (2 attempts)"])
