"""pytest-dsrepro: DeepSpeed distributed-training bugs as executable pytest tests in real N-rank worlds.

The public names live in ``pytest_dsrepro.api`` and are resolved from there on first use, so importing a subpackage
(in the fork server, in a rank, in the ``dsrepro`` command) loads nothing else of the package.

The catalogue is ``pytest_dsrepro.catalogue``: ``repros/`` of the checkout, which a built wheel installs there (a
package mapped in ``pyproject.toml``). From a checkout (``pip install -e .``, ``uv pip install -e .``, or the tree on
the path) it is named here: setuptools' editable finder cannot import a namespace package mapped inside a regular
one (pypa/setuptools#4943), and ``repros/`` must stay one (its files import their neighbours by plain name).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .api import (
        ConfigRejected,
        EngineFactory,
        RankContext,
        Slowdown,
        Verdict,
        WorldFailed,
        current,
        rank_fixture,
        run_in_world,
        slowdown,
        starting_worlds,
    )

__all__ = [
    "ConfigRejected", "EngineFactory", "RankContext", "Slowdown", "Verdict", "WorldFailed", "current", "rank_fixture",
    "run_in_world", "slowdown", "starting_worlds",
]  # fmt: skip


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import api

    return getattr(api, name)


def _catalogue_of_checkout() -> None:
    """``pytest_dsrepro.catalogue`` as ``repros/`` beside this package, where it is not installed inside it."""
    here = os.path.dirname(os.path.abspath(__file__))
    repros = os.path.join(os.path.dirname(here), "repros")
    name = f"{__name__}.catalogue"
    if name in sys.modules or os.path.isdir(os.path.join(here, "catalogue")):
        return
    if os.path.isfile(os.path.join(repros, "conftest.py")):
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = [repros]
        sys.modules[name] = importlib.util.module_from_spec(spec)


_catalogue_of_checkout()
