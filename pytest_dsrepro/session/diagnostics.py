"""What a maintainer asks for besides the repro: DeepSpeed's own ``ds_report``, torch's environment summary, and the
accelerator DeepSpeed runs on. Gathered for ``--ds-report`` only, when the report is written (never at plugin load,
never for a plain run): each in a subprocess of this interpreter, both at once, so the pytest process itself still
imports neither torch nor DeepSpeed.

The subprocesses get DeepSpeed's accelerator as the run's worlds had it: ``DS_ACCELERATOR=cpu`` when there is no CUDA
device and the user chose no accelerator (as in every gloo world); on a GPU machine DeepSpeed's own choice, CUDA, as
in its NCCL worlds (``core.world_spec.accelerator_for``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping

from ..core.results import Environment
from ..core.text import strip_ansi
from ..core.world_spec import ds_accelerator

#: Seconds each may take (importing DeepSpeed and probing its ops takes ~3 s here; a cold machine more).
TIMEOUT = 180.0
ACCELERATOR_LINE = "dsrepro-accelerator:"
#: DeepSpeed's accelerator as the ranks get it, then ``ds_report`` exactly as its own command prints it.
DS_SCRIPT = f"""
import runpy, sys
from deepspeed.accelerator import get_accelerator
accelerator = get_accelerator()
print("{ACCELERATOR_LINE}", accelerator.device_name(), accelerator.communication_backend_name(), flush=True)
sys.argv = ["ds_report"]
runpy.run_module("deepspeed.env_report", run_name="__main__")
"""
TORCH_COMMAND = ("-W", "ignore::RuntimeWarning", "-m", "torch.utils.collect_env")  # not runpy's import warning


#: What the report says in place of the diagnostics of a run that was interrupted: gathering them takes seconds.
NOT_GATHERED = "(not gathered: the run was interrupted, and gathering this takes seconds that a cancelled job lacks)"


def rank_environment(cuda_devices: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment DeepSpeed sees in a rank: the fork server's choice of accelerator on a CPU machine."""
    env = dict(os.environ if base is None else base)
    chosen = ds_accelerator(env, cuda_devices)
    if chosen is not None:
        env["DS_ACCELERATOR"] = chosen
    return env


def _finish(proc: subprocess.Popen[str], what: str) -> str:
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        return f"({what} did not finish within {TIMEOUT:.0f} s)\n{strip_ansi(out or '')[-2000:]}"
    text = strip_ansi(out or "").rstrip()
    if proc.returncode:
        return f"({what} exited with {proc.returncode})\n{text[-4000:]}"
    return text


def _start(args: tuple[str, ...], env: Mapping[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(env)
    )


def split_accelerator(output: str) -> tuple[str | None, str]:
    """``(accelerator, ds_report's own output)`` from what ``DS_SCRIPT`` printed; ``cpu (ccl)``-style text."""
    lines = output.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(ACCELERATOR_LINE):
            name, _, backend = line.removeprefix(ACCELERATOR_LINE).strip().partition(" ")
            accelerator = f"{name} (communication backend {backend})" if backend else name
            return accelerator, "\n".join(lines[:i] + lines[i + 1 :]).strip()
    return None, output


@contextlib.contextmanager
def _blocked() -> Iterator[None]:
    """SIGINT and SIGTERM blocked (delivered at the end); what is started meanwhile inherits the mask, and ends or
    is killed."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


Started = tuple["subprocess.Popen[str] | None", "subprocess.Popen[str] | None"]


def start(environment: Environment, cuda_devices: int) -> Started:
    """The two diagnostics started: ``ds_report`` (where DeepSpeed is installed) and torch's ``collect_env``. The
    caller's signal handlers must not raise meanwhile: blocking the signals here holds them off this thread only, and
    a signal another thread takes (the process has one) runs the handler here all the same, inside ``Popen`` after
    the fork: a process that nothing could kill (CI's cancel under load left one)."""
    env = rank_environment(cuda_devices)
    with _blocked():
        ds = _start(("-c", DS_SCRIPT), env) if environment.deepspeed else None
        torch = _start(TORCH_COMMAND, env) if environment.torch else None
    return ds, torch


def stop(started: Started) -> None:
    """What is left of the diagnostics killed and reaped (abandoned by a signal, or already ended)."""
    with _blocked():
        for proc in started:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def gather(environment: Environment, started: Started) -> Environment:
    """``environment`` with ``ds_report``, torch's ``collect_env`` and the accelerator filled in (what failed says
    so in its place), from the diagnostics ``start`` started. Without DeepSpeed installed, only torch's summary. The
    caller stops them after (a signal abandons them)."""
    ds, torch = started
    torch_env = _finish(torch, "python -m torch.utils.collect_env") if torch else None
    accelerator, ds_report = (None, None)
    if ds is not None:
        accelerator, ds_report = split_accelerator(_finish(ds, "ds_report"))
    return dataclasses.replace(
        environment,
        accelerator=accelerator or environment.accelerator,
        ds_report=ds_report,
        torch_env=torch_env,
    )


def known_accelerator(cuda_devices: int) -> str | None:
    """The accelerator without asking DeepSpeed: the user's ``DS_ACCELERATOR``, or ``cpu`` where the fork server
    chooses it (no CUDA device); None when DeepSpeed detects it itself."""
    return ds_accelerator(os.environ, cuda_devices)
