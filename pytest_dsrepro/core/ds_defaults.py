"""A config as the release being scanned reads it: each key the config leaves out takes that release's default.

The values come from the release itself: its ``DeepSpeedConfig`` is built on the config in a subprocess of the
release's interpreter (``scan.probe``, started by ``scan.defaults``), and the keys a premise
reads are read off the object it made. What this module holds is structure, not values: *where* each JSON key
lives in DeepSpeed's config classes (``KEYS``, ``SECTIONS``: the attribute names, with the older name where a
release renamed one), the request sent to the release, and the merge of its answer into the config as written.

Pure: no torch, no DeepSpeed (the probe imports them), no pytest.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .premises import lookup, put, remove

#: JSON keys read off ``DeepSpeedConfig`` where the config leaves them out: the attribute paths that hold the
#: value, the first one a release has wins (``fp16_enabled`` until 0.19.x made ``float16_config`` a section).
KEYS: dict[str, tuple[str, ...]] = {
    "train_micro_batch_size_per_gpu": ("train_micro_batch_size_per_gpu",),
    "gradient_accumulation_steps": ("gradient_accumulation_steps",),
    "steps_per_print": ("steps_per_print",),
    "gradient_clipping": ("gradient_clipping",),
    "communication_data_type": ("communication_data_type",),
    "prescale_gradients": ("prescale_gradients",),
    "zero_allow_untested_optimizer": ("zero_allow_untested_optimizer",),
    "zero_force_ds_cpu_optimizer": ("zero_force_ds_cpu_optimizer",),
    "fp16.enabled": ("fp16_enabled", "float16_config.enabled"),
    "bf16.enabled": ("bfloat16_enabled", "bfloat16_config.enabled"),
    "data_types.grad_accum_dtype": ("grad_accum_dtype",),
    "checkpoint.load_universal": ("load_universal_checkpoint",),
    "torch_autocast.enabled": ("torch_autocast_enabled",),
}

#: Sections DeepSpeed reads with a pydantic model: the model's attribute on ``DeepSpeedConfig``, dumped whole (JSON
#: names, every field at the value that release resolves, defaults that depend on other keys included:
#: ``overlap_comm`` by stage, the deprecated ``cpu_offload`` as ``offload_optimizer``).
SECTIONS: dict[str, tuple[str, ...]] = {
    "zero_optimization": ("zero_config",),
    "comms_logger": ("comms_config.comms_logger",),
}

#: The probe's answer format; a cached answer of another format is read again.
FORMAT = 4


@dataclass(frozen=True)
class ReleaseReading:
    """What one release made of one config: the values at ``KEYS`` and ``SECTIONS`` (a path no attribute of that
    release holds is left out: the release does not know the key), or why it refused the config. ``unknown``: the
    keys its config classes refused as extra (a key no release knows, or one of a newer release) and the optimizer
    parameters its engine refuses (``max_grad_norm``), each with DeepSpeed's message; the values were read with them
    taken out."""

    keys: dict[str, Any] = field(default_factory=dict)
    sections: dict[str, Any] = field(default_factory=dict)
    refused: str | None = None  # ``Type: message``, as DeepSpeed raised it
    unknown: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"keys": self.keys, "sections": self.sections, "refused": self.refused, "unknown": self.unknown}

    @classmethod
    def from_json(cls, data: object) -> ReleaseReading:
        """A reading as ``to_json`` wrote it; ``ValueError`` saying what is wrong with any other shape."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a reading is an object, not {type(data).__name__}")
        keys, sections, refused = data.get("keys") or {}, data.get("sections") or {}, data.get("refused")
        unknown = data.get("unknown") or {}
        if not isinstance(keys, dict) or not isinstance(sections, dict) or not isinstance(unknown, dict):
            raise ValueError("a reading's keys, sections and unknown keys are objects")
        if not all(isinstance(v, dict) for v in sections.values()) or not isinstance(refused, str | None):
            raise ValueError("a reading's sections are objects, and what refused it a string")
        return cls(dict(keys), dict(sections), refused, dict(unknown))


def paths(node: object, prefix: str = "") -> list[str]:
    """Every dotted key of a config, sections and the keys in them."""
    if not isinstance(node, Mapping):
        return []
    return [p for key, value in node.items() for p in (f"{prefix}{key}", *paths(value, f"{prefix}{key}."))]


def named(config: Mapping[str, Any], place: tuple[str, ...]) -> list[str]:
    """The dotted keys of ``config`` that end with ``place`` (what a pydantic error names: the key inside the
    section whose model refused it, not the section)."""
    return [p for p in paths(config) if tuple(p.split("."))[-len(place) :] == place] if place else []


def without(written: Mapping[str, Any], unknown: Mapping[str, str]) -> dict[str, Any]:
    """``written`` with the keys a release does not take (``ReleaseReading.unknown``) taken out."""
    config = copy.deepcopy(dict(written))
    for key in unknown:
        remove(config, key)
    return config


def read_by_release(key: str) -> bool:
    """Does the release give ``key`` a value where a config leaves it out (``KEYS``, or a key of a section in
    ``SECTIONS``)? Any other key left out is absent on every release (no scheduler, no such section)."""
    return key in KEYS or key.split(".", 1)[0] in SECTIONS


def request(written: Mapping[str, Any], world_size: int) -> dict[str, Any]:
    """What the probe is asked: the config as written, and the size of the world it is read for (``DeepSpeedConfig``
    derives the batch keys from it; the probe gives it the size, there being no process group)."""
    return {"config": copy.deepcopy(dict(written)), "world_size": world_size}


def digest(config: Mapping[str, Any]) -> str:
    """A request's identity for the cache: its canonical JSON."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def merged(written: Mapping[str, Any], reading: ReleaseReading) -> dict[str, Any]:
    """``written`` as the release reads it: each section the release resolves is its resolution (keys it does not
    know kept as written), each key of ``KEYS`` the config leaves out is the release's value."""
    config = copy.deepcopy(dict(written))
    for name, resolved in reading.sections.items():
        if isinstance(resolved, dict):
            own = config.get(name)
            config[name] = {**(own if isinstance(own, dict) else {}), **resolved}
    for key, value in reading.keys.items():
        if lookup(written, key) is None:
            put(config, key, value)
    return config
