"""What every repro of the catalogue shares: each test here runs in an N-rank world.

A repro file states the bug (``ds_repro``, ``ds_version``, ``ds_config``); that its body runs in every rank of a
fresh world is the catalogue's rule, applied here once. A test (or module) that carries its own ``ds_world`` marker
keeps it, with its own size, backend or timeout. This file travels with the catalogue: the wheel installs both as
``pytest_dsrepro/catalogue`` (``dsrepro scan`` runs them there), where the rule holds the same.
"""

from __future__ import annotations

from pathlib import Path

import pytest

REPROS = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(REPROS) and item.get_closest_marker("ds_world") is None:
            item.add_marker(pytest.mark.ds_world)
