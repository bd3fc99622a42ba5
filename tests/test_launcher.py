"""Under an external launcher every pytest process is one rank, and the processes make one run: lockstep, a fresh
process group per test, one outcome judged the same on every rank, one set of files, a per-test timeout with every
rank's stack. Tested for real with torchrun (the commands of docs/multinode.md): 2 processes on this machine, and
2 simulated nodes on loopback with c10d rendezvous. Small pure parts (options, the backend rule) are tested directly.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import RunPytest
from pytest_dsrepro.core import options
from pytest_dsrepro.core.options import Launched
from pytest_dsrepro.worlds.launched.launched_world import unrunnable
from pytest_dsrepro.worlds.launched.launcher import settle_backend_here

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
PYTEST = ["-m", "pytest", "-p", "no:cacheprovider", "-rA"]
#: torchrun's variables for rank 1 of a 4-rank world, 2 ranks a node.
TORCHRUN_ENV = {"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}


# ---- pure parts -----------------------------------------------------------------------------------------------


def test_the_ranks_of_this_node_come_from_the_launcher() -> None:
    world = options.launched({**TORCHRUN_ENV, "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert world == Launched(rank=1, world_size=4, local_rank=1, local_world_size=2)
    assert world.ranks_here == 2
    deepspeed_launcher = options.launched({**TORCHRUN_ENV, "LOCAL_SIZE": "2"})
    assert deepspeed_launcher is not None
    assert deepspeed_launcher.ranks_here == 2
    unknown = options.launched(TORCHRUN_ENV)
    assert unknown is not None
    assert unknown.ranks_here == 4


def test_auto_backend_counts_the_ranks_of_this_node_not_the_world() -> None:
    """2 nodes x 1 GPU: NCCL; the world's size (2) against the node's one GPU would have said gloo."""
    two_nodes = Launched(rank=1, world_size=2, local_rank=0, local_world_size=1)
    assert settle_backend_here("auto", two_nodes, devices=1) == ("nccl", None)
    assert settle_backend_here("auto", two_nodes, devices=0) == ("gloo", None)
    backend, skip = settle_backend_here("nccl", Launched(0, 4, 0, 2), devices=1)
    assert backend == "nccl"
    assert skip == "NCCL needs a CUDA device for each of the 2 ranks on this node; found 1"


def test_srun_without_a_launcher_is_refused_in_one_line() -> None:
    srun = {"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1"}
    message = options.unlaunched_slurm(srun)
    assert message is not None
    assert "\n" not in message
    assert message.startswith("pytest-dsrepro: SLURM task 3 of 4 runs pytest without a launcher")
    assert "srun --ntasks-per-node 1 torchrun" in message
    assert options.unlaunched_slurm({**srun, "SLURM_STEP_NUM_TASKS": "1"}) is None  # one task: worlds of its own
    assert options.unlaunched_slurm({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"}) is None  # a batch script
    assert options.unlaunched_slurm({**srun, **TORCHRUN_ENV}) is None  # srun ... torchrun


def test_the_plan_keeps_the_tests_every_rank_reaches_in_the_same_order() -> None:
    lists = [["a", "b"], ["a", "x", "b"]]
    assert unrunnable(lists[0], lists) == {}
    assert unrunnable(lists[1], lists) == {"x": "rank 0 did not collect this test"}
    lists = [["a", "first", "second", "z"], ["a", "second", "first", "z"], ["a", "first", "second", "z"]]
    expected = {
        "second": "the ranks reach this test in another order (rank 0: world test 3; rank 1: world test 2; rank 2: "
        "world test 3)"
    }
    for mine in lists:
        assert unrunnable(mine, lists) == expected  # every rank comes to the same answer


def test_shard_values() -> None:
    assert options.shard("2/4") == (2, 4)
    assert options.shard(" 1 / 1 ") == (1, 1)
    for bad in ("0/4", "5/4", "2", "a/b", "-1/2"):
        with pytest.raises(options.OptionError, match="must be I/N with 1 <= I <= N"):
            options.shard(bad)
    settings = options.resolve([options.environment_source({"DSREPRO_SHARD": "3/5"})], environ={})
    assert settings.shard == (3, 5)


# ---- pytest runs without a launcher ------------------------------------------------------------------------------


def test_srun_pytest_stops_at_startup(
    pytester: pytest.Pytester, run: RunPytest, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile("def test_x(): pass")
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    result = run()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: pytest-dsrepro: SLURM task 1 of 2 runs pytest without a launcher*"])


def test_shards_split_the_tests_between_them(pytester: pytest.Pytester, run: RunPytest) -> None:
    """Every test in exactly one of the shards, in collection order, every N-th."""
    pytester.makepyfile("\n".join(f"def test_{i}(): pass" for i in range(7)))
    ran = []
    for index in (1, 2, 3):
        result = run("-v", f"--ds-shard={index}/3")
        result.assert_outcomes(passed=len(range(index - 1, 7, 3)))
        assert f"shard {index}/3" in result.stdout.str()
        ran.append([line.split("::")[1].split()[0] for line in result.outlines if " PASSED" in line])
    assert ran == [["test_0", "test_3", "test_6"], ["test_1", "test_4"], ["test_2", "test_5"]]


# ---- under torchrun ----------------------------------------------------------------------------------------------

#: One session of world tests, each a case of the launcher path; the order matters (each follows a failure).
CASES = """\
import os
import time

import pytest

RANK = os.environ["RANK"]


@pytest.mark.ds_world
def test_a_one_rank_fails(ds_rank):
    import torch, torch.distributed as dist

    if ds_rank == 1:
        raise ValueError("rank 1 failed before the collective")
    dist.all_reduce(torch.ones(1))


@pytest.mark.ds_world
def test_b_collective_after_a_failure(ds_rank):
    import torch, torch.distributed as dist

    t = torch.tensor([float(ds_rank + 1)])
    dist.all_reduce(t)
    assert t.item() == 3.0, "the collective met another test's"


@pytest.mark.ds_world(timeout=5)
def test_c_one_rank_hangs(ds_rank):
    import torch.distributed as dist

    if ds_rank == 1:
        time.sleep(600)
    dist.barrier()


@pytest.mark.ds_world(size=4)
def test_d_needs_four_ranks():
    pass


def _here_only():
    pass


globals()[f"test_e_only_rank{RANK}"] = pytest.mark.ds_world(_here_only)  # a different test on each rank


def _first():
    pass


def _second():
    pass


_ORDER = [("test_j_first", _first), ("test_j_second", _second)]
for _name, _test in _ORDER if RANK == "0" else _ORDER[::-1]:  # collected in another order on rank 1
    globals()[_name] = pytest.mark.ds_world(_test)


@pytest.fixture
def breaks_on_rank_1():
    if RANK == "1":
        raise RuntimeError("the fixture broke on rank 1")


@pytest.mark.ds_world
def test_f_fixture_fails_on_one_rank(breaks_on_rank_1):
    pass


@pytest.mark.ds_world
@pytest.mark.ds_version(affected=">=0.1", raises=ValueError, match="only on rank 0")
def test_g_bug_on_rank_0_only(ds_rank):
    if ds_rank == 0:
        raise ValueError("the bug shows only on rank 0")


@pytest.mark.ds_world
def test_i_one_tmp_path_for_all_ranks(ds_rank, tmp_path):
    import torch.distributed as dist

    (tmp_path / f"rank{ds_rank}").write_text("here")
    dist.barrier()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]


@pytest.mark.ds_world
@pytest.mark.ds_nondeterministic(runs=4)
@pytest.mark.ds_version(affected=">=0.1", raises=ValueError, match="race")
def test_j_race_in_some_runs(ds_rank, tmp_path):
    import torch.distributed as dist

    runs = tmp_path / "runs"  # rank 0's tmp_path, on every rank: one count of the series' worlds
    if ds_rank == 0:
        runs.write_text(str(int(runs.read_text()) + 1) if runs.exists() else "1")
    dist.barrier()
    if ds_rank == 1 and runs.read_text() == "2":
        raise ValueError("the race, in the second run only")
    dist.barrier()


@pytest.mark.ds_world
def test_h_collective_at_the_end(ds_rank):
    import torch, torch.distributed as dist

    t = torch.tensor([float(ds_rank + 1)])
    dist.all_reduce(t)
    assert t.item() == 3.0
"""


def _line(code: str) -> int:
    """The line of ``CASES`` that holds ``code``."""
    return next(i for i, line in enumerate(CASES.splitlines(), 1) if code in line)


def _torchrun(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def _rank_outputs(log_dir: Path) -> dict[int, str]:
    """Each rank's own stdout, as torchrun's ``--log-dir``/``--redirects`` kept it (``.../attempt_0/<rank>/``)."""
    found = {int(p.parent.name): p.read_text() for p in log_dir.glob("*/attempt_0/*/stdout.log")}
    assert found, f"no rank output under {log_dir}"
    return found


def _results(directory: Path) -> list[dict[str, object]]:
    return [json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))]


def _verdicts(run: dict[str, object]) -> dict[str, tuple[object, object]]:
    tests = run["tests"]
    assert isinstance(tests, list)
    return {t["nodeid"].split("::")[1]: (t["verdict"], t["outcome"]) for t in tests}


def test_a_torchrun_session_is_one_run(pytester: pytest.Pytester, process_tag: str) -> None:
    """2 processes: each case below ends the same on both ranks, and one set of files is written (rank 0's)."""
    pytester.makepyfile(test_cases=CASES)
    logs = pytester.path / "logs"
    command = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", "--log-dir", str(logs), "--redirects", "3"]
    proc = _torchrun([*command, *PYTEST, "--ds-results", "results", "--junitxml", "junit.xml"], pytester.path)
    outputs = _rank_outputs(logs)
    assert sorted(outputs) == [0, 1], proc.stderr[-3000:]
    for rank, out in outputs.items():
        lines = pytest.LineMatcher(out.splitlines())
        lines.fnmatch_lines(["*launched externally: rank * of 2, 2 on this node*"])
        # a one-rank failure, followed by a collective test that passes: nothing leaked into it
        lines.fnmatch_lines(
            [
                "*rank 1: ValueError: rank 1 failed before the collective; rank 0 (lost a peer): RuntimeError: *",
                "PASSED test_cases.py::test_b_collective_after_a_failure",
            ],
            consecutive=False,
        )
        # a hang: both ranks' stacks, at their own lines, after the 5 s timeout; and the session went on
        lines.fnmatch_lines(
            [
                "ranks 0-1: hung: still running when the 5s world timeout expired",
                "---- rank 0: Python stacks when hung ----",
                f'*File "*test_cases.py", line {_line("dist.barrier()")} in test_c_one_rank_hangs',
                "---- rank 1: Python stacks when hung ----",
                f'*File "*test_cases.py", line {_line("time.sleep(600)")} in test_c_one_rank_hangs',
            ],
            consecutive=False,
        )
        lines.fnmatch_lines(["SKIPPED *needs a 4-rank world; the launcher started 2 ranks"])
        # the plan: a test only one rank collected fails there at once, one the ranks reach in another order fails on
        # both; neither puts a later test out of step
        lines.fnmatch_lines(
            [
                f"test_cases.py::test_e_only_rank{rank}: rank {1 - rank} did not collect this test; every world test "
                "must run on every rank",
                "test_cases.py::test_j_second: the ranks reach this test in another order (rank 0: world test *; "
                "rank 1: world test *); every world test must run on every rank",
            ],
            consecutive=False,
        )
        lines.fnmatch_lines(["PASSED test_cases.py::test_j_first"])
        # the bug seen on rank 0 only: REPRODUCED on both ranks; a series of 4 worlds, each on keys of its own,
        # the race in one: the same rate on both ranks
        lines.fnmatch_lines(["REPRODUCED      test_cases.py::test_g_bug_on_rank_0_only"])
        lines.fnmatch_lines(["REPRODUCED 1/4  test_cases.py::test_j_race_in_some_runs"])
        lines.fnmatch_lines(["PASSED test_cases.py::test_h_collective_at_the_end"])
        assert out.count("generated xml file") == (1 if rank == 0 else 0), out[-2000:]
    # the fixture that broke on rank 1: its own error there, a harness error (never a verdict) on rank 0
    assert "ERROR test_cases.py::test_f_fixture_fails_on_one_rank - RuntimeError: the fixture broke on" in outputs[1]
    assert (
        "rank 1 did not run this test's body (rank 1: its setup failed: RuntimeError: the fixture broke on rank 1)"
        in outputs[0]
    )
    (run,) = _results(pytester.path / "results")  # one file: rank 0's
    assert _verdicts(run) == {
        "test_a_one_rank_fails": (None, "failed"),
        "test_b_collective_after_a_failure": (None, "passed"),
        "test_c_one_rank_hangs": (None, "failed"),
        "test_d_needs_four_ranks": (None, "skipped"),
        "test_e_only_rank0": (None, "error"),
        "test_j_first": (None, "passed"),
        "test_j_second": (None, "error"),
        "test_f_fixture_fails_on_one_rank": (None, "failed"),
        "test_g_bug_on_rank_0_only": ("REPRODUCED", "xfailed"),
        "test_i_one_tmp_path_for_all_ranks": (None, "passed"),  # rank 0's fixture values, as in spawned worlds
        "test_j_race_in_some_runs": ("REPRODUCED", "xfailed"),
        "test_h_collective_at_the_end": (None, "passed"),
    }
    environment = run["environment"]
    assert isinstance(environment, dict)
    assert (environment["world_size"], environment["backend"], environment["gpu_count"]) == (2, "gloo", 0)
    junit = (pytester.path / "junit.xml").read_text()
    assert 'name="test_e_only_rank0"' in junit  # rank 0's file: rank 1 wrote none
    assert 'name="test_e_only_rank1"' not in junit
    assert proc.returncode != 0  # tests failed


def _free_port() -> int:
    """A port for the rendezvous of two torchrun processes; torchrun takes no listening socket, so this is the
    usual bind-and-release (the plugin itself never picks ports so)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


TWO_NODES = """\
import os

import pytest


@pytest.mark.ds_world
def test_one_rank_fails(ds_rank):
    import torch, torch.distributed as dist

    if ds_rank == 1:
        raise ValueError("failed on the second node")
    dist.all_reduce(torch.ones(1))


@pytest.mark.ds_world
def test_collective(ds_rank):
    import torch, torch.distributed as dist

    assert os.environ["LOCAL_WORLD_SIZE"] == "1"
    t = torch.tensor([float(ds_rank + 1)])
    dist.all_reduce(t)
    assert t.item() == 3.0
"""


def test_two_nodes_on_loopback(pytester: pytest.Pytester, process_tag: str) -> None:
    """Two torchrun processes, one rank each, meeting through c10d rendezvous: one run, one results file."""
    pytester.makepyfile(test_nodes=TWO_NODES)
    port = _free_port()
    procs = []
    for node in (0, 1):
        logs = pytester.path / f"logs{node}"
        command = [
            *TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "rehearsal", "--log-dir", str(logs), "--redirects", "3",
            *PYTEST, "--ds-results", "results",
        ]  # fmt: skip
        procs.append(subprocess.Popen(command, cwd=pytester.path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    for proc in procs:
        proc.communicate(timeout=300)
    outputs = [out for node in (0, 1) for out in _rank_outputs(pytester.path / f"logs{node}").values()]
    assert len(outputs) == 2
    for out in outputs:
        lines = pytest.LineMatcher(out.splitlines())
        lines.fnmatch_lines(["*launched externally: rank ? of 2, 1 on this node*"])
        lines.fnmatch_lines(["FAILED test_nodes.py::test_one_rank_fails - WorldFailed: rank 1: ValueError: failed on*"])
        lines.fnmatch_lines(["PASSED test_nodes.py::test_collective"])
    (run,) = _results(pytester.path / "results")
    assert _verdicts(run) == {"test_one_rank_fails": (None, "failed"), "test_collective": (None, "passed")}


# ---- Ctrl-C under torchrun (issue 27) -------------------------------------------------------------------------

INTERRUPTIBLE = """\
import os
import subprocess
import time

import pytest


@pytest.mark.ds_world
def test_1_before(ds_rank):
    pass


@pytest.mark.ds_world
@pytest.mark.ds_version(affected=">=0", raises=RuntimeError)  # gated, as every repro: Ctrl-C is still no verdict
def test_2_interrupted(ds_rank):
    subprocess.Popen(["sleep", "600"])  # what the body started: killed with it
    with open(f"ready-{ds_rank}", "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)


@pytest.mark.ds_world
def test_3_never_starts(ds_rank):
    pass
"""


def _interrupt(pytester: pytest.Pytester, stop: Callable[[subprocess.Popen[bytes], list[int]], None]) -> dict[int, str]:
    """Run ``INTERRUPTIBLE`` under torchrun; once both ranks are in ``test_2_interrupted``, ``stop(torchrun, pids)``.
    Every rank's output; asserts what holds however the run was stopped."""
    pytester.makepyfile(test_interrupt=INTERRUPTIBLE)
    logs = pytester.path / "logs"
    command = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", "--log-dir", str(logs), "--redirects", "3"]
    proc = subprocess.Popen(
        [*command, *PYTEST, "--ds-results", "results"], cwd=pytester.path, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        ready = [pytester.path / f"ready-{rank}" for rank in (0, 1)]
        deadline = time.monotonic() + 240
        while not all(p.exists() and p.read_text() for p in ready):
            assert proc.poll() is None, "torchrun ended before the ranks reached the body"
            assert time.monotonic() < deadline, "the ranks never reached the body"
            time.sleep(0.1)
        started = time.monotonic()
        stop(proc, [int(p.read_text()) for p in ready])
        proc.communicate(timeout=60)
        assert time.monotonic() - started < 30, "torchrun had to kill the ranks: they did not end on their own"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # only matters when an assertion above failed
    outputs = _rank_outputs(logs)
    (run,) = _results(pytester.path / "results")  # rank 0 wrote what there was
    assert _verdicts(run) == {"test_1_before": (None, "passed")}, "an interrupt was recorded as a test's outcome"
    for out in outputs.values():
        assert "test_3_never_starts" not in out
        assert "FAILED" not in out
        # pytest's own interrupt, then the summary
        pytest.LineMatcher(out.splitlines()).fnmatch_lines(["!!!* KeyboardInterrupt*!!!", "*1 passed in *"])
    return outputs


def test_ctrl_c_under_torchrun_ends_the_session_on_every_rank(pytester: pytest.Pytester, process_tag: str) -> None:
    """Ctrl-C in a terminal reaches torchrun and every rank: the test running then is no outcome, no further test
    starts, rank 0 writes the summary and results, and nothing is left (the body's ``sleep`` included)."""
    _interrupt(pytester, lambda proc, pids: os.killpg(proc.pid, signal.SIGINT))


def test_a_launcher_stopping_one_rank_ends_the_session_on_every_rank(
    pytester: pytest.Pytester, process_tag: str
) -> None:
    """SIGTERM to one rank alone (what a launcher sends): that rank ends as on Ctrl-C, and tells the other."""
    outputs = _interrupt(pytester, lambda proc, pids: os.kill(pids[1], signal.SIGTERM))
    assert "KeyboardInterrupt: the launcher stopped this rank (SIGTERM)" in outputs[1]
    assert "KeyboardInterrupt: rank 1 was interrupted" in outputs[0]


# ---- a rank that dies under torchrun (issue 38) -----------------------------------------------------------------

DYING = """\
import os
import signal
import subprocess

import pytest


@pytest.mark.ds_world
def test_1_before(ds_rank):
    pass


@pytest.mark.ds_world
def test_2_rank_1_dies(ds_rank):
    if ds_rank == 1:
        sleeper = subprocess.Popen(["sleep", "600"])  # what the dead rank's body started: killed all the same
        with open("sleeper", "w") as f:
            f.write(str(sleeper.pid))
        os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.ds_world
def test_3_after(ds_rank):
    pass
"""


def test_a_rank_killed_under_torchrun_is_noticed_at_once(pytester: pytest.Pytester, process_tag: str) -> None:
    """Rank 1's pytest process SIGKILLed in a body: rank 0 waits for it no longer (not the 120 s world timeout, nor
    torchrun's 30 s before its own SIGKILL), prints its summary and writes its results, and the dead rank's
    ``sleep`` is killed (``process_tag``)."""
    pytester.makepyfile(test_dying=DYING)
    logs = pytester.path / "logs"
    command = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", "--log-dir", str(logs), "--redirects", "3"]
    proc = subprocess.Popen(
        [*command, *PYTEST, "--ds-timeout", "120", "--ds-results", "results"], cwd=pytester.path,
        start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        sleeper = pytester.path / "sleeper"
        deadline = time.monotonic() + 240
        while not (sleeper.exists() and sleeper.read_text()):
            assert proc.poll() is None, "torchrun ended before rank 1 died"
            assert time.monotonic() < deadline, "rank 1 never reached its death"
            time.sleep(0.1)
        died = time.monotonic()
        proc.communicate(timeout=60)
        assert time.monotonic() - died < 25, "torchrun had to kill rank 0: it waited for the dead rank"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # only matters when an assertion above failed
    out = _rank_outputs(logs)[0]
    assert "test_3_after PASSED" not in out
    pytest.LineMatcher(out.splitlines()).fnmatch_lines(["PASSED *::test_1_before", "*1 passed* in *"])
    (run,) = _results(pytester.path / "results")
    assert _verdicts(run)["test_1_before"] == (None, "passed")
