"""Runs in the fork server, and in its store process (``serve_store``, forked from it once): the TCPStore where every
world of the server meets.
"""

from __future__ import annotations

import functools
import socket
import sys
import time
from multiprocessing.connection import Connection
from typing import NoReturn

from ..workdir import LOOPBACK
from .spawning import fork_child

#: Connections the store's socket queues before it accepts them: every rank of the largest world at once.
STORE_BACKLOG = 4096


class Store:
    """The TCPStore every world of this server meets on, in one child process forked once (``serve_store``).

    Not in the server itself: a TCPStore serves from a thread of its own, and the server must hold none when it
    forks. Not one per world either: that costs a fork and a wait for its port in every world. Worlds keep apart
    under their own key prefixes, and DeepSpeed names its ``/dev/shm`` buffers after this port, which the server
    holds while it lives, so they are this server's (its worlds run one at a time and are reaped in between).
    """

    def __init__(self) -> None:
        self.pid: int | None = None
        self.port = 0

    def start(self, conn: Connection, server_pid: int) -> None:
        listener = socket.create_server((LOOPBACK, 0), backlog=STORE_BACKLOG)
        self.port = listener.getsockname()[1]
        try:
            self.pid = fork_child(conn, server_pid, functools.partial(serve_store, listener))
        finally:
            listener.close()

    def ended(self) -> None:
        """The store process was reaped: the next world starts a new one."""
        print("pytest-dsrepro fork server: the store process ended; the next world gets a new one", file=sys.stderr)
        self.pid = None


def serve_store(listener: socket.socket) -> NoReturn:
    """Host a TCPStore on ``listener`` until this process is killed (the fork server's store process).

    Every world of one fork server meets there under its own key prefix (``world_prefix``). The socket is bound
    before this process starts, to a loopback port the OS picked: ranks know the port at once and may connect before
    the store accepts (the kernel queues them); no port scanning, no bind-and-close race, nothing listening beyond
    this machine.
    """
    import torch.distributed as dist

    port = listener.getsockname()[1]
    store = dist.TCPStore(  # type: ignore[attr-defined]  # noqa: F841 - kept alive until the process is killed
        LOOPBACK, port, None, True, wait_for_workers=False, master_listen_fd=listener.detach()
    )
    while True:
        time.sleep(3600)
