"""End to end: real gloo worlds started by the plugin, seen as a user sees them.

How one world is stopped after a failure is proved a level lower, on the runner itself (``test_worlds_client.py``),
where the failure grace is a parameter and nothing waits 5 s.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import RunPytest, assert_clear_error, leftovers, run_marked, wait_for_no_processes


def test_body_runs_in_every_rank_with_fixtures_and_params(pytester: pytest.Pytester, run: RunPytest) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.fixture
        def payload():
            return {"answer": 42}

        @pytest.mark.ds_world
        @pytest.mark.parametrize("scale", [1, 10])
        def test_sum(ds_rank, ds_world_size, scale, payload, tmp_path):
            import torch, torch.distributed as dist
            assert dist.get_rank() == ds_rank and dist.get_world_size() == ds_world_size == 2
            assert dist.get_backend() == "gloo"
            t = torch.tensor([float(ds_rank + 1) * scale])
            dist.all_reduce(t)
            assert t.item() == 3 * scale
            assert payload == {"answer": 42}
            (tmp_path / f"rank{ds_rank}").write_text("here")
        """
    )
    result = run("-v")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*test_sum?1? PASSED*", "*test_sum?10? PASSED*"])


def test_worlds_listen_on_loopback_only(pytester: pytest.Pytester, run: RunPytest) -> None:
    pytester.makepyfile(
        """
        import psutil
        import pytest

        @pytest.mark.ds_world
        def test_sockets(ds_rank):
            import torch, torch.distributed as dist
            t = torch.ones(1)
            dist.all_reduce(t)
            listening = [c.laddr.ip for c in psutil.Process().net_connections("inet") if c.status == "LISTEN"]
            assert listening and set(listening) == {"127.0.0.1"}, listening
        """
    )
    run().assert_outcomes(passed=1)


def test_the_store_outlives_the_first_rank_to_finish(pytester: pytest.Pytester, run: RunPytest) -> None:
    pytester.makepyfile(
        """
        import time
        import pytest

        @pytest.mark.ds_world
        def test_late_rank(ds_rank):
            import torch.distributed as dist
            if ds_rank == 1:
                time.sleep(1)  # rank 0 has long finished
                store = dist.distributed_c10d._get_default_store()
                store.set("late", "still here")
                assert store.get("late") == b"still here"
        """
    )
    run().assert_outcomes(passed=1)


def test_world_size_from_option_and_marker(pytester: pytest.Pytester, run: RunPytest) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ds_world
        def test_default(ds_world_size):
            assert ds_world_size == 3

        @pytest.mark.ds_world(size=1)
        def test_pinned(ds_world_size):
            assert ds_world_size == 1
        """
    )
    run("--ds-world-size", "3").assert_outcomes(passed=2)


def test_marker_on_module_and_class(pytester: pytest.Pytester, run: RunPytest) -> None:
    pytester.makepyfile(
        """
        import pytest
        pytestmark = pytest.mark.ds_world

        def test_function(ds_rank):
            import torch.distributed as dist
            assert dist.is_initialized()

        class TestGroup:
            def test_method(self, ds_rank):
                import torch.distributed as dist
                assert dist.get_rank() == ds_rank
        """
    )
    run().assert_outcomes(passed=2)


def test_failures_are_deduplicated_by_rank_with_output(pytester: pytest.Pytester, run: RunPytest) -> None:
    pytester.makepyfile(
        """
        import os, time
        import pytest

        @pytest.mark.ds_world
        def test_same(ds_rank):
            print(f"python print from rank {ds_rank}")
            os.write(2, f"fd-level write from rank {ds_rank}\\n".encode())
            raise AttributeError("'Engine' object has no attribute 'epilogue'")

        @pytest.mark.ds_world
        def test_different(ds_rank):
            if ds_rank == 0:
                raise KeyError("zero")
            time.sleep(0.5)  # the first to fail is told first: rank 0
            raise ValueError("one")
        """
    )
    result = run()
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        [
            "*_ test_same _*",
            "ranks 0-1: AttributeError: 'Engine' object has no attribute 'epilogue'",
            "(2-rank gloo world, *s)",
            "---- ranks 0-1: traceback ----",
            "*raise AttributeError*",
            "---- rank 0: output (last 25 lines) ----",
            "python print from rank 0",
            "fd-level write from rank 0",
            "---- rank 1: output (last 25 lines) ----",
            "python print from rank 1",
            "fd-level write from rank 1",
            "*_ test_different _*",
            "rank 0: KeyError: 'zero'; rank 1: ValueError: one",
        ]
    )
    result.stdout.fnmatch_lines(["FAILED *test_same - WorldFailed: ranks 0-1: AttributeError: *"])
    assert "pytest_dsrepro" not in result.stdout.str().split("short test summary")[0].split("test_same")[1]


def test_skip_in_ranks_skips_with_reason(pytester: pytest.Pytester, run: RunPytest) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ds_world
        def test_skipper(ds_rank):
            pytest.skip("needs a bigger machine")
        """
    )
    result = run("-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED * needs a bigger machine"])


def test_nccl_without_gpus_is_skipped_with_what_was_found(pytester: pytest.Pytester, run: RunPytest) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ds_world(backend="nccl")
        def test_gpu(ds_rank):
            raise AssertionError("must not run")
        """
    )
    if os.path.exists("/proc/driver/nvidia/gpus") and os.listdir("/proc/driver/nvidia/gpus"):
        pytest.skip("this machine has GPUs: the NCCL path runs instead of skipping")
    result = run("-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED * NCCL needs 2 CUDA devices for a 2-rank world; found 0"])


def test_hang_shows_every_rank_stack_and_session_continues(pytester: pytest.Pytester, run: RunPytest) -> None:
    pytester.makepyfile(
        """
        import time
        import pytest

        @pytest.mark.ds_world(timeout=3)
        def test_hangs(ds_rank):
            import torch.distributed as dist
            if ds_rank == 0:
                dist.barrier()  # rank 1 never joins
            else:
                time.sleep(3600)

        @pytest.mark.ds_world
        def test_next(ds_rank):
            pass
        """
    )
    result = run()
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(
        [
            "ranks 0-1: hung: still running when the 3s world timeout expired",
            "---- rank 0: Python stacks when hung ----",
            "*in barrier",
            "*test_hang*.py*line 8 in test_hangs",
            "---- rank 1: Python stacks when hung ----",
            "*test_hang*.py*line 10 in test_hangs",
        ]
    )


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("os._exit(3)", "rank 1: crashed: exit code 3"),
        ("ctypes.string_at(0)", "rank 1: crashed: killed by signal SIGSEGV"),
        ("os.kill(os.getpid(), signal.SIGKILL)", "rank 1: crashed: killed by signal SIGKILL"),
        ("os._exit(0)", "rank 1: crashed: exit code 0 without reporting that its body completed"),
    ],
    ids=["exit3", "segfault", "sigkill", "exit0"],
)
def test_a_dead_rank_is_never_a_pass(pytester: pytest.Pytester, run: RunPytest, body: str, expected: str) -> None:
    pytester.makepyfile(
        f"""
        import ctypes, os, signal
        import pytest

        @pytest.mark.ds_world
        def test_dies(ds_rank):
            if ds_rank == 1:
                {body}
        """
    )
    result = run()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([expected])


def test_no_state_leaks_between_tests(pytester: pytest.Pytester, run: RunPytest) -> None:
    pytester.makepyfile(
        """
        import json
        import pytest

        @pytest.mark.ds_world
        def test_first(ds_rank):
            json.dumps = lambda *a, **k: "patched"
            import torch
            torch.manual_seed(1234)

        @pytest.mark.ds_world
        def test_second(ds_rank):
            assert json.dumps([1]) == "[1]", "a patch made by an earlier test leaked into this one"
            import torch.distributed as dist
            assert dist.is_initialized()
        """
    )
    run("-p", "no:randomly").assert_outcomes(passed=2)


def test_unpicklable_fixture_is_named(pytester: pytest.Pytester, run: RunPytest) -> None:
    pytester.makepyfile(
        """
        import threading
        import pytest

        @pytest.fixture
        def lock():
            return threading.Lock()

        @pytest.mark.ds_world
        def test_uses_lock(lock):
            pass
        """
    )
    result = run()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*test_uses_lock: fixture or parameter 'lock' cannot be sent to the ranks (TypeError: *"]
    )


def test_bad_world_marker_names_marker_test_and_value(pytester: pytest.Pytester, run: RunPytest) -> None:
    """One case end to end (each value's words are tested on the validators, in test_options.py)."""
    result = run_marked(pytester, run, "ds_world(size=0)")
    result.assert_outcomes(errors=1)
    assert_clear_error(result, "ds_world", "size=0 must be a whole number >= 1")
    assert result.stdout.str().count("must be a whole number") == 1


def test_world_fixtures_outside_worlds_fail_clearly(pytester: pytest.Pytester, run: RunPytest) -> None:
    pytester.makepyfile(
        """
        def test_plain(ds_rank):
            pass
        """
    )
    result = run()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*test_plain: fixture 'ds_rank' exists only in world tests (@pytest.mark.ds_world)"])


@pytest.mark.parametrize("marker", ["ds_world", "ds_world(process_group=False)"], ids=["plugin-group", "own-group"])
def test_dev_shm_is_left_as_found(pytester: pytest.Pytester, run: RunPytest, marker: str) -> None:
    """DeepSpeed's CPU shm allreduce creates a buffer per rank and never deletes it; worlds must, also when the body
    makes its own group (the buffers are then named after a port only its ranks know)."""
    pytester.makepyfile(
        f"""
        import os
        import pytest

        @pytest.mark.{marker}
        @pytest.mark.parametrize("i", range(3))
        def test_deepspeed_comm(ds_rank, i):
            import deepspeed, torch
            deepspeed.init_distributed(dist_backend="gloo")
            port = os.environ["MASTER_PORT"]
            mine = [n for n in os.listdir("/dev/shm") if n.startswith("deepspeed_allreduce_buffer") and f"_{{port}}_" in n]
            assert len(mine) == 2, mine  # the op really ran: one buffer per rank, for this world's port
            t = torch.ones(4)
            deepspeed.comm.inference_all_reduce(t)
            assert t.tolist() == [2.0] * 4
            with open(os.path.join({str(pytester.path)!r}, f"world-{{i}}-port-{{port}}"), "w"):
                pass
        """
    )
    run().assert_outcomes(passed=3)
    worlds = list(pytester.path.glob("world-*-port-*"))
    assert len(worlds) == 3
    ports = {p.name.rpartition("-")[2] for p in worlds}  # the fork server's store port: one, or one per server
    left = [n for n in os.listdir("/dev/shm") if any(f"_{port}_" in n for port in ports)]
    assert not left, f"left in /dev/shm: {left}"


#: A body that makes its own process group (on the port rank 0 hosts for it, or on one it chose itself) and binds
#: DeepSpeed to it, which maps its /dev/shm buffers named after that port; then it hangs or crashes.
OWN_GROUP = """
import os, signal, socket, time
from pathlib import Path
import pytest

def own_group(ds_rank, own_port):
    import deepspeed, torch.distributed as dist
    if own_port:  # a MASTER_PORT of the body's own: rank 0 finds a free one and tells rank 1
        if ds_rank == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                Path("chosen").write_text(str(s.getsockname()[1]))
        while not (Path("chosen").exists() and Path("chosen").read_text()):
            time.sleep(0.01)
        os.environ["MASTER_PORT"] = Path("chosen").read_text()
    dist.init_process_group("gloo")
    deepspeed.init_distributed(dist_backend="gloo")
    port = os.environ["MASTER_PORT"]
    mine = [n for n in os.listdir("/dev/shm") if n.startswith("deepspeed_allreduce_buffer") and f"_{{port}}_" in n]
    assert len(mine) == 2, mine  # the op really ran: one buffer per rank, named after the group's port
    Path(f"port-{{ds_rank}}").write_text(port)

@pytest.mark.ds_world(process_group=False, timeout={timeout})
def test_own_group(ds_rank):
    own_group(ds_rank, {own_port})
    {ending}
"""

ENDINGS = {
    "hangs": ("time.sleep(3600)", 10),
    "one-rank-crashes": ("os._exit(3) if ds_rank == 1 else time.sleep(3600)", 60),
    "every-rank-is-killed": ("os.kill(os.getpid(), signal.SIGKILL)", 60),
}


#: Every ending on rank 0's port; on a port of the body's own, those where a rank lives on to be read. Not covered:
#: every rank dead by a signal before anyone read their maps, on a port the body chose (no process that knew it lives).
OWN_GROUP_CASES = [(e, False) for e in sorted(ENDINGS)] + [("hangs", True), ("one-rank-crashes", True)]


@pytest.mark.parametrize(("ending", "own_port"), OWN_GROUP_CASES, ids=lambda v: str(v).lower())
def test_dev_shm_is_left_as_found_when_a_body_with_its_own_group_hangs_or_crashes(
    pytester: pytest.Pytester, run: RunPytest, private_tmp: Path, ending: str, own_port: bool
) -> None:
    """Issue 49, item 4: DeepSpeed names its buffers after the group's port, which only the world's processes know.
    The fork server reads what they map before it kills them (a hung or stopped rank maps its peers' buffers, a
    crashed one's too), and rank 0 notes the port it hosts for the body's group; nothing of the world is left."""
    body, timeout = ENDINGS[ending]
    pytester.makepyfile(OWN_GROUP.format(timeout=timeout, own_port=own_port, ending=body))
    result = run()
    result.assert_outcomes(failed=1)
    port = (pytester.path / "port-0").read_text()
    assert leftovers(private_tmp, [port]) == []


ALL_REDUCES = """
import pytest

@pytest.mark.ds_world
@pytest.mark.parametrize("i", range({n}))
def test_many(ds_rank, i):
    import torch, torch.distributed as dist
    t = torch.tensor([1.0])
    dist.all_reduce(t)
    assert t.item() == 2
"""


def test_xdist_runs_worlds_in_parallel(pytester: pytest.Pytester, run: RunPytest) -> None:
    pytester.makepyfile(ALL_REDUCES.format(n=8))
    result = run("-n", "4")
    result.assert_outcomes(passed=8)


def test_two_sessions_at_once(pytester: pytest.Pytester, process_tag: str) -> None:
    pytester.makepyfile(ALL_REDUCES.format(n=5))
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q"]
    procs = [
        subprocess.Popen(cmd, cwd=pytester.path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for _ in range(2)
    ]
    outputs = [p.communicate(timeout=300)[0].decode() for p in procs]
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out
        assert "5 passed" in out


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_killing_pytest_leaves_nothing_behind(pytester: pytest.Pytester, process_tag: str, sig: signal.Signals) -> None:
    """Ctrl-C, SIGTERM or SIGKILL of pytest mid-world: no rank survives, no /dev/shm buffer is left."""
    pytester.makepyfile(
        """
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
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"],
        cwd=pytester.path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        ready = [pytester.path / f"ready-{rank}" for rank in range(2)]
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not all(p.exists() and p.read_text() for p in ready):
            time.sleep(0.2)
        port = ready[0].read_text()
        buffers = [n for n in os.listdir("/dev/shm") if n.startswith("deepspeed_allreduce_buffer") and f"_{port}_" in n]
        assert len(buffers) == 2, f"the world did not create its buffers: {buffers}"
        proc.send_signal(sig)
        out = proc.communicate(timeout=60)[0].decode()
    finally:
        proc.kill()  # only matters when an assertion above failed
    left = wait_for_no_processes(process_tag, timeout=10)
    assert not left, f"alive after {sig.name} of pytest: {[p.cmdline() for p in left]}\n{out}"
    assert not any(os.path.exists(f"/dev/shm/{n}") for n in buffers), f"/dev/shm buffers left after {sig.name}"
    if sig == signal.SIGINT:
        assert "KeyboardInterrupt" in out


def test_plugin_load_imports_neither_torch_nor_deepspeed(pytester: pytest.Pytester, run: RunPytest) -> None:
    pytester.makepyfile(
        """
        import sys
        import pytest

        @pytest.mark.ds_world
        def test_collected_only():
            pass

        def test_modules():
            assert "torch" not in sys.modules
            assert "deepspeed" not in sys.modules
        """
    )
    result = run("-k", "test_modules")
    result.assert_outcomes(passed=1, deselected=1)
    collect = run("--co", "-q")
    collect.stdout.fnmatch_lines(["*test_collected_only*"])


def test_markers_and_options_are_documented(pytester: pytest.Pytester, run: RunPytest) -> None:
    markers = run("--markers")
    markers.stdout.fnmatch_lines(
        [
            "@pytest.mark.ds_world(size=None, backend=None, timeout=None, reuse=False, process_group=True, launcher_env=True):*",
            "@pytest.mark.ds_config(*presets_or_dicts):*",
            "@pytest.mark.ds_version(affected, raises*",
            "@pytest.mark.ds_repro(*",
            "@pytest.mark.ds_origin(project, revision, described=None):*",
        ]
    )
    helptext = run("--help")
    helptext.stdout.fnmatch_lines(
        ["*--ds-world-size=N*", "*--ds-backend=NAME*", "*--ds-timeout=SECONDS*", "*ds_world_size (string):*"]
    )


def test_report_header_names_what_is_in_play(pytester: pytest.Pytester, run: RunPytest) -> None:
    pytester.makepyfile("def test_x(): pass")
    result = run()
    result.stdout.fnmatch_lines(["dsrepro: deepspeed *, torch *, world size 2, backend auto, timeout 300s"])


def test_launcher_mode_runs_in_place_under_torchrun(pytester: pytest.Pytester, process_tag: str) -> None:
    """Under torchrun every pytest process is a rank: the plugin spawns nothing and uses the launcher's world."""
    pytester.makepyfile(
        """
        import os
        import pytest

        @pytest.mark.ds_world
        def test_in_launched_world(ds_rank, ds_world_size):
            import torch, torch.distributed as dist
            assert ds_rank == int(os.environ["RANK"]) and ds_world_size == 2
            t = torch.tensor([1.0])
            dist.all_reduce(t)
            assert t.item() == 2
            import psutil
            assert not any("pytest_dsrepro.worlds.server" in " ".join(p.cmdline()) for p in psutil.Process().children())

        @pytest.mark.ds_world(size=4)
        def test_needs_four():
            pass
        """
    )
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc = subprocess.run(
        [*torchrun, "-m", "pytest", "-p", "no:cacheprovider", "-rs", "-q"],
        cwd=pytester.path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("1 passed, 1 skipped") == 2, proc.stdout
    assert "needs a 4-rank world; the launcher started 2 ranks" in proc.stdout


def test_bad_options_fail_at_startup(pytester: pytest.Pytester, run: RunPytest) -> None:
    pytester.makepyfile("def test_x(): pass")
    for args, message in [
        (["--ds-world-size", "0"], "--ds-world-size: invalid value '0': must be a whole number >= 1"),
        (["--ds-world-size", "abc"], "--ds-world-size: invalid value 'abc': must be a whole number >= 1"),
        (["--ds-timeout", "-5"], "--ds-timeout: invalid value '-5': must be a number of seconds > 0"),
        (["--ds-backend", "mpi"], "--ds-backend: invalid value 'mpi': must be one of auto, gloo, nccl"),
    ]:
        result = run(*args)
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        result.stderr.fnmatch_lines([f"ERROR: pytest-dsrepro: {message}"])


def test_env_and_ini_sources_are_named(
    pytester: pytest.Pytester, run: RunPytest, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile("def test_x(): pass")
    pytester.makeini("[pytest]\nds_timeout = soon\n")
    result = run()
    result.stderr.fnmatch_lines(["ERROR: pytest-dsrepro: ini option ds_timeout: invalid value 'soon': *"])
    monkeypatch.setenv("DSREPRO_WORLD_SIZE", "-2")
    result = run()
    result.stderr.fnmatch_lines(
        ["ERROR: pytest-dsrepro: environment variable DSREPRO_WORLD_SIZE: invalid value '-2': *"]
    )
