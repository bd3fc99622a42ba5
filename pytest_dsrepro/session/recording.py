"""Recording, the pytest side of the results file: a ``TestRecord`` per test report, a ``Run`` collecting them, and
the run's outputs (``--ds-results``, ``--ds-report``, the terminal summary).

The schema is ``core.results``'s; this module only reads the facts a test left on its stash (``session.stash``) and
its report. Records travel inside ``report.user_properties`` as JSON data, so they reach the controller under xdist.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ..core import results
from ..core.gates import Judgement, Verdict
from ..core.report import render_markdown
from ..core.results import Environment, ReproMeta, RunRecord, TestRecord
from . import markers
from .stash import CONFIG_KEY, JUDGEMENT_KEY, MARKS_KEY, OUTCOME_KEY

#: The ``user_properties`` name under which a report carries its record.
PROPERTY = "dsrepro"


def repro_meta(item: pytest.Item) -> ReproMeta | None:
    """The ``ds_repro`` metadata of a test, or None when it is not a catalogued repro."""
    mark = item.get_closest_marker("ds_repro")
    if mark is None:
        return None
    ds_versions = [(m.args, m.kwargs) for m in item.iter_markers("ds_version")]
    return results.repro_meta(mark.args, mark.kwargs, item.path, ds_versions)


def _outcome_word(report: pytest.TestReport) -> str:
    if hasattr(report, "wasxfail"):
        return "xfailed" if report.skipped else "xpassed"
    if report.when != "call" and report.failed:
        return "error"
    return report.outcome


def _error_line(report: pytest.TestReport, judgement: Judgement | None) -> str | None:
    if judgement is not None and judgement.verdict not in (Verdict.FIXED, Verdict.PASSES_WITH_FIX):
        return judgement.message.splitlines()[0]
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)  # the exception line, as pytest's short summary shows it
        text = crash.message if crash is not None else report.longreprtext.strip()
        return text.splitlines()[0] if text.strip() else "failed"
    return None


def record(item: pytest.Item, report: pytest.TestReport) -> TestRecord:
    """The record of one report of ``item``, from what the test left on its stash."""
    judgement = item.stash.get(JUDGEMENT_KEY, None)
    marks = item.stash.get(MARKS_KEY, None)
    verdict, reason = (judgement.verdict, judgement.reason) if judgement else (None, None)
    gated = bool(marks.gates) if marks is not None else item.get_closest_marker("ds_version") is not None
    if report.skipped and not hasattr(report, "wasxfail") and gated:
        verdict, reason = Verdict.SKIPPED, None  # a gated test that never got judged: no reason to give
    config = item.stash.get(CONFIG_KEY, None)
    return TestRecord(
        nodeid=item.nodeid,
        repro=repro_meta(item),
        variant=marks.variant if marks is not None else markers.variant(item),  # markers that failed to parse
        verdict=verdict,
        reason=reason,
        outcome=_outcome_word(report),
        error=_error_line(report, judgement),
        duration=round(report.duration, 3),
        config=config.config if config else None,
        config_notes=config.notes if config else (),
        ranks=results.rank_stories(item.stash.get(OUTCOME_KEY, None)),
        longrepr=(report.longreprtext or None) if report.failed else None,
    )


def attach(item: pytest.Item, report: pytest.TestReport) -> None:
    """Put the record of a call, or of a setup/teardown that did not pass, on the report (as JSON data)."""
    if report.when == "call" or not report.passed:
        report.user_properties.append((PROPERTY, record(item, report).to_json()))


@dataclass
class Run:
    """Collects the records of one pytest run, where reports arrive (the controller under xdist)."""

    tests: list[TestRecord] = field(default_factory=list)

    def add(self, report: pytest.TestReport) -> None:
        for name, value in report.user_properties:
            if name == PROPERTY:
                self.tests.append(TestRecord.from_json(value))

    def record(self, environment: Environment) -> RunRecord:
        return RunRecord(created=results.now(), environment=environment, tests=tuple(self.tests))

    def summary_lines(self) -> list[str]:
        """The terminal summary: one line per gated test, its verdict first."""
        gated = [t for t in self.tests if t.verdict or t.repro]
        labels = [t.verdict.value if t.verdict else t.outcome.upper() for t in gated]
        width = max(map(len, labels), default=0)
        lines = []
        for label, t in zip(labels, gated, strict=True):
            why = f"  -- {t.error}" if label in (Verdict.UNEXPECTED.value, Verdict.SKIPPED.value) else ""
            lines.append(f"{label:<{width}}  {t.nodeid}{why}")
        return lines


def write_outputs(run: RunRecord, results_dir: Path | None, report: Path | None) -> None:
    """``--ds-results DIR`` (a new file in it) and ``--ds-report PATH`` (Markdown), each when asked for."""
    if results_dir is not None:
        results.write(run, results_dir)
    if report is not None:
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(render_markdown(run))
