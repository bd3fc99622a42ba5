"""Where a run will write, checked before it runs: a run is never lost at its end for a path it could not write.

Tried, never asked: permission bits do not tell root's view, an immutable directory and a read-only mount apart.
And where a run reads a path a user gave (a log, a config, results): a FIFO, a directory or a symbolic link loop is
refused before it is opened (``not_a_file``, ``read_text``), in one line.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path


def unwritable(directory: Path) -> str | None:
    """Why no file can be made in ``directory`` (created if missing), or None when one can."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):  # a file where a directory must be: name it ("File exists" would not)
        blocking = next((p for p in (directory, *directory.parents) if p.exists() and not p.is_dir()), directory)
        return f"{blocking} is not a directory"
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
    why = not_a_file(path) if os.path.lexists(path) else None
    if why is not None and ("FIFO" in why or "socket" in why or "loop" in why):  # opening a FIFO waits for a reader;
        return f"it is {why}"  # a device (/dev/null, /dev/full) is written as a file is
    if path.exists():
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND))
        except OSError as exc:
            return exc.strerror or str(exc)
        return None
    return unwritable(path.parent)


class NotAFile(OSError):
    """A path given to be read that is no regular file (a FIFO, a directory, a device, a symbolic link loop, ...):
    refused before it is opened, since opening a FIFO waits for a writer. Its message is one line."""

    def __str__(self) -> str:
        return str(self.strerror)


class NoFile(NotAFile, FileNotFoundError):
    """Nothing at a path given to be read: still a ``FileNotFoundError``, for a reader to whom absence is no error (a
    cache that misses)."""


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (a named pipe), not a file"),
    (stat.S_ISSOCK, "a socket, not a file"),
    (stat.S_ISCHR, "a character device, not a file"),
    (stat.S_ISBLK, "a block device, not a file"),
)


def _kind(mode: int, otherwise: str) -> str:
    return next((what for test, what in _KINDS if test(mode)), otherwise)


def _mode(path: Path, missing: str) -> int | str:
    """``path``'s file mode, or why it has none (``missing`` when nothing is there)."""
    try:
        return os.stat(path).st_mode
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "a symbolic link loop (too many levels of symbolic links)"
        return missing if exc.errno == errno.ENOENT else exc.strerror or str(exc)


NO_SUCH_FILE = "no such file"


def not_a_file(path: Path) -> str | None:
    """Why ``path`` cannot be read as a file (missing, a directory, a FIFO, a device, a symbolic link loop), found
    without opening it; None for a regular file (or a link to one)."""
    mode = _mode(path, NO_SUCH_FILE)
    if isinstance(mode, str):
        return mode
    return None if stat.S_ISREG(mode) else _kind(mode, "not a regular file")


def not_collectable(path: Path) -> str | None:
    """Why ``path`` is neither a file nor a directory to collect (missing, a FIFO, a device, a symbolic link loop);
    None for either (or a link to one)."""
    mode = _mode(path, "no such file or directory")
    if isinstance(mode, str):
        return mode
    return None if stat.S_ISREG(mode) or stat.S_ISDIR(mode) else _kind(mode, "not a regular file")


def not_a_directory(path: Path, *, missing_ok: bool = False) -> str | None:
    """Why ``path`` is no directory to use (a file, a FIFO, a symbolic link loop; missing unless ``missing_ok``),
    found without opening it; None for a directory (or a link to one)."""
    mode = _mode(path, "" if missing_ok else "no such directory")
    if isinstance(mode, str):
        return mode or None
    if stat.S_ISDIR(mode):
        return None
    what = _kind(mode, "a file")
    return f"{what.removesuffix(', not a file')}, not a directory"


def real(path: Path) -> Path:
    """``path`` absolute, its links resolved as far as they go: ``Path.resolve`` without its ``RuntimeError`` on a
    symbolic link loop (Python 3.11, 3.12)."""
    return Path(os.path.realpath(path))


def read_text(path: Path) -> str:
    """The text of the file at ``path``; ``NotAFile`` (an ``OSError``) naming what the path is where it is no
    regular file, before anything is opened (``NoFile``, also a ``FileNotFoundError``, where nothing is there)."""
    why = not_a_file(path)
    if why is not None:
        missing = why == NO_SUCH_FILE
        raise (NoFile if missing else NotAFile)(errno.ENOENT if missing else errno.EINVAL, why, str(path))
    return path.read_text()
