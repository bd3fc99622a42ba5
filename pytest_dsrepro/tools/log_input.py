"""A log as a user gives it (a file, or ``-`` for standard input), read within limits: its first ``HEAD_BYTES`` and last
``TAIL_BYTES`` only, so a 200 MB log answers as fast as a short one; an empty or binary file is said in one line.

What ``dsrepro triage`` ranks the catalogue against, and what ``dsrepro new --from-log`` prefills a repro from.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ..core.paths import not_a_file
from ..triage import logread

#: The parts of a log that are read: its start (where versions and configs are printed) and its end (the error).
HEAD_BYTES, TAIL_BYTES = 1 << 20, 4 << 20
#: How much of the start decides whether the input is text.
SNIFF_BYTES = 8192


class LogError(Exception):
    """The log cannot be read (missing, a directory, empty, binary): one line."""


@dataclass(frozen=True)
class LogText:
    """A log as read: its text (head and tail when it was cut), its size in bytes, whether its middle was left."""

    name: str
    text: str
    size: int
    cut: bool = False

    @property
    def described(self) -> str:
        if self.cut:
            return (f"{self.name}: {_bytes(self.size)}, its first {_bytes(HEAD_BYTES)} and last {_bytes(TAIL_BYTES)} "
                    "read")  # fmt: skip
        return f"{self.name}: {_bytes(self.size)}"


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}".replace(".0 ", " ")
    return f"{n} bytes"


def _windows(stream: BinaryIO) -> tuple[bytes, bytes, int]:
    """A stream's first ``HEAD_BYTES`` and last ``TAIL_BYTES`` (empty when the head holds it all), and its size."""
    head = stream.read(HEAD_BYTES)
    tail = bytearray()
    size = len(head)
    while chunk := stream.read(1 << 20):
        size += len(chunk)
        tail += chunk
        del tail[: max(0, len(tail) - TAIL_BYTES)]
    return head, bytes(tail), size


def _binary(sample: bytes) -> bool:
    """NUL bytes, or more than a tenth of control characters that no log prints (ANSI's escape is allowed)."""
    if b"\0" in sample:
        return True
    controls = sum(1 for b in sample if b < 32 and b not in (9, 10, 12, 13, 27, 8))
    return controls > len(sample) // 10


def read_log(source: str, stdin: BinaryIO | None = None) -> LogText:
    """The log at ``source`` (``-``: standard input), within ``HEAD_BYTES`` + ``TAIL_BYTES``; ``LogError`` names
    the file and what is wrong with it (missing, a directory, empty, binary; standard input closed)."""
    name = "standard input" if source == "-" else source
    if source == "-" and stdin is None and sys.stdin is None:  # started with standard input closed (``<&-``)
        raise LogError("standard input is closed; pipe the log into it, or give the log's file")
    try:
        if source == "-":
            head, tail, size = _windows(stdin or sys.stdin.buffer)
        elif (why := not_a_file(Path(source))) not in (None, "no such file"):
            pipe = "; pipe it into standard input instead: dsrepro triage - < FILE" if "FIFO" in why else ""
            raise LogError(f"{name}: {why}{pipe}")
        else:
            with Path(source).open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                head = f.read(HEAD_BYTES)
                if size > HEAD_BYTES + TAIL_BYTES:
                    f.seek(size - TAIL_BYTES)
                tail = f.read(TAIL_BYTES)
    except OSError as exc:
        raise LogError(f"{name}: cannot be read ({exc.strerror or exc})") from None
    if not (head + tail).strip():
        raise LogError(f"{name}: empty; give the log, traceback or issue text that shows the error")
    if _binary(head[:SNIFF_BYTES]):
        raise LogError(f"{name}: binary, not a log (control bytes in its first {_bytes(SNIFF_BYTES)}); give the "
                       "text of the error")  # fmt: skip
    cut = size > len(head) + len(tail)
    if cut:  # whole lines where there are lines, and a line that says what is missing
        head = head[: head.rfind(b"\n") + 1] or head
        tail = tail[tail.find(b"\n") + 1 :] or tail
        skipped = f"\n[... dsrepro triage did not read {_bytes(size - len(head) - len(tail))} here ...]\n"
        data = head + skipped.encode() + tail
    else:
        data = head + tail
    return LogText(name, data.decode("utf-8", errors="replace"), size, cut)


def reading(source: str) -> logread.Reading:
    """The log at ``source`` read (``read_log``'s limits), for what else starts from a log (``dsrepro new``)."""
    return logread.read(read_log(source).text)
