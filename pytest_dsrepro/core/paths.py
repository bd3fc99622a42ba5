"""Where a run will write, checked before it runs: a run is never lost at its end for a path it could not write.

Tried, never asked: permission bits do not tell root's view, an immutable directory and a read-only mount apart.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def unwritable(directory: Path) -> str | None:
    """Why no file can be made in ``directory`` (created if missing), or None when one can."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):  # a file where a directory must be: name it ("File exists" would not)
        return f"{next(p for p in (directory, *directory.parents) if p.is_file())} is not a directory"
    except OSError as exc:
        return exc.strerror or str(exc)
    try:
        fd, name = tempfile.mkstemp(prefix=".dsrepro-write-check-", dir=directory)
    except OSError as exc:
        return exc.strerror or str(exc)
    os.close(fd)
    os.unlink(name)
    return None


def unwritable_file(path: Path) -> str | None:
    """Why ``path`` cannot be written (made, or replaced where it exists), or None when it can. Nothing written."""
    if path.is_dir():
        return "it is a directory"
    if path.exists():
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND))
        except OSError as exc:
            return exc.strerror or str(exc)
        return None
    return unwritable(path.parent)
