"""The run's collector: a plugin object that gathers every test's record where reports arrive (the controller under
xdist) and writes the run's outputs: the terminal summary, ``--ds-results``, ``--ds-report`` and the verdicts as
JUnit ``<property>`` elements (``--junitxml``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from ..core import results, scan_verdicts, versions
from ..core.gates import installed_deepspeed
from ..core.options import Launched, Settings
from ..core.paths import unwritable, unwritable_file
from ..core.report import Neutral
from ..core.results import ScanSource
from ..core.world_spec import settle_backend
from . import diagnostics, recording
from .stash import SCAN_KEY, SETTINGS_KEY, WORLDS_KEY


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


def check_outputs(config: pytest.Config, settings: Settings) -> None:
    """Every file the run will write, checked before anything runs, by the process that will write them: a path
    that cannot be written is a usage error now, not a traceback after the last test."""
    if config.option.collectonly or hasattr(config, "workerinput") or not config.stash[WORLDS_KEY].writes:
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


def _scanned(config: pytest.Config) -> ScanSource | None:
    """The config a scan ran (``--ds-scan``), as the run's record names it."""
    scan = config.stash.get(SCAN_KEY, None)
    return scan.source if scan is not None else None


class RunCollector:
    """Registered once per pytest process; under xdist only the controller writes."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.run = recording.Run()
        self.deepspeed = versions.installed_text("deepspeed")
        self.unsaved: list[str] = []  # outputs that could not be written at the end, in words

    @pytest.hookimpl(tryfirst=True)  # before junitxml, which writes a testcase's properties from its teardown report
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.run.add(report)
        if not hasattr(self.config, "workerinput"):  # under xdist the controller adds them, once
            report.user_properties.extend(self.run.junit_properties(report, self.deepspeed))

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        for what in self.unsaved:
            terminalreporter.write_line(f"pytest-dsrepro: NOT SAVED: {what}", red=True, bold=True)
        scanned = _scanned(self.config)
        if scanned is not None:  # a scan's verdicts are its table's, per bug
            settings = self.config.stash[SETTINGS_KEY]
            run = self.run.record(results.environment(settings.backend, settings.world_size), scanned)
            terminalreporter.write_sep("=", f"dsrepro scan of {scanned.path} (deepspeed {installed_deepspeed()})")
            for line in scan_verdicts.terminal(run):
                terminalreporter.write_line(line)
        lines = [] if scanned is not None else self.run.summary_lines()
        if lines:
            terminalreporter.write_sep("=", f"dsrepro verdicts (deepspeed {installed_deepspeed()})")
            for line in lines:
                terminalreporter.write_line(line)
        for facts in self.config.stash[WORLDS_KEY].started():  # one fork server per DeepSpeed accelerator used
            if lines or self.config.option.verbose > 0:
                terminalreporter.write_line(f"worlds ran on: {facts.describe()}")

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if hasattr(self.config, "workerinput") or self.config.option.collectonly:
            return  # the controller writes; a mere collection writes nothing
        worlds = self.config.stash[WORLDS_KEY]
        if not worlds.writes:
            return  # under torchrun rank 0 writes the run's files; every rank holds the same verdicts
        s = self.config.stash[SETTINGS_KEY]
        facts = next(iter(worlds.started()), None)
        cuda_devices = facts.cuda_devices if facts else 0
        backend, _ = settle_backend(s.backend, s.world_size, cuda_devices)
        env = results.environment(backend, s.world_size, list(facts.gpus) if facts else None)
        accelerator = facts.accelerator if facts and facts.accelerator else diagnostics.known_accelerator(cuda_devices)
        env = worlds.environment(dataclasses.replace(env, accelerator=accelerator))
        cuda_devices = facts.cuda_devices if facts else env.gpu_count or 0  # a launched run's: this node's devices
        if s.report is not None:  # what a maintainer asks for: only for a report, and only now
            env = diagnostics.gather(env, cuda_devices)
        neutral = Neutral.here(self.config.rootpath)
        run = self.run.record(env, _scanned(self.config))
        self.unsaved = recording.write_outputs(run, s.results, s.report, neutral)
        if self.unsaved and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
            session.exitstatus = NOT_SAVED  # the summary still says how the tests went
