"""Files written whole or not at all: a reader (another process, a later run, ``dsrepro matrix``) never finds half
of one, and a full disk leaves the old file or none, never an empty one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomically(path: Path, data: str | bytes) -> None:
    """``data`` into ``path``, through a file beside it renamed over it, with the mode a plain write would give it
    (the old file's, else the umask's); a device or pipe is written in place. Nothing is left behind on failure."""
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode() if isinstance(data, str) else data
    if path.exists() and not path.is_file():
        path.write_bytes(raw)
        return
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o666 & ~_umask()
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())  # on disk before it replaces the old file: a full disk fails here, not later
        os.chmod(temp, mode)  # mkstemp's file is private
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
