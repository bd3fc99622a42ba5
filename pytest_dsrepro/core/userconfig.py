"""A user's own ``ds_config.json``, taken as users write it, for ``--ds-scan`` and ``dsrepro scan``: JSON, with
``//`` and ``/* */`` comments blanked in place (so an error still names the user's line and column); nothing else
guessed, a key given twice refused as DeepSpeed refuses it. Decided once, before any world: one JSON object whose
stage and offload devices DeepSpeed can read, every ``"auto"`` one Hugging Face fills, on CPUs nothing that needs
CUDA without a CPU form; the monitors turned off (no bug depends on one). Pure: no pytest, no torch.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import configs, json_input, paths
from .premises import OFFLOAD_DEVICES, STAGES


class UserConfigError(Exception):
    """The user's config cannot be scanned; the message starts with ``file:line:col`` or the file and the key."""


@dataclass(frozen=True)
class UserConfig:
    """A user's config as read from ``path``: ``config`` as written (comments gone, monitors off, ``"auto"`` kept: each
    world resolves them for its size), and what reading it found worth saying (``notes``)."""

    path: str
    config: dict[str, Any]
    notes: tuple[str, ...] = field(default=())


def strip_comments(text: str) -> tuple[str, int]:
    """``text`` with its ``//`` and ``/* */`` comments blanked out (newlines kept, so lines and columns stay), and
    how many comments there were. Slashes inside strings are text. ``ValueError`` for a comment left open, with its
    line and column."""
    out = list(text)
    i, n, count = 0, len(text), 0
    in_string = False
    while i < n:
        ch = text[i]
        if in_string:
            if ch == "\\":
                i += 2
                continue
            in_string = ch != '"'
            i += 1
        elif ch == '"':
            in_string = True
            i += 1
        elif text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end < 0 else end
            out[i:end] = " " * (end - i)
            count, i = count + 1, end
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            if end < 0:
                line, col = _place(text, i)
                raise ValueError(f"{line}:{col}: a /* comment is never closed")
            out[i : end + 2] = [c if c == "\n" else " " for c in text[i : end + 2]]
            count, i = count + 1, end + 2
        else:
            i += 1
    return "".join(out), count


def _place(text: str, index: int) -> tuple[int, int]:
    line = text.count("\n", 0, index) + 1
    return line, index - (text.rfind("\n", 0, index) + 1) + 1


_COLON = re.compile(r"\s*:")


def duplicate_key(plain: str) -> tuple[str, int, int] | None:
    """The first key that appears twice in one object of the valid JSON ``plain``: the key, the index of its second
    appearance and of its first; None when every object's keys are distinct."""
    seen: list[dict[str, int] | None] = []  # per open object its keys and where; None for an open array
    i = 0
    while i < len(plain):
        ch = plain[i]
        if ch == '"':
            text, end = json.decoder.scanstring(plain, i + 1)  # type: ignore[attr-defined]
            keys = seen[-1] if seen else None
            if keys is not None and _COLON.match(plain, end):
                if text in keys:
                    return text, i, keys[text]
                keys[text] = i
            i = end
            continue
        if ch in "{[":
            seen.append({} if ch == "{" else None)
        elif ch in "}]":
            seen.pop()
        i += 1
    return None


def parse(text: str, path: str) -> tuple[dict[str, Any], int]:
    """The config object in ``text`` (read from ``path``) and how many comments it had; ``UserConfigError`` naming
    ``path:line:col`` for what is not JSON."""
    try:
        plain, comments = strip_comments(text)
    except ValueError as exc:
        raise UserConfigError(f"{path}:{exc}") from None
    try:
        data = json_input.loads(plain)
    except json.JSONDecodeError as exc:
        raise UserConfigError(f"{path}:{exc.lineno}:{exc.colno}: not JSON: {exc.msg}") from None
    except json_input.BadJSON as exc:
        raise UserConfigError(f"{path}: not a config DeepSpeed reads: {exc}") from None
    if not isinstance(data, dict):
        raise UserConfigError(f"{path}: a DeepSpeed config is one JSON object ({{...}}), not a {type(data).__name__}")
    twice = duplicate_key(plain)
    if twice is not None:
        key, second, first = twice
        line, col = _place(plain, second)
        raise UserConfigError(
            f"{path}:{line}:{col}: the key {json.dumps(key)} is given twice in one object (first at "
            f"{':'.join(map(str, _place(plain, first)))}); DeepSpeed refuses such a config"
        )
    return data, comments


def _check_shape(config: dict[str, Any], path: str) -> None:
    """What DeepSpeed would refuse anyway, and a premise could not read: said now, naming the key."""
    zero = config.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise UserConfigError(f"{path}: zero_optimization must be an object, not {json.dumps(zero)}")
    stage = zero.get("stage", 0)
    if stage not in STAGES or isinstance(stage, bool):
        raise UserConfigError(f"{path}: zero_optimization.stage is {json.dumps(stage)}; DeepSpeed's stages are 0-3")
    for kind in ("offload_optimizer", "offload_param"):
        section = zero.get(kind)
        if section is None:
            continue
        if not isinstance(section, dict):
            raise UserConfigError(f"{path}: zero_optimization.{kind} must be an object, not {json.dumps(section)}")
        device = section.get("device", "none")
        if device not in OFFLOAD_DEVICES:
            raise UserConfigError(
                f"{path}: zero_optimization.{kind}.device is {json.dumps(device)}; DeepSpeed's devices are "
                f"{', '.join(OFFLOAD_DEVICES)}"
            )
    for name in ("fp16", "bf16", "bfloat16", "optimizer", "scheduler"):
        if name in config and not isinstance(config[name], dict):
            raise UserConfigError(f"{path}: {name} must be an object, not {json.dumps(config[name])}")


def _autos(node: object, prefix: str = "") -> list[str]:
    """The dotted keys whose value is still ``"auto"``."""
    if isinstance(node, dict):
        return [k for key, value in node.items() for k in _autos(value, f"{prefix}{key}.")]
    return [prefix.rstrip(".")] if node == "auto" else []


def check(config: dict[str, Any], path: str, backend: str | None) -> None:
    """Refuse, naming the key, what no world here could run: an ``"auto"`` Hugging Face does not fill, and (when the
    worlds are known to be ``gloo``: ``backend``, None while unknown) what needs CUDA and has no CPU form."""
    _check_shape(config, path)
    resolved = copy.deepcopy(config)
    configs.resolve_auto(resolved, 1, configs.TrainingArgs())
    left = _autos(resolved)
    if left:
        raise UserConfigError(
            f'{path}: "auto" at {", ".join(left)}: Hugging Face\'s Trainer fills only the batch sizes, gradient '
            "accumulation and clipping, the optimizer's and scheduler's hyper-parameters, the ZeRO-3 bucket sizes, "
            "fp16/bf16 and (through accelerate) stage3_gather_16bit_weights_on_model_save; give a value"
        )
    refused = configs.cuda_only(resolved) if backend == "gloo" else []
    if refused:
        raise UserConfigError(f"{path}: this scan runs in gloo (CPU) worlds; {'; '.join(refused)}")


#: DeepSpeed's monitors: sections whose ``enabled`` makes every rank import a package of its own (wandb, comet_ml,
#: tensorboard) and write logs; no catalogued bug depends on one, so a scan turns them off.
MONITORS = ("wandb", "tensorboard", "comet", "csv_monitor")


def monitors_off(config: dict[str, Any]) -> str | None:
    """Turn off (in place) the monitors ``config`` enables; what was done, in words (None: none was on)."""
    on = [name for name in MONITORS if isinstance(config.get(name), dict) and config[name].get("enabled")]
    for name in on:
        config[name]["enabled"] = False
    if not on:
        return None
    return (f"monitors turned off ({', '.join(f'{name}.enabled false' for name in on)}): no catalogued bug depends on "
            "one, and each would make every rank import its own package and write its logs")  # fmt: skip


def load(path: Path, backend: str | None = None) -> UserConfig:
    """Read and check the user's config at ``path`` (``backend``: as for ``check``)."""
    try:
        text = paths.read_text(path)
    except (OSError, UnicodeDecodeError) as exc:
        raise UserConfigError(f"{path}: cannot be read ({getattr(exc, 'strerror', None) or exc})") from None
    config, comments = parse(text, str(path))
    check(config, str(path), backend)
    notes = [f"{comments} comment(s) (// or /* */) read as blanks: JSON with comments is accepted"] if comments else []
    notes += filter(None, [monitors_off(config)])
    autos = _autos(config)
    if autos:
        notes.append(f'"auto" resolved as Hugging Face\'s Trainer does, for each world: {", ".join(autos)}')
    return UserConfig(str(path), config, tuple(notes))
