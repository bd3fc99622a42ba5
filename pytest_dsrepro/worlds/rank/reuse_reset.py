"""Runs in a kept rank, between two tests on the same ranks (``ds_world(reuse=True)``): what a rank puts back so that
the next test starts as it would on a freshly forked rank, as far as a process can be taken back.

torch's ``MultiProcContinuousTest`` keeps its workers and gives every test a fresh process group; DeepSpeed's own
``reuse_dist_env`` keeps the process group as well. Here a gloo rank destroys its default process group after every
test (the next test makes its own, under its own store prefix; an NCCL rank keeps its own, whose communicator is what
keeping the world saves), then puts back what it had when it was forked:

- the environment (``os.environ``), whatever the test set or removed;
- every global of DeepSpeed's modules that the test rebound or whose container it filled: its comm layer's backend
  (``deepspeed.comm.comm.cdb``), its cached groups (``deepspeed.utils.groups._WORLD_GROUP``, the expert-parallel
  dicts), counters, a monkeypatched function; in DeepSpeed modules first imported since, every global that holds a
  process group is emptied, since that group is gone.

What a test changes elsewhere (torch's global settings, other libraries' state, the test module's imports) stays for
the next test of its scope, as under DeepSpeed's own reuse. Runs in ranks; imports torch only inside functions.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any

#: How deep a global's containers are searched for a process group.
SEARCH_DEPTH = 3


def _deepspeed_modules() -> dict[str, ModuleType]:
    return {
        name: module
        for name, module in list(sys.modules.items())
        if isinstance(module, ModuleType) and (name == "deepspeed" or name.startswith("deepspeed."))
    }


def _contents(value: object) -> object:
    """A container's contents, copied (the container itself may be filled in place), or None."""
    if type(value) is dict:
        return dict(value)
    if type(value) is list:
        return list(value)
    if type(value) is set:
        return set(value)
    return None


def _unchanged(saved: Any, value: Any) -> bool:
    """Does the container hold what was saved, object for object (its items are never compared by ``==``: tensors)?"""
    if len(saved) != len(value):
        return False
    if isinstance(value, dict):
        return all(key in saved and saved[key] is item for key, item in value.items())
    if isinstance(value, list):
        return all(a is b for a, b in zip(saved, value, strict=True))
    return all(item in saved for item in value)


def _refill(container: Any, contents: Any) -> None:
    container.clear()
    if isinstance(container, list):
        container.extend(contents)
    else:
        container.update(contents)


def holds_group(value: object, depth: int = SEARCH_DEPTH) -> bool:
    """Is ``value`` a process group, or a dict, list, tuple or set holding one?"""
    from torch.distributed import ProcessGroup

    if isinstance(value, ProcessGroup):
        return True
    if depth > 0 and isinstance(value, dict):
        return any(holds_group(v, depth - 1) for v in (*value.keys(), *value.values()))
    if depth > 0 and isinstance(value, (list, tuple, set, frozenset)):
        return any(holds_group(v, depth - 1) for v in value)
    return False


@dataclass(frozen=True)
class Baseline:
    """A rank's state as forked: the environment, and the globals of every DeepSpeed module (with their containers'
    contents)."""

    environ: dict[str, str]
    globals: dict[str, dict[str, object]]
    contents: dict[tuple[str, str], object]

    @classmethod
    def take(cls) -> Baseline:
        found: dict[str, dict[str, object]] = {}
        contents: dict[tuple[str, str], object] = {}
        for name, module in _deepspeed_modules().items():
            found[name] = dict(vars(module))
            for key, value in found[name].items():
                copied = _contents(value)
                if copied is not None:
                    contents[name, key] = copied
        return cls(dict(os.environ), found, contents)

    def restore(self) -> list[str]:
        """Put it back; the DeepSpeed globals put back or emptied, as ``module.name``."""
        os.environ.clear()
        os.environ.update(self.environ)
        restored = []
        for name, module in _deepspeed_modules().items():
            before = self.globals.get(name)
            namespace = vars(module)
            for key, value in list(namespace.items()):
                if before is not None and key in before:
                    original = before[key]
                    saved = self.contents.get((name, key))
                    if original is not value:
                        namespace[key] = original
                    elif saved is None or _unchanged(saved, value):
                        continue
                    if saved is not None:
                        _refill(original, saved)
                    restored.append(f"{name}.{key}")
                elif holds_group(value):
                    namespace[key] = type(value)() if isinstance(value, (dict, list, set)) else None
                    restored.append(f"{name}.{key}")
        return restored
