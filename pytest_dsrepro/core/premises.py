"""``ds_premise``: what a DeepSpeed config must have for a catalogued bug to be possible at all.

A repro states it once, beside its ``ds_repro`` marker::

    pytest.mark.ds_premise(stage=2, offload_optimizer="cpu", gradient_accumulation=">=3",
                           sets={"gradient_clipping": 0.0}, because="the body compares with plain, unclipped SGD")

and it is used three ways: ``dsrepro list`` shows it; every run of the repro checks it against the repro's own
configs (a repro whose own config cannot show its bug is a defect, named at setup); and ``--ds-scan`` runs a
user's config through the repros whose premise it meets, saying NOT APPLICABLE, without a world, for the rest.

``sets`` are the settings a scan puts on top of the user's config for this repro (harness settings the repro's
check needs, such as no gradient clipping against an unclipped reference), each said to the user with ``because``;
they must be what the repro's own configs hold.

Pure: no pytest, no torch, no DeepSpeed. Values are read from a config as DeepSpeed reads them, a key that is
absent taking DeepSpeed's default where ``DEFAULTS`` knows it.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import MarkerError

PRECISIONS = ("fp32", "fp16", "bf16")
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
ACCELERATORS = ("cpu", "cuda")
STAGES = (0, 1, 2, 3)

#: DeepSpeed's value for a key a config leaves out, in every release the catalogue covers (0.14-0.19).
DEFAULTS: dict[str, object] = {
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "communication_data_type": None,
    "zero_allow_untested_optimizer": False,
    "zero_force_ds_cpu_optimizer": True,
    "zero_optimization.stage": 0,
    "zero_optimization.elastic_checkpoint": False,
    "zero_optimization.stage3_param_persistence_threshold": 100000,
    "zero_optimization.reduce_bucket_size": 500000000,
    "zero_optimization.overlap_comm": None,  # the default depends on the stage
    "data_types.grad_accum_dtype": None,
    "bf16.enabled": False,
    "fp16.enabled": False,
}

_COMPARISON = re.compile(r"\s*(==|!=|>=|<=|>|<)\s*(-?[0-9.eE+]+)\s*")
_OPERATORS: dict[str, Callable[[Any, Any], bool]] = {
    "==": operator.eq, "!=": operator.ne, ">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt,
}  # fmt: skip


def lookup(config: Mapping[str, Any], key: str) -> object:
    """A dotted key's value as DeepSpeed would use it: the config's, else ``DEFAULTS``', else None."""
    node: object = config
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return DEFAULTS.get(key)
        node = node[part]
    return node


def precision(config: Mapping[str, Any]) -> str:
    """``fp16``, ``bf16`` (DeepSpeed also reads the section as ``bfloat16``) or ``fp32``."""
    if (config.get("fp16") or {}).get("enabled") is True:
        return "fp16"
    if any((config.get(name) or {}).get("enabled") is True for name in ("bf16", "bfloat16")):
        return "bf16"
    return "fp32"


def offload_device(config: Mapping[str, Any], kind: str) -> str:
    """Where ``offload_optimizer`` or ``offload_param`` puts its tensors (``none`` when the section is absent); the
    deprecated ``cpu_offload``/``cpu_offload_params`` flags count as ``cpu``."""
    zero = config.get("zero_optimization") or {}
    device = (zero.get(kind) or {}).get("device")
    if device is None:
        legacy = {"offload_optimizer": "cpu_offload", "offload_param": "cpu_offload_params"}[kind]
        return "cpu" if zero.get(legacy) is True else "none"
    return str(device)


@dataclass(frozen=True)
class Comparison:
    """``>=3``, ``>0``, ``==1,<8``: numeric bounds, all of which must hold."""

    written: str
    bounds: tuple[tuple[str, float], ...]

    def holds(self, value: object) -> bool:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return False
        return all(_OPERATORS[op](value, bound) for op, bound in self.bounds)

    @classmethod
    def parse(cls, text: str) -> Comparison | None:
        bounds = []
        for part in text.split(","):
            found = _COMPARISON.fullmatch(part)
            if found is None:
                return None
            bounds.append((found[1], float(found[2])))
        return cls(text.replace(" ", ""), tuple(bounds))


@dataclass(frozen=True)
class Requirement:
    """One condition on a config: a value it reads (``key``, or a derived fact such as ``precision``) must be one of
    ``values`` or meet ``comparison``."""

    what: str  # how a person names it: "ZeRO stage", "precision", "zero_optimization.elastic_checkpoint"
    read: Callable[[Mapping[str, Any]], object] = field(compare=False)
    values: tuple[object, ...] = ()
    comparison: Comparison | None = None

    def holds(self, config: Mapping[str, Any]) -> bool:
        value = self.read(config)
        if self.comparison is not None:
            return self.comparison.holds(value)
        return any(_same(value, v) for v in self.values)

    def describe(self) -> str:
        if self.comparison is not None:
            return f"{self.what} {self.comparison.written}"
        if self.what == "optimizer section":
            return "an optimizer section" if self.values == (True,) else "no optimizer section"
        return f"{self.what} {' or '.join(_text(v) for v in self.values)}"

    def unmet(self, config: Mapping[str, Any]) -> str | None:
        """None when it holds, else what was needed and what the config has, in one phrase."""
        if self.holds(config):
            return None
        value = self.read(config)
        if self.what == "optimizer section":
            has = "has one" if value else "has none"
        else:
            has = f"has {_text(value)}" if value is not None else "does not set it"
        return f"needs {self.describe()}; the config {has}"


def _same(a: object, b: object) -> bool:
    """Equal as JSON values are (``1 == 1.0``, but ``True`` is not ``1``)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return bool(a == b)


def _text(value: object) -> str:
    if value is None:
        return "unset"  # a required None: the config must leave the key out (DeepSpeed's default then applies)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


@dataclass(frozen=True)
class Premise:
    """A repro's ``ds_premise``: what a config must meet, what a scan sets on top of a user's config, and why."""

    requirements: tuple[Requirement, ...]
    sets: tuple[tuple[str, object], ...] = ()
    because: str = ""
    accelerator: str | None = None  # the bug exists only with this DeepSpeed accelerator

    def unmet(self, config: Mapping[str, Any]) -> tuple[str, ...]:
        """What ``config`` lacks for the bug to be possible, one phrase per requirement (empty: the premise holds)."""
        return tuple(u for r in self.requirements if (u := r.unmet(config)) is not None)

    def describe(self) -> str:
        parts = [r.describe() for r in self.requirements] or ["any config"]
        if self.accelerator:
            parts.append(f"the {self.accelerator} accelerator only")
        return ", ".join(parts)

    def describe_sets(self) -> str:
        return ", ".join(f"{k}={_text(v)}" for k, v in self.sets)

    def apply(self, config: dict[str, Any]) -> list[str]:
        """Put ``sets`` into ``config`` (in place); each change, in words, for the scan's notes."""
        notes = []
        for key, value in self.sets:
            before = lookup(config, key)
            if _same(before, value) and before is not None:
                continue
            node = config
            *parents, last = key.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[last] = value
            notes.append(f"{key} {_text(before) if before is not None else 'unset'} -> {_text(value)}: {self.because}")
        return notes

    def sets_differ(self, config: Mapping[str, Any]) -> tuple[str, ...]:
        """The ``sets`` that ``config`` (a repro's own) does not already hold: a scan would run what it never runs."""
        return tuple(
            f"{key}={_text(value)} (its config has {_text(lookup(config, key))})"
            for key, value in self.sets
            if not _same(lookup(config, key), value)
        )


def own_config_problem(
    premise: Premise, name: str, written: Mapping[str, Any], config: Mapping[str, Any]
) -> str | None:
    """What is wrong with a repro's own config ``name`` for its premise (``written``: as its author wrote it, autos
    resolved; ``config``: as the world runs it), or None. A repro whose own config cannot show its bug, or that
    runs without the settings a scan gives a user's config, is a defect."""
    unmet = premise.unmet(written)
    if unmet:
        return f"the test's own config [{name}] does not meet the premise: {'; '.join(unmet)}"
    differ = premise.sets_differ(config)
    if differ:
        return (f"sets {', '.join(differ)} differs from the test's own config [{name}]; a scan would run users' "
                "configs with settings the repro never runs with")  # fmt: skip
    return None


#: The marker's keyword arguments, in the order ``describe`` lists them.
PARAMETERS = (
    "stage", "precision", "offload_optimizer", "offload_param", "optimizer", "gradient_accumulation", "config",
    "accelerator", "sets", "because",
)  # fmt: skip


def _choices(name: str, value: object, allowed: tuple[object, ...], where: str) -> tuple[object, ...]:
    values = tuple(value) if isinstance(value, (tuple, list, set, frozenset)) else (value,)
    bad = [v for v in values if v not in allowed or isinstance(v, bool) != isinstance(allowed[0], bool)]
    if not values or bad:
        named = ", ".join(repr(a) for a in allowed)
        raise MarkerError(f"{where}: {name}={value!r} must be one of {named}, or a tuple of them")
    return tuple(sorted(set(values), key=allowed.index))


def _number_requirement(what: str, read: Callable[[Mapping[str, Any]], object], value: object, where: str,
                        name: str) -> Requirement:  # fmt: skip
    if isinstance(value, str):
        comparison = Comparison.parse(value)
        if comparison is None:
            raise MarkerError(f"{where}: {name}={value!r} must be a number or a comparison such as '>=3' or '>0,<8'")
        return Requirement(what, read, comparison=comparison)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return Requirement(what, read, (value,))
    raise MarkerError(f"{where}: {name}={value!r} must be a number or a comparison such as '>=3'")


def _keys(name: str, value: object, where: str) -> dict[str, object]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and k for k in value):
        raise MarkerError(f"{where}: {name}= must be a dict of dotted config keys, e.g. {{'zero_optimization.x': 1}}")
    return dict(value)


def _reader(key: str) -> Callable[[Mapping[str, Any]], object]:
    return lambda config: lookup(config, key)


def _offload_reader(kind: str) -> Callable[[Mapping[str, Any]], object]:
    return lambda config: offload_device(config, kind)


def _requirements(kwargs: Mapping[str, object], where: str) -> list[Requirement]:
    """The conditions of a ``ds_premise``, in ``PARAMETERS`` order."""
    found: list[Requirement] = []
    if "stage" in kwargs:
        stages = _choices("stage", kwargs["stage"], STAGES, where)
        found.append(Requirement("ZeRO stage", _reader("zero_optimization.stage"), stages))
    if "precision" in kwargs:
        found.append(Requirement("precision", precision, _choices("precision", kwargs["precision"], PRECISIONS, where)))
    for kind in ("offload_optimizer", "offload_param"):
        if kind in kwargs:
            devices = _choices(kind, kwargs[kind], OFFLOAD_DEVICES, where)
            found.append(Requirement(f"{kind} device", _offload_reader(kind), devices))
    if "optimizer" in kwargs:
        if not isinstance(kwargs["optimizer"], bool):
            raise MarkerError(f"{where}: optimizer={kwargs['optimizer']!r} must be True (the config has an optimizer "
                              "section) or False (it has none)")  # fmt: skip
        found.append(Requirement("optimizer section", lambda c: "optimizer" in c, (kwargs["optimizer"],)))
    if "gradient_accumulation" in kwargs:
        reader = _reader("gradient_accumulation_steps")
        value = kwargs["gradient_accumulation"]
        found.append(_number_requirement("gradient_accumulation_steps", reader, value, where, "gradient_accumulation"))
    for key, value in _keys("config", kwargs.get("config", {}), where).items():
        comparison = Comparison.parse(value) if isinstance(value, str) else None
        found.append(Requirement(key, _reader(key), (value,), comparison))
    return found


def parse(args: tuple[object, ...], kwargs: Mapping[str, object], where: str) -> Premise:
    """A ``ds_premise`` marker's arguments, validated; ``MarkerError`` names ``where`` (marker and test)."""
    unknown = sorted(set(kwargs) - set(PARAMETERS))
    if args or unknown:
        extra = [repr(a) for a in args] + unknown
        raise MarkerError(f"{where}: unexpected argument(s) {', '.join(extra)}; takes {'=, '.join(PARAMETERS)}=")
    found = _requirements(kwargs, where)
    accelerator = kwargs.get("accelerator")
    if accelerator is not None and accelerator not in ACCELERATORS:
        raise MarkerError(
            f"{where}: accelerator={accelerator!r} must be one of {', '.join(ACCELERATORS)} (or leave it out)"
        )
    sets = _keys("sets", kwargs.get("sets", {}), where)
    because = kwargs.get("because", "")
    if sets and (not isinstance(because, str) or not because.strip()):
        raise MarkerError(f"{where}: sets= needs because=: why a scan changes a user's config for this repro, in words")
    if because and not sets:
        raise MarkerError(f"{where}: because= explains sets=, which is not given")
    return Premise(tuple(found), tuple(sets.items()), " ".join(str(because).split()), str(accelerator or "") or None)
