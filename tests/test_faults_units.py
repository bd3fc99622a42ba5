"""Fault handling one level down (issue 11): pure functions and the world directory's readers, on plain data."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

from pytest_dsrepro.core.outcome import (
    OUTPUT_HEAD_BYTES,
    OUTPUT_TAIL_BYTES,
    RankResult,
    Status,
    WorldOutcome,
    bounded_output,
    describe_failure,
)
from pytest_dsrepro.worlds import workdir


def test_a_short_output_is_kept_whole() -> None:
    assert bounded_output(b"abc", b"", 3) == "abc"
    assert bounded_output(b"ab", b"cd", 4) == "abcd"


def test_a_long_output_keeps_head_and_tail_and_says_how_much_was_cut() -> None:
    text = bounded_output(b"first\n", b"\nlast", 1_000_000)
    assert text.splitlines() == [
        "first",
        "[... pytest-dsrepro cut 999,989 bytes of this rank's output (1,000,000 in all; the first 6 and the last 5 "
        "are kept) ...]",
        "",
        "last",
    ]


def test_reading_a_flood_reads_only_its_ends(tmp_path: Path) -> None:
    """Item 8: a 64 MiB output costs the pytest process a few KiB (a sparse file: nothing is really written)."""
    with open(workdir.output_file(tmp_path, 0), "wb") as f:
        f.write(b"BEGIN\n")
        f.truncate(64 * 2**20)
        f.seek(0, 2)
        f.write(b"\nEND\n")
    tracemalloc.start()
    try:
        text = workdir.read_output(tmp_path, 0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 256 * 1024, f"read {peak:,} bytes into memory"
    assert len(text.encode()) < OUTPUT_HEAD_BYTES + OUTPUT_TAIL_BYTES + 200
    assert text.startswith("BEGIN\n")
    assert text.rstrip().endswith("END")
    assert f"cut {64 * 2**20 + 5 - OUTPUT_HEAD_BYTES - OUTPUT_TAIL_BYTES:,} bytes" in text
    assert workdir.read_output(tmp_path, 1) == ""  # a rank that wrote nothing


def test_a_cut_output_shows_its_first_lines_the_cut_and_its_last_lines() -> None:
    output = bounded_output(
        "".join(f"head {i}\n" for i in range(40)).encode(), "".join(f"tail {i}\n" for i in range(40)).encode(), 10**8
    )
    outcome = WorldOutcome(2, "gloo", (RankResult(0, Status.CRASHED, detail="exit code 1", output=output),), 1.0)
    text = describe_failure(outcome).splitlines()
    at = text.index("---- rank 0: output (first 5 and last 25 lines of what was kept) ----")
    assert text[at + 1 : at + 6] == [f"head {i}" for i in range(5)]
    assert text[at + 6].startswith("[... pytest-dsrepro cut ")
    assert text[at + 7 :] == [f"tail {i}" for i in range(15, 40)]
