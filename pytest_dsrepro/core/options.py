"""The plugin's settings: declared once, validated by one set of validators, resolved once from ordered sources.

The same validators check command-line, environment and ini values (as text) and marker arguments (as values), so
``--ds-world-size 0`` and ``@pytest.mark.ds_world(size=0)`` are refused with the same words. Resolution is a pure
function of the sources, so the pytest side only gathers them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .text import cut

BACKENDS = ("auto", "gloo", "nccl")
#: The launcher's variables; all of them set means pytest itself already is one rank of a world.
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
CACHE_ENV = "DSREPRO_CACHE_DIR"


class OptionError(ValueError):
    """A value that an option or a marker argument does not accept; the message says what it must be."""


def whole_number(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise OptionError("must be a whole number >= 1")
    return value


#: The default limit on a world's size: this many ranks per CPU core, and no more than one per this many bytes of
#: memory. Every rank is a process of its own; a world far beyond the machine only ends in ``fork()`` failing.
RANKS_PER_CORE = 8
BYTES_PER_RANK = 256 * 2**20


def machine_world_limit(cores: int | None = None, memory: int | None = None) -> int:
    """The largest world this machine is allowed to fork by default (at least 2)."""
    cores = cores if cores is not None else os.cpu_count() or 1
    if memory is None:
        try:
            memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):  # not POSIX: the cores alone decide
            memory = 0
    limit = RANKS_PER_CORE * cores
    if memory > 0:
        limit = min(limit, memory // BYTES_PER_RANK)
    return max(2, limit)


def world_size(value: object, limit: int | None) -> int:
    """A whole number of ranks, at most ``limit`` (None: no limit, as under an external launcher that forks
    nothing). The message names the limit and how to raise it, for the option and the marker alike."""
    size = whole_number(value)
    if limit is not None and size > limit:
        raise OptionError(
            f"must be at most {limit}, the largest world pytest-dsrepro forks on this machine "
            f"(--ds-max-world-size; default {RANKS_PER_CORE} ranks per CPU core, one per "
            f"{BYTES_PER_RANK // 2**20} MiB of memory); raise it with --ds-max-world-size=N, "
            "DSREPRO_MAX_WORLD_SIZE=N or the ini option ds_max_world_size"
        )
    return size


def seconds(value: object) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < float("inf"):
        raise OptionError("must be a number of seconds > 0")
    return float(value)


def backend(value: object) -> str:
    if value not in BACKENDS:
        raise OptionError(f"must be one of {', '.join(BACKENDS)}")
    return str(value)


def shard(text: str) -> tuple[int, int]:
    """``"I/N"`` -> ``(I, N)``: this process runs the I-th of N slices of the collected tests."""
    found = re.fullmatch(r"\s*(\d{1,18})\s*/\s*(\d{1,18})\s*", text)  # int() of 4300 digits: a ValueError
    if found is None or not 1 <= int(found[1]) <= int(found[2]):
        raise OptionError("must be I/N with 1 <= I <= N, e.g. 2/4 for the second of four slices")
    return int(found[1]), int(found[2])


def _number_text(kind: Callable[[str], int | float], check: Callable[[object], Any]) -> Callable[[str], Any]:
    """A validator of text: the number it spells, then the value check (bad text gets the value check's words)."""

    def parse(text: str) -> Any:
        try:
            number: object = kind(text)
        except ValueError:
            number = None
        return check(number)

    return parse


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
    def dest(self) -> str:
        return "ds_" + self.name

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
        _number_text(int, whole_number),
        "2",
        "N",
    ),
    Option(
        "max_world_size",
        "the largest world pytest-dsrepro forks: bigger --ds-world-size or ds_world(size=) values are refused "
        f"(default {RANKS_PER_CORE} ranks per CPU core, at most one per {BYTES_PER_RANK // 2**20} MiB of memory; "
        "not applied under torchrun, which forks nothing here)",
        _number_text(int, whole_number),
        None,
        "N",
    ),
    Option(
        "backend",
        "process-group backend: auto (nccl when every rank has a CUDA device of its own: devices >= world size, or "
        ">= ranks on the node under torchrun; else gloo), gloo or nccl (default auto)",
        backend,
        "auto",
        "NAME",
    ),
    Option(
        "timeout",
        "seconds a world may run before every rank's stack is dumped and it fails (default 300)",
        _number_text(float, seconds),
        "300",
        "SECONDS",
    ),
    Option(
        "startup_timeout",
        "seconds the fork server may take to import torch/DeepSpeed and build DeepSpeed's CPU "
        "comm op on first use (default 1800)",
        _number_text(float, seconds),
        "1800",
        "SECONDS",
    ),
    Option(
        "shard",
        "run only the I-th of N slices of the collected tests (every N-th test, starting with the I-th), so that N "
        "machines or processes share a run; their --ds-results files merge in dsrepro matrix",
        shard,
        None,
        "I/N",
    ),
    Option("results", "write machine-readable results of this run into DIR (one JSON file per run)", Path, None, "DIR"),
    Option(
        "report",
        "write an issue-ready Markdown report of this run to PATH (with --ds-scan: the scan, per bug)",
        Path,
        None,
        "PATH",
    ),
    Option(
        "scan",
        "scan a DeepSpeed config (JSON, // and /* */ comments allowed) against the catalogue: each catalogued repro "
        "runs once with it (plus its premise's settings), the [fixed] variants and the repros' own configs do not; "
        "per bug AFFECTED, NOT AFFECTED, NOT APPLICABLE (the config cannot meet its premise: no world) or CANNOT TELL",
        Path,
        None,
        "CONFIG",
    ),
    Option(
        "cache_dir",
        "where per-release DeepSpeed op builds are cached and GPU leases taken: sessions sharing GPUs share it "
        "(default ~/.cache/pytest-dsrepro)",
        Path,
        None,
        "DIR",
    ),
    Option(
        "gpu_wait",
        "seconds an NCCL world waits for free GPUs (each world leases its own, across pytest-xdist workers and "
        "sessions) before it is skipped naming what was busy (default 600)",
        _number_text(float, seconds),
        "600",
        "SECONDS",
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
    max_world_size: int | None  # None under an external launcher: nothing is forked
    shard: tuple[int, int] | None = None  # (I, N): run only the I-th of N slices of the collected tests
    gpu_wait: float = 600.0  # how long an NCCL world waits for its GPU lease before it is skipped
    scan: Path | None = None  # a user's DeepSpeed config to scan against the catalogue (``--ds-scan``)


class SettingsError(Exception):
    """A bad option value; the message names where it came from (option, environment variable or ini key)."""


@dataclass(frozen=True)
class Launched:
    """The rank an external launcher (torchrun, SLURM + torchrun, DeepSpeed's launcher) made this process."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None = None  # ranks on this node (LOCAL_WORLD_SIZE); None when the launcher did not say

    @property
    def ranks_here(self) -> int:
        """Ranks on this node, what its devices are shared by; the whole world when the launcher did not say."""
        return self.local_world_size or self.world_size


def launched(environ: Mapping[str, str]) -> Launched | None:
    """``LOCAL_WORLD_SIZE`` is torchrun's name for the ranks of a node, ``LOCAL_SIZE`` DeepSpeed's launcher's."""
    if not all(environ.get(name) for name in LAUNCHER_VARIABLES):
        return None
    local = "LOCAL_WORLD_SIZE" if environ.get("LOCAL_WORLD_SIZE") else "LOCAL_SIZE"
    return Launched(
        _launcher_number(environ, "RANK", 0),
        _launcher_number(environ, "WORLD_SIZE", 1),
        _launcher_number(environ, "LOCAL_RANK", 0) if environ.get("LOCAL_RANK") else 0,
        _launcher_number(environ, local, 1) if environ.get(local) else None,
    )


def _launcher_number(environ: Mapping[str, str], name: str, least: int) -> int:
    """A whole number a launcher set; ``SettingsError`` naming the variable where it is none (``x``, ``nan``, 5000
    digits: it was an INTERNALERROR)."""
    text = environ[name]
    if re.fullmatch(r"\s*\d{1,9}\s*", text) is None or int(text) < least:
        raise SettingsError(f"pytest-dsrepro: environment variable {name}: invalid value {_shown(text)}: must be a "
                            f"whole number >= {least}, as a launcher (torchrun, SLURM) sets it")  # fmt: skip
    return int(text)


#: What ``srun`` sets in every task of a job step: its number among the step's tasks, and how many there are.
SLURM_TASK = ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS")


def unlaunched_slurm(environ: Mapping[str, str]) -> str | None:
    """The one-line error for ``srun pytest`` run as several tasks with no launcher in between, else None.

    Every such task would run its own private worlds on its own: nothing would be one run. (A batch script, or a
    one-task step, has no or one ``SLURM_STEP_NUM_TASKS``: pytest there runs its worlds itself, as anywhere.)
    """
    procid, tasks = (environ.get(name, "") for name in SLURM_TASK)
    if launched(environ) is not None or not procid.isdigit() or not tasks.isdigit() or int(tasks) < 2:
        return None
    return (
        f"pytest-dsrepro: SLURM task {procid} of {tasks} runs pytest without a launcher, so every task would run "
        "worlds of its own; start one torchrun per node instead: srun --ntasks-per-node 1 torchrun --nnodes "
        '"$SLURM_NNODES" --nproc-per-node N --rdzv-backend c10d --rdzv-endpoint FIRST_NODE:29500 -m pytest ... '
        "(see docs/multinode.md)"
    )


def default_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``$DSREPRO_CACHE_DIR``, else ``$XDG_CACHE_HOME/pytest-dsrepro``, else ``~/.cache/pytest-dsrepro``."""
    env = os.environ if environ is None else environ
    if env.get(CACHE_ENV):
        return Path(env[CACHE_ENV])
    base = env.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pytest-dsrepro"


Source = Callable[[Option], tuple[object, str]]  # an option -> (raw value or None, where it came from)


def resolve(sources: Iterable[Source], environ: Mapping[str, str]) -> Settings:
    """The first source that has a value wins, else the default; ``SettingsError`` names where a bad value came from.

    Under an external launcher the world size defaults to the launcher's ``WORLD_SIZE``.
    """
    ordered = list(sources)
    world = launched(environ)
    values: dict[str, Any] = {}
    origins: dict[str, tuple[object, str]] = {}
    for opt in OPTIONS:
        default = str(world.world_size) if world and opt.name == "world_size" else opt.default
        given = (source(opt) for source in ordered)
        raw, where = next(((v, w) for v, w in given if v is not None), (default, "default"))
        origins[opt.name] = (raw, where)
        try:
            values[opt.name] = None if raw is None else opt.parse(str(raw))
        except ValueError as exc:
            raise SettingsError(f"pytest-dsrepro: {where}: invalid value {_shown(raw)}: {exc}") from None
    if values["cache_dir"] is None:
        values["cache_dir"] = default_cache_dir(environ)
    if world is not None:
        values["max_world_size"] = None  # the launcher's world already exists; nothing is forked
    elif values["max_world_size"] is None:
        values["max_world_size"] = machine_world_limit()
    try:
        world_size(values["world_size"], values["max_world_size"])
    except OptionError as exc:
        raw, where = origins["world_size"]
        raise SettingsError(f"pytest-dsrepro: {where}: invalid value {_shown(raw)}: {exc}") from None
    return Settings(**values)


def _shown(raw: object) -> str:
    """A value as a message quotes it: its ``repr``, cut to a line (a number of 5000 digits, a pasted log)."""
    return cut(repr(raw), 80)


def environment_source(environ: Mapping[str, str]) -> Source:
    return lambda opt: (environ.get(opt.env) or None, f"environment variable {opt.env}")
