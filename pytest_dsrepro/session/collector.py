"""The run's collector: a plugin object that gathers every test's record where reports arrive (the controller under
xdist) and writes the run's outputs: the terminal summary, ``--ds-results``, ``--ds-report`` and the verdicts as
JUnit ``<property>`` elements (``--junitxml``). A plugin object may put the run its own way: amend its record
(``pytest_dsrepro_run_record``), write its own summary (``pytest_dsrepro_summary``) and report
(``pytest_dsrepro_report``)."""

from __future__ import annotations

import dataclasses
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from ..core import results, versions
from ..core.escape import terminal
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
        self.held = HeldSignals()
        self.interrupted = False  # a signal ended the session or abandoned the report's diagnostics

    @pytest.hookimpl(tryfirst=True)  # before junitxml, which writes a testcase's properties from its teardown report
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.recorded.add(report)
        if not hasattr(self.config, "workerinput"):  # under xdist the controller adds them, once
            report.user_properties.extend(self.recorded.junit_properties(report, self.deepspeed))

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        for what in self.unsaved:  # every line here through core.escape: paths and rank errors from outside
            terminalreporter.write_line(terminal(f"pytest-dsrepro: NOT SAVED: {what}"), red=True, bold=True)
        summary = self.config.hook.pytest_dsrepro_summary(config=self.config, recorded=self.recorded) or Summary(
            f"dsrepro verdicts (deepspeed {installed_deepspeed()})", self.recorded.summary_lines()
        )
        if summary.lines:
            terminalreporter.write_sep("=", summary.title)
            for line in summary.lines:
                terminalreporter.write_line(terminal(line))
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
        try:
            self._write(session, env, cuda_devices)
        finally:
            if self.unsaved and getattr(session, "exitstatus", None) in (
                pytest.ExitCode.OK,
                pytest.ExitCode.TESTS_FAILED,
            ):
                session.exitstatus = NOT_SAVED  # the summary still says how the tests went

    def _write(self, session: pytest.Session, env: Environment, cuda_devices: int) -> None:
        """The ended tests' results and the report, whole, before anything slow: CI cancels with SIGINT, then SIGTERM
        seconds later, and a signal while they are written is held until they are (from the first signal on: see
        ``pytest_keyboard_interrupt``). Only then, for a report of a run not interrupted, the environment's
        diagnostics (3-10 s of subprocesses on a busy machine), the files rewritten with them; a signal meanwhile
        abandons them (the session ends interrupted), and the files stay as first written."""
        s = self.config.stash[SETTINGS_KEY]
        interrupted = (
            getattr(session, "exitstatus", None) == pytest.ExitCode.INTERRUPTED
        )  # unset where pytester collects
        if s.report is not None and interrupted:
            env = dataclasses.replace(env, ds_report=diagnostics.NOT_GATHERED, torch_env=diagnostics.NOT_GATHERED)
        run = self._run_record(env)
        self.held.hold()
        self.unsaved, written = write_outputs(
            run, s.results, None if s.report is None else (s.report, self._markdown(run))
        )
        if self.held.caught and not interrupted:  # CI's cancel came as the run ended: it ends interrupted
            session.exitstatus = pytest.ExitCode.INTERRUPTED
        if s.report is None or interrupted or self.held.caught:
            return
        started = diagnostics.start(env, cuda_devices)  # a signal meanwhile is noted (held), never raised in Popen
        try:
            self.held.raising = True
            if self.held.caught:  # it came while they started
                raise KeyboardInterrupt
            env = diagnostics.gather(env, started)
        except KeyboardInterrupt:  # the files are written; what signal comes next, up to pytest's end, stops nothing
            self.interrupted = True
            session.exitstatus = pytest.ExitCode.INTERRUPTED
            return
        finally:
            self.held.raising = False
            diagnostics.stop(started)
        run = self._run_record(env)
        lost = self.unsaved[:1] if s.results is not None and written is None else []  # the results, said once
        self.unsaved = lost + write_outputs(run, written, (s.report, self._markdown(run)), amend=True)[0]
        self.held.release()

    @pytest.hookimpl(tryfirst=True)  # before the terminal's, which formats the interrupted test's traceback: seconds
    def pytest_keyboard_interrupt(self) -> None:
        """The first signal of CI's cancel ended the session: a second one (SIGTERM, seconds later) is held until the
        ended tests' results and the report are written, where it would interrupt pytest's own handling of the
        first and lose them both, with a traceback."""
        self.interrupted = True
        self.held.hold()

    def pytest_unconfigure(self) -> None:
        """Signals act again; but once CI's cancel has begun (a signal ended the session, or abandoned the
        diagnostics), the next is held until the process ends: what is left is pytest's own exit."""
        if not self.held.caught and not self.interrupted:
            self.held.release()

    def _run_record(self, environment: Environment) -> RunRecord:
        own = self.recorded.record(environment)
        return self.config.hook.pytest_dsrepro_run_record(config=self.config, record=own) or own

    def _markdown(self, run: RunRecord) -> str:
        """``--ds-report``'s Markdown: a plugin object's own, else the run's report (local paths made neutral)."""
        own = self.config.hook.pytest_dsrepro_report(config=self.config, run=run)
        return own if own is not None else render_markdown(run, neutral=Neutral.here(self.config.rootpath))


#: What CI sends to cancel a job: SIGINT, then SIGTERM seconds later (then SIGKILL).
SIGNALS = (signal.SIGINT, signal.SIGTERM)


def write_outputs(
    run: RunRecord, results_at: Path | None, report: tuple[Path, str] | None, *, amend: bool = False
) -> tuple[list[str], Path | None]:
    """``--ds-results DIR`` (a new file in it; ``amend``: the file written before, again) and ``--ds-report PATH`` (its
    Markdown, whole or not at all), each when asked for; what could not be saved, in words (checked at startup, a
    path can still fail at the end: a full disk, a directory removed meanwhile), and the results file written."""
    unsaved, written = [], None
    if results_at is not None:
        try:
            written = results.write(run, results_at, amend=amend)
        except OSError as exc:
            unsaved.append(f"--ds-results {results_at} ({exc.strerror or exc})")
    if report is not None:
        path, markdown = report
        try:
            write_atomically(path, markdown)
        except OSError as exc:
            unsaved.append(f"--ds-report {path} ({exc.strerror or exc})")
    return unsaved, written


class HeldSignals:
    """SIGINT and SIGTERM noted (``caught``), not acted on, from ``hold`` to ``release``; from the main thread. While
    ``raising``, the first is a ``KeyboardInterrupt`` (what is under way is abandoned), and those after it are noted:
    one set of handlers throughout, so that no signal falls between two."""

    def __init__(self) -> None:
        self.caught: list[int] = []
        self.previous: dict[int, Any] = {}
        self.raising = False

    def hold(self) -> None:
        if self.previous or threading.current_thread() is not threading.main_thread():
            return
        self.previous = {signum: signal.signal(signum, self._note) for signum in SIGNALS}

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.caught.append(signum)
        if self.raising:
            self.raising = False
            raise KeyboardInterrupt(f"pytest-dsrepro: signal {signum} while the report's diagnostics were gathered")

    def release(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous = {}
