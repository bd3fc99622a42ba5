"""The one helper per chore (core/text, core/files, core/git), on the inputs their callers meet."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from pytest_dsrepro.core.files import write_atomically
from pytest_dsrepro.core.git import GitError, git
from pytest_dsrepro.core.text import aligned, cut, markdown_cell, markdown_table, strip_ansi


def test_strip_ansi_takes_colours_and_their_pasted_leftovers() -> None:
    assert strip_ansi("\x1b[1;31mFAILED\x1b[0m ok \x1b]0;title\x07x") == "FAILED ok x"
    assert strip_ansi("[31mKeyError: 2[0m") == "KeyError: 2"  # the escape character lost in a paste


def test_aligned_pads_all_but_the_last_column_and_cuts() -> None:
    assert aligned([["a", "bb", "last one"], ["ccc", "d", ""]]) == ["a    bb  last one", "ccc  d"]
    assert aligned([["id", "x" * 20]], width=10) == ["id  xxx..."]
    assert cut("abcdef", None) == "abcdef"


def test_markdown_cells_stay_on_one_line() -> None:
    assert markdown_cell("a | b\n c") == "a \\| b c"
    assert markdown_cell("") == "-"
    assert markdown_table(["bug", "verdict"], [["`x`", "AFFECTED"]]) == [
        "| bug | verdict |",
        "| --- | --- |",
        "| `x` | AFFECTED |",
    ]


def test_write_atomically_keeps_the_mode_and_leaves_nothing_on_failure(tmp_path: Path) -> None:
    target = tmp_path / "out" / "results.json"
    write_atomically(target, "one")
    assert target.read_text() == "one"
    target.chmod(0o640)
    write_atomically(target, b"two")
    assert target.read_bytes() == b"two"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640

    class Full(OSError):
        pass

    def no_space(fd: int) -> None:
        raise Full(28, "No space left on device")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "fsync", no_space)
        with pytest.raises(Full):
            write_atomically(target, "three")
    assert target.read_text() == "two"  # the old file stands, whole
    assert sorted(p.name for p in target.parent.iterdir()) == ["results.json"]


def test_git_names_the_command_and_gits_complaint(tmp_path: Path) -> None:
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    assert git(tmp_path, "rev-parse", "--is-inside-work-tree").strip() == "true"
    with pytest.raises(GitError, match=r"git rev-parse HEAD in .*: .*HEAD"):
        git(tmp_path, "rev-parse", "HEAD")
    with pytest.raises(GitError, match="git status"):
        git(tmp_path / "missing", "status")
