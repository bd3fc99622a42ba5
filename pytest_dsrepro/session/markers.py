"""The markers: their documentation (one place, shown by ``pytest --markers``) and the world marker's evaluation."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from ..core.configs import PRESETS
from .settings import BACKENDS, Settings

MARKERS = {
    "ds_world": "ds_world(size=None, backend=None, timeout=None): run the test body in every rank of a fresh "
    "torch.distributed world started by pytest-dsrepro (size defaults to --ds-world-size, backend to "
    "--ds-backend, timeout to --ds-timeout). Fixtures ds_rank and ds_world_size tell a rank who it is.",
    "ds_config": "ds_config(*presets_or_dicts): parametrize the ds_config fixture with named DeepSpeed presets "
    f"({', '.join(PRESETS)}) and/or config dicts; each becomes its own test id.",
    "ds_version": "ds_version(affected, raises, match=None, fix=None): the bug affects DeepSpeed releases in the "
    "PEP 440 specifier set `affected`: there the test must fail with `raises` (message matching `match`), "
    "elsewhere it must pass. `fix` (a callable taking a pytest.MonkeyPatch, or 'module:name') adds a [fixed] "
    "variant that applies it in every rank and must pass on every release. Several markers may cover disjoint ranges.",
    "ds_repro": "ds_repro(id, title, upstream, fix_ref=None, fixed_in=None, root_cause=''): catalogue metadata of a "
    "repro module: upstream issue, first fixed release (None: unfixed), root cause.",
}


class MarkerError(Exception):
    """A marker's arguments are wrong; the message names the marker, the test and the value."""


def register(config: pytest.Config) -> None:
    for text in MARKERS.values():
        config.addinivalue_line("markers", text)


@dataclass(frozen=True)
class WorldSpec:
    size: int
    backend: str  # auto, gloo or nccl; "auto" is settled when the devices are known
    timeout: float


def world_spec(item: pytest.Item, settings: Settings) -> WorldSpec | None:
    """The world a test asks for, or None when it is not a world test."""
    mark = item.get_closest_marker("ds_world")
    if mark is None:
        return None
    where = f"@pytest.mark.ds_world on {item.nodeid}"
    allowed = {"size", "backend", "timeout"}
    if mark.args or set(mark.kwargs) - allowed:
        extra = [repr(a) for a in mark.args] + sorted(set(mark.kwargs) - allowed)
        raise MarkerError(f"{where}: unexpected argument(s) {', '.join(extra)}; takes size=, backend=, timeout=")
    given = {k: v for k, v in mark.kwargs.items() if v is not None}
    size = given.get("size", settings.world_size)
    backend = given.get("backend", settings.backend)
    timeout = given.get("timeout", settings.timeout)
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise MarkerError(f"{where}: size={size!r} must be a whole number >= 1")
    if backend not in BACKENDS:
        raise MarkerError(f"{where}: backend={backend!r} must be one of {', '.join(BACKENDS)}")
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout < float("inf"):
        raise MarkerError(f"{where}: timeout={timeout!r} must be a number of seconds > 0")
    return WorldSpec(size=size, backend=backend, timeout=float(timeout))


def settle_backend(requested: str, size: int, cuda_devices: int) -> tuple[str, str | None]:
    """``(backend, skip_reason)``: auto picks NCCL only when every rank can have its own GPU."""
    if requested == "auto":
        return ("nccl", None) if cuda_devices >= size else ("gloo", None)
    if requested == "nccl" and cuda_devices < size:
        return "nccl", f"NCCL needs {size} CUDA devices for a {size}-rank world; found {cuda_devices}"
    return requested, None
