"""What a run leaves at its end when the end goes wrong (issue 49, item 7): SIGTERM to pytest, as a CI runner or a
scheduler stops a job, ends it as Ctrl-C does and keeps what the tests that ended said; a disk that is full when the
results and the report are written leaves no empty or partial file, and ``dsrepro matrix`` still reads the
directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import leftovers, wait_for_no_processes
from pytest_dsrepro.core import results
from pytest_dsrepro.core.gates import Reason, Verdict

ONE_PASSES_ONE_WAITS = """
import os, time
import pytest

@pytest.mark.ds_world
def test_1_passes(ds_rank):
    pass

@pytest.mark.ds_world(timeout=600)
def test_2_waits(ds_rank):
    open(f"ready-{ds_rank}", "w").close()
    time.sleep(600)
"""


def test_sigterm_ends_the_run_as_ctrl_c_does_and_keeps_the_tests_that_ended(
    pytester: pytest.Pytester, process_tag: str, private_tmp: Path
) -> None:
    """SIGTERM to pytest mid-world: the world is stopped and reaped, the session ends interrupted (exit 2), and the
    test that passed is in the summary, the results file and the report; the interrupted one is no outcome. It was
    SIGTERM's default: pytest gone at once, nothing written."""
    pytester.makepyfile(ONE_PASSES_ONE_WAITS)
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--ds-results", "results", "--ds-report",
               "report.md", "-v"]  # fmt: skip
    proc = subprocess.Popen(command, cwd=pytester.path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        ready = [pytester.path / f"ready-{rank}" for rank in range(2)]
        while not all(p.exists() for p in ready) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(p.exists() for p in ready), proc.communicate(timeout=60)[0]
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    finally:
        proc.kill()  # only matters when an assertion above failed
    assert proc.returncode == pytest.ExitCode.INTERRUPTED, out
    assert "KeyboardInterrupt: pytest-dsrepro: SIGTERM: the run stops as on Ctrl-C" in out
    assert "test_1_passes PASSED" in out
    (written,) = (pytester.path / "results").glob("*.json")
    recorded = [(t.nodeid.split("::")[-1], t.outcome) for t in results.read(written).tests]
    assert recorded == [("test_1_passes", "passed")]
    assert "test_1_passes" in (pytester.path / "report.md").read_text()
    assert not leftovers(private_tmp)


ONE_PASSES_ONE_SLEEPS = """
import time

def test_1_passes():
    pass

def test_2_sleeps():
    open("sleeping", "w").close()
    time.sleep(600)
"""

#: The report's diagnostics as slow as a busy machine makes them (3-10 s there; here a minute, tagged to be found).
SLOW_DIAGNOSTICS = """
from pytest_dsrepro.session import diagnostics

diagnostics.DS_SCRIPT = "import time; time.sleep(60)  # {tag}"
diagnostics.TORCH_COMMAND = ("-c", "import time; time.sleep(60)  # {tag}")
"""

#: As slow, and slow to start too (a loaded machine, inside Popen): CI's cancel comes while the second one starts.
#: Blocking the signals there held them off the main thread only; another thread took them, and the handler ran
#: here all the same, after the fork: the process was left running, held by nothing.
SLOW_TO_START = (
    SLOW_DIAGNOSTICS
    + """
import time

_start = diagnostics._start


def slow_start(args, env):
    proc = _start(args, env)
    if args == diagnostics.TORCH_COMMAND:
        open("starting", "w").close()
        time.sleep(3)
    return proc


diagnostics._start = slow_start
"""
)


def _cancelled(pytester: pytest.Pytester, ready: Path, *args: str) -> tuple[int, str, float]:
    """pytest run, and cancelled as CI cancels a job once ``ready`` exists: SIGINT, then SIGTERM a second later.
    Its exit status, its output, and the seconds from the SIGINT to its end."""
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--ds-results", "results", "--ds-report",
               "report.md", "-v", *args]  # fmt: skip
    proc = subprocess.Popen(command, cwd=pytester.path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), proc.communicate(timeout=60)[0]
        started = time.monotonic()
        proc.send_signal(signal.SIGINT)
        time.sleep(1)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
        return proc.returncode, out, time.monotonic() - started
    finally:
        proc.kill()  # only matters when an assertion above failed


def _kept(pytester: pytest.Pytester) -> tuple[list[tuple[str, str]], str]:
    (written,) = (pytester.path / "results").glob("*.json")
    recorded = [(t.nodeid.split("::")[-1], t.outcome) for t in results.read(written).tests]
    return recorded, (pytester.path / "report.md").read_text()


def test_a_second_signal_mid_run_keeps_the_ended_tests_and_the_report(pytester: pytest.Pytester) -> None:
    """CI's cancel (SIGINT, SIGTERM a second later) mid-test: the interrupted run gathers no diagnostics (seconds
    that a cancelled job lacks, said so in the report), so the second signal finds the results and the report
    written."""
    pytester.makepyfile(ONE_PASSES_ONE_SLEEPS)
    code, out, _ = _cancelled(pytester, pytester.path / "sleeping")
    assert code in (pytest.ExitCode.INTERRUPTED, -signal.SIGTERM), out  # as below
    assert "Traceback" not in out
    recorded, report = _kept(pytester)
    assert recorded == [("test_1_passes", "passed")]
    assert "test_1_passes" in report
    assert "not gathered: the run was interrupted" in report
    assert "NOT SAVED" not in out


@pytest.mark.parametrize(("conftest", "ready"), [(SLOW_DIAGNOSTICS, "report.md"), (SLOW_TO_START, "starting")],
                         ids=["gathered", "starting"])  # fmt: skip
def test_a_second_signal_while_the_diagnostics_are_gathered_loses_nothing(
    pytester: pytest.Pytester, process_tag: str, conftest: str, ready: str
) -> None:
    """The run ended, the report's diagnostics are slow (a busy machine): the results and the report are written
    before them, CI's cancel abandons them (their processes killed), and the files stay whole. It was a traceback,
    and neither file."""
    pytester.makepyfile(ONE_PASSES_ONE_SLEEPS.replace("time.sleep(600)", "pass"))
    pytester.makeconftest(conftest.format(tag=process_tag))
    code, out, seconds = _cancelled(pytester, pytester.path / ready)
    # pytest ends interrupted; or, where the SIGTERM comes while the interpreter itself ends (its handlers gone by
    # then: seconds on a loaded machine), SIGTERM ends it, all written.
    assert code in (pytest.ExitCode.INTERRUPTED, -signal.SIGTERM), out
    assert seconds < 15, out
    assert "Traceback" not in out
    recorded, report = _kept(pytester)
    assert recorded == [("test_1_passes", "passed"), ("test_2_sleeps", "passed")]
    assert "test_2_sleeps" in report
    assert not wait_for_no_processes(process_tag), "the abandoned diagnostics are left running"


AT_THE_END_THE_DISK_IS_FULL = """
import resource, signal
import pytest

@pytest.hookimpl(tryfirst=True)  # before the plugin writes the run's results and report
def pytest_sessionfinish(session):
    # Every write to a file past 0 bytes now fails (EFBIG), as on a full disk (ENOSPC): a kernel limit of this
    # process, which neither a loop device nor root is needed for. SIGXFSZ ignored: the write fails instead.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
"""


def test_a_full_disk_at_the_end_leaves_no_empty_file_and_the_matrix_reads_the_directory(
    pytester: pytest.Pytester, process_tag: str, private_tmp: Path
) -> None:
    """The results directory holds an earlier run's file and the report an earlier report; at the end every write
    fails. The summary names both outputs NOT SAVED and pytest exits 6; the directory holds the earlier file alone
    (nothing empty, nothing half-written, no temporary file), the report is the earlier one, whole; ``dsrepro matrix``
    reads the directory as before."""
    earlier = results.TestRecord(nodeid="test_earlier.py::test_x", repro=None, variant=None, verdict=Verdict.FIXED,
                                 reason=Reason.NOT_AFFECTED, outcome="passed", error=None, duration=1.0,
                                 config=None)  # fmt: skip
    kept = results.write(results.RunRecord(environment=results.environment("gloo", 2), tests=(earlier,)),
                         pytester.path / "results")  # fmt: skip
    (pytester.path / "report.md").write_text("# the earlier report\n")
    pytester.makeconftest(AT_THE_END_THE_DISK_IS_FULL)
    pytester.makepyfile("import pytest\n\n@pytest.mark.ds_world\ndef test_passes(ds_rank):\n    pass\n")
    # The terminal is a pipe, as a terminal or a CI log is: pytester's own runs write it to a file, which the limit
    # would stop too.
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--ds-results", "results", "--ds-report",
               "report.md"]  # fmt: skip
    proc = subprocess.run(command, cwd=pytester.path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 6, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert "pytest-dsrepro: NOT SAVED: --ds-results results (File too large)" in lines
    assert "pytest-dsrepro: NOT SAVED: --ds-report report.md (File too large)" in lines
    assert "1 passed" in lines[-1]
    assert sorted(p.name for p in (pytester.path / "results").iterdir()) == [kept.name]
    assert json.loads(kept.read_text())["tests"][0]["nodeid"] == "test_earlier.py::test_x"
    assert (pytester.path / "report.md").read_text() == "# the earlier report\n"
    assert not [p for p in pytester.path.iterdir() if p.name.startswith(".report.md.")]
    assert not leftovers(private_tmp)
    matrix = subprocess.run([sys.executable, "-m", "pytest_dsrepro.tools.cli", "matrix", "results", "--no-write"],
                            cwd=pytester.path, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "COLUMNS": "200"})  # fmt: skip
    assert matrix.returncode == 0, matrix.stdout + matrix.stderr
    assert "cut short" not in matrix.stdout + matrix.stderr
    assert "test_x" in matrix.stdout
