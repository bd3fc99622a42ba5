"""Children of the ``dsrepro`` command (uv, a probe's pytest) that never outlive it.

A child is run to its end, or stopped the way Ctrl-C stops it, with everything it started: on a timeout, or on an
exception in this process (Ctrl-C), it gets SIGINT (pytest then ends its worlds and its fork server, uv its build),
``grace`` seconds to finish, then SIGKILL; whatever it had started that is still there then is killed too
(``psutil``: the process tree as it was when stopping began). Output goes to a file, never to a pipe that nobody
reads while the child is being stopped.
"""

from __future__ import annotations

import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import psutil

#: How long a stopped child has to end after SIGINT (pytest stops its fork server within 10 s), and then its own
#: children after it.
GRACE = 30.0
#: After Ctrl-C at a terminal the child got SIGINT too: it is given this long before it is sent one.
ALREADY_TOLD = 5.0


@dataclass(frozen=True)
class Ended:
    """How a child ended: its exit code (negative: the signal that ended it), its output, whether it was stopped
    at the timeout, and how long it ran."""

    returncode: int
    output: str
    timed_out: bool
    seconds: float


def run(
    command: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float | None = None,
    output: Path | None = None,
    grace: float = GRACE,
) -> Ended:
    """Run ``command`` to its end or to ``timeout`` (then stopped, ``timed_out``), stdout and stderr together in
    ``output`` (a temporary file when None). An exception here (KeyboardInterrupt) stops the child, then goes on."""
    started = time.monotonic()
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
    with output.open("w+") if output is not None else tempfile.TemporaryFile("w+") as sink:
        child = psutil.Popen(
            list(command), stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT,
            env=None if env is None else dict(env), cwd=cwd,
        )  # fmt: skip
        timed_out = False
        try:
            child.wait(timeout)
        except psutil.TimeoutExpired:
            timed_out = True
            stop(child, grace, told=False)
        except BaseException:
            with shielded():
                stop(child, grace, told=True)
            raise
        sink.seek(0)
        text = sink.read()
    return Ended(_code(child), text, timed_out, time.monotonic() - started)


def to_terminal(command: Sequence[str], *, cwd: Path, env: Mapping[str, str] | None = None) -> int:
    """Run ``command`` to its end, its output on this process's terminal, the user's to watch; its exit code. On an
    exception here (Ctrl-C, SIGTERM under ``interrupting``) it is stopped as ``stop`` stops a child: a pytest first
    prints its summary and writes its results, then the exception goes on."""
    child = psutil.Popen(
        list(command), cwd=cwd, env=None if env is None else dict(env), stdin=subprocess.DEVNULL
    )  # fmt: skip
    try:
        return int(child.wait())
    except BaseException:
        with shielded():
            stop(child, told=True)
        raise


def _code(child: psutil.Popen) -> int:
    code = child.returncode
    return -1 if code is None else int(code)


def stop(child: psutil.Process, grace: float = GRACE, *, told: bool) -> None:
    """End ``child`` as Ctrl-C would, then whatever it started. ``told``: it may have had SIGINT already (Ctrl-C at
    a terminal reaches the whole foreground process group), so it is given a moment before it is sent one."""
    try:
        family = child.children(recursive=True)
    except psutil.Error:
        family = []
    deadline = time.monotonic() + grace
    if not (told and _ended(child, min(ALREADY_TOLD, grace))):
        with suppress(psutil.Error):
            child.send_signal(signal.SIGINT)
        if not _ended(child, max(deadline - time.monotonic(), 0.1)):
            with suppress(psutil.Error):
                child.kill()
            _ended(child, 5.0)
    _, alive = psutil.wait_procs(family, timeout=max(deadline - time.monotonic(), 1.0))
    for survivor in alive:
        with suppress(psutil.Error):
            survivor.kill()
    psutil.wait_procs(alive, timeout=5.0)


def _ended(process: psutil.Process, timeout: float) -> bool:
    try:
        process.wait(timeout)
    except psutil.TimeoutExpired:
        return False
    except psutil.Error:
        pass
    return True


@contextmanager
def interrupting(signum: int) -> Iterator[None]:
    """While inside, ``signum`` raises KeyboardInterrupt where this thread is, as Ctrl-C does: a long unattended
    job is stopped with SIGTERM (a scheduler, ``kill``; a shell's background job ignores SIGINT) as often as with
    Ctrl-C, and unwinds the same way. Call from the main thread."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signum, interrupt)
    try:
        yield
    finally:
        signal.signal(signum, previous)


@contextmanager
def shielded() -> Iterator[None]:
    """While inside, Ctrl-C (and SIGTERM) wait: what cleans up after a first one (a child stopped, a half-made
    environment removed) is never cut short by a second, which is raised as KeyboardInterrupt once it is done.
    Outside the main thread (where no signal handler can be set), nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: came.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if came:
        raise KeyboardInterrupt
