"""Fault injection (issue 11): each fault injected for real, and what the user then sees.

Every test here runs pytest in a subprocess with real gloo worlds, injects one fault (a crash, a signal, a flood, a
typo) and checks both the words the user reads and that nothing is left: no process (``process_tag``), no world
directory or server log (``private_tmp``), no ``/dev/shm`` buffer of the worlds involved. How long each fault takes
to reach its verdict is measured by ``benchmarks/faults.py``, not asserted here.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import RunPytest, deepspeed_version, leftovers, named, wait_for_no_processes
from pytest_dsrepro.core import results
from pytest_dsrepro.core.options import CACHE_ENV
from pytest_dsrepro.worlds.server.builds import BUILDER_NAME, COMPILER_NAME

PYTEST = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]


def start_pytest(pytester: pytest.Pytester, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([*PYTEST, *args], cwd=pytester.path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.1)


SLEEPING_WORLD = """
import os, time
import pytest

@pytest.mark.ds_world(timeout=600)
def test_sleeps(ds_rank):
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")  # creates this world's /dev/shm buffers
    with open(f"ready-{ds_rank}", "w") as f:
        f.write(os.environ["MASTER_PORT"])
    time.sleep(3600)
"""


def test_a_rank_that_crashes_after_reporting_a_pass_fails(
    pytester: pytest.Pytester, run: RunPytest, private_tmp: Path
) -> None:
    """Item 4: the rank writes PASSED, then dies by SIGSEGV on its way out; the exit code outweighs the report."""
    pytester.makepyfile(
        """
        import os, signal
        import pytest

        @pytest.mark.ds_world
        def test_dies_on_exit(ds_rank):
            if ds_rank == 1:  # the harness exits the rank with os._exit once its report is written
                os._exit = lambda code: os.kill(os.getpid(), signal.SIGSEGV)
        """
    )
    result = run()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["rank 1: crashed: killed by signal SIGSEGV after its body passed"])
    assert leftovers(private_tmp) == []


def test_the_fork_servers_death_mid_world_is_told_at_once(
    pytester: pytest.Pytester, run: RunPytest, private_tmp: Path
) -> None:
    """Item 6: a rank kills the fork server. The test fails as a harness error naming the server's death (not as a
    hang at the world's timeout), and the next test gets a new server."""
    pytester.makepyfile(
        """
        import os, signal, time
        import pytest

        @pytest.mark.ds_world(timeout=600)
        def test_server_dies(ds_rank):
            if ds_rank == 0:
                os.kill(os.getppid(), signal.SIGKILL)
            time.sleep(3600)

        @pytest.mark.ds_world
        def test_next(ds_rank):
            pass
        """
    )
    result = run("-p", "no:randomly", timeout=120)
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(
        [
            "*pytest-dsrepro could not run this test's world: the pytest-dsrepro fork server died while this test's "
            "world ran (killed by signal SIGKILL), *s in; its ranks died with it; its log is empty",
        ]
    )
    assert "hung" not in result.stdout.str()
    assert leftovers(private_tmp) == []


def test_setsid_in_a_body_behaves_as_documented(pytester: pytest.Pytester, run: RunPytest, private_tmp: Path) -> None:
    """Issue 38, item 5: ``os.setsid()`` fails in rank 0 only, the leader of the world's process group (as
    docs/writing-repros.md says); ``start_new_session=True`` works in every rank, and what it started is killed when
    the world ends (``process_tag``)."""
    pytester.makepyfile(
        """
        import os, subprocess
        import pytest

        @pytest.mark.ds_world
        def test_sessions(ds_rank):
            child = subprocess.Popen(["sleep", "600"], start_new_session=True)
            assert os.getsid(child.pid) == child.pid
            if ds_rank == 0:
                with pytest.raises(PermissionError):
                    os.setsid()
            else:
                os.setsid()
        """
    )
    run().assert_outcomes(passed=1)
    assert leftovers(private_tmp) == []


#: Where Ctrl-C lands while a first comm-op build runs beside the worlds: a world waiting for the op in the one
#: collective that needs it, or a world that does not need it (the build would have gone on apart after the run).
CTRL_C_DURING_THE_BUILD = {
    "in-a-world-waiting-for-it": "import deepspeed.comm, torch\n    deepspeed.comm.inference_all_reduce(torch.ones(4))",
    "in-a-world-without-it": "import time\n    time.sleep(600)",
}


@pytest.mark.parametrize("where", list(CTRL_C_DURING_THE_BUILD))
def test_the_first_build_is_announced_and_ctrl_c_during_it_leaves_nothing(
    pytester: pytest.Pytester, process_tag: str, private_tmp: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """Items 1 and 12: Ctrl-C while DeepSpeed's comm op builds (a cold cache: the first run of a release). The build
    was announced on the terminal; pytest stops the fork server with SIGTERM, which stops the build beside the worlds
    (it unwinds: torch removes its lock) and kills the compilers, whose temporary files (issue 27) go with their
    directory. Issue 35: so does a build that the run's end would have let go on apart, in a session of its own."""
    body = CTRL_C_DURING_THE_BUILD[where]
    cache = pytester.path / "cold-cache"
    monkeypatch.setenv(CACHE_ENV, str(cache))
    pytester.makepyfile(f"import pytest\n\n@pytest.mark.ds_world\ndef test_x(ds_rank):\n    {body}\n")
    output = pytester.path / "pytest-output.txt"
    with output.open("wb") as sink:
        proc = subprocess.Popen(PYTEST, cwd=pytester.path, stdout=sink, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: named(process_tag, "cc1plus"), "a compiler started")
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        proc.kill()  # only matters when an assertion above failed
    out = output.read_text()
    assert "KeyboardInterrupt" in out, out
    assert "goes on building apart" not in out, out
    progress = f"pytest-dsrepro: building DeepSpeed's CPU comm op for {deepspeed_version()}, first time only"
    assert progress in out, out
    left = wait_for_no_processes(process_tag, timeout=5)
    assert not left, f"left running after Ctrl-C: {[p.name() for p in left]}\n{out}"
    assert list(cache.rglob("lock")) == [], "torch's build lock was left behind: the next build would wait forever"
    assert leftovers(private_tmp) == []
    left_in_tmp = [p for p in private_tmp.iterdir() if not p.name.startswith("torchinductor_")]  # torch's own cache
    assert left_in_tmp == [], "the killed compilers' temporary files were left in TMPDIR"


def test_a_build_beside_the_worlds_ends_with_a_killed_fork_server(
    pytester: pytest.Pytester, process_tag: str, private_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 35: the build beside the worlds lives in a session of its own, to go on after a run that ended; the fork
    server killed outright (it cannot stop the build) must still take it along: the build sees its lifeline end
    without being let go on, unwinds, and kills its compilers. The run goes on to its end."""
    cache = pytester.path / "cold-cache"
    monkeypatch.setenv(CACHE_ENV, str(cache))
    pytester.makepyfile(SLEEPING_WORLD)
    output = pytester.path / "pytest-output.txt"
    with output.open("wb") as sink:
        proc = subprocess.Popen(PYTEST, cwd=pytester.path, stdout=sink, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: named(process_tag, "cc1plus"), "a compiler started")
        wait_until(lambda: (pytester.path / "ready-0").exists(), "the world runs")
        (builder,) = named(process_tag, BUILDER_NAME)
        builder.parent().kill()  # the fork server
        proc.wait(timeout=120)
    finally:
        proc.kill()  # only matters when an assertion above failed
    out = output.read_text()
    assert "fork server died while this test's world ran (killed by signal SIGKILL)" in out, out
    left = wait_for_no_processes(process_tag, timeout=30)
    assert not left, f"left running after the fork server was killed: {[p.name() for p in left]}\n{out}"
    assert list(cache.rglob("lock")) == [], "torch's build lock was left behind: the next build would wait forever"
    assert leftovers(private_tmp) == []


WAITS_FOR_A_MARK = """
import os, time
import pytest

@pytest.mark.ds_world(size=1, timeout=600)
def test_waits(ds_rank):
    while not os.path.exists({mark!r}):
        time.sleep(0.1)
"""


@pytest.mark.parametrize("victim", [BUILDER_NAME, COMPILER_NAME], ids=["its-warden", "the-process-that-compiles"])
def test_a_sigkilled_comm_op_build_takes_its_compilers_along(
    pytester: pytest.Pytester, process_tag: str, private_tmp: Path, monkeypatch: pytest.MonkeyPatch, victim: str
) -> None:
    """Issue 49 item 7: a comm-op build SIGKILLed beside the worlds orphaned its compilers, which raced the next build
    in the same directory. A build is two processes now; whichever is killed, its compilers die with it at once (the
    warden adopts and kills those of a killed worker; a killed warden's worker gets SIGTERM from the kernel, unwinds
    and kills its own), and the run goes on to its end without the op, saying why."""
    monkeypatch.setenv(CACHE_ENV, str(pytester.path / "cold-cache"))
    mark = pytester.path / "compilers-checked"
    pytester.makepyfile(WAITS_FOR_A_MARK.format(mark=str(mark)))
    output = pytester.path / "pytest-output.txt"
    with output.open("wb") as sink:
        proc = subprocess.Popen([*PYTEST, "-v"], cwd=pytester.path, stdout=sink, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: bool(named(process_tag, "cc1plus")), "a compiler started")
        (killed,) = named(process_tag, victim)
        killed.kill()
        at = time.monotonic()
        wait_until(lambda: not named(process_tag, "cc1plus") + named(process_tag, "ninja"), "compilers gone", 10)
        gone_after = time.monotonic() - at
        # the warden reports after it cleaned up; on a loaded machine the test may end before that, and the build
        # was then rightly said to go on apart: the run's end must come after the build's
        wait_until(lambda: not named(process_tag, BUILDER_NAME) + named(process_tag, COMPILER_NAME), "build ended", 30)
        mark.touch()
        proc.wait(timeout=120)
    finally:
        mark.touch()
        proc.kill()  # only matters when an assertion above failed
    out = output.read_text()
    assert gone_after < 5, out
    assert "= 1 passed in " in out, out
    assert f"DeepSpeed's CPU comm op for {deepspeed_version()} could not be built in " in out, out
    left = wait_for_no_processes(process_tag, timeout=15)
    assert not left, f"left running: {[p.name() for p in left]}\n{out}"
    assert leftovers(private_tmp) == []


#: A DeepSpeed whose import is slow and has started a process that started another (a compiler driver and its stage):
#: the fork server is still starting, and has a grandchild, when Ctrl-C comes.
SLOW_DEEPSPEED_WITH_A_GRANDCHILD = """
import subprocess, time
subprocess.Popen(["sh", "-c", "sleep 600 & echo $! > grandchild; wait"])
time.sleep(600)
"""
#: How soon pytest ends after Ctrl-C while its fork server starts (1.5 s here on 2 loaded cores).
PROMPT_END = 3.0


def test_ctrl_c_while_the_fork_server_starts_ends_at_once(
    pytester: pytest.Pytester, process_tag: str, private_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 38, the fork server's part: Ctrl-C while the server is still importing, with a grandchild of its own.
    pytest prints its summary and ends within moments: the server, stopped mid-import, kills every process below it,
    reaps them and exits at once, leaving nothing."""
    slow = pytester.mkpydir("slow")
    (slow / "deepspeed").mkdir()
    (slow / "deepspeed" / "__init__.py").write_text(SLOW_DEEPSPEED_WITH_A_GRANDCHILD)
    monkeypatch.setenv("PYTHONPATH", str(slow))
    pytester.makepyfile("import pytest\n\n@pytest.mark.ds_world\ndef test_x(ds_rank):\n    pass\n")
    proc = start_pytest(pytester)
    try:
        grandchild = pytester.path / "grandchild"
        wait_until(lambda: grandchild.exists() and grandchild.read_text().strip() != "", "the server's grandchild")
        interrupted = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=60)[0].decode()
        took = time.monotonic() - interrupted
    finally:
        proc.kill()
    assert "KeyboardInterrupt" in out, out
    assert took < PROMPT_END, f"pytest ended {took:.1f}s after Ctrl-C\n{out}"
    left = wait_for_no_processes(process_tag, timeout=5)
    assert not left, f"left running: {[p.cmdline() for p in left]}\n{out}"
    assert leftovers(private_tmp) == []


@pytest.mark.parametrize("gap", [0.05, 0.5], ids=lambda g: f"{g}s-apart")
def test_ctrl_c_twice_mid_world_leaves_nothing(
    pytester: pytest.Pytester, process_tag: str, private_tmp: Path, gap: float
) -> None:
    """Item 2: a second Ctrl-C lands in the middle of the first one's cleanup (or of pytest's shutdown); the server,
    which outlives both, still removes the world's /dev/shm buffers and its directory."""
    pytester.makepyfile(SLEEPING_WORLD)
    proc = start_pytest(pytester)
    try:
        ready = [pytester.path / f"ready-{rank}" for rank in range(2)]
        wait_until(lambda: all(p.exists() and p.read_text() for p in ready), "both ranks ready")
        port = ready[0].read_text()
        world = leftovers(private_tmp, [port])
        assert sum("dsrepro-world-" in x for x in world) == 1, world
        assert sum("/dev/shm/" in x for x in world) == 2, world
        proc.send_signal(signal.SIGINT)
        time.sleep(gap)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=60)[0].decode()
    finally:
        proc.kill()
    assert "KeyboardInterrupt" in out
    left = wait_for_no_processes(process_tag, timeout=10)
    assert not left, f"left running: {[p.cmdline() for p in left]}\n{out}"
    assert leftovers(private_tmp, [port]) == []


GATED_SLEEPER = """
import pathlib, time
import pytest

def fix(monkeypatch):
    pass

@pytest.mark.ds_world(timeout=600)
@pytest.mark.ds_version(affected=">=0", raises=RuntimeError, fix=fix)
def test_gated(ds_rank, ds_variant):
    if ds_variant == "fixed":
        return
    if ds_rank == 0:
        pathlib.Path("body-started").write_text("")
    time.sleep(3600)
"""


def test_ctrl_c_in_a_gated_test_ends_the_session_and_is_no_verdict(
    pytester: pytest.Pytester, process_tag: str, private_tmp: Path
) -> None:
    """Issue 38 item 1: Ctrl-C while a gated test's world runs was judged as its ending (``[stock] FAILED ... rank
    0: KeyboardInterrupt``, recorded UNEXPECTED) and the session went on to ``[fixed]``. It now ends the session as
    pytest ends it, and the results file holds no verdict for the interrupted test."""
    pytester.makepyfile(GATED_SLEEPER)
    saved = pytester.path / "results"
    proc = start_pytest(pytester, "-v", "-p", "no:randomly", f"--ds-results={saved}")
    try:
        wait_until(lambda: (pytester.path / "body-started").exists(), "the [stock] body started")
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=60)[0].decode()
    finally:
        proc.kill()
    assert proc.returncode == pytest.ExitCode.INTERRUPTED, out
    assert "!!! KeyboardInterrupt !!!" in out, out
    assert "test_gated[fixed]" not in out, out
    assert "UNEXPECTED" not in out, out
    files, unreadable = results.read_all([saved])
    assert unreadable == []
    assert [(t.nodeid, t.verdict) for f in files for t in f.run.tests] == []
    left = wait_for_no_processes(process_tag, timeout=10)
    assert not left, f"left running: {[p.cmdline() for p in left]}\n{out}"
    assert leftovers(private_tmp) == []


def test_a_world_too_big_for_the_machine_is_refused_at_startup(
    pytester: pytest.Pytester, run: RunPytest, private_tmp: Path
) -> None:
    """Item 7: no fork bomb. The option is a usage error at start-up; the marker fails its test at setup, before
    anything is spawned; both name the limit and how to raise it."""
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ds_world(size=100000)
        def test_huge(ds_rank):
            pass
        """
    )
    limit = "must be at most *, the largest world pytest-dsrepro forks on this machine (--ds-max-world-size; *"
    result = run("--ds-world-size", "100000")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: pytest-dsrepro: --ds-world-size: invalid value '100000': {limit}"])
    result.stderr.fnmatch_lines(["*raise it with --ds-max-world-size=N, DSREPRO_MAX_WORLD_SIZE=N or the ini option*"])
    result = run()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines([f"*@pytest.mark.ds_world on *::test_huge: size=100000 {limit}"])
    assert "Traceback" not in result.stdout.str()
    assert leftovers(private_tmp) == []
    raised = run("--ds-max-world-size", "100001", "--co")  # raised, the limit lets it through (collected only)
    assert raised.ret == pytest.ExitCode.OK


def test_input_errors_come_before_anything_is_spawned(
    pytester: pytest.Pytester, run: RunPytest, private_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 11 (and 9): a preset typo, an unpicklable fixture and a bad marker argument are each told once, at
    once: the fork server, which would take minutes to build on a cold cache, is never started. Proved by making
    its start fail loudly: a ``torch`` that cannot be imported, seen only by a process that imports torch."""
    sentinel = pytester.mkdir("no-torch")
    (sentinel / "torch.py").write_text("raise ImportError('sentinel: the fork server was started')\n")
    monkeypatch.setenv("PYTHONPATH", str(sentinel))
    pytester.makepyfile(
        """
        import threading
        import pytest

        @pytest.fixture
        def lock():
            return threading.Lock()

        @pytest.mark.ds_world
        def test_unpicklable(lock):
            pass

        @pytest.mark.ds_world
        @pytest.mark.ds_config("zero9")
        def test_typo(ds_config):
            pass

        @pytest.mark.ds_world(size=0)
        def test_bad_marker():
            pass
        """
    )
    result = run()
    result.assert_outcomes(failed=1, errors=2)
    out = result.stdout.str()
    assert "sentinel" not in out, "the fork server was started before the inputs were checked"
    for message in [
        "*::test_unpicklable: fixture or parameter 'lock' cannot be sent to the ranks (TypeError: *",
        "*@pytest.mark.ds_config on *::test_typo[[]zero9[]]: unknown preset 'zero9'; presets: zero0, *",
        "*@pytest.mark.ds_world on *::test_bad_marker: size=0 must be a whole number >= 1",
    ]:
        result.stdout.fnmatch_lines([message])
        assert sum(fnmatch.fnmatch(line, message) for line in out.splitlines()) == 1, f"told more than once: {message}"
    assert "During handling of the above exception" not in out
    assert leftovers(private_tmp) == []


def test_a_flood_of_rank_output_is_cut_to_its_ends_everywhere(
    pytester: pytest.Pytester, run: RunPytest, private_tmp: Path
) -> None:
    """Item 8: one rank prints a 10 MB line, the other 20 MB in a loop. The terminal, the results file and the JUnit
    XML each get their first and last lines and how much was cut, a few KiB per rank."""
    pytester.makepyfile(
        """
        import sys
        import pytest
        import torch.distributed as dist

        @pytest.mark.ds_world
        def test_floods(ds_rank):
            print("FIRST LINE")
            if ds_rank == 0:
                print("x" * 10_000_000)
            else:
                for i in range(400_000):
                    print(f"line {i:>12} of a rank that prints in a loop")
            print("LAST LINE")
            dist.barrier()  # both floods end before either rank fails, however slow a busy machine makes the loop
            raise RuntimeError("flooded")
        """
    )
    result = run(f"--junitxml={pytester.path / 'junit.xml'}", f"--ds-results={pytester.path / 'results'}")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "---- rank 0: output (first 2 and last 2 lines of what was kept) ----",
            "FIRST LINE",
            "xxxxxxxx*",
            "[[]... pytest-dsrepro cut 9,99*,*** bytes of this rank's output (10,000,*** in all; *",
            "xxxxxxxx*",
            "LAST LINE",
            "---- rank 1: output (first * and last 25 lines of what was kept) ----",
            "FIRST LINE",
            "line            0 of a rank that prints in a loop",
            "[[]... pytest-dsrepro cut *",
            "line       399999 of a rank that prints in a loop",
            "LAST LINE",
        ]
    )
    assert len(result.stdout.str()) < 64_000
    assert (pytester.path / "junit.xml").stat().st_size < 64_000
    (results,) = (pytester.path / "results").glob("*.json")
    assert results.stat().st_size < 64_000
    assert leftovers(private_tmp) == []


def test_a_crash_report_names_the_cause_first(pytester: pytest.Pytester, run: RunPytest, private_tmp: Path) -> None:
    """Item 10: a rank segfaults while its peer waits in a collective; another world's rank skips the collective.
    The rank that ended first is named first (in the short summary too), with the segfaulting rank's Python stack;
    the peer's 'connection closed' comes after it, marked as such."""
    pytester.makepyfile(
        """
        import ctypes, time
        import pytest

        @pytest.mark.ds_world
        def test_segfaults(ds_rank):
            import torch, torch.distributed as dist
            if ds_rank == 1:
                time.sleep(0.3)  # rank 0 is waiting in the all_reduce
                ctypes.string_at(0)
            dist.all_reduce(torch.ones(1))

        @pytest.mark.ds_world
        def test_skips_a_collective(ds_rank):
            import torch.distributed as dist
            if ds_rank == 0:
                dist.barrier()
        """
    )
    result = run("-p", "no:randomly")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        [
            "rank 1: crashed: killed by signal SIGSEGV; rank 0 (lost a peer): RuntimeError: *Connection closed by peer*",
            "(2-rank gloo world, *s; rank 1 failed first, at *s)",
            "---- rank 1: Python stacks when crashed ----",
            "Fatal Python error: Segmentation fault",
            "*line 9 in test_segfaults",
            "---- rank 0: traceback (it lost a peer: a consequence of the ranks above) ----",
            "rank 1: passed, but exited at *s while rank 0 still waited on it (a skipped collective?); "
            "rank 0 (lost a peer): RuntimeError: *",
            "FAILED *::test_segfaults - WorldFailed: rank 1: crashed: killed by signal SIGSEGV; *",
            "FAILED *::test_skips_a_collective - WorldFailed: rank 1: passed, but exited at *",
        ]
    )
    assert leftovers(private_tmp) == []


def test_pytest_timeout_firing_shows_every_ranks_stack(
    pytester: pytest.Pytester, run: RunPytest, private_tmp: Path
) -> None:
    """Item 3 under pytest-timeout: its failure comes with the world's story (every rank's stack), not a traceback
    through the plugin, and the world is reaped at once. The first test starts the fork server, so that the 5 s are
    the hanging world's alone, however busy the machine."""
    if importlib.util.find_spec("pytest_timeout") is None:
        pytest.skip("pytest-timeout is not installed")
    pytester.makepyfile(
        """
        import time
        import pytest

        @pytest.mark.ds_world
        def test_a_first_world(ds_rank):
            pass

        @pytest.mark.timeout(5)
        @pytest.mark.ds_world(timeout=600)
        def test_hangs(ds_rank):
            import torch.distributed as dist
            if ds_rank == 0:
                dist.barrier()
            else:
                time.sleep(3600)
        """
    )
    result = run("-p", "timeout")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "Timeout (>5.0s) from pytest-timeout.",
            "ranks 0-1: hung: still running when the test was interrupted (Failed: Timeout (>5.0s) from pytest-timeout.)",
            "---- rank 0: Python stacks when hung ----",
            "*in barrier",
            "*line 13 in test_hangs",
            "---- rank 1: Python stacks when hung ----",
            "*line 15 in test_hangs",
            "FAILED *::test_hangs - WorldFailed: Timeout (>5.0s) from pytest-timeout.",
        ]
    )
    assert "pytest_dsrepro" not in result.stdout.str().split("short test summary")[0]
    assert leftovers(private_tmp) == []


def _torch_that(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, body: str) -> Path:
    """A ``torch`` first on the path, seen only by processes that import torch (the fork server): ``body`` runs there,
    and each import is counted in the returned file."""
    sentinel = pytester.mkdir("fake-torch")
    starts = pytester.path / "server-starts"
    (sentinel / "torch.py").write_text(f"with open({str(starts)!r}, 'a') as f:\n    f.write('x')\n{body}\n")
    monkeypatch.setenv("PYTHONPATH", str(sentinel))
    return starts


TWO_WORLDS = """
import pytest

@pytest.mark.ds_world
def test_one(ds_rank):
    pass

@pytest.mark.ds_world
def test_two(ds_rank):
    pass
"""


def test_a_fork_server_that_cannot_get_ready_is_not_started_again_for_every_test(
    pytester: pytest.Pytester, run: RunPytest, monkeypatch: pytest.MonkeyPatch, private_tmp: Path
) -> None:
    """Item 5: it said "did not start ... within 1800s" however it ended, and every world test started it again."""
    starts = _torch_that(pytester, monkeypatch, "raise ImportError('sentinel: no torch here')")
    pytester.makepyfile(TWO_WORLDS)
    result = run()
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        [
            "*test_one*",
            "*the pytest-dsrepro fork server could not get ready (ImportError: sentinel: no torch here); its log is empty",
            "*test_two*",
            "*the pytest-dsrepro fork server could not get ready (ImportError: sentinel: no torch here), when this "
            "run's first world started it",
        ]
    )
    assert "within" not in result.stdout.str()
    assert starts.read_text() == "x", "the fork server was started again"
    assert leftovers(private_tmp) == []


def test_a_fork_server_that_dies_at_once_says_how_and_when(
    pytester: pytest.Pytester, run: RunPytest, monkeypatch: pytest.MonkeyPatch, private_tmp: Path
) -> None:
    _torch_that(pytester, monkeypatch, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    pytester.makepyfile(TWO_WORLDS)
    result = run()
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        [
            "*the pytest-dsrepro fork server ended (killed by signal SIGKILL) *s after it was started, before it "
            "was ready; its log is empty"
        ]
    )
    assert "within" not in result.stdout.str()
    assert leftovers(private_tmp) == []


def test_an_output_that_cannot_be_written_is_refused_before_anything_runs(
    pytester: pytest.Pytester, run: RunPytest, monkeypatch: pytest.MonkeyPatch, read_only: Callable[[Path], None]
) -> None:
    """Item 3: every test ran, then a 60-line traceback at the end and nothing saved. Now a usage error at startup,
    one line naming each output; no fork server is started (a torch that cannot be imported would say so)."""
    _torch_that(pytester, monkeypatch, "raise ImportError('sentinel: the fork server was started')")
    pytester.makepyfile(TWO_WORLDS)
    locked = pytester.mkdir("locked")
    read_only(locked)
    result = run(
        "--ds-results", str(locked / "results"), "--ds-report", str(locked / "report.md"),
        "--junitxml", str(locked / "junit.xml"),
    )  # fmt: skip
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            f"ERROR: pytest-dsrepro: --ds-results {locked / 'results'}: cannot be written (*); --ds-report "
            f"{locked / 'report.md'}: cannot be written (*); --junitxml {locked / 'junit.xml'}: cannot be written "
            "(*); nothing of this run could be saved there"
        ]
    )
    assert "sentinel" not in result.stdout.str() + result.stderr.str()
    assert "Traceback" not in result.stdout.str() + result.stderr.str()


def test_an_output_lost_at_the_end_still_gets_the_summary_and_an_exit_code_of_its_own(
    pytester: pytest.Pytester, run: RunPytest, private_tmp: Path
) -> None:
    """Item 3: the paths were fine at startup and are gone at the end (a body put files where the directories were):
    the summary is printed, each output not saved is named, and the exit code says so (6, not pytest's 1)."""
    pytester.makepyfile(
        """
        import shutil
        import pytest

        @pytest.mark.ds_world
        def test_takes_the_paths(ds_rank):
            if ds_rank == 0:
                for name in ("results", "out"):
                    shutil.rmtree(name)
                    open(name, "w").close()
        """
    )
    result = run("--ds-results", "results", "--ds-report", "out/report.md")
    assert result.ret == 6
    result.stdout.fnmatch_lines(
        [
            "pytest-dsrepro: NOT SAVED: --ds-results results (*)",
            "pytest-dsrepro: NOT SAVED: --ds-report out/report.md (*)",
            "*1 passed*",
        ]
    )
    assert "Traceback" not in result.stdout.str()


def test_a_body_that_closes_its_output_and_passes_passes(
    pytester: pytest.Pytester, run: RunPytest, private_tmp: Path
) -> None:
    """Item 5: it was "crashed: exit code 1" with no reason: flushing the closed streams after the body raised in
    the rank, which then unwound into the fork server's own code instead of exiting."""
    pytester.makepyfile(
        """
        import sys
        import pytest

        @pytest.mark.ds_world
        def test_closes_its_output(ds_rank):
            sys.stdout.close()
            sys.stderr.close()
        """
    )
    run().assert_outcomes(passed=1)
    assert leftovers(private_tmp) == []


def test_pytests_own_fixtures_that_stay_in_pytest_say_what_to_use_instead(
    pytester: pytest.Pytester, run: RunPytest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 5: capsys, caplog, request and tmp_path_factory in a world test were refused with pickle's words (or not
    at all); each now says what a world test uses in its place, before anything is spawned."""
    _torch_that(pytester, monkeypatch, "raise ImportError('sentinel: the fork server was started')")
    tests = [
        f"@pytest.mark.ds_world\ndef test_{name}(ds_rank, {name}):\n    pass\n"
        for name in ("capsys", "caplog", "request", "tmp_path_factory")
    ]
    pytester.makepyfile("import pytest\n\n" + "\n".join(tests))
    result = run()
    result.assert_outcomes(failed=4)
    result.stdout.fnmatch_lines(
        [
            "*::test_capsys: pytest's fixture 'capsys' lives in the pytest process and cannot reach the ranks; in a "
            "world test, capture in the body with contextlib.redirect_stdout(io.StringIO())*",
            "*::test_caplog: pytest's fixture 'caplog' *; in a world test, add a logging.Handler in the body*",
            "*::test_request: pytest's fixture 'request' *; in a world test, take the values you need through fixtures*",
            "*::test_tmp_path_factory: pytest's fixture 'tmp_path_factory' *; in a world test, take tmp_path*",
        ]
    )
    assert "sentinel" not in result.stdout.str()
