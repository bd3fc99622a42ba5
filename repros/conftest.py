"""What every repro of the catalogue shares: each test here runs in an N-rank world, and puts its data on its rank's
device.

A repro file states the bug (``ds_repro``, ``ds_version``, ``ds_config``); that its body runs in every rank of a
fresh world is the catalogue's rule, applied here once. A test (or module) that carries its own ``ds_world`` marker
keeps it, with its own size, backend or timeout. This file travels with the catalogue: the wheel installs both as
``pytest_dsrepro/catalogue`` (``dsrepro scan`` runs them there), where the rule holds the same.

The repros live in a folder per DeepSpeed subsystem (``zero3/``, ``checkpoint/``, ...: ``core.areas``), and import
the helpers at this folder's top by plain name (``from _zero12 import ...``): pytest's default import mode puts this
folder on ``sys.path`` with this file, and a repro's own folder with the repro. Each repro is imported as a top-level
module named after its file, so a file name two repros share is refused here, naming both, before either is
imported.

The catalogue gives the same verdicts on a GPU as on the CPU only if its bodies put their tensors on the rank's
device (``ds_device``). On a CPU machine that cannot be seen (both are the CPU), so every catalogue body runs under
``placement_check`` (``inrank.devices``, through ``inrank.checks``): a tensor made here, in a repro or a shared
helper, or by ``inrank``'s helpers, without a device fails the test, on any machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_dsrepro.core.areas import namesake
from pytest_dsrepro.inrank.checks import tensors_on_the_rank_device

__all__ = ["tensors_on_the_rank_device"]  # a fixture: pytest finds it in this module

REPROS = Path(__file__).parent


@pytest.fixture
def checked_directory() -> str:
    """What the device check covers: the whole catalogue, the repro's folder and the helpers at the top alike."""
    return str(REPROS)


def pytest_make_collect_report(collector: pytest.Collector) -> pytest.CollectReport | None:
    """A repro whose file name another repro has fails to collect, naming both, and is never imported."""
    problem = namesake(collector.path, REPROS) if isinstance(collector, pytest.Module) else None
    return None if problem is None else pytest.CollectReport(collector.nodeid, "failed", problem, [])


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(REPROS) and item.get_closest_marker("ds_world") is None:
            item.add_marker(pytest.mark.ds_world)
