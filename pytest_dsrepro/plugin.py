"""pytest-dsrepro's hooks and fixtures: each hook is a line or two that call the module owning the idea; the
plugin's own hooks (``HookSpecs``), for its plugin objects, with the plugin's defaults.

Nothing heavy is imported here: torch and DeepSpeed live in the fork server and the ranks.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest

from .core.gates import Judgement
from .core.results import RunRecord, TestRecord
from .inrank.engine import EngineFactory
from .session import backends, collector, execution, markers, parametrize, rank_job, recording, settings, verdicts
from .session.recording import RecordedTests, Summary
from .worlds.launched import launcher
from .worlds.protocol import RankValue


class HookSpecs:
    """The plugin's own hooks, for plugin objects that put a test or the run their own way. Each is asked first;
    where none answers (None), the plugin does its own."""

    @pytest.hookspec(firstresult=True)
    def pytest_dsrepro_conclude(self, item: pytest.Item, judgement: Judgement, story: str) -> object:
        """The pytest outcome of a judged test: raise it (``pytest.xfail``, ``pytest.skip``, ``pytest.fail``), or
        return True for a pass. ``story``: what the user reads under the verdict. The plugin's own conclusion comes
        last (REPRODUCED xfails, UNEXPECTED fails)."""

    @pytest.hookspec(firstresult=True)
    def pytest_dsrepro_config(self, item: pytest.Item) -> dict[str, Any] | None:
        """The DeepSpeed config a test runs in place of its ``ds_config`` entry, asked when the fixture resolves it
        for the test's world."""

    @pytest.hookspec(firstresult=True)
    def pytest_dsrepro_test_record(self, item: pytest.Item, record: TestRecord) -> TestRecord | None:
        """The record of one of the test's reports, amended (``core.results.TestRecord``)."""

    @pytest.hookspec(firstresult=True)
    def pytest_dsrepro_run_record(self, config: pytest.Config, record: RunRecord) -> RunRecord | None:
        """The run's record, amended, for ``--ds-results``, ``--ds-report`` and the summary."""

    @pytest.hookspec(firstresult=True)
    def pytest_dsrepro_summary(self, config: pytest.Config, recorded: RecordedTests) -> Summary | None:
        """The run's part of the terminal summary, in place of its verdicts."""

    @pytest.hookspec(firstresult=True)
    def pytest_dsrepro_report(self, config: pytest.Config, run: RunRecord) -> str | None:
        """The Markdown ``--ds-report`` writes, in place of the run's report."""


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    pluginmanager.add_hookspecs(HookSpecs)


def pytest_addoption(parser: pytest.Parser) -> None:
    settings.add_options(parser)


def pytest_configure(config: pytest.Config) -> None:
    markers.register(config)
    resolved = settings.configure(config)
    backends.configure(config, resolved)  # once: spawned worlds, or a launcher's
    collector.configure(config, resolved)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    backends.session_finished(session, exitstatus)


@pytest.hookimpl(trylast=True)  # after the summary and every output written (a launched rank 0's, for its peers)
def pytest_unconfigure(config: pytest.Config) -> None:
    backends.close(config)


def pytest_report_header(config: pytest.Config) -> list[str]:
    return [collector.header_line(config.stash[settings.SETTINGS_KEY], launcher.launched())]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    parametrize.select(config, items)


def pytest_collection_finish(session: pytest.Session) -> None:
    backends.plan(session)


def pytest_itemcollected(item: pytest.Item) -> None:
    rank_job.remember(item)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    parametrize.expand(metafunc)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    execution.setup(item)


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> Generator[None, object, object]:
    __tracebackhide__ = True  # users read their test's frames, not the plugin's
    return (yield from execution.call(pyfuncitem))


@pytest.hookimpl(trylast=True)  # a plugin object's conclusion comes first
def pytest_dsrepro_conclude(judgement: Judgement, story: str) -> bool:
    return verdicts.conclude(judgement, story)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    verdicts.relocate(item, report)
    recording.attach(item, report)
    return report


@pytest.fixture
def ds_rank(request: pytest.FixtureRequest) -> Any:
    """This rank's global rank (0..N-1)."""
    execution.require_world(request, "ds_rank")
    return RankValue("rank")


@pytest.fixture
def ds_world_size(request: pytest.FixtureRequest) -> Any:
    """The number of ranks in this test's world."""
    execution.require_world(request, "ds_world_size")
    return RankValue("world_size")


@pytest.fixture
def ds_device(request: pytest.FixtureRequest) -> Any:
    """This rank's device, for the data a body feeds its engine: ``"cuda:LOCAL_RANK"`` in NCCL worlds, ``"cpu"``."""
    execution.require_world(request, "ds_device")
    return RankValue("device")


@pytest.fixture
def ds_variant(request: pytest.FixtureRequest) -> str | None:
    """``"stock"`` or ``"fixed"`` for tests whose ds_version declares a fix; None otherwise."""
    return getattr(request, "param", None)


@pytest.fixture
def ds_config(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The DeepSpeed config of this test id (from @pytest.mark.ds_config), resolved for its world."""
    return execution.resolve_config(request)


@pytest.fixture
def ds_engine(request: pytest.FixtureRequest, ds_config: dict[str, Any]) -> EngineFactory:
    """Call it in the body: ``engine = ds_engine(model=None, optimizer="auto")`` runs ``deepspeed.initialize``."""
    execution.require_world(request, "ds_engine")
    return EngineFactory(ds_config, request.node.stash[execution.CONFIG_KEY].name)
