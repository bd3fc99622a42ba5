"""The plugin's settings: declared once, resolved once (command line > environment > ini), validated at startup.

Every option is described by one ``Option`` whose help text serves the command line and the ini key alike, and
whose validator says where a bad value came from.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ..worlds import launcher
from ..worlds.comm_op import default_cache_dir

BACKENDS = ("auto", "gloo", "nccl")


def positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise ValueError("must be a whole number >= 1")
    return number


def positive_seconds(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = 0.0
    if not 0 < number < float("inf"):
        raise ValueError("must be a number of seconds > 0")
    return number


def backend_name(value: str) -> str:
    if value not in BACKENDS:
        raise ValueError(f"must be one of {', '.join(BACKENDS)}")
    return value


@dataclass(frozen=True)
class Option:
    name: str  # attribute of Settings, ini key "ds_<name>", option "--ds-<name>", env "DSREPRO_<NAME>"
    help: str
    parse: Callable[[str], Any]
    default: str | None
    metavar: str

    @property
    def flag(self) -> str:
        return "--ds-" + self.name.replace("_", "-")

    @property
    def ini(self) -> str:
        return "ds_" + self.name

    @property
    def env(self) -> str:
        return "DSREPRO_" + self.name.upper()


OPTIONS = (
    Option(
        "world_size",
        "ranks per world where @ds_world does not pin a size (default 2; under torchrun, its WORLD_SIZE)",
        positive_int,
        "2",
        "N",
    ),
    Option(
        "backend",
        "process-group backend: auto (nccl when CUDA devices >= world size, else gloo), gloo or nccl (default auto)",
        backend_name,
        "auto",
        "NAME",
    ),
    Option(
        "timeout",
        "seconds a world may run before every rank's stack is dumped and it fails (default 300)",
        positive_seconds,
        "300",
        "SECONDS",
    ),
    Option(
        "startup_timeout",
        "seconds the fork server may take to import torch/DeepSpeed and build DeepSpeed's CPU "
        "comm op on first use (default 1800)",
        positive_seconds,
        "1800",
        "SECONDS",
    ),
    Option("results", "write machine-readable results of this run into DIR (one JSON file per run)", Path, None, "DIR"),
    Option("report", "write an issue-ready Markdown report of this run to PATH", Path, None, "PATH"),
    Option(
        "cache_dir",
        "where per-release DeepSpeed op builds are cached (default ~/.cache/pytest-dsrepro)",
        Path,
        None,
        "DIR",
    ),
)


@dataclass(frozen=True)
class Settings:
    world_size: int
    backend: str
    timeout: float
    startup_timeout: float
    results: Path | None
    report: Path | None
    cache_dir: Path


SETTINGS_KEY = pytest.StashKey[Settings]()


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("dsrepro", "DeepSpeed repros in N-rank torch.distributed worlds")
    for opt in OPTIONS:
        group.addoption(opt.flag, dest="ds_" + opt.name, metavar=opt.metavar, default=None, help=opt.help)
        parser.addini(opt.ini, opt.help, default=None)


def resolve(config: pytest.Config, environ: dict[str, str] | None = None) -> Settings:
    """Command line > environment > ini > default; a bad value is a ``UsageError`` naming where it came from."""
    environ = dict(os.environ) if environ is None else environ
    values: dict[str, Any] = {}
    launched = launcher.launched(environ)
    for opt in OPTIONS:
        default = str(launched.world_size) if launched and opt.name == "world_size" else opt.default
        sources = [
            (config.getoption("ds_" + opt.name), opt.flag),
            (environ.get(opt.env) or None, f"environment variable {opt.env}"),
            (config.getini(opt.ini) or None, f"ini option {opt.ini}"),
            (default, "default"),
        ]
        raw, where = next(((v, w) for v, w in sources if v is not None), (None, "default"))
        try:
            values[opt.name] = None if raw is None else opt.parse(str(raw))
        except ValueError as exc:
            raise pytest.UsageError(f"pytest-dsrepro: {where}: invalid value {raw!r}: {exc}") from None
    if values["cache_dir"] is None:
        values["cache_dir"] = default_cache_dir()
    return Settings(**values)
