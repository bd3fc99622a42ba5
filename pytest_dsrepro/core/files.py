"""Files written whole or not at all: a reader (another process, a later run, ``dsrepro matrix``) never finds half
of one, and a full disk leaves the old file or none, never an empty one."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def write_atomically(path: Path, data: str | bytes, *, durable: bool = True) -> None:
    """``data`` into ``path``, through a file beside it renamed over it, with the mode a plain write would give it
    (the old file's, else the umask's); a device or pipe is written in place. Nothing is left behind on failure.

    ``durable=False``: a file only processes of this boot read, and soon (a rank's report, a flight-recorder dump):
    renamed whole without first waiting for the disk, which only a crash of the machine would need (milliseconds on
    a world's path, more on a busy disk).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode() if isinstance(data, str) else data
    if path.exists() and not path.is_file():
        path.write_bytes(raw)
        return
    temp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    # The kernel applies the umask to 0o666, as to a plain write: no os.umask() round trip, which another thread
    # (a rank's flight-recorder thread) could see half done.
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            if durable:
                f.flush()
                os.fsync(f.fileno())  # on disk before it replaces the old file: a full disk fails here, not later
        if path.exists():
            os.chmod(temp, path.stat().st_mode & 0o777)
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
