"""What a ``dsrepro`` argument that takes a path or a number accepts, checked as it is parsed: one place for every
command, so that a FIFO, a directory, a symbolic link loop, a number of 5000 digits or ``nan`` is one line and exit 2
(``cli``'s parser) before anything runs, never a wait, a traceback or an hour's work lost at its end.

Each is an argparse ``type=``: it returns the value, or raises ``ArgumentTypeError`` naming the value and what is
wrong with it; the parser names the argument.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from packaging.version import Version

from ..core import options, paths
from ..core.escape import terminal
from ..core.json_input import MAX_DIGITS
from ..core.text import cut

#: The longest revision ``bisect --good`` takes: a commit's 40 hex digits, a tag, ``HEAD~12^2``; never a page.
MAX_REVISION = 200


def shown(text: str) -> str:
    """A value as a message quotes it: cut to a line, its control characters shown."""
    return terminal(cut(text, 60))


def count(text: str) -> int:
    """A whole number >= 1 (``--top``, ``--world-size``, ``--limit``, ``--shards``)."""
    try:
        return options.whole_number(int(text) if len(text.strip()) <= MAX_DIGITS else None)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{shown(text)!r}: must be a whole number >= 1") from None


def seconds(text: str) -> float:
    """A finite number of seconds > 0 (``--timeout``): never ``nan``, ``inf`` or ``1e999``."""
    try:
        return options.seconds(float(text) if len(text.strip()) <= MAX_DIGITS else None)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{shown(text)!r}: must be a number of seconds > 0") from None


def release(text: str) -> str:
    """A DeepSpeed release version (``--release``): what ``packaging`` reads, never thousands of digits."""
    try:
        Version(text)
    except ValueError:  # InvalidVersion, or a part of 4300 digits or more (int())
        raise argparse.ArgumentTypeError(f"{shown(text)!r} is not a version such as 0.18.3") from None
    return text


def revision(text: str) -> str:
    """A release, or with ``--repo`` any revision of the clone (``bisect --good``): a line of a sensible length."""
    if len(text) > MAX_REVISION or terminal(text) != text or not text.strip():
        raise argparse.ArgumentTypeError(f"{shown(text)!r}: not a release version or a revision of a clone")
    return text


def _checked(text: str, why: str | None) -> Path:
    """``text`` as a path, or ``ArgumentTypeError`` saying ``why`` it is no path to use."""
    if why is not None:
        raise argparse.ArgumentTypeError(f"{shown(text)}: {why}")
    return Path(text)


def input_file(text: str) -> Path:
    """A file to be read: one that exists and is a regular file (or a link to one); never opened here."""
    return _checked(text, paths.not_a_file(Path(text)))


def directory(text: str) -> Path:
    """A directory to be read (a clone, a checkout, a catalogue): one that exists."""
    return _checked(text, paths.not_a_directory(Path(text)))


def file_or_directory(text: str) -> str:
    """A file or a directory to be collected (``dsrepro list``), or a node id in a file: never a FIFO, which pytest
    would wait on."""
    _checked(text, paths.not_collectable(Path(text.split("::", 1)[0])))
    return text


def output_directory(text: str) -> Path:
    """A directory to be written into, made where missing: nothing else (a file, a FIFO, a loop) in its place."""
    return _checked(text, paths.not_a_directory(Path(text), missing_ok=True))


def output_file(text: str) -> Path:
    """A file to be written: tried now (``paths.unwritable_file``), not found unwritable after the work is done."""
    why = paths.unwritable_file(Path(text))
    return _checked(text, None if why is None else f"cannot be written ({why})")
