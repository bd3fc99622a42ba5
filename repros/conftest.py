"""What every repro of the catalogue shares: each test here runs in an N-rank world, and puts its data on its rank's
device.

A repro file states the bug (``ds_repro``, ``ds_version``, ``ds_config``); that its body runs in every rank of a
fresh world is the catalogue's rule, applied here once. A test (or module) that carries its own ``ds_world`` marker
keeps it, with its own size, backend or timeout. This file travels with the catalogue: the wheel installs both as
``pytest_dsrepro/catalogue`` (``dsrepro scan`` runs them there), where the rule holds the same.

The catalogue gives the same verdicts on a GPU as on the CPU only if its bodies put their tensors on the rank's
device (``ds_device``). On a CPU machine that cannot be seen (both are the CPU), so every catalogue body runs under
``placement_check`` (``inrank.devices``, through ``inrank.checks``): a tensor made here, or by ``inrank``'s helpers,
without a device fails the test, on any machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_dsrepro.inrank.checks import checked_directory, tensors_on_the_rank_device

__all__ = ["checked_directory", "tensors_on_the_rank_device"]  # fixtures: pytest finds them in this module

REPROS = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(REPROS) and item.get_closest_marker("ds_world") is None:
            item.add_marker(pytest.mark.ds_world)
