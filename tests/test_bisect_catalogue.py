"""``benchmarks/bisect_catalogue.py``: which catalogued boundaries it bisects, and how its table reads the records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from packaging.version import Version

from conftest import load_benchmark
from pytest_dsrepro.tools.catalogue import Entry

bc = load_benchmark("bisect_catalogue")

LISTED = [Version(v) for v in ("0.14.4", "0.15.4", "0.16.0", "0.16.1")]
PYPI = [Version(v) for v in ("0.14.4", "0.14.5", "0.15.0", "0.15.4", "0.16.0", "0.16.1")]


def _entry(bug: str, *affected: str, stock: bool = True) -> Entry:
    tests = (f"repros/t.py::test_{bug}[cfg-stock]", f"repros/t.py::test_{bug}[cfg-fixed]") if stock else ()
    return Entry(bug, "title", None, None, None, "cause", affected, "repros/t.py", tests)


def test_only_bounds_in_a_gap_holding_other_releases_are_bisected() -> None:
    found = bc.boundaries(
        [
            _entry("fix-in-gap", "<0.15.0"),  # fixed between 0.14.4 and 0.15.4, which hold 0.14.5 and 0.15.0
            _entry("start-in-gap", ">=0.14.5,<0.16.1"),  # begins in that gap; ends between adjacent releases
            _entry("message-change", "<0.15.0", ">=0.15.0,<0.16.0"),  # 0.15.0: its message changes, not the bug
            _entry("no-stock-test", "<0.15.0", stock=False),
        ],
        LISTED,
        PYPI,
    )
    assert [(b.id, b.kind, b.declared, b.good, b.bad) for b in found] == [
        ("fix-in-gap", "fixed", "0.15.0", "0.15.4", "0.14.4"),
        ("start-in-gap", "introduced", "0.14.5", "0.14.4", "0.15.4"),
    ]
    assert found[0].node == "repros/t.py::test_fix-in-gap[cfg-stock]"


def test_the_table_counts_agreements_and_says_why_a_bisect_found_no_release(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = {
        "agrees": ("0.15.0", "first release where the outcome flips: deepspeed 0.15.0\n"),
        "differs": ("0.14.5", "first release where the outcome flips: deepspeed 0.14.5\n"),
        "feature": (None, "dsrepro bisect: deepspeed 0.14.4 could not be tested (NOT-APPLICABLE: ...)\n"),
    }
    for bug, (release, text) in runs.items():
        boundary = bc.Boundary(bug, f"t.py::test_{bug}[stock]", "0.15.0", "fixed", "0.15.4", "0.14.4")
        (tmp_path / f"{boundary.name}.txt").write_text(text)
        record = {**vars(boundary), "rc": 0 if release else 1, "wall_s": 60.0, "found": release, "probes": 4}
        (tmp_path / f"{boundary.name}.json").write_text(json.dumps(record))
    bc.summary(tmp_path)
    out = capsys.readouterr().out
    assert "| 0.15.0 | 0.14.5 **differs** |" in out
    assert "not applicable at the older end: the feature appears in the gap" in out
    assert out.rstrip().endswith("3 boundaries: 1 found where declared, 1 elsewhere, 1 without a release; 3 min in all")
