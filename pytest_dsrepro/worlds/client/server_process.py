"""Runs in the pytest process: the fork server as a child process, started in its own session, spoken to over one
socket, and stopped so that it cleans up after its worlds.

Only the transport lives here: what the messages mean is ``fork_server``'s, the one loop that reads them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import site
import socket
import subprocess
import sys
import tempfile
from multiprocessing.connection import Connection
from pathlib import Path

from ...core.errors import HarnessError
from ...core.options import CACHE_ENV
from ...core.outcome import describe_exit
from ..protocol import SCOUT_ARGUMENT, SERVER_MESSAGES, ClientMessage, ServerMessage
from .gpu_probe import Gpu, server_environment

#: After pytest asks the fork server to stop (SIGTERM), how long it gets to clean up before its whole process group
#: is killed.
STOP_WAIT = 10.0


#: How long a server whose socket closed gets to finish dying, so that its exit status can be told.
EXIT_WAIT = 5.0


#: The fork server's module, run as ``python -m``.
SERVER_MODULE = "pytest_dsrepro.worlds.server"


class ServerGone(HarnessError):
    """The fork server's socket closed: it died (or was never running). ``ending`` says how, when it is known."""

    def __init__(self, ending: str, log: str) -> None:
        super().__init__(f"the pytest-dsrepro fork server is gone ({ending}); {told_log(log)}")
        self.ending = ending
        self.log = log


def told_log(log: str) -> str:
    """The server's log in a message: its tail, or that it is empty (never a colon with nothing after it)."""
    return f"its log:\n{log}" if log.strip() else "its log is empty"


def server_pythonpath(package_root: str, pythonpath: str | None, site_dirs: list[str]) -> str | None:
    """The fork server's ``PYTHONPATH``: this plugin must import there, and nothing may shadow what pytest imports.

    A source checkout's root is added *after* the caller's entries; an installed plugin's root is a site directory,
    already on the server's path: adding it would put the whole environment ahead of ``PYTHONPATH=<release dir>``.
    """
    entries = [p for p in (pythonpath or "").split(os.pathsep) if p]
    real = {os.path.realpath(p) for p in (*entries, *site_dirs)}
    if os.path.realpath(package_root) not in real:
        entries.append(package_root)
    return os.pathsep.join(entries) or None


class ServerProcess:
    """The fork server's process, its socket and its log. ``accelerator``: DeepSpeed's in its ranks
    (``DS_ACCELERATOR``, unless the user set it); ``gpus``: the machine's, as the pytest process found them."""

    def __init__(self, cache_dir: Path, accelerator: str, gpus: tuple[Gpu, ...]) -> None:
        self.cache_dir = cache_dir
        self.accelerator = accelerator
        self.gpus = gpus
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._log: Path | None = None
        self.environ: dict[str, str] = {}  # the pytest process's environment when the server started: its baseline

    @property
    def started(self) -> bool:
        return self._proc is not None

    def _environment(self) -> dict[str, str]:
        env = dict(os.environ)
        package_root = str(Path(__file__).resolve().parents[3])  # the directory holding pytest_dsrepro/
        path = server_pythonpath(package_root, env.get("PYTHONPATH"), site.getsitepackages())
        if path:
            env["PYTHONPATH"] = path
        env[CACHE_ENV] = str(self.cache_dir)
        return server_environment(env, self.accelerator, self.gpus)

    def launch(self, deepspeed: bool) -> None:
        """Start the server; ``deepspeed``: its first world uses DeepSpeed (``SCOUT_ARGUMENT``)."""
        ours, theirs = socket.socketpair()
        fd, log = tempfile.mkstemp(prefix="dsrepro-server-", suffix=".log")
        self._log = Path(log)
        self.environ = dict(os.environ)
        try:
            command = [sys.executable, "-P", "-m", SERVER_MODULE, str(theirs.fileno()), str(os.getpid()), log]
            self._proc = subprocess.Popen(
                [*command, *([SCOUT_ARGUMENT] if deepspeed else [])],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=fd,
                stderr=subprocess.STDOUT,
                env=self._environment(),
                start_new_session=True,  # out of the terminal's process group: Ctrl-C is pytest's to handle
            )
        finally:
            os.close(fd)
            theirs.close()
        self._conn = Connection(ours.detach())

    def log_tail(self, lines: int = 30) -> str:
        if self._log is None or not self._log.exists():
            return ""
        return "\n".join(self._log.read_text(errors="replace").splitlines()[-lines:])

    def send(self, message: ClientMessage) -> None:
        """``ServerGone`` when the server is not running or died."""
        if self._conn is None:
            raise ServerGone("not running", self.log_tail())
        try:
            self._conn.send(message)
        except OSError:
            raise self._lost() from None

    def receive(self, timeout: float) -> ServerMessage | None:
        """The next message, or None when none came within ``timeout``; ``ServerGone`` as soon as the server is gone
        (end of file on its socket), never a busy wait on a closed socket."""
        if self._conn is None:
            raise ServerGone("not running", self.log_tail())
        try:
            if not self._conn.poll(max(timeout, 0.0)):
                return None
            message = self._conn.recv()
        except (EOFError, OSError):
            raise self._lost() from None
        if not isinstance(message, SERVER_MESSAGES):
            raise HarnessError(f"the pytest-dsrepro fork server sent an unknown message: {message!r}")
        return message

    def _lost(self) -> ServerGone:
        """The socket closed under us: give the server a moment to finish dying, then say how it ended."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        ending = "its socket closed"
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                ending = describe_exit(self._proc.wait(timeout=EXIT_WAIT))
        return ServerGone(ending, self.log_tail())

    @property
    def alive(self) -> bool:
        return self._conn is not None and self._proc is not None and self._proc.poll() is None

    def stop(self) -> None:
        """End of file and SIGTERM: the server kills its worlds (or a comm-op build in progress: the compilers, and
        torch's build lock goes with the unwound build), discards their directories and exits. Only a server that
        is still there after ``STOP_WAIT`` is killed, with its whole process group (it leads its own session)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.terminate()
                try:
                    self._proc.wait(timeout=STOP_WAIT)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self._proc.pid, signal.SIGKILL)  # unreaped, so the group id is still its own
                    self._proc.wait()
            self._proc = None

    def remove_log(self) -> None:
        if self._log is not None:
            self._log.unlink(missing_ok=True)
