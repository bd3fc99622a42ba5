"""``dsrepro matrix`` as a user runs it (a process of its own, its exit code, what it prints), with the faults it
must survive injected: outputs that cannot be written, a disk that fills while writing, damaged results files, a
reader that goes away; and the results of a CI matrix (shards x releases) merged into one table."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from matrix_records import EPI, EPILOGUE, FIXED, STOCK, rec, write

from pytest_dsrepro.core import results
from pytest_dsrepro.tools.matrix_command import Exit

OUTPUTS = ("matrix.md", "matrix.html", "matrix.svg")


def dsrepro_matrix(*args: str | Path, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest_dsrepro.tools.cli", "matrix", *map(str, args)],
                          capture_output=True, text=True, timeout=60, **kwargs)  # type: ignore[call-overload]  # fmt: skip


@pytest.fixture
def results_dir(tmp_path: Path) -> Path:
    d = tmp_path / "results"
    write(d, "0.16.3", [rec(STOCK, "REPRODUCED", outcome="xfailed"), rec(FIXED, "PASSES-WITH-FIX", variant="fixed")])
    write(d, "0.16.4", [rec(STOCK, "FIXED"), rec(FIXED, "PASSES-WITH-FIX", variant="fixed")])
    return d


def _writable(directory: Path) -> bool:
    try:
        (directory / ".probe").touch()
    except OSError:
        return False
    (directory / ".probe").unlink()
    return True


@pytest.fixture
def read_only() -> Iterator[Callable[[Path], Path]]:
    """Makes a directory read-only: by its mode, and where that does not stop this user (root), by the immutable
    attribute, undone afterwards."""
    made: list[Path] = []

    def make(directory: Path) -> Path:
        directory.chmod(0o555)
        made.append(directory)
        if _writable(directory) and shutil.which("chattr"):
            subprocess.run(["chattr", "+i", str(directory)], capture_output=True, check=False)
        if _writable(directory):
            pytest.skip(f"cannot make {directory} read-only as this user (no mode or attribute stops it)")
        return directory

    yield make
    for directory in made:
        if shutil.which("chattr"):
            subprocess.run(["chattr", "-i", str(directory)], capture_output=True, check=False)
        directory.chmod(0o755)


def test_a_read_only_results_directory_is_told_at_once_and_nothing_is_done(
    results_dir: Path, read_only: Callable[[Path], Path], tmp_path: Path
) -> None:
    """Downloaded CI artifacts are often read-only: the default outputs beside them cannot be written. That is said
    before anything is read or printed, with its own exit code and where to write instead; --out works."""
    read_only(results_dir)
    start = time.monotonic()
    run = dsrepro_matrix(results_dir)
    assert time.monotonic() - start < 30
    assert run.returncode == Exit.NOT_SAVED == 3, run.stderr
    assert run.stdout == ""  # nothing rendered
    lines = run.stderr.splitlines()
    assert [ln.rsplit(": ", 1)[0] for ln in lines[:3]] == [
        f"dsrepro matrix: cannot write {results_dir / n}" for n in OUTPUTS
    ]
    assert all(
        ln.endswith(("Permission denied", "Read-only file system", "Operation not permitted")) for ln in lines[:3]
    )
    assert lines[3] == ("dsrepro matrix: nothing was read or written; choose where the files go with --out DIR (or "
                        "--markdown, --html, --svg), or print only with --no-write")  # fmt: skip
    assert "Traceback" not in run.stderr
    assert sorted(p.name for p in results_dir.iterdir()) == sorted(p.name for p in results_dir.glob("*.json"))
    elsewhere = dsrepro_matrix(results_dir, "--out", tmp_path / "out")
    assert elsewhere.returncode == 0, elsewhere.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(OUTPUTS)


def test_an_output_below_a_file_is_told_before_anything_is_read(results_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    run = dsrepro_matrix(results_dir, "--html", tmp_path / "file" / "page.html")
    assert run.returncode == Exit.NOT_SAVED, run.stderr
    assert (
        f"dsrepro matrix: cannot write {tmp_path / 'file' / 'page.html'}: {tmp_path / 'file'} is not a directory"
        in (run.stderr)
    )
    assert not (results_dir / "matrix.md").exists()  # the others were not written either: nothing was done


def test_an_output_that_fails_while_written_is_named_and_the_rest_is_saved(results_dir: Path) -> None:
    """A full disk after the check: the table is printed, the other files are written, the one lost is named."""
    run = dsrepro_matrix(results_dir, "--html", "/dev/full")
    assert run.returncode == Exit.NOT_SAVED, run.stderr
    assert run.stderr == "dsrepro matrix: /dev/full not saved: No space left on device\n"
    assert "DeepSpeed repro matrix: 1 bug in 1 row x 2 DeepSpeed releases" in run.stdout
    assert f"wrote {results_dir / 'matrix.md'}" in run.stdout
    assert (results_dir / "matrix.svg").read_text().startswith("<svg")


def _small_files() -> None:
    """In the child: files of at most 500 bytes, and EFBIG (not a signal) beyond: a disk that fills up."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (500, 500))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def test_a_file_cut_short_while_written_leaves_the_old_one_whole(results_dir: Path) -> None:
    old = "# the matrix of yesterday\n"
    (results_dir / "matrix.md").write_text(old)
    run = dsrepro_matrix(results_dir, preexec_fn=_small_files, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert run.returncode == Exit.NOT_SAVED, run.stderr
    assert [ln.split(" not saved: ")[0] for ln in run.stderr.splitlines()] == [
        f"dsrepro matrix: {results_dir / n}" for n in OUTPUTS]  # fmt: skip
    assert "File too large" in run.stderr
    assert (results_dir / "matrix.md").read_text() == old  # written beside it and renamed, or not at all
    assert sorted(p.name for p in results_dir.iterdir() if not p.name.endswith(".json")) == ["matrix.md"]


def test_damaged_results_files_are_named_with_what_to_do_and_fail_the_run(results_dir: Path) -> None:
    """A file cut short, and one from a newer pytest-dsrepro: each named with what to do, their releases kept as
    columns that say so, exit 4 (over UNEXPECTED's 1: the matrix is incomplete)."""
    cut = write(results_dir, "0.17.0", [rec(STOCK, "FIXED")], name="results-deepspeed-0.17.0-0badf00d.json")
    cut.write_text(cut.read_text()[:100])
    newer = write(results_dir, "0.18.0", [rec(STOCK, "FIXED")])
    data = json.loads(newer.read_text())
    data.update(schema=results.SCHEMA + 1)
    data["environment"]["plugin"] = "2.0.0"
    newer.write_text(json.dumps(data))
    write(results_dir, "0.16.4", [rec(EPI, "UNEXPECTED", repro=EPILOGUE, outcome="failed", error="boom")])
    run = dsrepro_matrix(results_dir, "--no-write")
    assert run.returncode == Exit.UNREADABLE == 4, run.stderr
    out = " ".join(run.stdout.split())
    assert (f"Results files that could not be read (the matrix lacks them): {cut}: not valid JSON (") in out
    assert "cut short by an interrupted run, a full disk or a partial copy? Run its tests again, or delete it " \
           "(release 0.17.0)" in out  # fmt: skip
    assert f"{newer}: schema {results.SCHEMA + 1}: written by a newer pytest-dsrepro (2.0.0); this one reads " \
           f"results files of schema 5 to {results.SCHEMA}: upgrade pytest-dsrepro to read it (release 0.18.0)" in out  # fmt: skip
    assert "0.17 0.18" in run.stdout  # their columns are there, saying so
    assert "??" in run.stdout
    assert run.stderr == ("dsrepro matrix: 2 results files could not be read (listed above): the matrix lacks what "
                          "they hold\n")  # fmt: skip


def test_a_json_file_that_is_no_results_file_is_left_out_and_said(results_dir: Path) -> None:
    """Named, and not held against the run; a directory of many (a checkout's, a virtualenv's) is counted."""
    (results_dir / "package.json").write_text('{"name": "x"}')
    run = dsrepro_matrix(results_dir, "--no-write")
    assert run.returncode == 0, run.stderr
    said = f"Left out: {results_dir / 'package.json'}: not a pytest-dsrepro results file (no 'schema')"
    assert said in " ".join(run.stdout.split())
    for i in range(30):
        (results_dir / "node_modules" / f"p{i}").mkdir(parents=True)
        (results_dir / "node_modules" / f"p{i}" / "package.json").write_text("{}")
    run = dsrepro_matrix(results_dir, "--no-write")
    assert run.returncode == 0, run.stderr
    left_out = " ".join(run.stdout.split("Left out:")[1].split())
    assert left_out.count("not a pytest-dsrepro results file (no 'schema')") == 5  # five named, the rest counted
    assert "26 more JSON files: no pytest-dsrepro results files either" in run.stdout


def test_a_ci_matrix_of_shards_and_releases_merges_into_one_table(tmp_path: Path) -> None:
    """Each CI job (a release, a --ds-shard slice of its tests) uploads its own results directory; the matrix reads
    them all: one column per release, both halves of every cell, the outputs where --out says."""
    artifacts = tmp_path / "artifacts"
    for version, stock in (("0.16.3", "REPRODUCED"), ("0.16.4", "FIXED")):
        write(artifacts / f"ds{version}-shard-1-of-2", version, [rec(STOCK, stock)])
        write(artifacts / f"ds{version}-shard-2-of-2", version, [rec(FIXED, "PASSES-WITH-FIX", variant="fixed"),
                                                                 rec(EPI, "REPRODUCED", repro=EPILOGUE)])  # fmt: skip
    shards = sorted(artifacts.iterdir())
    run = dsrepro_matrix(*shards, shards[0] / next(shards[0].glob("*.json")).name, "--out", tmp_path / "out")
    assert run.returncode == 0, run.stderr
    assert "2 bugs in 2 rows x 2 DeepSpeed releases: 3 REPRODUCED, 1 FIXED, 2 PASSES-WITH-FIX" in " ".join(
        run.stdout.split()
    )
    assert "  zero3      [●✓]○✓" in run.stdout
    assert "0.16.3: 2 results files (per test, the newest file that ran it)" in run.stdout
    assert "disagree" not in run.stdout  # a file given twice is read once
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(OUTPUTS)
    md = (tmp_path / "out" / "matrix.md").read_text()
    assert "| [●✓] | ○✓ |" in md
    assert "![the matrix as an image](matrix.svg)" in md


def test_a_reader_that_goes_away_stops_the_printing_not_the_files(results_dir: Path) -> None:
    """``dsrepro matrix | head -3``: no traceback, and the files are written."""
    cli = [sys.executable, "-m", "pytest_dsrepro.tools.cli", "matrix", str(results_dir)]
    with subprocess.Popen(cli, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        assert proc.stdout is not None
        assert proc.stderr is not None
        proc.stdout.readline()
        proc.stdout.close()
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=60) == 0, err
    assert "Traceback" not in err
    assert all((results_dir / n).is_file() for n in OUTPUTS)


def test_the_exit_codes_are_in_the_help() -> None:
    run = subprocess.run([sys.executable, "-m", "pytest_dsrepro.tools.cli", "matrix", "--help"], capture_output=True,
                         text=True, check=True)  # fmt: skip
    assert ("Exit codes: 0 as declared, 1 an UNEXPECTED run, 2 usage, 3 an output not saved, 4 results files that "
            "could not be read.") in " ".join(run.stdout.split())  # fmt: skip


def test_the_observed_matrix_is_one_command(results_dir: Path, tmp_path: Path) -> None:
    """What docs/matrix.md gives for regenerating docs/matrix-observed.md: the three files under one name, the page
    saying when, where and how long, the Markdown showing its image."""
    run = dsrepro_matrix(results_dir, "--out", tmp_path / "docs", "--name", "matrix-observed")
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in (tmp_path / "docs").iterdir()) == [
        "matrix-observed.html", "matrix-observed.md", "matrix-observed.svg"]  # fmt: skip
    md = (tmp_path / "docs" / "matrix-observed.md").read_text()
    assert "![the matrix as an image](matrix-observed.svg)" in md
    assert "Run 2026-11-22 on Linux; the tests of a release took 2 s (their durations added up)." in md
