"""git, run one way: in a directory, with no optional locks (nothing written into a user's clone just by reading
it), C messages, and git's own complaint (its ``fatal:`` line) in the error."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


class GitError(Exception):
    """git failed, could not run, or took too long; the message says which command and why."""


def git_bytes(cwd: Path | None, *args: str, data: bytes | None = None, timeout: float | None = None) -> bytes:
    """git's output for ``args``, run in ``cwd`` (None: here)."""
    where = ["-C", str(cwd)] if cwd is not None else []
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0", "LC_ALL": "C"}
    command = f"git {' '.join(args[:3])}" + (f" in {cwd}" if cwd is not None else "")
    try:
        proc = subprocess.run(
            ["git", *where, *args], input=data, capture_output=True, env=env, timeout=timeout, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise GitError(f"{command}: {exc}") from None
    if proc.returncode != 0:
        said = proc.stderr.decode(errors="replace").strip().splitlines()
        why = next((line for line in said if line.startswith(("fatal:", "error:"))), said[-1] if said else "")
        raise GitError(f"{command}: {why or f'exit {proc.returncode}'}")
    return proc.stdout


def git(cwd: Path | None, *args: str, data: bytes | None = None, timeout: float | None = None) -> str:
    """git's output for ``args`` as text, run in ``cwd`` (None: here)."""
    return git_bytes(cwd, *args, data=data, timeout=timeout).decode(errors="replace")
