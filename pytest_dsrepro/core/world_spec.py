"""What world a test asks for (the ``ds_world`` marker) and which backend it gets on the devices at hand."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from . import options
from .errors import MarkerError
from .options import Settings

T = TypeVar("T")

WORLD_ARGUMENTS = ("size", "backend", "timeout", "reuse", "process_group", "launcher_env")


@dataclass(frozen=True)
class WorldSpec:
    size: int
    backend: str  # auto, gloo or nccl; "auto" is settled when the devices are known
    timeout: float
    reuse: bool = False  # the tests under the marker may run one after another on the same ranks
    process_group: bool = True  # each rank joins the world's default process group before the body
    launcher_env: bool = True  # each rank gets the variables torchrun sets (RANK, WORLD_SIZE, MASTER_PORT, ...)


def _flag(value: object) -> bool:
    if not isinstance(value, bool):
        raise options.OptionError("must be True or False")
    return value


def world_spec(args: tuple[object, ...], kwargs: Mapping[str, object], settings: Settings, where: str) -> WorldSpec:
    """The world of a ``ds_world(size=None, backend=None, timeout=None, reuse=False, process_group=True,
    launcher_env=True)`` marker; unset values come from settings. A list of sizes is refused here: collection has made
    one test per size by then (``world_sizes``), each with its own size."""
    unexpected = [repr(a) for a in args] + sorted(set(kwargs) - set(WORLD_ARGUMENTS))
    if unexpected:
        takes = ", ".join(f"{name}=" for name in WORLD_ARGUMENTS)
        raise MarkerError(f"{where}: unexpected argument(s) {', '.join(unexpected)}; takes {takes}")
    if isinstance(kwargs.get("size"), (list, tuple)):
        raise MarkerError(
            f"{where}: size={kwargs['size']!r} makes one test per size when pytest collects the test; this marker "
            "was added after collection, so give it one size"
        )
    return WorldSpec(
        size=_argument(kwargs, "size", _size_within(settings.max_world_size), settings.world_size, where),
        backend=_argument(kwargs, "backend", options.backend, settings.backend, where),
        timeout=_argument(kwargs, "timeout", options.seconds, settings.timeout, where),
        reuse=_argument(kwargs, "reuse", _flag, False, where),
        process_group=_argument(kwargs, "process_group", _flag, True, where),
        launcher_env=_argument(kwargs, "launcher_env", _flag, True, where),
    )


def world_sizes(value: object, limit: int | None, where: str) -> tuple[int, ...] | None:
    """The sizes of ``ds_world(size=[1, 2])``, each checked as a size is (None: ``value`` is not a list)."""
    if not isinstance(value, (list, tuple)):
        return None
    if not value:
        raise MarkerError(f"{where}: size=[] names no world size; give one size or a list of them")
    try:
        sizes = tuple(options.world_size(v, limit) for v in value)
    except options.OptionError as exc:
        raise MarkerError(f"{where}: size={list(value)!r}: each size {exc}") from None
    if len(set(sizes)) < len(sizes):
        raise MarkerError(f"{where}: size={list(value)!r} names a size twice")
    return sizes


def size_id(size: int) -> str:
    """The test id of one size of ``ds_world(size=[...])``: ``1rank``, ``2ranks``."""
    return f"{size}rank" if size == 1 else f"{size}ranks"


def _size_within(limit: int | None) -> Callable[[object], int]:
    return lambda value: options.world_size(value, limit)


def _argument(kwargs: Mapping[str, object], name: str, check: Callable[[object], T], default: T, where: str) -> T:
    value = kwargs.get(name)
    if value is None:
        return default
    try:
        return check(value)
    except options.OptionError as exc:
        raise MarkerError(f"{where}: {name}={value!r} {exc}") from None


def ds_accelerator(environ: Mapping[str, str], cuda_devices: int) -> str | None:
    """DeepSpeed's accelerator as the ranks get it: the user's ``DS_ACCELERATOR``, else ``cpu`` on a machine without
    CUDA devices (where DeepSpeed would probe for CUDA/XPU/... accelerators); None where DeepSpeed detects it itself.

    The one rule: the fork server applies it before importing DeepSpeed, and reports describe by it.
    """
    return environ.get("DS_ACCELERATOR") or (None if cuda_devices else "cpu")


#: DeepSpeed's accelerator in a world of each backend: a gloo world is a CPU world (what ``configs`` adapts a config
#: to), on a GPU machine too; an NCCL world a CUDA one.
ACCELERATORS = {"gloo": "cpu", "nccl": "cuda"}


def accelerator_for(backend: str, environ: Mapping[str, str]) -> str:
    """DeepSpeed's accelerator in the ranks of a world with this (settled) backend: the user's ``DS_ACCELERATOR``
    where set (DeepSpeed's own variable), else the one that follows the backend. Fork servers are one per accelerator.
    """
    return environ.get("DS_ACCELERATOR") or ACCELERATORS.get(backend, "cpu")


def settle_backend(requested: str, size: int, cuda_devices: int) -> tuple[str, str | None]:
    """``(backend, skip_reason)``: auto picks NCCL only when every rank can have its own GPU."""
    if requested == "auto":
        return ("nccl", None) if cuda_devices >= size else ("gloo", None)
    if requested == "nccl" and cuda_devices < size:
        return "nccl", f"NCCL needs {size} CUDA devices for a {size}-rank world; found {cuda_devices}"
    return requested, None
