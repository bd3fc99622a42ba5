"""The run's collector: a plugin object that gathers every test's record where reports arrive (the controller under
xdist) and writes the run's outputs: the terminal summary, ``--ds-results`` and ``--ds-report``."""

from __future__ import annotations

from typing import Any

import pytest

from ..core.gates import installed_deepspeed
from ..core.options import Launched, Settings
from ..core.report import render_markdown
from ..core.worlds import settle_backend
from . import recording
from .execution import RUNNER_KEY
from .stash import SETTINGS_KEY


def header_line(settings: Settings, launched: Launched | None) -> str:
    env = recording.environment(settings.backend, settings.world_size)
    line = (
        f"dsrepro: deepspeed {env['deepspeed'] or 'not installed'}, torch {env['torch'] or 'not installed'}, "
        f"world size {settings.world_size}, backend {settings.backend}, timeout {settings.timeout:g}s"
    )
    if launched is not None:
        line += f"; launched externally: rank {launched.rank} of {launched.world_size}"
    return line


def attach(item: pytest.Item, report: pytest.TestReport) -> None:
    """Put the test's record on its report (call phase, or any phase that did not pass), so it travels under xdist."""
    if report.when == "call" or not report.passed:
        record = recording.record(item, report, item.stash.get(recording.OUTCOME_KEY, None))
        report.user_properties.append((recording.PROPERTY, record))


class RunCollector:
    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.run = recording.Run()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.run.add(report)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        lines = self.run.summary_lines()
        if lines:
            terminalreporter.write_sep("=", f"dsrepro verdicts (deepspeed {installed_deepspeed()})")
            for line in lines:
                terminalreporter.write_line(line)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if hasattr(self.config, "workerinput") or self.config.option.collectonly:
            return  # the controller writes; a mere collection writes nothing
        s = self.config.stash[SETTINGS_KEY]
        facts = self.config.stash[RUNNER_KEY].server.facts
        backend, _ = settle_backend(s.backend, s.world_size, facts.cuda_devices if facts else 0)
        self.run.environment = recording.environment(backend, s.world_size, list(facts.gpus) if facts else None)
        if s.results is not None:
            self.run.write(s.results)
        if s.report is not None:
            s.report.parent.mkdir(parents=True, exist_ok=True)
            s.report.write_text(render_markdown(self.run.as_json()))
