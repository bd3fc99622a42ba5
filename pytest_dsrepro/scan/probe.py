"""Each config as one DeepSpeed release reads it: ``python -m pytest_dsrepro.scan.probe REQUEST ANSWER``,
run by ``scan.defaults`` with the interpreter of the release being scanned, so the pytest process itself
never imports DeepSpeed.

``REQUEST`` is a JSON list of configs, each with the world size it is read for (``core.ds_defaults.request``);
``ANSWER`` gets one ``ReleaseReading`` per config: the values ``DeepSpeedConfig`` resolved at the places
``core.ds_defaults`` names, or what DeepSpeed raised when it refused the config (its config classes, or the scheduler
``deepspeed.initialize`` would build from it); a key the release does not know, or an optimizer parameter its engine
refuses before building the optimizer, is taken out and named, and the rest read. A file, not standard output:
DeepSpeed logs there.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..core.ds_defaults import KEYS, SECTIONS, ReleaseReading, named, without

_MISSING = object()


def _attribute(root: object, path: str) -> object:
    node = root
    for part in path.split("."):
        node = getattr(node, part, _MISSING)
        if node is _MISSING:
            return _MISSING
    return node


def _first(root: object, paths: tuple[str, ...]) -> object:
    """The value at the first of ``paths`` the release has (releases moved some)."""
    return next((v for p in paths if (v := _attribute(root, p)) is not _MISSING), _MISSING)


def _jsonable(value: object) -> object:
    """A value as a config writes it: a torch dtype by DeepSpeed's name for it, a pydantic model dumped."""
    import torch

    names = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
    if isinstance(value, torch.dtype):
        return names.get(value, str(value))
    dump = getattr(value, "model_dump", None)
    if dump is not None:
        return dump(mode="json", by_alias=True)
    return json.loads(json.dumps(value, default=str))


class _World:
    """What ``DeepSpeedConfig`` asks ``deepspeed.comm`` (this rank, the world's size), answered for a world of
    ``size`` ranks: there is no process group here."""

    def __init__(self, size: int) -> None:
        self.size = size

    def get_rank(self, *args: Any, **kwargs: Any) -> int:
        return 0

    def get_world_size(self, *args: Any, **kwargs: Any) -> int:
        return self.size


class _Refused(Exception):
    """DeepSpeed refused a config for more than keys it does not know (``said``), those taken out (``unknown``)."""

    def __init__(self, said: str, unknown: dict[str, str]) -> None:
        super().__init__(said)
        self.said, self.unknown = said, unknown


def _extra(exc: Exception) -> list[tuple[tuple[str, ...], str]]:
    """The places a pydantic refusal names as extra (``extra_forbidden``: a key this release does not know), inside
    the model that refused them, each with DeepSpeed's words for it; nothing for any other refusal."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return []
    title = str(exc).splitlines()[0] if str(exc) else ""
    found = []
    for error in errors():
        if error.get("type") == "extra_forbidden":
            place = tuple(str(p) for p in error.get("loc", ()))
            found.append((place, f"{type(exc).__name__}: {title}: {'.'.join(place)}: {error.get('msg')}"))
    return found


def _unknown(exc: Exception, config: dict[str, Any], refused: Callable[[dict[str, Any]], set[tuple[str, ...]]]
             ) -> dict[str, str]:  # fmt: skip
    """The keys of ``config`` a pydantic refusal names as extra, each with DeepSpeed's words for it. A place is
    inside the model that refused it: where several keys end so (``fp16.loss_scale`` and ``bf16.loss_scale``, which
    only one section's model refuses), the key is one whose removal ends that refusal (``refused``: the places the
    release refuses in a config)."""
    found = {}
    for place, said in _extra(exc):
        keys = named(config, place)
        if len(keys) > 1:
            keys = [key for key in keys if place not in refused(without(config, {key: said}))] or keys
        found.update(dict.fromkeys(keys, said))
    return found


class _Checked(Exception):
    """The engine's checks of the optimizer's parameters passed: it went on to build the optimizer."""


class _OptimizerChecks:
    """The engine as ``DeepSpeedEngine._configure_basic_optimizer`` first reads it: the config's optimizer parameters,
    which it checks before anything else; whatever it asks next (the optimizer's name, to build it) ends the call."""

    def __init__(self, params: dict[str, Any]) -> None:
        self._params = params

    def optimizer_params(self) -> dict[str, Any]:
        return dict(self._params)

    def __getattr__(self, name: str) -> Any:
        raise _Checked(name)


def _refused_parameters(config: dict[str, Any]) -> dict[str, str]:
    """The parameters of ``config``'s optimizer that the release's engine refuses at ``deepspeed.initialize`` (0.14 to
    0.19: ``max_grad_norm``, for ``gradient_clipping``), each with DeepSpeed's message, found by running its own
    check; a refusal that names none of them is the config's."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    params = (config.get("optimizer") or {}).get("params") or {}
    try:
        DeepSpeedEngine._configure_basic_optimizer(_OptimizerChecks(params), [])
    except _Checked:
        return {}
    except Exception as exc:  # its check refused a parameter: named below, or else the config's refusal
        said = f"{type(exc).__name__}: {exc}"
        named = {f"optimizer.params.{key}": said for key in params if f"'{key}'" in str(exc)}
        if not named:
            raise
        return named
    return {}


def _made(config: dict[str, Any], world_size: int) -> tuple[object, dict[str, str]]:
    """The release's ``DeepSpeedConfig`` of ``config`` (its scheduler built too), the keys it does not know and the
    optimizer parameters its engine refuses taken out one refusal at a time (each with DeepSpeed's message); whatever
    else it raises is raised."""
    from deepspeed.runtime import config as config_module

    from ..inrank.engine import build_scheduler

    def extra(trial: dict[str, Any]) -> set[tuple[str, ...]]:
        try:
            config_module.DeepSpeedConfig(json.loads(json.dumps(trial)))
        except Exception as exc:  # noqa: BLE001 - only its places of extra keys are asked for
            return {place for place, _ in _extra(exc)}
        return set()

    unknown: dict[str, str] = {}
    comm = config_module.dist
    config_module.dist = _World(world_size)  # what the module calls for the rank and the world's size
    try:
        while True:
            try:
                made = config_module.DeepSpeedConfig(json.loads(json.dumps(config)))  # DeepSpeed edits its input
                build_scheduler(config)
                refused = _refused_parameters(config)
                if not refused:
                    return made, unknown
            except Exception as exc:  # whatever DeepSpeed raises is its refusal, said as it said it
                refused = {k: v for k, v in _unknown(exc, config, extra).items() if k not in unknown}
                if not refused:
                    raise _Refused(f"{type(exc).__name__}: {exc}", unknown) from exc
            unknown.update(refused)
            config = without(config, refused)
    finally:
        config_module.dist = comm


def read(config: dict[str, Any], world_size: int) -> ReleaseReading:
    """``config`` through the release's ``DeepSpeedConfig``, for a world of ``world_size`` ranks, and its scheduler;
    the values read where ``KEYS`` and ``SECTIONS`` say, past the keys the release does not know."""
    try:
        made, unknown = _made(config, world_size)
    except _Refused as refusal:
        return ReleaseReading(refused=refusal.said, unknown=refusal.unknown)
    keys, sections = {}, {}
    for key, paths in KEYS.items():
        found = _first(made, paths)
        if found is not _MISSING:
            keys[key] = _jsonable(found)
    for name, paths in SECTIONS.items():
        found = _first(made, paths)
        if found is not _MISSING and found is not None:
            sections[name] = _jsonable(found)
    return ReleaseReading(keys, sections, unknown=unknown)


def main(argv: list[str]) -> int:
    request, answer = Path(argv[0]), Path(argv[1])
    readings = [read(asked["config"], asked["world_size"]).to_json() for asked in json.loads(request.read_text())]
    answer.write_text(json.dumps(readings))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
