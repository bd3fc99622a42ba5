"""DeepSpeed's own multi-rank tests in this plugin's worlds: ``pytest -p pytest_dsrepro.upstream`` from a DeepSpeed
checkout's ``tests/`` (what ``dsrepro upstream`` runs), with DeepSpeed's ``unit/common.py``, ``conftest.py`` and
``pytest.ini`` as they are on disk.

Built on the public API only (``ds_world``, ``rank_fixture``, ``run_in_world``, ``ds_not_applicable``,
``ds_origin``): ``harness`` reads upstream's classes as worlds, ``collection`` marks them and turns files that need
what the installed release lacks into NOT-APPLICABLE tests. The hooks here are a line or two each.
"""

from __future__ import annotations

import gc
import importlib.util
import inspect
import os
import sys
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ..api import rank_fixture, starting_worlds
from ..core import checkout, versions
from . import harness
from .collection import STATE, UpstreamModule, UpstreamSession

#: The project whose tests these are, as results and the matrix name it.
PROJECT = "DeepSpeed"


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> Generator[None, None, None]:
    """Import the installed DeepSpeed before DeepSpeed's tests/conftest.py puts its checkout first on ``sys.path``:
    the tests then run against the release installed here (what the fork server's ranks import), never against the
    checkout's sources, whatever release they came from; once the conftests are loaded, the checkout comes off
    ``sys.path`` again (``take_checkout_off_path``). The worlds' fork server starts first, to import torch and
    DeepSpeed beside this process and its conftests (``starting_worlds``)."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None:
        return (yield)
    with starting_worlds(early_config):
        try:
            deepspeed = importlib.import_module("deepspeed")
        except Exception as exc:  # whatever a broken DeepSpeed raises: one line, before anything runs
            where = os.path.dirname(spec.origin or "?")
            message = f"pytest_dsrepro.upstream: DeepSpeed from {where} does not import: {exc!r}"
            raise pytest.UsageError(message) from exc
        gc.freeze()  # torch's and DeepSpeed's million import-time objects: no collection of this run walks them again
        yield
        take_checkout_off_path(checkout.find(early_config.rootpath), deepspeed.__file__)


def take_checkout_off_path(root: Path | None, deepspeed_file: str | None) -> None:
    """Take the checkout's root back off ``sys.path`` once DeepSpeed's conftest has put it first there (unless the
    installed DeepSpeed is that checkout, installed editable): what this process and its children then import by
    name comes from the installed release too, not ``deepspeed`` alone (imported before). Otherwise DeepSpeed picks
    the checkout's top-level ``op_builder`` and compiles its ops in this process from the checkout's C++ sources
    (rebuilding the ranks' builds of the installed ones, and back), and a test's ``multiprocessing`` children
    (DeepSpeed's ``run_cpu_gloo_test``), which start from this ``sys.path``, import the checkout's ``deepspeed``."""
    if root is None or (deepspeed_file is not None and Path(deepspeed_file).resolve().is_relative_to(root)):
        return
    sys.path[:] = [p for p in sys.path if not p or Path(p).resolve() != root]


def pytest_configure(config: pytest.Config) -> None:
    config.stash[STATE] = UpstreamSession(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    state = config.stash.get(STATE, None)
    if state is not None:
        state.close()


def pytest_report_header(config: pytest.Config) -> list[str]:
    return [header(config)]


def pytest_pycollect_makemodule(module_path: Any, parent: Any) -> pytest.Module:
    return UpstreamModule.from_parent(parent, path=module_path)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    origin = pytest.mark.ds_origin(**tests_origin(config))
    for item in items:
        item.add_marker(origin)
        size = sized_by_parameter(item)
        if size is not None:
            item.add_marker(pytest.mark.ds_world(size=size), append=False)


def pytest_runtest_setup(item: pytest.Item) -> None:
    cls = getattr(item, "cls", None)
    skip = harness.requires_accelerator_skip(cls) if harness.is_dist_test(cls) else None
    if skip is not None:
        pytest.skip(skip)


# ---- what the hooks call ---------------------------------------------------------------------------------------


def tests_checkout(config: pytest.Config) -> checkout.Checkout | None:
    """The DeepSpeed checkout the tests of this run come from (None: not a git checkout of DeepSpeed)."""
    root = checkout.find(config.rootpath)
    try:
        return checkout.read(root) if root is not None else None
    except checkout.CheckoutError:
        return None


def tests_origin(config: pytest.Config) -> dict[str, str | None]:
    """``ds_origin``'s arguments for the tests of this run: DeepSpeed, its checkout's revision (``unknown`` when the
    tests are not in a git checkout)."""
    found = tests_checkout(config)
    if found is None:
        return {"project": PROJECT, "revision": checkout.UNKNOWN, "described": None}
    return {"project": PROJECT, "revision": found.revision, "described": found.described}


def header(config: pytest.Config) -> str:
    """What runs against what: the tests' checkout and revision, the DeepSpeed release and where it imports from."""
    found = tests_checkout(config)
    tests = found.describe() if found is not None else f"{config.rootpath} (not a git checkout of DeepSpeed)"
    release = versions.installed_text("deepspeed") or "not installed"
    spec = importlib.util.find_spec("deepspeed")
    where = os.path.dirname(spec.origin) if spec is not None and spec.origin else "nowhere"
    return f"dsrepro upstream: {PROJECT}'s tests from {tests}; DeepSpeed {release} from {where}"


def sized_by_parameter(item: pytest.Item) -> int | None:
    """A ``DistributedTest`` method that takes a ``world_size`` argument gets its world from that parameter, as
    upstream's harness does (the parameter of a ``world_size`` fixture or of ``parametrize``)."""
    if not harness.is_dist_test(getattr(item, "cls", None)):
        return None
    params = getattr(getattr(item, "callspec", None), "params", {})
    value = params.get("world_size")
    if not isinstance(value, int) or isinstance(value, bool) or not isinstance(item, pytest.Function):
        return None
    return value if "world_size" in inspect.signature(item.function).parameters else None


# ---- in every rank of an upstream test --------------------------------------------------------------------------


@dataclass(frozen=True)
class Preamble:
    """What upstream's harness does in each rank before a test, and which DeepSpeed the pytest process imported."""

    init_distributed: bool
    deepspeed_file: str | None


@pytest.fixture
def dsrepro_upstream_world(request: pytest.FixtureRequest) -> Preamble | None:
    """The preamble of an upstream ``DistributedTest``'s ranks (None for any other test)."""
    cls = getattr(request.node, "cls", None)
    if not harness.is_dist_test(cls):
        return None
    spec = importlib.util.find_spec("deepspeed")
    return Preamble(bool(getattr(cls, "init_distributed", True)), spec.origin if spec else None)


@rank_fixture(autouse=True)
def dsrepro_upstream_preamble(dsrepro_upstream_world: Preamble | None) -> None:
    """In each rank of an upstream test: check that the rank imports the DeepSpeed the pytest process imported (the
    release under test, not the checkout's sources), then, for an ``init_distributed`` class, what upstream's
    ``_dist_run`` does: ``deepspeed.init_distributed`` on the world's process group and a barrier."""
    if dsrepro_upstream_world is None:
        return
    import deepspeed

    if dsrepro_upstream_world.deepspeed_file not in (None, deepspeed.__file__):
        raise RuntimeError(
            f"this rank imports DeepSpeed from {deepspeed.__file__}, the pytest process from "
            f"{dsrepro_upstream_world.deepspeed_file}: the test would not run the release under test"
        )
    if dsrepro_upstream_world.init_distributed:
        from ..api import current

        deepspeed.init_distributed(dist_backend=current().backend)
        deepspeed.comm.barrier()
