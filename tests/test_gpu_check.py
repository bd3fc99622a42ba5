"""``benchmarks/gpu_check.py`` on a CPU: its time budget's arithmetic, and that a check stopped by a stall names the
one test and the one stack that stopped it (stalls injected into a small catalogue run in real gloo worlds). What it
finds on a GPU is for the GPU machine (docs/gpus.md)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TAG, load_benchmark, wait_for_no_processes

ROOT = Path(__file__).resolve().parents[1]


gc = load_benchmark("gpu_check")


# ---- the budget -----------------------------------------------------------------------------------------------


def test_the_whole_check_fits_eight_minutes_and_no_check_overruns_it() -> None:
    assert gc.ORDER[:5] == ("nccl-1", "gloo-2", "hang", "cost", "leases")
    assert gc.steps(gc.ORDER) == [("nccl-1", "gloo-2"), ("hang",), ("cost",), ("leases",), ("nccl-2",)]
    assert gc.budget_for(gc.ORDER) == gc.BUDGET == 480
    assert gc.arithmetic(gc.ORDER) == (
        "budget: setup 25 + nccl-1 beside gloo-2 305 + hang 55 + cost 40 + leases 35 + one stop 20 = 480 s; nccl-2 "
        "on what the others leave"
    )
    # Every step runs to its limit, and any of them is stopped there (a stop takes STOPPING more): the run still
    # ends by its deadline; each step has its share, less one stop after a step that was stopped.
    planned = gc.steps(gc.ORDER)
    for stops in itertools.product((False, True), repeat=len(planned)):
        now, stopped_before = gc.SETUP, False
        for step, stopped in zip(planned, stops, strict=True):
            limit = gc.limit_for(step, gc.ORDER, gc.BUDGET - now)
            assert limit >= gc.share(step) - (gc.STOPPING if stopped_before else 0)
            now += max(limit, 0) + (gc.STOPPING if stopped and limit > 0 else 0)
            stopped_before = stopped
        assert now <= gc.BUDGET


def test_what_a_check_leaves_unused_passes_to_the_next() -> None:
    left = gc.BUDGET - 10  # set up in 10 s
    assert gc.limit_for(("nccl-1", "gloo-2"), gc.ORDER, left) == 320  # their 305, and the 15 s the setup left
    assert gc.limit_for(("hang",), gc.ORDER, left - 200) == 175  # the catalogues took 200 of their 320
    assert gc.limit_for(("nccl-2",), gc.ORDER, 60) == 40  # two GPUs: what is left, less the one stop


def test_a_rerun_of_what_failed_takes_only_their_shares() -> None:
    assert gc.steps(["cost", "hang"]) == [("hang",), ("cost",)]
    assert gc.budget_for(["hang", "cost"]) == 25 + 55 + 40 + 20
    assert gc.budget_for(["gloo-2"]) == 25 + 300 + 20  # alone, the gloo catalogue's own share
    assert gc.budget_for(["hang"], scale=2) == 2 * (25 + 55 + 20)


# ---- naming the test and the stack ----------------------------------------------------------------------------

VERBOSE = """\
repros/test_a.py::test_a[x-stock] PASSED                                [ 25%]
repros/test_b.py::test_b[x-stock] \npytest-dsrepro: finding what a first DeepSpeed engine step imports
repros/test_b.py::test_b[x-stock] FAILED                                [ 50%]
repros/test_c.py::test_c[x-stock] """


def test_the_running_test_is_the_last_one_started_and_not_ended() -> None:
    assert gc.running_test(VERBOSE) == "repros/test_c.py::test_c[x-stock]"
    assert gc.running_test(VERBOSE + "PASSED   [100%]\n\nPASSED repros/test_c.py::test_c[x-stock]\n") is None


TRACEBACK = """\
Traceback (most recent call last):
  File "/x/pytest_dsrepro/worlds/rank/body.py", line 117, in run_body
  File "/x/repros/test_comms_logger_stop_profiling.py", line 90, in test_stop_profiling_comms_stops_logging
    step(seed=0)
  File "/x/deepspeed/utils/comms_logging.py", line 45, in calc_bw_log
    tput = (size / duration)
ZeroDivisionError: float division by zero
"""
FAULTHANDLER = """\
Thread 0x00007f0000000001 (most recent call first):
  File "/x/threading.py", line 324 in wait
Current thread 0x00007f0000000000 (most recent call first):
  File "/x/torch/cuda/__init__.py", line 1040 in synchronize
  File "/x/repros/test_comms_logger_stop_profiling.py", line 84 in step
"""
PY_SPY = """\
Process 16747: python3 -m pytest
Python v3.12.3 (/usr/bin/python3.12)

Thread 16750 (idle): "dsrepro-nccl-flight-recorder"
    serve (pytest_dsrepro/worlds/rank/nccl_recorder.py:70)
Thread 16747 (active): "MainThread"
    synchronize (torch/cuda/__init__.py:1040)
    step (repros/test_comms_logger_stop_profiling.py:84)
    run_body (pytest_dsrepro/worlds/rank/body.py:117)
"""


def test_a_stack_is_read_innermost_first_whatever_wrote_it() -> None:
    assert gc.frames(TRACEBACK)[:2] == [
        "comms_logging.py:45 in calc_bw_log",
        "test_comms_logger_stop_profiling.py:90 in test_stop_profiling_comms_stops_logging",
    ]
    assert gc.frames(FAULTHANDLER) == [
        "__init__.py:1040 in synchronize",
        "test_comms_logger_stop_profiling.py:84 in step",
    ]
    rank = gc.Process(3, 2, "pid 3 ...", PY_SPY)
    assert gc.frames(rank.main_thread()) == [
        "__init__.py:1040 in synchronize",
        "test_comms_logger_stop_profiling.py:84 in step",
        "body.py:117 in run_body",
    ]
    assert (
        gc.one_line(FAULTHANDLER) == "__init__.py:1040 in synchronize <- test_comms_logger_stop_profiling.py:84 in step"
    )


def test_a_stopped_check_blames_the_rank_in_a_body_then_the_fork_server_then_pytest() -> None:
    pytest_process = gc.Process(1, 0, "pid 1", 'Thread 1 (idle): "MainThread"\n    wait (world_run.py:200)\n')
    server = gc.Process(
        2, 1, "pid 2", 'Thread 2 (idle): "MainThread"\n    serve (pytest_dsrepro/worlds/server/serving.py:90)\n'
    )
    rank = gc.Process(3, 2, "pid 3", PY_SPY)
    assert gc.stopping_stack([pytest_process, server, rank], "").startswith("pid 3:\nsynchronize")
    assert gc.one_line(gc.stopping_stack([pytest_process, server, rank], "")) == (
        "__init__.py:1040 in synchronize <- test_comms_logger_stop_profiling.py:84 in step"
    )
    assert gc.stopping_stack([pytest_process, server], "").startswith("pid 2:\nserve")
    assert gc.stopping_stack([pytest_process], "") == "pid 1:\nwait (world_run.py:200)"
    without_spy = "\n!!! KeyboardInterrupt !!!\n/tmp/x/test_c.py:6: KeyboardInterrupt\n"
    assert gc.stopping_stack([gc.Process(1, 0, "pid 1")], without_spy) == "pytest, interrupted at test_c.py:6"


def test_a_cpu_only_repro_not_applicable_on_cuda_is_an_explained_difference() -> None:
    reference = {"a": "FIXED", "b": "FIXED", "c": "REPRODUCED"}
    compared = gc.compare({"a": "FIXED", "b": "NOT-APPLICABLE", "c": "REPRODUCED"}, reference, {"b"})
    assert (compared.result, compared.first, compared.explained) == (gc.PASS, None, ("b",))
    assert compared.seen == "2 verdicts as on CPU; 1 NOT-APPLICABLE by their premise (CPU accelerator only)"
    compared = gc.compare({"a": "UNEXPECTED", "b": "FIXED"}, reference)
    assert (compared.result, compared.first) == (gc.FAIL, "a")
    assert (
        compared.seen == "1 as on CPU, 2 differ: a: FIXED on CPU, UNEXPECTED here; c: REPRODUCED on CPU, not run here"
    )


def test_the_one_script_runs_the_check_from_the_repository(tmp_path: Path) -> None:
    (tmp_path / "gpu").mkdir()
    script = gc.script(tmp_path / "gpu", "0.19.8", "3.12")
    text = script.read_text()
    assert f'--input {tmp_path / "gpu"} --out "${{OUT:-/tmp/gpu-check}}"' in text  # outside the repository: absolute
    assert f"\ncd {ROOT} || exit 1\n" in text
    assert os.access(script, os.X_OK)
    subprocess.run(["bash", "-n", str(script)], check=True)


def test_prepare_without_uv_says_so_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """uv neither installed as a package nor on ``PATH``: one line and exit 2, not a traceback, and nothing made."""
    monkeypatch.setitem(sys.modules, "uv", None)  # its package cannot be imported
    monkeypatch.setenv("PATH", str(tmp_path))
    assert gc.main(["prepare", "--into", str(tmp_path / "into")]) == 2
    assert capsys.readouterr().err == "gpu_check prepare: uv is not installed (pip install uv): it builds the wheels\n"
    assert not (tmp_path / "into").exists()


# ---- stalls injected into a small catalogue -------------------------------------------------------------------

CATALOGUE = {
    "test_a.py": """
import pytest


@pytest.mark.ds_world(size=1)
def test_a(ds_rank):
    pass
""",
    "test_b.py": """
import os
import time

import pytest


@pytest.mark.ds_world(size=1)
def test_b(ds_rank):
    if os.environ.get("STALL") == "world":
        time.sleep(600)
""",
    "test_c.py": """
import os
import time


def test_c():
    if os.environ.get("STALL") == "pytest":
        time.sleep(600)
""",
}


@pytest.fixture
def catalogue(tmp_path: Path) -> Path:
    """Three tests, and the CPU reference of their verdicts (no stall), as ``prepare`` writes it."""
    where = tmp_path / "catalogue"
    where.mkdir()
    for name, text in CATALOGUE.items():
        (where / name).write_text(text)
    gc.reference(sys.executable, where, tmp_path / "input" / "cpu-1", 1, [])
    assert gc.verdicts(tmp_path / "input" / "cpu-1") == {f"catalogue/test_{x}.py::test_{x}": "passed" for x in "abc"}
    return where


def _check(tmp_path: Path, catalogue: Path, stall: str, **kwargs: object) -> object:
    """The check's catalogue run on ``catalogue``, with ``STALL`` set, its processes tagged (``TAG``)."""
    (tmp_path / "evidence").mkdir()
    (tmp_path / "work").mkdir()
    env = {**os.environ, "STALL": stall, TAG: str(tmp_path)}
    return gc.GpuCheck(tmp_path / "input", tmp_path / "evidence", env, 0, None, tmp_path / "work", catalogue, **kwargs)


def test_a_test_hung_in_its_world_is_named_with_its_ranks_stack(tmp_path: Path, catalogue: Path) -> None:
    """The world ends at the catalogue's --ds-timeout, the catalogue goes on, and the check names that test and the
    body's frame the rank was stuck in."""
    check = _check(tmp_path, catalogue, "world", timeout=8)
    done = check.catalogue_run("catalogue", "gloo-1", 1, "gloo", "cpu-1", limit=300)
    assert (done.result, done.test) == (gc.FAIL, "catalogue/test_b.py::test_b")
    assert "1 failed, 2 passed" in done.seen
    assert "catalogue/test_b.py::test_b: passed on CPU, failed here" in done.seen
    assert gc.one_line(done.stack) == "test_b.py:11 in test_b"
    assert "still running when the 8s world timeout expired" in done.stack
    assert done.seconds < 300
    assert not wait_for_no_processes(str(tmp_path))


def test_a_check_stopped_at_its_limit_names_the_running_test_and_ends_within_its_stop(
    tmp_path: Path, catalogue: Path
) -> None:
    """A stall outside any world (here in the pytest process) outlasts the check's limit: the check takes the
    process tree, interrupts pytest, and names the test it was running and where pytest was (py-spy's stacks where
    it is on PATH; here, pytest's own report of the interrupt)."""
    check = _check(tmp_path, catalogue, "pytest", stopping=15)
    check.select = ["-k", "test_c"]
    done = check.catalogue_run("catalogue", "gloo-1", 1, "gloo", "cpu-1", limit=25)
    assert (done.result, done.test) == (gc.FAIL, "catalogue/test_c.py::test_c")
    assert done.stack == "pytest, interrupted at test_c.py:8"
    assert done.seen.startswith("stopped at its limit with 0 tests recorded")
    assert 25 <= done.seconds <= 25 + 15
    log = (tmp_path / "evidence" / "gloo-1.log").read_text()
    assert "==== gpu_check: stopped at its limit (25s); what its processes were doing:" in log
    assert not wait_for_no_processes(str(tmp_path))  # pytest, its fork server and ranks: all ended
