"""Each test file's digest as pytest collected it: ranks import the file anew, which must still hold that code."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from ..core.errors import HarnessError
from .stash import SOURCES_KEY


def remember(item: pytest.Item) -> None:
    """Note what the item's file holds as pytest collects it (just after importing it)."""
    path = getattr(getattr(item, "module", None), "__file__", None)
    sources = item.config.stash.setdefault(SOURCES_KEY, {})
    if path is not None and path not in sources:
        sources[path] = _digest(path)


def _digest(path: str) -> str | None:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def check_unchanged(config: pytest.Config, path: str) -> None:
    """Refuse to run ranks that import ``path`` when it no longer holds the code pytest collected (edited while the
    run goes on), rather than run a body, fixes or markers pytest never saw."""
    collected = config.stash.get(SOURCES_KEY, {})
    if path in collected and _digest(path) != collected[path]:
        raise HarnessError(
            f"{path} changed since pytest collected it, so its ranks would run code pytest never saw; run pytest again"
        )
