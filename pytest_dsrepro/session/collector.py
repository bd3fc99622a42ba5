"""The run's collector: a plugin object that gathers every test's record where reports arrive (the controller under
xdist) and writes the run's outputs: the terminal summary, ``--ds-results``, ``--ds-report`` and the verdicts as
JUnit ``<property>`` elements (``--junitxml``). A plugin object may put the run its own way: amend its record
(``pytest_dsrepro_run_record``), write its own summary (``pytest_dsrepro_summary``) and report
(``pytest_dsrepro_report``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from ..core import results, versions
from ..core.files import write_atomically
from ..core.gates import installed_deepspeed
from ..core.options import Launched, Settings
from ..core.paths import unwritable, unwritable_file
from ..core.report import Neutral, render_markdown
from ..core.results import Environment, RunRecord
from ..core.world_spec import settle_backend
from . import diagnostics
from .backends import WORLD_BACKEND_KEY
from .recording import RecordedTests, Summary
from .settings import SETTINGS_KEY


def header_line(settings: Settings, launched: Launched | None) -> str:
    deepspeed, torch = versions.installed_text("deepspeed"), versions.installed_text("torch")
    line = (
        f"dsrepro: deepspeed {deepspeed or 'not installed'}, torch {torch or 'not installed'}, "
        f"world size {settings.world_size}, backend {settings.backend}, timeout {settings.timeout:g}s"
    )
    if launched is not None:
        line += f"; launched externally: rank {launched.rank} of {launched.world_size}"
        if launched.local_world_size is not None:
            line += f", {launched.local_world_size} on this node"
    if settings.shard is not None:
        line += f"; shard {settings.shard[0]}/{settings.shard[1]}"
    return line


#: The exit code of a run whose results or report could not be saved at its end (pytest's own codes are 0 to 5).
NOT_SAVED = 6


def configure(config: pytest.Config, settings: Settings) -> None:
    """At configure: the run's outputs checked, then its collector registered."""
    check_outputs(config, settings)
    config.pluginmanager.register(RunCollector(config), "dsrepro-run")


def check_outputs(config: pytest.Config, settings: Settings) -> None:
    """Every file the run will write, checked before anything runs, by the process that will write them: a path
    that cannot be written is a usage error now, not a traceback after the last test."""
    if config.option.collectonly or hasattr(config, "workerinput") or not config.stash[WORLD_BACKEND_KEY].writes:
        return
    junit = getattr(config.option, "xmlpath", None)
    outputs = [
        ("--ds-results", settings.results, unwritable),
        ("--ds-report", settings.report, unwritable_file),
        ("--junitxml", Path(junit) if junit else None, unwritable_file),
    ]
    problems = [f"{option} {path}: cannot be written ({why})" for option, path, check in outputs
                if path is not None and (why := check(path)) is not None]  # fmt: skip
    if problems:
        raise pytest.UsageError(f"pytest-dsrepro: {'; '.join(problems)}; nothing of this run could be saved there")


class RunCollector:
    """Registered once per pytest process; under xdist only the controller writes."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.recorded = RecordedTests()
        self.deepspeed = versions.installed_text("deepspeed")
        self.unsaved: list[str] = []  # outputs that could not be written at the end, in words

    @pytest.hookimpl(tryfirst=True)  # before junitxml, which writes a testcase's properties from its teardown report
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.recorded.add(report)
        if not hasattr(self.config, "workerinput"):  # under xdist the controller adds them, once
            report.user_properties.extend(self.recorded.junit_properties(report, self.deepspeed))

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        for what in self.unsaved:
            terminalreporter.write_line(f"pytest-dsrepro: NOT SAVED: {what}", red=True, bold=True)
        summary = self.config.hook.pytest_dsrepro_summary(config=self.config, recorded=self.recorded) or Summary(
            f"dsrepro verdicts (deepspeed {installed_deepspeed()})", self.recorded.summary_lines()
        )
        if summary.lines:
            terminalreporter.write_sep("=", summary.title)
            for line in summary.lines:
                terminalreporter.write_line(line)
        for facts in self.config.stash[WORLD_BACKEND_KEY].started():  # one fork server per DeepSpeed accelerator used
            if (summary.lines and summary.with_worlds) or self.config.option.verbose > 0:
                terminalreporter.write_line(f"worlds ran on: {facts.describe()}")

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if hasattr(self.config, "workerinput") or self.config.option.collectonly:
            return  # the controller writes; a mere collection writes nothing
        world_backend = self.config.stash[WORLD_BACKEND_KEY]
        if not world_backend.writes:
            return  # under torchrun rank 0 writes the run's files; every rank holds the same verdicts
        s = self.config.stash[SETTINGS_KEY]
        facts = next(iter(world_backend.started()), None)
        cuda_devices = facts.cuda_devices if facts else 0
        backend, _ = settle_backend(s.backend, s.world_size, cuda_devices)
        env = results.environment(backend, s.world_size, list(facts.gpus) if facts else None)
        accelerator = facts.accelerator if facts and facts.accelerator else diagnostics.known_accelerator(cuda_devices)
        env = world_backend.environment(dataclasses.replace(env, accelerator=accelerator))
        cuda_devices = facts.cuda_devices if facts else env.gpu_count or 0  # a launched run's: this node's devices
        if s.report is not None:  # what a maintainer asks for: only for a report, and only now
            env = diagnostics.gather(env, cuda_devices)
        run = self._run_record(env)
        report = None if s.report is None else (s.report, self._markdown(run))
        self.unsaved = write_outputs(run, s.results, report)
        if self.unsaved and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
            session.exitstatus = NOT_SAVED  # the summary still says how the tests went

    def _run_record(self, environment: Environment) -> RunRecord:
        own = self.recorded.record(environment)
        return self.config.hook.pytest_dsrepro_run_record(config=self.config, record=own) or own

    def _markdown(self, run: RunRecord) -> str:
        """``--ds-report``'s Markdown: a plugin object's own, else the run's report (local paths made neutral)."""
        own = self.config.hook.pytest_dsrepro_report(config=self.config, run=run)
        return own if own is not None else render_markdown(run, neutral=Neutral.here(self.config.rootpath))


def write_outputs(run: RunRecord, results_dir: Path | None, report: tuple[Path, str] | None) -> list[str]:
    """``--ds-results DIR`` (a new file in it) and ``--ds-report PATH`` (its Markdown, whole or not at all), each
    when asked for; what could not be saved, in words (checked at startup, a path can still fail at the end: a full
    disk, a directory removed meanwhile)."""
    unsaved = []
    if results_dir is not None:
        try:
            results.write(run, results_dir)
        except OSError as exc:
            unsaved.append(f"--ds-results {results_dir} ({exc.strerror or exc})")
    if report is not None:
        path, markdown = report
        try:
            write_atomically(path, markdown)
        except OSError as exc:
            unsaved.append(f"--ds-report {path} ({exc.strerror or exc})")
    return unsaved
