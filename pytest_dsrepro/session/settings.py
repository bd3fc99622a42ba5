"""The plugin's options on pytest's side: declared from ``core.options.OPTIONS``, resolved once into ``Settings``,
kept on ``config.stash[SETTINGS_KEY]``.

Command line > ``DSREPRO_*`` environment > ini > default; a bad value is a ``pytest.UsageError`` at startup that
names where it came from.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

import pytest

from ..core import options
from ..core.options import Option, Settings

#: The run's settings, resolved once at configure (``configure``).
SETTINGS_KEY = pytest.StashKey[Settings]()


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("dsrepro", "DeepSpeed repros in N-rank torch.distributed worlds")
    for opt in options.OPTIONS:
        group.addoption(opt.flag, dest=opt.dest, metavar=opt.metavar, default=None, help=opt.help)
        parser.addini(opt.ini, opt.help, default=None)


def configure(config: pytest.Config) -> Settings:
    """The settings, resolved at configure and kept for every later hook."""
    resolved = config.stash[SETTINGS_KEY] = resolve(config)
    return resolved


def resolve(
    config: pytest.Config, environ: Mapping[str, str] | None = None, namespace: argparse.Namespace | None = None
) -> Settings:
    """``namespace``: the command line as pytest parsed it before ``pytest_configure`` (``known_args_namespace``),
    for the hooks that come earlier."""
    environ = os.environ if environ is None else environ

    def command_line(opt: Option) -> tuple[object, str]:
        return (config.getoption(opt.dest) if namespace is None else getattr(namespace, opt.dest, None)), opt.flag

    def ini(opt: Option) -> tuple[object, str]:
        return config.getini(opt.ini) or None, f"ini option {opt.ini}"

    try:
        return options.resolve([command_line, options.environment_source(environ), ini], environ)
    except options.SettingsError as exc:
        raise pytest.UsageError(str(exc)) from None
