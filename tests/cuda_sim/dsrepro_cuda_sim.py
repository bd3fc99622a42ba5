"""The CUDA simulation's pytest side (a plugin through ``PYTEST_PLUGINS``, set by ``sitecustomize``): pytest's
assertion rewriter imports the plugin's modules ahead of any other import hook, so the device-node patch is applied
here instead."""

from __future__ import annotations

import pytest
import sitecustomize


def pytest_configure(config: pytest.Config) -> None:
    from pytest_dsrepro.worlds import device_nodes

    sitecustomize.patch_devices(device_nodes)
