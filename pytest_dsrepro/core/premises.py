"""``ds_premise``: what a DeepSpeed config must have for a catalogued bug to be possible at all.

A repro states it once, beside its ``ds_repro`` marker, and it is used three ways: ``dsrepro list`` shows it; every
run of the repro checks it against the repro's own configs (a repro whose own config cannot show its bug is a defect,
named at setup); and ``--ds-scan`` runs a user's config through the repros whose premise it meets, saying NOT
APPLICABLE, without a world, for the rest.

Pure: no pytest, no torch, no DeepSpeed.
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

_COMPARISON = re.compile(r"\s*(==|!=|>=|<=|>|<)\s*(-?[0-9.eE+]+)\s*")
_OPERATORS: dict[str, Callable[[Any, Any], bool]] = {
    "==": operator.eq, "!=": operator.ne, ">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt,
}  # fmt: skip


def lookup(config: Mapping[str, Any], key: str) -> object:
    """A dotted key's value in ``config`` (None where it is absent: for a config as a release reads it, a key that
    release does not know)."""
    node: object = config
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def stage(config: Mapping[str, Any]) -> object:
    """The ZeRO stage; a config without ``zero_optimization.stage`` runs without ZeRO (stage 0) on every release."""
    value = lookup(config, "zero_optimization.stage")
    return 0 if value is None else value


def precision(config: Mapping[str, Any]) -> str:
    """``fp16``, ``bf16`` (DeepSpeed also reads the section as ``bfloat16``) or ``fp32``."""
    if lookup(config, "fp16.enabled") is True:
        return "fp16"
    if any(lookup(config, f"{name}.enabled") is True for name in ("bf16", "bfloat16")):
        return "bf16"
    return "fp32"


def offload_device(config: Mapping[str, Any], kind: str) -> str:
    """Where ``offload_optimizer`` or ``offload_param`` puts its tensors (``none`` when the section is absent); the
    deprecated ``cpu_offload``/``cpu_offload_params`` flags count as ``cpu``."""
    device = lookup(config, f"zero_optimization.{kind}.device")
    if device is None:
        legacy = {"offload_optimizer": "cpu_offload", "offload_param": "cpu_offload_params"}[kind]
        return "cpu" if lookup(config, f"zero_optimization.{legacy}") is True else "none"
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
    key: str | None = None  # the dotted key it reads as it is, where it reads one

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

    def unmet(self, config: Mapping[str, Any], written: Mapping[str, Any] | None = None) -> str | None:
        """None when it holds, else what was needed and what the config has, in one phrase; a value ``written``
        leaves out is named as the release's default."""
        if self.holds(config):
            return None
        value = self.read(config)
        if self.what == "optimizer section":
            has = "has one" if value else "has none"
        elif value is None:
            has = "does not set it"
        elif written is not None and self.key is not None and lookup(written, self.key) is None:
            has = f"leaves it to DeepSpeed's default, {_text(value)}"
        else:
            has = f"has {_text(value)}"
        return f"needs {self.describe()}; the config {has}"


def _same(a: object, b: object) -> bool:
    """Equal as JSON values are (``1 == 1.0``, but ``True`` is not ``1``); ``b`` the type ``list``: any list (a value
    given per param group)."""
    if b is list:
        return isinstance(a, list)
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return bool(a == b)


def _text(value: object) -> str:
    if value is list:
        return "a list"
    if value is None:
        return "unset"  # a required None: the config must leave the key out (DeepSpeed's default then applies)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, Mapping):
        return "{...}"
    return str(value)


def remove(config: dict[str, Any], key: str) -> object:
    """Take a dotted key out of ``config`` (in place); what it held (None: it was not there)."""
    *parents, last = key.split(".")
    node: object = config
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    return node.pop(last, None) if isinstance(node, dict) else None


def put(config: dict[str, Any], key: str, value: object) -> None:
    """Set a dotted key in ``config`` (in place), making the sections on its way."""
    node = config
    *parents, last = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


@dataclass(frozen=True)
class Premise:
    """A repro's ``ds_premise``: what a config must meet, what a scan sets on top of (and removes from) a user's
    config, and why; and for a bug of refusals, the config's ``mend``::

        pytest.mark.ds_premise(stage=2, offload_optimizer="cpu", gradient_accumulation=">=3",
                               sets={"gradient_clipping": 0.0}, because="the body compares with plain, unclipped SGD")

    ``sets`` are the settings a scan puts on top of the user's config for this repro (harness settings the repro's
    check needs, such as no gradient clipping against an unclipped reference), each said to the user with
    ``because``; they must be what the repro's own configs hold.

    ``removes`` are keys a scan takes out of a user's config for this repro (a scheduler whose warm-up would make the
    body's one step a step of rate 0), said the same way; a repro's own configs must not hold them.

    ``mend`` is for a bug no body gets past: on a release inside its affected range, a config that meets this premise
    is refused by DeepSpeed, or fails every step whatever the body (inputs cast to half for an fp32 model). It is the
    change to the config that avoids it (the fix on the config's side), and takes the config out of this premise. A
    scan of such a config on such a release runs this repro with the config as written (the bug, AFFECTED) and judges
    every other bug with the config mended, said so; where several bugs mend it, each one's row has the others' mends.
    Past the range, where DeepSpeed refuses such a config as the bug's fix does, the mend is applied the same way.

    A premise is judged on a config as the release being scanned reads it, each key the config leaves out at that
    release's own default (``core.ds_defaults``, read from the release's own config classes); ``written`` says which
    keys the config wrote, so that a default is named as one. A repro's own configs are judged as written: a key its
    premise reads, it writes (its default differs between releases).
    """

    requirements: tuple[Requirement, ...]
    sets: tuple[tuple[str, object], ...] = ()
    because: str = ""
    accelerator: str | None = None  # the bug exists only with this DeepSpeed accelerator
    removes: tuple[str, ...] = ()
    mend: tuple[tuple[str, object], ...] = ()

    def unmet(self, config: Mapping[str, Any], written: Mapping[str, Any] | None = None) -> tuple[str, ...]:
        """What ``config`` lacks for the bug to be possible, one phrase per requirement (empty: the premise holds);
        ``written``: the config as written, where ``config`` is as a release reads it."""
        return tuple(u for r in self.requirements if (u := r.unmet(config, written)) is not None)

    def describe(self) -> str:
        parts = [r.describe() for r in self.requirements] or ["any config"]
        if self.accelerator:
            parts.append(f"the {self.accelerator} accelerator only")
        return ", ".join(parts)

    def describe_sets(self) -> str:
        return ", ".join([*(f"{k}={_text(v)}" for k, v in self.sets), *(f"no {k}" for k in self.removes)])

    def describe_mend(self) -> str:
        return ", ".join(f"{k} {_text(v)}" for k, v in self.mend)

    def apply(
        self, config: dict[str, Any], values: Mapping[str, Any] | None = None, written: Mapping[str, Any] | None = None
    ) -> list[str]:
        """Take ``removes`` out of ``config`` and put ``sets`` into it (in place); what changed, in words, with the
        reason, for the scan's notes (none when nothing did). ``values``/``written``: the config as the release
        reads it and as written, for what a key held before (``"auto"`` resolved, or the release's default)."""
        changes = []
        for key in self.removes:
            held = remove(config, key)
            if held is not None:
                kind = held.get("type") if isinstance(held, Mapping) else None
                changes.append(f"no {key}{f' ({kind})' if kind else ''}")
        for key, value in self.sets:
            before = lookup(values if values is not None else config, key)
            if _same(before, value) and before is not None:
                continue
            default = written is not None and before is not None and lookup(written, key) is None
            put(config, key, value)
            was = "unset" if before is None else _text(before) + (" (DeepSpeed's default)" if default else "")
            changes.append(f"{key} {was} -> {_text(value)}")
        return [f"{', '.join(changes)}: {self.because}"] if changes else []

    def mended(self, config: dict[str, Any]) -> list[str]:
        """Put ``mend`` into ``config`` (in place); each change, in words."""
        notes = []
        for key, value in self.mend:
            before = lookup(config, key)
            put(config, key, value)
            notes.append(f"{key} {_text(before)} -> {_text(value)}")
        return notes

    def sets_differ(self, config: Mapping[str, Any]) -> tuple[str, ...]:
        """The ``sets`` that ``config`` (a repro's own, as written) does not hold, and the ``removes`` it holds: a
        scan would run what the repro never runs."""
        return (
            *(f"{key}={_text(value)} (its config has {_text(lookup(config, key))})" for key, value in self.sets
              if not _same(lookup(config, key), value)),
            *(f"no {key} (its config has one)" for key in self.removes if lookup(config, key) is not None),
        )  # fmt: skip


def own_config_problem(
    premise: Premise, name: str, written: Mapping[str, Any], config: Mapping[str, Any]
) -> str | None:
    """What is wrong with a repro's own config ``name`` for its premise (``written``: as its author wrote it, autos
    resolved; ``config``: as the world runs it), or None. A repro whose own config cannot show its bug, or that
    runs without the settings a scan gives a user's config, is a defect. Judged as written: a key the premise reads
    or sets, the repro's config writes, since its default differs between releases."""
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
    "accelerator", "sets", "removes", "because", "mend",
)  # fmt: skip


def _choices(name: str, value: object, allowed: tuple[object, ...], where: str) -> tuple[object, ...]:
    values = tuple(value) if isinstance(value, (tuple, list, set, frozenset)) else (value,)
    bad = [v for v in values if v not in allowed or isinstance(v, bool) != isinstance(allowed[0], bool)]
    if not values or bad:
        named = ", ".join(repr(a) for a in allowed)
        raise MarkerError(f"{where}: {name}={value!r} must be one of {named}, or a tuple of them")
    return tuple(sorted(set(values), key=allowed.index))


def _number_requirement(key: str, value: object, where: str, name: str) -> Requirement:
    """The config's ``key`` (as written) must be the number ``value``, or meet it where it is a comparison."""
    if isinstance(value, str):
        comparison = Comparison.parse(value)
        if comparison is None:
            raise MarkerError(f"{where}: {name}={value!r} must be a number or a comparison such as '>=3' or '>0,<8'")
        return Requirement(key, _reader(key), comparison=comparison, key=key)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return Requirement(key, _reader(key), (value,), key=key)
    raise MarkerError(f"{where}: {name}={value!r} must be a number or a comparison such as '>=3'")


def _keys(name: str, value: object, where: str) -> dict[str, object]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and k for k in value):
        raise MarkerError(f"{where}: {name}= must be a dict of dotted config keys, e.g. {{'zero_optimization.x': 1}}")
    return dict(value)


def _reader(key: str) -> Callable[[Mapping[str, Any]], object]:
    return lambda config: lookup(config, key)


def _key_requirement(key: str, value: object) -> Requirement:
    """``config={key: value}``: a value (a tuple: one of its values; ``list``: any list) or a comparison such as
    ``'>0'``."""
    comparison = Comparison.parse(value) if isinstance(value, str) else None
    values = value if isinstance(value, tuple) else (value,)
    return Requirement(key, _reader(key), values, comparison, key=key)


def _offload_reader(kind: str) -> Callable[[Mapping[str, Any]], object]:
    return lambda config: offload_device(config, kind)


def _requirements(kwargs: Mapping[str, object], where: str) -> list[Requirement]:
    """The conditions of a ``ds_premise``, in ``PARAMETERS`` order."""
    found: list[Requirement] = []
    if "stage" in kwargs:
        stages = _choices("stage", kwargs["stage"], STAGES, where)
        found.append(Requirement("ZeRO stage", stage, stages))
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
        value = kwargs["gradient_accumulation"]
        found.append(_number_requirement("gradient_accumulation_steps", value, where, "gradient_accumulation"))
    found += [_key_requirement(key, value) for key, value in _keys("config", kwargs.get("config", {}), where).items()]
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
    removes = kwargs.get("removes", ())
    if not isinstance(removes, (tuple, list)) or not all(isinstance(k, str) and k for k in removes):
        raise MarkerError(f"{where}: removes= must be a tuple of dotted config keys, e.g. ('scheduler',)")
    because = kwargs.get("because", "")
    if (sets or removes) and (not isinstance(because, str) or not because.strip()):
        raise MarkerError(f"{where}: sets= and removes= need because=: why a scan changes a user's config for this "
                          "repro, in words")  # fmt: skip
    if because and not (sets or removes):
        raise MarkerError(f"{where}: because= explains sets= or removes=, neither of which is given")
    mend = _keys("mend", kwargs.get("mend", {}), where)
    mended: dict[str, Any] = {}
    for key, value in mend.items():
        put(mended, key, value)
    if mend and all(r.holds(mended) for r in found if r.key in mend):
        raise MarkerError(f"{where}: mend= must take a config out of the premise (the fix on the config's side): it "
                          "sets none of the premise's config= keys to a value the premise excludes")  # fmt: skip
    return Premise(tuple(found), tuple(sets.items()), " ".join(str(because).split()), str(accelerator or "") or None,
                   tuple(removes), tuple(mend.items()))  # fmt: skip
