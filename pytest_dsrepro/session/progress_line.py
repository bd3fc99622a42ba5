"""A line on the terminal mid-run, for what takes long or changes the run (a fork server's first start, a cache that
cannot be written)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest


def progress_line(config: pytest.Config) -> Callable[[str], None]:
    """A line on the terminal, now, even mid-test: ``pytest-dsrepro: <text>``.

    pytest captures a test's output at the file-descriptor level, so the line is written with capturing suspended,
    as pytest's own live logging does (the capture manager reached through the plugin manager, by its registered
    name, as pytest-timeout does). Silent where there is no terminal reporter (``-p no:terminal``, xdist workers).
    """

    def write(text: str) -> None:
        if not config.pluginmanager.has_plugin("terminalreporter"):
            return
        capture = config.pluginmanager.getplugin("capturemanager")
        suspended = getattr(capture, "global_and_fixture_disabled", contextlib.nullcontext)
        writer = config.get_terminal_writer()
        with suspended():
            writer.line()
            writer.line(f"pytest-dsrepro: {text}", bold=True)
            writer.flush()

    return write
