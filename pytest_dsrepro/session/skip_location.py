"""A skip the harness raises for a test, reported where the user looks: at the line of the body that skipped in its
rank, or at the test itself (NOT-APPLICABLE). As pytest's own ``skipping`` plugin does for ``skipif``, the report's
location is set when the report is made (``pytest_runtest_makereport``), not by where the exception was raised."""

from __future__ import annotations

from typing import NoReturn

import pytest

from .stash import SKIP_AT_KEY


def skip_at(item: pytest.Item, reason: str, path: str, line: int) -> NoReturn:
    """Skip ``item``, reported at ``path:line`` (1-based, as pytest's short summary shows it)."""
    __tracebackhide__ = True
    item.stash[SKIP_AT_KEY] = (path, line)
    raise pytest.skip.Exception(reason)


def skip_at_test(item: pytest.Item, reason: str) -> NoReturn:
    """Skip ``item``, reported at the test's definition, as a ``skipif`` marker's skip is."""
    __tracebackhide__ = True
    path, line, _ = item.reportinfo()
    skip_at(item, reason, str(path), (line or 0) + 1)


def relocate(item: pytest.Item, report: pytest.TestReport) -> None:
    """Put a skipped report at the place ``skip_at`` kept (once: a later phase of the test is not moved)."""
    where = item.stash.get(SKIP_AT_KEY, None)
    if where is None or not report.skipped or hasattr(report, "wasxfail") or not isinstance(report.longrepr, tuple):
        return
    del item.stash[SKIP_AT_KEY]
    report.longrepr = (*where, report.longrepr[2])
