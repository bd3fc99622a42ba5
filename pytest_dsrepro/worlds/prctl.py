"""Runs in the fork server, the processes it forks, and a launched rank's pytest process: Linux's process controls
that tie a process's children to it (a child subreaper adopts what they leave; a child dies with its parent).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


PR_SET_CHILD_SUBREAPER = 36


def prctl(option: int, value: int) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def die_with_parent(parent: int, sig: int = signal.SIGKILL) -> None:
    prctl(PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)
