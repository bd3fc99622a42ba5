"""pytest-dsrepro's hooks and fixtures. Each hook is a few lines that call the module owning the idea.

Nothing heavy is imported here: torch and DeepSpeed live in the fork server and the ranks.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest

from .core import configs
from .session import execution
from .worlds import launcher
from .session import markers
from .session import parametrize
from .session import recording as results
from .session import settings
from .inrank.engine import EngineFactory
from .session.execution import PREPARED_KEY, RUNNER_KEY
from .core.gates import installed_deepspeed
from .worlds.rank import RankValue
from .session.settings import SETTINGS_KEY
from .worlds.client import WorldRunner


def pytest_addoption(parser: pytest.Parser) -> None:
    settings.add_options(parser)


def pytest_configure(config: pytest.Config) -> None:
    markers.register(config)
    resolved = settings.resolve(config)
    config.stash[SETTINGS_KEY] = resolved
    config.stash[RUNNER_KEY] = WorldRunner(resolved.cache_dir, resolved.startup_timeout)
    config.stash[results.RUN_KEY] = results.Run()


def pytest_unconfigure(config: pytest.Config) -> None:
    runner = config.stash.get(RUNNER_KEY, None)
    if runner is not None:
        runner.close()


def pytest_report_header(config: pytest.Config) -> list[str]:
    s = config.stash[SETTINGS_KEY]
    env = results.environment(s.backend, s.world_size)
    line = (
        f"dsrepro: deepspeed {env['deepspeed'] or 'not installed'}, torch {env['torch'] or 'not installed'}, "
        f"world size {s.world_size}, backend {s.backend}, timeout {s.timeout:g}s"
    )
    world = launcher.launched()
    if world is not None:
        line += f"; launched externally: rank {world.rank} of {world.world_size}"
    return [line]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    parametrize.configs(metafunc)
    parametrize.variants(metafunc)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    execution.setup(item)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    return execution.call(pyfuncitem)


@pytest.hookimpl(wrapper=True, specname="pytest_pyfunc_call")
def pytest_pyfunc_call_judged(pyfuncitem: pytest.Function) -> Generator[None, object, object]:
    try:
        result = yield
    except BaseException as exc:  # noqa: BLE001 - the gate decides what a failure means
        execution.judge_call(pyfuncitem, exc)
        raise
    execution.judge_call(pyfuncitem, None)
    return result


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.when == "call" or not report.passed:
        outcome = item.stash.get(execution.OUTCOME_KEY, None)
        record = results.record(item, report, outcome, execution.variant_of(item))
        report.user_properties.append((results.PROPERTY, record))
    return report


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.pluginmanager.register(_RunCollector(session.config), "dsrepro-run")


class _RunCollector:
    """Gathers records where reports arrive (the controller under xdist) and writes the run's outputs."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.run = config.stash[results.RUN_KEY]

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.run.add(report)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        lines = self.run.summary_lines()
        if lines:
            terminalreporter.write_sep("=", f"dsrepro verdicts (deepspeed {installed_deepspeed()})")
            for line in lines:
                terminalreporter.write_line(line)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if results.is_xdist_worker(self.config) or self.config.option.collectonly:
            return  # the controller writes; a mere collection writes nothing
        s = self.config.stash[SETTINGS_KEY]
        facts = self.config.stash[RUNNER_KEY].server.facts
        backend, _ = markers.settle_backend(s.backend, s.world_size, facts.cuda_devices if facts else 0)
        self.run.environment = results.environment(backend, s.world_size, facts.gpus if facts else None)
        if s.results is not None:
            self.run.write(s.results)
        if s.report is not None:
            from .core.report import render_markdown

            s.report.parent.mkdir(parents=True, exist_ok=True)
            s.report.write_text(render_markdown(self.run.as_json()))


def _world_only(request: pytest.FixtureRequest, name: str) -> None:
    if PREPARED_KEY not in request.node.stash:
        pytest.fail(
            f"{request.node.nodeid}: fixture {name!r} exists only in world tests (@pytest.mark.ds_world)", pytrace=False
        )


@pytest.fixture
def ds_rank(request: pytest.FixtureRequest) -> Any:
    """This rank's global rank (0..N-1)."""
    _world_only(request, "ds_rank")
    return RankValue("rank")


@pytest.fixture
def ds_world_size(request: pytest.FixtureRequest) -> Any:
    """The number of ranks in this test's world."""
    _world_only(request, "ds_world_size")
    return RankValue("world_size")


@pytest.fixture
def ds_variant(request: pytest.FixtureRequest) -> str | None:
    """``"stock"`` or ``"fixed"`` for tests whose ds_version declares a fix; None otherwise."""
    return getattr(request, "param", None)


@pytest.fixture
def ds_config(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The DeepSpeed config of this test id (from @pytest.mark.ds_config), resolved for its world."""
    param = getattr(request, "param", None)
    if param is None:
        pytest.fail(
            f"{request.node.nodeid}: ds_config needs @pytest.mark.ds_config('zero3', ...) on the test", pytrace=False
        )
    name, spec = param
    s = request.config.stash[SETTINGS_KEY]
    prepared = request.node.stash.get(PREPARED_KEY, None)
    size = prepared.spec.size if prepared else s.world_size
    backend = prepared.backend if prepared else "gloo"
    try:
        resolved = configs.resolve(spec, name, size, backend)
    except configs.ConfigError as exc:
        pytest.fail(f"@pytest.mark.ds_config on {request.node.nodeid}: {exc}", pytrace=False)
    request.node.stash[results.CONFIG_KEY] = resolved
    return resolved.config


@pytest.fixture
def ds_engine(request: pytest.FixtureRequest, ds_config: dict[str, Any]) -> EngineFactory:
    """Call it in the body: ``engine = ds_engine(model=None, optimizer="auto")`` runs ``deepspeed.initialize``."""
    _world_only(request, "ds_engine")
    return EngineFactory(ds_config, request.node.stash[results.CONFIG_KEY].name)
