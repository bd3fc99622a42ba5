"""Runs in the fork server and its throwaway children: what a rank would import for a DeepSpeed engine step,
imported once in the fork server instead of in every rank.

A first ZeRO step imports ~1,400 modules that ``import torch, deepspeed`` does not (sympy, networkx, torch._dynamo,
inductor, ...): about 2 s in every rank of every test. The fork server imports them once, before it forks. Which
modules is found, not hand-listed (``discover``), by a scout while the first worlds run without it (``scout``), and
only what leaves the server safe to fork is kept (``vet``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import importlib
import json
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from ...core.files import write_atomically
from ...core.outcome import describe_exit
from .. import shm

#: The ZeRO stages whose first step the discovery runs (each imports its own optimizer code).
PRESETS = ("zero1", "zero2", "zero3")
DISCOVERY_TIMEOUT = 300.0
#: The list file's format (in its name): lists of another one are found again, and left to the version that reads them.
LIST_FORMAT = 2
#: How long collecting a scout's result may take once it said it is done (its pipe readable: milliseconds).
LOAD_TIMEOUT = 60.0
#: At most this many fork-unsafe modules are looked for (one throwaway child each); more, and nothing is preloaded.
VET_ROUNDS = 20


@dataclass(frozen=True)
class Preloaded:
    """What the fork server imported ahead of its ranks, for the report header and the server's facts."""

    modules: int
    seconds: float
    note: str  # where the list came from, or why preloading stopped short
    stopped: bool = False  # a module's import left a hazard here: nothing more is done in this process

    def describe(self) -> str:
        return f"{self.modules} modules in {self.seconds:.1f}s ({self.note})"


@dataclass(frozen=True)
class Install:
    """What a list is found for: a DeepSpeed install (release and location) on a torch, under one of DeepSpeed's
    accelerators, and the cache directory it is kept in."""

    cache_dir: Path
    deepspeed_version: str
    torch_version: str
    deepspeed_dir: Path
    #: DeepSpeed's accelerator (``cpu``, ``cuda``): a first engine step imports other modules under each, and a CUDA
    #: server's list holds Triton ops that start a thread in a CPU server of the same install (seen on an H100).
    accelerator: str


def list_file(install: Install) -> Path:
    """One list per DeepSpeed install, accelerator, torch, Python and format, in the cache directory: only the first
    run of a release pays for finding it."""
    where = hashlib.sha256(str(install.deepspeed_dir.resolve()).encode()).hexdigest()[:10]
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    name = (
        f"deepspeed-{install.deepspeed_version}-{install.accelerator}-torch-{install.torch_version}-{where}-{py}"
        f"-v{LIST_FORMAT}.json"
    )
    return install.cache_dir / "preload" / name


def threads() -> int:
    """Threads of this process as the kernel counts them (C++ pools too, not only Python's)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def hazard(threads_before: int = 1) -> str | None:
    """What makes forking this process unsafe, or None: more threads than ``threads_before`` (by default: any thread
    besides this one; a forked child has only the forking thread, and a lock another thread held stays locked in it
    forever), a CUDA context, a process group."""
    if threads() > threads_before:
        return "a thread"
    torch = sys.modules.get("torch")
    if torch is not None:
        if torch.cuda.is_initialized():
            return "a CUDA context"
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return "a process group"
    return None


@dataclass(frozen=True)
class Child:
    """A throwaway child forked from this process, working; ``result`` waits for what it found."""

    pid: int
    read: int  # the pipe its JSON-able result comes through

    @classmethod
    def start(cls, work: Callable[[], Any]) -> Child:
        """Fork a child that runs ``work()``. One that may outlive a world goes through ``builds.BuildChild``, whose
        lifeline stops it when the server ends."""
        sys.stdout.flush()
        sys.stderr.flush()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            code = 1
            try:
                os.close(read)
                result = work()
                with os.fdopen(write, "w") as out:
                    json.dump(result, out)
                code = 0
            except BaseException:  # noqa: BLE001 - told through the exit code; the traceback goes to the server's log
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        os.close(write)
        return cls(pid, read)

    def done(self) -> bool:
        """Has it ended (its result can be read at once)?"""
        return bool(select.select([self.read], [], [], 0)[0])

    def result(self, timeout: float) -> Any:
        """Its result; ``RuntimeError`` saying why when it failed (its traceback went to this process's stderr) or
        took longer than ``timeout``, when it is killed."""
        data: bytes | None = None
        try:
            data = _read_all(self.read, time.monotonic() + timeout)
        finally:
            os.close(self.read)
            if data is None:
                os.kill(self.pid, signal.SIGKILL)
            _, status = os.waitpid(self.pid, 0)
        if data is None:
            raise RuntimeError(f"it took longer than {timeout:g}s")
        if os.waitstatus_to_exitcode(status) != 0:
            raise RuntimeError(f"it failed ({describe_exit(os.waitstatus_to_exitcode(status))})")
        return json.loads(data)


def in_child(work: Callable[[], Any], timeout: float) -> Any:
    """``work()`` in a throwaway child forked from this process; its JSON-able result. Nothing it imports or starts
    stays here. ``RuntimeError`` saying why when it fails (its traceback goes to this process's stderr) or takes
    longer than ``timeout``."""
    return Child.start(work).result(timeout)


def _read_all(fd: int, deadline: float) -> bytes | None:
    chunks: list[bytes] = []
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
    return None


def _engine_steps() -> None:
    """One step of each ZeRO stage in a 1-rank gloo world (runs in the throwaway child)."""
    import torch
    import torch.distributed as dist

    from ...core import configs
    from ...inrank import context
    from ...inrank.engine import EngineFactory
    from ...inrank.models import make_batch, tiny_mlp

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1", LOCAL_WORLD_SIZE="1")
    # Only a name here (the group's store is in-process): DeepSpeed names its /dev/shm buffer after it, so this
    # child's buffer is its own even when another discovery runs at the same time.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(os.getpid()))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    try:
        with context.running(context.RankContext(rank=0, world_size=1, local_rank=0, backend="gloo")):
            for preset in PRESETS:
                config = configs.resolve(preset, preset, 1, "gloo").config
                engine = EngineFactory(config, preset)(model=tiny_mlp(), optimizer="adam")
                # On the engine's device: a CUDA fork server's engine is on the GPU, whatever this group's backend.
                x, y = make_batch(config["train_micro_batch_size_per_gpu"], device=engine.device)
                engine.backward(torch.nn.functional.mse_loss(engine(x), y))
                engine.step()
    finally:  # DeepSpeed's CPU allreduce left a 66 MiB buffer for this 1-rank world in /dev/shm
        shm.remove_world_buffers("127.0.0.1", os.getpid())


def discover(timeout: float = DISCOVERY_TIMEOUT) -> list[str]:
    """The modules a throwaway child forked from the server imports for one training step of each ZeRO stage in a
    1-rank gloo world, in import order.

    Raises ``RuntimeError`` with the reason when the child fails or takes longer than ``timeout``.
    """
    before = set(sys.modules)

    def steps() -> list[str]:
        _engine_steps()
        return [name for name in sys.modules if name not in before]

    try:
        return [str(name) for name in in_child(steps, timeout)]
    except RuntimeError as exc:
        raise RuntimeError(f"the engine step failed or hung: {exc}") from None


def import_ahead(names: list[str]) -> tuple[int, str | None, str | None]:
    """Import ``names`` in order until one leaves this process less safe to fork than it was (``hazard``);
    ``(imported, stopped_at, left)``: that module, and what it left.

    A module that cannot be imported here (one a child generated on the fly, say) is skipped: ranks import it
    themselves, as they would without preloading.
    """
    imported = 0
    before = threads()
    for name in names:
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: BLE001 - preloading is an optimisation; the rank reports real errors
            continue
        left = hazard(before)
        if left is not None:
            return imported, name, left
        imported += 1
    return imported, None, None


def vet(names: list[str], timeout: float = DISCOVERY_TIMEOUT) -> tuple[list[str], list[str]]:
    """``(safe, unsafe)``: ``names`` split by what importing them, in order, does to a copy of this process. Each
    throwaway child imports the list without the modules found unsafe so far, up to the next one that leaves a
    hazard; an unsafe module's dependants are found in a later round, where they bring it in themselves. The server
    never imports the unsafe ones (with what only they brought in), and its ranks import them themselves; it still
    checks after each import and stops at the first that leaves a hazard all the same (``import_ahead``)."""
    unsafe: list[str] = []
    for _ in range(VET_ROUNDS):
        candidates = [n for n in names if n not in unsafe]
        _, stopped, _ = in_child(functools.partial(import_ahead, candidates), timeout)
        if stopped is None:
            return candidates, unsafe
        unsafe.append(str(stopped))
    raise RuntimeError(f"more than {VET_ROUNDS} modules leave a thread, a CUDA context or a process group")


def _keep(listing: Path, names: list[str], unsafe: list[str], seconds: float) -> str:
    """Write the list for later servers (whole or not at all), with how long finding it took; what became of it, in
    words."""
    try:
        write_atomically(
            listing, json.dumps({"format": LIST_FORMAT, "modules": names, "unsafe": unsafe, "seconds": seconds})
        )
    except OSError as exc:  # a read-only cache: found again by the next run
        return f"not cached ({exc.strerror or exc})"
    return "now cached"


def _listed(listing: Path) -> list[str] | None:
    """The cached list, when there is one of this format."""
    try:
        kept = json.loads(listing.read_text())
        if kept.get("format") != LIST_FORMAT:
            return None
        return [str(n) for n in kept["modules"]]
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return None


def find(install: Install) -> dict[str, Any]:
    """The list found and vetted (in a scout, ``scout``), kept in the cache for every later server of ``install``;
    how long it took, and what became of it (``kept``)."""
    started = time.monotonic()
    names, unsafe = vet(discover())
    seconds = round(time.monotonic() - started, 1)
    kept = _keep(list_file(install), names, unsafe, seconds)
    return {"names": names, "unsafe": unsafe, "seconds": seconds, "kept": kept}


def expected_discovery(cache_dir: Path) -> str:
    """How long finding a list takes here, in words: the range of the earlier ones in the cache, or the range
    measured on a 2-core machine when there was none."""
    taken = []
    for path in (cache_dir / "preload").glob("*.json"):
        with contextlib.suppress(OSError, ValueError, TypeError, AttributeError, KeyError):
            taken.append(float(json.loads(path.read_text())["seconds"]))
    if not taken:
        return "usually 10-30 s"
    return (
        f"{min(taken):.0f}-{max(taken):.0f} s here"
        if max(taken) - min(taken) >= 5
        else f"about {max(taken):.0f} s here"
    )


def _without_comm_op() -> None:
    """In a scout, which runs while the server builds DeepSpeed's comm op: DeepSpeed's own switch for an op it cannot
    build (its compatibility table, which ``build_shm_op`` reads in 0.14-0.19) says the op is not there, so that the
    engine steps do not wait for the build. The op is C++ (no module of the list is in it), and nothing but this
    throwaway process sees the switch."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


class Scout(Protocol):
    """A child of the server that finds the list (``scout``): ``builds.BuildChild``, which goes on apart after a run
    that ended uninterrupted, as a build does, and is stopped with the server otherwise."""

    def done(self) -> bool: ...

    def result(self, timeout: float) -> Any: ...


S = TypeVar("S", bound=Scout)


def scout(install: Install, start: Callable[[Callable[[], Any]], S]) -> S | None:
    """Start finding the list in a child of the server (``start``, running ``find``), while worlds run without it
    (seconds on a CPU machine, minutes on a GPU image's Python stack); None when it is cached. ``warm`` imports it
    before the first world once it is ``ready``; it is kept in the cache as soon as it is found, for later runs, even
    when this one has ended."""
    if _listed(list_file(install)) is not None:
        return None

    def work() -> dict[str, Any]:
        _without_comm_op()
        return find(install)

    return start(work)


def ready(install: Install, scouted: Scout | None) -> bool:
    """Can ``warm`` import a list now, without waiting: cached, or found by the scout (or failed there: said once)."""
    return _listed(list_file(install)) is not None or (scouted is not None and scouted.done())


def warm(install: Install, scouted: Scout | None = None) -> Preloaded:
    """Import, in this (the fork server's) process, what a rank would import for its first engine step, once the list
    is ``ready``: cached, or found by ``scouted`` (``scout``)."""
    started = time.monotonic()
    listing = list_file(install)
    cached = _listed(listing)
    if scouted is None and cached is not None:
        names, note = cached, "list cached"
    else:
        try:
            found = scouted.result(LOAD_TIMEOUT) if scouted is not None else None
        except RuntimeError as exc:
            return Preloaded(0, time.monotonic() - started, f"not preloaded: finding the list failed: {exc}")
        if found is None:
            return Preloaded(0, time.monotonic() - started, "not preloaded: no list was found")
        names, unsafe = [str(n) for n in found["names"]], [str(n) for n in found["unsafe"]]
        note = f"list found beside the worlds in {found['seconds']:.0f}s, {found['kept']}"
        if unsafe:
            note += f"; left to the ranks: {', '.join(unsafe)} (fork-unsafe)"
    imported, stopped, left = import_ahead(names)
    if stopped is not None:
        note = f"stopped at {stopped}, which left {left}; {_learn_unsafe(listing, stopped)}"
    return Preloaded(imported, time.monotonic() - started, note, stopped=stopped is not None)


def _learn_unsafe(listing: Path, module: str) -> str:
    """A module whose import left a hazard here although the throwaway children found it safe (what a child of the
    server sees is not always what the server does: a GPU machine's Triton started a thread in the server only):
    taken out of the cached list, so that the next server of this install leaves it to the ranks. A module that
    imports it is taken out the same way by the server that meets it next."""
    try:
        kept = json.loads(listing.read_text())
        names = [str(n) for n in kept["modules"] if n != module]
        unsafe = [*(str(n) for n in kept.get("unsafe", ())), module]
        seconds = float(kept.get("seconds", 0.0))
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return "no list to correct"
    said = _keep(listing, names, unsafe, seconds)
    return "the next server leaves it to the ranks" if said == "now cached" else f"the corrected list is {said}"


def first_use(accelerator: str, load_built: Callable[[], str | None] | None = None) -> str:
    """After the imports, what a fresh rank's first DeepSpeed use still costs, done here once so that no rank pays it
    again; says what was done. Each step runs subprocesses at most (no thread, no CUDA), and ``hazard`` is checked
    after each: the server never goes on from a step that left one.

    - py-cpuinfo's ``get_cpu_info()`` starts a Python subprocess at every call (DeepSpeed's CPU op builders call it
      twice per op load: ``cpu_arch``, ``simd_width``; CPU Adam and Lion once more): asked once here, its answer is
      what every later call returns (a copy: callers may change theirs). The CPU does not change under a fork.
    - On the CPU accelerator: DeepSpeed's op-compatibility probe (``deepspeed.ops.__compatible_ops__``, run lazily
      since 0.19.8 on first use: a compiler subprocess per op), and ``load_built``: every op already built for this
      install in the cache, loaded (``op_builds.load_built``). Not on CUDA: the probe asks the GPUs, which would
      poison this server's forks.
    """
    before = threads()
    done: list[str] = []
    steps: list[tuple[str, Callable[[], str | None]]] = [("cpuinfo", _remember_cpu_info)]
    if accelerator == "cpu":
        steps.append(("op probe", _probe_ops))
        if load_built is not None:
            steps.append(("ops", load_built))
    for name, step in steps:
        try:
            said = step()
        except Exception as exc:  # noqa: BLE001 - an optimisation: ranks then do it themselves, and report errors
            said = f"{name} left to the ranks ({type(exc).__name__}: {exc})"
        left = hazard(before)
        if left is not None:
            done.append(f"stopped after {name}, which left {left}")
            break
        if said:
            done.append(said)
    return "first use done ahead: " + (", ".join(done) or "nothing to do")


def _remember_cpu_info() -> str | None:
    try:
        import cpuinfo
    except ImportError:
        return None
    if getattr(cpuinfo.get_cpu_info, "dsrepro_remembered", False):
        return "cpuinfo"
    info = cpuinfo.get_cpu_info()

    def get_cpu_info() -> dict[str, Any]:
        return copy.deepcopy(info)

    get_cpu_info.dsrepro_remembered = True  # type: ignore[attr-defined]
    cpuinfo.get_cpu_info = get_cpu_info
    return "cpuinfo"


def _probe_ops() -> str:
    import deepspeed.ops

    compatible = deepspeed.ops.__compatible_ops__
    return f"op probe ({sum(bool(v) for v in compatible.values())} compatible)"
