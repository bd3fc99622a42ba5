"""pytest-dsrepro's hooks and fixtures: each hook is a few lines that call the module owning the idea.

Nothing heavy is imported here: torch and DeepSpeed live in the fork server and the ranks.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest

from .core import configs
from .core.gates import Judgement
from .inrank.engine import EngineFactory
from .session import (
    backends,
    cache_check,
    collector,
    execution,
    hookspecs,
    markers,
    parametrize,
    recording,
    scan_plugin,
    settings,
    shard,
    skip_location,
    source_digests,
)
from .session.stash import CONFIG_KEY, INTERRUPTED_KEY, PREPARED_KEY, SCAN_PLAN_KEY, SETTINGS_KEY, WORLDS_KEY
from .worlds.launched import launcher
from .worlds.protocol import RankValue


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    pluginmanager.add_hookspecs(hookspecs)


def pytest_addoption(parser: pytest.Parser) -> None:
    settings.add_options(parser)


def pytest_configure(config: pytest.Config) -> None:
    markers.register(config)
    resolved = settings.resolve(config)
    config.stash[SETTINGS_KEY] = resolved
    config.stash[WORLDS_KEY] = backends.choose(config, resolved)  # once: spawned worlds, or a launcher's
    scan_plugin.configure(config, resolved)  # registered only for --ds-scan
    collector.check_outputs(config, resolved)
    config.pluginmanager.register(collector.RunCollector(config), "dsrepro-run")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[INTERRUPTED_KEY] = exitstatus == pytest.ExitCode.INTERRUPTED


@pytest.hookimpl(trylast=True)  # after the summary and every output written (a launched rank 0's, for its peers)
def pytest_unconfigure(config: pytest.Config) -> None:
    worlds = config.stash.get(WORLDS_KEY, None)
    if worlds is not None:  # a comm-op build beside the worlds is let go on here, for later runs
        worlds.close(finish_builds=not config.stash.get(INTERRUPTED_KEY, True))


def pytest_report_header(config: pytest.Config) -> list[str]:
    return [collector.header_line(config.stash[SETTINGS_KEY], launcher.launched())]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    shard.select(config, items)


def pytest_collection_finish(session: pytest.Session) -> None:
    session.config.stash[WORLDS_KEY].plan(session.items)
    cache_check.check(session)


def pytest_itemcollected(item: pytest.Item) -> None:
    source_digests.remember(item)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    parametrize.expand(metafunc)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    execution.setup(item)


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> Generator[None, object, object]:
    __tracebackhide__ = True  # users read their test's frames, not the plugin's
    with execution.in_world(pyfuncitem):
        try:
            result = yield
        except BaseException as exc:
            execution.judge_call(pyfuncitem, exc)
            raise
    execution.judge_call(pyfuncitem, None)
    return result


@pytest.hookimpl(trylast=True)  # a scan's conclusion (``scan_plugin.Scan``) comes first
def pytest_dsrepro_conclude(item: pytest.Item, judgement: Judgement, story: str) -> bool:
    return execution.conclude(judgement, story)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    skip_location.relocate(item, report)
    recording.attach(item, report)
    return report


def _world_only(request: pytest.FixtureRequest, name: str) -> None:
    if PREPARED_KEY not in request.node.stash:
        markers.fail(f"{request.node.nodeid}: fixture {name!r} exists only in world tests (@pytest.mark.ds_world)")


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
def ds_device(request: pytest.FixtureRequest) -> Any:
    """This rank's device, for the data a body feeds its engine: ``"cuda:LOCAL_RANK"`` in NCCL worlds, ``"cpu"``."""
    _world_only(request, "ds_device")
    return RankValue("device")


@pytest.fixture
def ds_variant(request: pytest.FixtureRequest) -> str | None:
    """``"stock"`` or ``"fixed"`` for tests whose ds_version declares a fix; None otherwise."""
    return getattr(request, "param", None)


@pytest.fixture
def ds_config(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The DeepSpeed config of this test id (from @pytest.mark.ds_config), resolved for its world."""
    param = getattr(request, "param", None)
    if param is None:
        markers.fail(f"{request.node.nodeid}: ds_config needs @pytest.mark.ds_config('zero3', ...) on the test")
    name, spec = param
    plan = request.node.stash.get(SCAN_PLAN_KEY, None)  # a scan's: the user's config, the premise's settings on top
    spec = plan.config if plan is not None else spec
    prepared = request.node.stash.get(PREPARED_KEY, None)
    size = prepared.spec.size if prepared else request.config.stash[SETTINGS_KEY].world_size
    try:
        resolved = configs.resolve(spec, name, size, prepared.backend if prepared else "gloo")
    except configs.ConfigError as exc:
        markers.fail(f"@pytest.mark.ds_config on {request.node.nodeid}: {exc}")
    request.node.stash[CONFIG_KEY] = resolved
    return resolved.config


@pytest.fixture
def ds_engine(request: pytest.FixtureRequest, ds_config: dict[str, Any]) -> EngineFactory:
    """Call it in the body: ``engine = ds_engine(model=None, optimizer="auto")`` runs ``deepspeed.initialize``."""
    _world_only(request, "ds_engine")
    return EngineFactory(ds_config, request.node.stash[CONFIG_KEY].name)
