"""``--ds-shard I/N``: this process runs every N-th collected test, starting with the I-th, so that N machines (or
processes) share one run, each with worlds of its own; ``dsrepro matrix`` merges their results files."""

from __future__ import annotations

import pytest

from .stash import SETTINGS_KEY


def select(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep this shard's items, in their order; the others are deselected (pytest counts them as such).

    Every N-th item rather than contiguous blocks: a catalogue's slow repros sit together in its files.
    """
    shard = config.stash[SETTINGS_KEY].shard
    if shard is None:
        return
    index, count = shard
    kept = [item for i, item in enumerate(items) if i % count == index - 1]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[item for i, item in enumerate(items) if i % count != index - 1])
        items[:] = kept
