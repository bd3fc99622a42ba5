"""The cache directory checked once the run's tests are known, before the first world: one that can serve no world
stops a run that has world tests, in one line, rather than failing each of them."""

from __future__ import annotations

import pytest

from ..core.paths import unwritable
from ..worlds.server import comm_op
from .progress_line import progress_line
from .stash import SETTINGS_KEY


def check(session: pytest.Session) -> None:
    """A read-only cache without builds is a usage error; a read-only one that holds builds is said."""
    config = session.config
    if config.option.collectonly or not any(item.get_closest_marker("ds_world") for item in session.items):
        return
    cache = config.stash[SETTINGS_KEY].cache_dir
    why = unwritable(cache)
    if why is None:
        return
    if not comm_op.holds_builds(cache):
        raise pytest.UsageError(  # one line, as every startup error: pytest.exit() here reads "! Exit: ... !"
            f"pytest-dsrepro: the cache directory {cache} cannot be written ({why}) and holds no build of DeepSpeed's "
            "comm op for worlds to use: point --ds-cache-dir (or DSREPRO_CACHE_DIR) at a writable directory"
        )
    progress_line(config)(f"the cache directory {cache} cannot be written ({why}): worlds use the builds it holds")
