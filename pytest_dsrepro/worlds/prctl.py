"""Runs in the fork server, the processes it forks, and a launched rank's pytest process: Linux's process controls
that tie a process's children to it (a child subreaper adopts what they leave; a child dies with its parent).
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


PR_SET_CHILD_SUBREAPER = 36


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library, loaded once: a forked rank calls what its fork server loaded, not a library of its own."""
    return ctypes.CDLL(None, use_errno=True)


def prctl(option: int, value: int) -> None:
    if sys.platform.startswith("linux"):
        _libc().prctl(option, value, 0, 0, 0)


def die_with_parent(parent: int, sig: int = signal.SIGKILL) -> None:
    prctl(PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)
