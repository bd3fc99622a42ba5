"""Runs in a kept rank (``ds_world(reuse=True)``): what a test may leave in its process that the rank cannot put back,
looked for after every test; any one found ends the world, and the next test gets fresh ranks.

A fresh rank starts as the fork server forked it. After a test, a kept rank puts back what it can (``reuse_reset``)
and looks here for what it cannot, each compared with the rank's own state when it was forked (``ProcessState``).
Each getter reads the state; it costs about a millisecond in all. Imports torch only where the rank already has it.
"""

from __future__ import annotations

import contextlib
import gc
import locale
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import nccl_recorder

#: The interval timers a test may leave running (``signal.setitimer``, ``signal.alarm``).
TIMERS = (signal.ITIMER_REAL, signal.ITIMER_VIRTUAL, signal.ITIMER_PROF)


def _torch_modes(torch: Any) -> dict[str, Callable[[], object]]:
    """torch's global modes, each as ``what it is (how a test sets it)``: a getter of its value."""
    backends, hooks = torch.backends, torch._C._autograd
    return {
        "torch's default dtype (torch.set_default_dtype)": torch.get_default_dtype,
        "torch's default device (torch.set_default_device)": torch.get_default_device,
        "grad mode (torch.set_grad_enabled, torch.no_grad)": torch.is_grad_enabled,
        "inference mode (torch.inference_mode)": torch.is_inference_mode_enabled,
        "deterministic algorithms (torch.use_deterministic_algorithms)": lambda: (
            torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
        "anomaly mode (torch.autograd.set_detect_anomaly)": lambda: (
            torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
        "autocast (torch.autocast)": lambda: (torch.is_autocast_cache_enabled(), *(
            (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda"))),
        "torch function modes (a TorchFunctionMode, torch.device as a context)": torch._C._len_torch_function_stack,
        "torch dispatch modes (a TorchDispatchMode)": torch._C._len_torch_dispatch_stack,
        "saved-tensor hooks (torch.autograd.graph.saved_tensors_hooks)": lambda: (
            hooks._top_saved_tensors_default_hooks(False) is None, hooks._saved_tensors_hooks_is_enabled()),
        "torch's threads (torch.set_num_threads)": lambda: (torch.get_num_threads(), torch.get_num_interop_threads()),
        "float32 matmul precision (torch.set_float32_matmul_precision)": torch.get_float32_matmul_precision,
        "torch.backends flags (cudnn, cuda.matmul, mkldnn)": lambda: (
            backends.cudnn.enabled, backends.cudnn.benchmark, backends.cudnn.deterministic, backends.cudnn.allow_tf32,
            backends.cuda.matmul.allow_tf32, backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
            backends.mkldnn.enabled),
        "torch's print options (torch.set_printoptions)": lambda: dict(vars(torch._tensor_str.PRINT_OPTS)),
        "torch's warn-always (torch.set_warn_always)": torch.is_warn_always_enabled,
        "the rank's CUDA device (torch.cuda.set_device)": lambda: not torch.cuda.is_initialized() or (
            torch.cuda.current_device() == int(os.environ.get("LOCAL_RANK", "0"))),
    }  # fmt: skip


def _deepspeed_contexts() -> dict[str, Callable[[], object]]:
    def entered() -> object:
        return getattr(sys.modules.get("deepspeed.runtime.zero.partition_parameters"), "zero_init_context", 0)

    return {"deepspeed.zero.Init contexts entered and not left": entered}


def _interpreter() -> dict[str, Callable[[], object]]:
    def umask() -> int:
        mask = os.umask(0o022)
        os.umask(mask)
        return mask

    return {
        "sys.stdin, sys.stdout, sys.stderr": lambda: (sys.stdin, sys.stdout, sys.stderr),
        "a trace or profile function (sys.settrace, sys.setprofile, threading.settrace)": lambda: (
            sys.gettrace(), sys.getprofile(), threading.gettrace(), threading.getprofile()),
        "the import machinery (sys.meta_path, sys.path_hooks)": lambda: (tuple(sys.meta_path), tuple(sys.path_hooks)),
        "the interpreter's limits (sys.setrecursionlimit, sys.setswitchinterval)": lambda: (
            sys.getrecursionlimit(), sys.getswitchinterval()),
        "signal handlers (signal.signal)": lambda: tuple(_handlers()),
        "interval timers (signal.setitimer, signal.alarm)": lambda: tuple(signal.getitimer(t) for t in TIMERS),
        "the garbage collector (gc.disable, gc.set_threshold)": lambda: (gc.isenabled(), gc.get_threshold()),
        "the umask (os.umask)": umask,
        "the locale (locale.setlocale)": lambda: locale.setlocale(locale.LC_ALL),
    }  # fmt: skip


def _handlers() -> Iterator[object]:
    for signum in sorted(signal.valid_signals()):
        if signum not in (signal.SIGKILL, signal.SIGSTOP):
            with contextlib.suppress(OSError, ValueError):
                yield signal.getsignal(signum)


def _read(getter: Callable[[], object]) -> object:
    try:
        return getter()
    except Exception as exc:  # noqa: BLE001 - a mode this torch does not have, or that cannot be read now
        return f"unreadable ({type(exc).__name__})"


def _threads() -> list[str]:
    """Python threads still running, besides the main one, the harness's own and native ones seen by Python."""
    harness = set(nccl_recorder.threads())
    return [
        f"thread {t.name!r} still running"
        for t in threading.enumerate()
        if t is not threading.main_thread() and t not in harness and not isinstance(t, threading._DummyThread)
    ]


def _children() -> list[str]:
    """Child processes of this rank still running (a zombie is over: it only waits to be reaped). One call says
    whether there is any child at all; only then is each thread's list read."""
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return []
    found = []
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            for pid in (task / "children").read_text().split():
                stat = Path(f"/proc/{pid}/stat").read_text()
                if stat.rpartition(")")[2].split()[0] != "Z":
                    found.append(f"child process {pid} ({stat.partition('(')[2].rpartition(')')[0]}) still running")
    return found


def _locks(locks: Path = Path("/proc/locks")) -> list[str]:
    """File locks this process holds (``fcntl.flock``, ``fcntl.lockf``, ``filelock``), from the kernel's list."""
    pid = str(os.getpid())
    try:
        lines = locks.read_text().splitlines()
    except OSError:
        return []
    held = [line.split() for line in lines if "->" not in line]
    return [f"a {f[1]} lock on {f[5]} (device:inode) still held" for f in held if len(f) > 5 and f[4] == pid]


@dataclass(frozen=True)
class ProcessState:
    """What a rank's process was when it was forked, of what it cannot put back: each getter's value.

    - torch's global modes: its default dtype and device, grad and inference mode, deterministic algorithms, anomaly
      mode, autocast, function and dispatch modes (``torch.device`` used as a context), saved-tensor hooks, its
      threads, matmul precision, ``torch.backends`` flags, print options, the rank's CUDA device. Put back, they would
      hide what the test built under them (a module-level tensor made in float64);
    - a DeepSpeed context entered and never left: ``deepspeed.zero.Init`` patches every ``torch.nn.Module`` class,
      the test's own included, for as long as it is entered;
    - threads and child processes still running, file locks held (``/proc/locks``): a fresh rank has none;
    - the interpreter's state: ``sys.stdin``/``stdout``/``stderr`` replaced (the plugin's own code writes to them),
      a trace or profile function, the import machinery, the recursion limit, signal handlers and timers, the garbage
      collector, the umask, the locale. (Its hooks are names of ``sys``: ``namespaces``.)
    """

    getters: dict[str, Callable[[], object]]
    values: dict[str, object]

    @classmethod
    def take(cls) -> ProcessState:
        getters = {**_interpreter(), **_deepspeed_contexts()}
        if "torch" in sys.modules:
            getters.update(_torch_modes(sys.modules["torch"]))
        return cls(getters, {what: _read(getter) for what, getter in getters.items()})

    def leftovers(self) -> list[str]:
        """What differs now, in words; threads, child processes and file locks, which a fresh rank has none of."""
        found = []
        for what, getter in self.getters.items():
            now, then = _read(getter), self.values[what]
            if not _same(now, then):
                values = f": {now!r}, forked with {then!r}" if len(repr(now)) + len(repr(then)) < 80 else ""
                found.append(f"{what} changed{values}")
        return found + _threads() + _children() + _locks()


def _same(now: object, then: object) -> bool:
    try:
        return bool(now == then)
    except Exception:  # noqa: BLE001 - an object that cannot say: changed
        return now is then
