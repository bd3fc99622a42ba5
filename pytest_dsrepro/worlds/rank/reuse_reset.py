"""Runs in the fork server (``Baseline.take``, before it forks a reusable world) and in its kept ranks (between two
tests of a reuse scope, ``ds_world(reuse=True)``): what a kept rank puts back so that the next test starts as it would
on a freshly forked rank, where torch's ``MultiProcContinuousTest`` and DeepSpeed's ``reuse_dist_env`` put nothing
back. What a rank cannot put back (``Baseline.leftovers``, ``leftovers.ProcessState``) ends the world instead; what
no rank looks at (objects changed in place deeper than a test module's containers) stays, as in one pytest process.
Imports torch only inside functions.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import operator
import os
import random
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from .namespaces import Namespaces, Rebound

# What is put back, as forked: a gloo rank's default process group is destroyed (the next test makes its own; an NCCL
# rank keeps its own, whose communicator is what keeping the world saves); the environment and its time zone; every
# global of DeepSpeed's modules that the test rebound or whose container it filled (``deepspeed.comm.comm.cdb``,
# ``deepspeed.utils.groups._WORLD_GROUP``, a monkeypatched function), and in DeepSpeed modules first imported since,
# every global holding a process group emptied; every name the libraries rebound in a module the rank was forked with
# or its classes (``Init.param_id``, ``torch.nn.functional.linear`` swapped by ZeRO-3: ``namespaces``); the random
# streams, warnings filters and loggers; the test modules' lists, dicts and sets, as imported (``remember``). The
# ``monkeypatch`` a body or a fix got is undone as the body ends (``body.run_body``).

#: How deep a global's containers are searched for a process group.
SEARCH_DEPTH = 3
#: The fork server's namespaces, taken once and refreshed before each reusable world it forks (``Baseline.take``).
_SERVER: list[Namespaces] = []
#: In a rank: each test module it imported, with its containers' contents as imported (``remember``).
_TEST_MODULES: dict[str, dict[str, object]] = {}


def _deepspeed(name: str) -> bool:
    return name == "deepspeed" or name.startswith("deepspeed.")


def _deepspeed_modules() -> dict[str, ModuleType]:
    return {name: m for name, m in list(sys.modules.items()) if isinstance(m, ModuleType) and _deepspeed(name)}


def _contents(value: object) -> object:
    """A container's contents, copied (the container itself may be filled in place), or None."""
    if type(value) is dict:
        return dict(value)
    if type(value) is list:
        return list(value)
    if type(value) is set:
        return set(value)
    return None


def _contained(module: ModuleType) -> dict[str, object]:
    """Each container a module's globals name, by name: its contents, copied."""
    return {key: copied for key, value in list(vars(module).items()) if (copied := _contents(value)) is not None}


def remember(module: ModuleType) -> None:
    """In a rank, as it imports a test module: its containers as a fresh rank has them, put back after each test on
    a kept rank (``Baseline.restore``)."""
    _TEST_MODULES[module.__name__] = _contained(module)


def _unchanged(saved: Any, value: Any) -> bool:
    """Does the container hold what was saved, object for object (its items are never compared by ``==``: tensors)?
    In C loops: a kept rank asks it of every DeepSpeed container after every test."""
    if len(saved) != len(value):
        return False
    if isinstance(value, dict):
        return bool(saved.keys() == value.keys() and all(map(operator.is_, saved.values(), value.values())))
    if isinstance(value, list):
        return all(map(operator.is_, saved, value))
    return bool(value.issubset(saved))


def _refill(container: Any, contents: Any) -> None:
    container.clear()
    if isinstance(container, list):
        container.extend(contents)
    else:
        container.update(contents)


def holds_group(value: object, depth: int = SEARCH_DEPTH) -> bool:
    """Is ``value`` a process group, or a dict, list, tuple or set holding one?"""
    from torch.distributed import ProcessGroup

    def holds(value: object, depth: int) -> bool:
        if issubclass(type(value), ProcessGroup):  # not isinstance: torch's metaclass makes each one cost microseconds
            return True
        if depth > 0 and isinstance(value, dict):
            return any(holds(v, depth - 1) for v in (*value.keys(), *value.values()))
        if depth > 0 and isinstance(value, (list, tuple, set, frozenset)):
            return any(holds(v, depth - 1) for v in value)
        return False

    return holds(value, depth)


def _forked_namespaces() -> Namespaces:
    if _SERVER:
        _SERVER[0].refresh()
    else:
        _SERVER.append(Namespaces.take())
    return _SERVER[0]


def _random_streams() -> tuple[tuple[Callable[[Any], object], object], ...]:
    """Each random stream the rank has, with what puts its state back: Python's, torch's, NumPy's global one."""
    streams: list[tuple[Callable[[Any], object], object]] = [(random.setstate, random.getstate())]
    torch, numpy_random = sys.modules.get("torch"), sys.modules.get("numpy.random")
    if torch is not None:
        streams.append((torch.set_rng_state, torch.get_rng_state()))
    if numpy_random is not None:
        streams.append((numpy_random.set_state, numpy_random.get_state()))
    return tuple(streams)


def _fresh_cuda_streams() -> None:
    """CUDA's generators as a fresh process makes them (its default seed, no offset): a rank forks without CUDA, and
    a kept NCCL rank's were made by its first test."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        for i, generator in enumerate(torch.cuda.default_generators):
            generator.manual_seed(torch.Generator(device=f"cuda:{i}").initial_seed())


_Logger = tuple[logging.Logger, int, bool, bool, tuple[logging.Handler, ...]]


def _loggers() -> tuple[int, tuple[_Logger, ...]]:
    """``logging.disable``'s level, and each logger's level, switches and handlers."""
    manager = logging.Logger.manager
    found = [logging.getLogger(), *(v for v in manager.loggerDict.values() if isinstance(v, logging.Logger))]
    return manager.disable, tuple((g, g.level, g.disabled, g.propagate, tuple(g.handlers)) for g in found)


def _put_back_loggers(saved: tuple[int, tuple[_Logger, ...]]) -> None:
    disable, loggers = saved
    logging.Logger.manager.disable = disable
    for logger, level, disabled, propagate, handlers in loggers:
        logger.level, logger.disabled, logger.propagate = level, disabled, propagate
        if tuple(logger.handlers) != handlers:
            logger.handlers[:] = handlers
    logging.Logger.manager._clear_cache()  # type: ignore[attr-defined] # what Logger.setLevel calls


@dataclass(frozen=True)
class Baseline:
    """A rank's state as forked: the environment, the namespaces of its modules (``namespaces``), the contents of
    DeepSpeed's containers; and, taken in the rank itself (``settled``), its random streams, warnings filters and
    loggers."""

    environ: dict[str, str]
    namespaces: Namespaces
    contents: dict[tuple[str, str], object]
    deepspeed: frozenset[str]  # DeepSpeed's modules then
    streams: tuple[tuple[Callable[[Any], object], object], ...] = ()
    filters: tuple[object, ...] = ()
    loggers: tuple[int, tuple[_Logger, ...]] = (0, ())

    @classmethod
    def take(cls) -> Baseline:
        """In the fork server, before it forks a reusable world: saved in its own memory, which the ranks share
        until they write to it (a kept rank never copies a page to compare)."""
        modules = _deepspeed_modules()
        contents = {(name, key): c for name, module in modules.items() for key, c in _contained(module).items()}
        return cls(dict(os.environ), _forked_namespaces(), contents, frozenset(modules))

    def settled(self) -> Baseline:
        """In the rank, at once after the fork: what the fork changed (threading's locks, Python's random seed)."""
        self.namespaces.refresh()
        return dataclasses.replace(self, streams=_random_streams(), filters=tuple(warnings.filters), loggers=_loggers())

    def leftovers(self, rebound: list[Rebound]) -> list[str]:
        """What the test left that cannot be put back: a name its own code rebound outside DeepSpeed's modules and
        classes (put back whoever rebound them), a module taken out of ``sys.modules``."""
        ours = [r for r in rebound if r.by_test and not _deepspeed(r.where)]
        replaced = [f"sys.modules[{name!r}] was replaced or removed" for name in self.namespaces.replaced_modules()]
        return [str(r) for r in ours] + replaced

    def restore(self, rebound: list[Rebound]) -> list[str]:
        """Put it all back; what was put back of the namespaces, as ``module.name``. What the libraries set (not code)
        outside DeepSpeed stays, and is what the next test is compared with."""
        zone = os.environ.get("TZ")
        os.environ.clear()
        os.environ.update(self.environ)
        if zone != os.environ.get("TZ"):
            time.tzset()
        back = [r for r in rebound if _deepspeed(r.where) or r.code]
        if any(not r.code for r in back):
            # A counter goes back only once the test's objects are gone, as with its process: a DeepSpeedCPUAdam
            # frees its native state by its id in __del__, and a cycle collected later would free the next test's.
            gc.collect()
        for r in back:
            r.put_back()
        restored = [r.where for r in back] + self._containers()
        for set_state, state in self.streams:
            set_state(state)
        _fresh_cuda_streams()
        warnings.filters[:] = self.filters  # type: ignore[index]
        getattr(warnings, "_filters_mutated", lambda: None)()  # the filters' caches, as warnings.simplefilter does
        _put_back_loggers(self.loggers)
        self.namespaces.refresh(self.namespaces.moved)
        return restored

    def _containers(self) -> list[str]:
        """DeepSpeed's containers refilled as forked, the test modules' as imported; in DeepSpeed's modules first
        imported since, globals holding a process group emptied."""
        restored = []
        tests = {(name, key): c for name, saved in _TEST_MODULES.items() for key, c in saved.items()}
        for (name, key), saved in [*self.contents.items(), *tests.items()]:
            value = vars(sys.modules[name]).get(key) if name in sys.modules else None
            if value is not None and not _unchanged(saved, value):
                _refill(value, saved)
                restored.append(f"{name}.{key}")
        later = [*self.namespaces.added, *(n for n, _ in self.namespaces.new_modules())]
        for name in (n for n in later if _deepspeed(n) and n not in self.deepspeed and n in sys.modules):
            namespace = vars(sys.modules[name])
            for key, value in list(namespace.items()):
                if holds_group(value):
                    namespace[key] = type(value)() if isinstance(value, (dict, list, set)) else None
                    restored.append(f"{name}.{key}")
        return restored
