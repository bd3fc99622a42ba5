"""The GPU logic in pieces, with fake device lists: device discovery, leases (also across pytest-xdist workers), the
accelerator that follows the backend, NCCL's diagnostics. Nothing here needs a GPU, torch or a world."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pytest_dsrepro.core import premises
from pytest_dsrepro.core.errors import HarnessError
from pytest_dsrepro.core.gates import Reason
from pytest_dsrepro.core.world_spec import accelerator_for
from pytest_dsrepro.session.verdicts import wrong_accelerator
from pytest_dsrepro.worlds import device_nodes, workdir
from pytest_dsrepro.worlds.client import gpu_probe, leases, nccl_diagnostics
from pytest_dsrepro.worlds.client.gpu_probe import Gpu
from pytest_dsrepro.worlds.rank import nccl_recorder
from pytest_dsrepro.worlds.server import cuda_reexec

GPUS = tuple(Gpu(i, f"GPU-fa4e0000-0000-4000-8000-{i:012d}", "Fake GPU") for i in range(3))


# ---- devices --------------------------------------------------------------------------------------------------


def test_the_probe_output_is_parsed_whatever_else_it_printed() -> None:
    printed = 'a warning\ndsrepro-gpus: [[0, "6e0d-11", "NVIDIA H100"], [1, "GPU-77", "NVIDIA H100"], [2, "", "X"]]\n'
    assert gpu_probe.parse_probe(printed) == (
        Gpu(0, "GPU-6e0d-11", "NVIDIA H100"),  # torch's UUID without the prefix CUDA_VISIBLE_DEVICES wants
        Gpu(1, "GPU-77", "NVIDIA H100"),
        Gpu(2, "", "X"),
    )
    assert [g.visible_id for g in gpu_probe.parse_probe(printed)] == ["GPU-6e0d-11", "GPU-77", "2"]
    with pytest.raises(ValueError, match="no device list"):
        gpu_probe.parse_probe("Traceback ...\n")


def test_a_cpu_machine_starts_no_probe(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(device_nodes, "DEVICE_DIR", tmp_path)
    monkeypatch.setattr(gpu_probe, "probe", lambda: pytest.fail("probed without a GPU device node"))
    assert gpu_probe.find() == ()
    (tmp_path / "nvidia0").touch()
    monkeypatch.setattr(gpu_probe, "probe", lambda: GPUS)
    assert gpu_probe.find() == GPUS


def test_a_failing_probe_is_a_harness_error_with_its_output() -> None:
    broken = {**os.environ, "PYTHONPATH": ""}
    with pytest.raises(HarnessError, match=r"counting CUDA devices .* failed"):
        gpu_probe.probe({**broken, "PYTHONSAFEPATH": "1", "PYTHONHOME": "/nonexistent"}, timeout=30)


def test_the_fork_server_environment_keeps_the_users_choices() -> None:
    assert gpu_probe.server_environment({}, "cpu", ()) == {"DS_ACCELERATOR": "cpu"}  # a CPU machine: as before
    assert gpu_probe.server_environment({}, "cuda", GPUS) == {"DS_ACCELERATOR": "cuda", gpu_probe.NVML_CHECK: "1"}
    mine = {"DS_ACCELERATOR": "xpu", gpu_probe.NVML_CHECK: "0"}
    assert gpu_probe.server_environment(dict(mine), "cuda", GPUS) == mine


def test_deepspeeds_accelerator_follows_the_backend() -> None:
    assert accelerator_for("gloo", {}) == "cpu"  # on a GPU machine too: the CPU adaptations of configs hold
    assert accelerator_for("nccl", {}) == "cuda"
    assert accelerator_for("gloo", {"DS_ACCELERATOR": "cuda"}) == "cuda"  # DeepSpeed's own variable wins


def test_a_bug_of_one_accelerator_is_not_applicable_where_the_ranks_run_another() -> None:
    cpu_only = premises.parse((), {"stage": 2, "accelerator": "cpu"}, "here")
    judgement = wrong_accelerator(cpu_only, "nccl", "cuda")
    assert judgement is not None
    assert judgement.reason is Reason.NOT_APPLICABLE
    assert judgement.message == (
        "not applicable in a nccl world: its bug exists only with DeepSpeed's cpu accelerator (its ds_premise), "
        "and this world's ranks run the cuda one"
    )
    assert wrong_accelerator(cpu_only, "gloo", "cpu") is None  # a gloo world on a GPU machine runs it
    assert wrong_accelerator(premises.parse((), {"stage": 2}, "here"), "nccl", "cuda") is None  # any accelerator
    assert wrong_accelerator(None, "nccl", "cuda") is None


def test_what_a_poisoned_server_found_survives_its_restart() -> None:
    found = cuda_reexec.Deferred("why", "0.18.3", "/x/deepspeed", "cuda", "nccl")
    assert cuda_reexec.Deferred.loads(found.dumps()) == found


# ---- leases ---------------------------------------------------------------------------------------------------


def test_a_lease_is_all_or_nothing_and_names_its_gpus(tmp_path: Path) -> None:
    first = leases.try_lease(GPUS, 2, tmp_path, "first")
    assert first is not None
    assert first.gpus == GPUS[:2]
    assert first.environ() == {"CUDA_VISIBLE_DEVICES": f"{GPUS[0].uuid},{GPUS[1].uuid}"}
    assert leases.try_lease(GPUS, 2, tmp_path, "second") is None  # one free GPU is not two: none taken
    third = leases.try_lease(GPUS, 1, tmp_path, "third")
    assert third is not None
    assert third.gpus == GPUS[2:]
    first.release()
    again = leases.try_lease(GPUS, 2, tmp_path, "again")
    assert again is not None
    assert again.gpus == GPUS[:2]
    again.release()
    third.release()


def test_a_world_that_cannot_get_its_gpus_gives_up_naming_what_was_busy(tmp_path: Path) -> None:
    held = leases.try_lease(GPUS[:2], 1, tmp_path, "tests/test_x.py::test_long, xdist gw1")
    assert held is not None
    started = time.monotonic()
    with pytest.raises(leases.Busy) as busy:
        leases.acquire(GPUS[:2], 2, tmp_path, wait=0.3, holder="waiting", poll=0.05)
    assert 0.3 <= time.monotonic() - started < 5
    message = str(busy.value)
    assert message.startswith("no 2 free GPUs within 0.3s (--ds-gpu-wait); busy: GPU 0 (Fake GPU, GPU-fa4e")
    assert f"leased by pid {os.getpid()} (tests/test_x.py::test_long, xdist gw1) since" in message
    assert "GPU 1" not in message  # free, only not enough
    held.release()
    leases.acquire(GPUS[:2], 2, tmp_path, wait=0, holder="now").release()


def test_more_gpus_than_the_machine_has_is_busy_at_once(tmp_path: Path) -> None:
    with pytest.raises(leases.Busy, match="3 GPUs needed, 2 on this machine"):
        leases.acquire(GPUS[:2], 3, tmp_path, wait=60, holder="x")


HOLD = """
import sys, time
from pathlib import Path
from pytest_dsrepro.worlds.client import leases
from pytest_dsrepro.worlds.client.gpu_probe import Gpu
lease = leases.try_lease([Gpu(0, sys.argv[2], "Fake GPU")], 1, Path(sys.argv[1]), "a killed holder")
print("held" if lease else "busy", flush=True)
time.sleep(600)
"""


def test_the_lease_ends_with_its_holder_even_by_sigkill(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path), GPUS[0].uuid], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "held"
        assert leases.try_lease(GPUS[:1], 1, tmp_path, "here") is None
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    lease = leases.try_lease(GPUS[:1], 1, tmp_path, "here")  # no stale lease: the kernel dropped the lock
    assert lease is not None
    lease.release()


XDIST_LEASES = """
import json, os, time
from pathlib import Path

import pytest

from pytest_dsrepro.worlds.client import leases
from pytest_dsrepro.worlds.client.gpu_probe import Gpu

GPUS = [Gpu(i, f"GPU-fa4e0000-0000-4000-8000-{i:012d}", "Fake GPU") for i in range(2)]


@pytest.mark.parametrize("i", range(12))
def test_lease(i):
    lease = leases.acquire(GPUS, 1 + i % 2, Path(os.environ["LEASES"]), 60, f"test {i}", poll=0.02)
    start = time.monotonic()
    time.sleep(0.05)
    used = [start, time.monotonic(), [g.uuid for g in lease.gpus], os.environ["PYTEST_XDIST_WORKER"]]
    lease.release()
    with open(os.environ["LEASE_LOG"], "a") as log:
        log.write(json.dumps(used) + "\\n")
"""


def test_xdist_workers_never_share_a_gpu(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three workers, two fake GPUs, worlds of one and two GPUs: no GPU is ever in two leases at once."""
    log = pytester.path / "leases.log"
    monkeypatch.setenv("LEASES", str(pytester.path / "gpu-leases"))
    monkeypatch.setenv("LEASE_LOG", str(log))
    pytester.makepyfile(XDIST_LEASES)
    result = pytester.runpytest_subprocess("-p", "xdist", "-n", "3", "-p", "no:cacheprovider", timeout=120)
    result.assert_outcomes(passed=12)
    used = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(used) == 12
    assert len({u[3] for u in used}) > 1  # the leases were taken by several workers
    for i, (start, end, gpus, _) in enumerate(used):
        for other_start, other_end, other_gpus, _ in used[i + 1 :]:
            if set(gpus) & set(other_gpus):
                assert end <= other_start or other_end <= start, (gpus, other_gpus)


# ---- NCCL diagnostics -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("world", "expected"), [(1.0, 0.25), (15.0, 3.75), (30.0, 15.0), (300.0, 225.0)])
def test_an_nccl_collective_times_out_before_the_world_with_time_left_to_dump(world: float, expected: float) -> None:
    """torch's watchdog dumps a hang that began early enough, and needs up to ``DUMP_TIME`` after the timeout to do
    so (a 15 s world once gave it 3.75 s: no dump); the collective keeps a quarter of a short world's time."""
    timeout = nccl_recorder.process_group_timeout(world)
    assert timeout == pytest.approx(expected)
    assert world - timeout >= min(nccl_recorder.DUMP_TIME, world * 0.75)


def test_nccl_ranks_get_diagnostics_unless_the_user_chose(tmp_path: Path) -> None:
    given = nccl_diagnostics.environment(tmp_path, {"NCCL_DEBUG": "INFO", "TORCH_INCLUDE_STACK_TRACE": "1"}, 15.0)
    assert given["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"  # a timeout neither aborts nor ends the rank
    assert given["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert given["TORCH_NCCL_ENABLE_MONITORING"] == "1"  # the thread that dumps on a timeout
    assert int(given["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"]) > 15.0  # ... and kills only after the harness's deadline
    assert int(given["TORCH_FR_BUFFER_SIZE"]) > 0
    assert given[workdir.NCCL_TRACE_FILE] == str(tmp_path / workdir.NCCL_TRACE_PREFIX)
    assert "NCCL_DEBUG" not in given
    assert "TORCH_INCLUDE_STACK_TRACE" not in given


#: A flight recorder dump with the keys torch 2.13 writes (``FlightRecorder.cpp``): a completed all-reduce, a
#: broadcast that started and never finished, a send (point to point: numbered by ``p2p_seq_id``) still scheduled.
TORCH_DUMP = {
    "version": "2.10",
    "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
    "pg_status": {"0": {"last_enqueued_collective": 8, "last_started_collective": 8, "last_completed_collective": 7}},
    "entries": [
        {
            "record_id": i,
            "pg_id": 0,
            "process_group": ("0", "default_pg"),
            "collective_seq_id": seq,
            "p2p_seq_id": p2p,
            "op_id": i + 1,
            "profiling_name": name,
            "time_created_ns": 1_700_000_000_000_000_000 + i,
            "input_sizes": sizes,
            "input_dtypes": ["Float"],
            "output_sizes": sizes,
            "output_dtypes": ["Float"],
            "state": state,
            "time_discovered_started_ns": None,
            "time_discovered_completed_ns": None,
            "retired": state == "completed",
            "timeout_ms": 11250,
            "is_p2p": p2p > 0,
            "frames": [],
        }
        for i, (name, seq, p2p, sizes, state) in enumerate(
            [
                ("nccl:all_reduce", 7, 0, [[1024]], "completed"),
                ("nccl:broadcast", 8, 0, [[4, 4]], "started"),
                ("nccl:send 0->1", 0, 3, [[16]], "scheduled"),
            ]
        )
    ],
}


def test_torchs_watchdog_dump_is_kept_and_named_before_the_ranks_own(tmp_path: Path) -> None:
    world, keep = tmp_path / "world", tmp_path / "kept"
    world.mkdir()
    assert not nccl_diagnostics.watchdog_dumped(world)
    workdir.nccl_dump_file(world, 0).write_bytes(pickle.dumps(TORCH_DUMP))  # as torch's watchdog writes it
    workdir.nccl_requested_file(world, 0).write_bytes(pickle.dumps(RECORDER))  # the rank's thread answered too
    assert nccl_diagnostics.watchdog_dumped(world)
    nccl_diagnostics.wait_for_dumps(world, [0], timeout=0)
    told = nccl_diagnostics.keep_dumps(world, [0], keep)
    assert told[0] == (
        "NCCL flight recorder: 3 collectives recorded; not completed: nccl:broadcast #8 started (sizes [[4, 4]]), "
        f"nccl:send 0->1 #3 scheduled (sizes [[16]]); dump {keep / 'nccl-trace-rank-0'} (dumped by torch's watchdog "
        "at the collective's timeout)"
    )


RECORDER = {
    "entries": [
        {"profiling_name": "nccl:all_reduce", "collective_seq_id": 7, "state": "completed", "input_sizes": [[8]]},
        {"profiling_name": "nccl:broadcast", "collective_seq_id": 8, "state": "started", "input_sizes": [[8]]},
        {"profiling_name": "nccl:all_gather", "collective_seq_id": 9, "state": "scheduled", "input_sizes": [[2]]},
    ]
}


def test_a_hung_ranks_flight_recorder_is_asked_for_kept_and_summarised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    world, keep = tmp_path / "world", tmp_path / "kept"
    world.mkdir()
    monkeypatch.setenv(workdir.NCCL_TRACE_FILE, str(world / workdir.NCCL_TRACE_PREFIX))
    nccl_recorder.serve_dump_request(1, dump=lambda: pickle.dumps(RECORDER), poll=0.01)
    time.sleep(0.05)
    assert not workdir.nccl_requested_file(world, 1).exists()  # nothing until the harness asks
    nccl_diagnostics.request_dumps(world)
    nccl_diagnostics.wait_for_dumps(world, [1], timeout=10)
    told = nccl_diagnostics.keep_dumps(world, [0, 1], keep)
    assert told[0] == (
        "NCCL flight recorder: no dump (no collective of the rank had reached torch's timeout, and its Python thread "
        "did not answer)"
    )
    assert told[1] == (
        "NCCL flight recorder: 3 collectives recorded; not completed: nccl:broadcast #8 started (sizes [[8]]), "
        f"nccl:all_gather #9 scheduled (sizes [[2]]); dump {keep / 'nccl-trace-rank-1.requested'} (dumped on request "
        "by the rank's Python thread)"
    )


def test_a_flight_recorder_dump_never_imports_anything() -> None:
    class Evil:
        def __reduce__(self) -> tuple[object, ...]:
            return (os.system, ("true",))

    assert nccl_diagnostics.summary(pickle.dumps({"entries": [Evil()]})).startswith(
        "unreadable (UnpicklingError: posix.system"
    )
    assert nccl_diagnostics.summary(pickle.dumps({"dsrepro_error": "RuntimeError: no recorder"})) == (
        "not dumped: RuntimeError: no recorder"
    )


def test_the_flight_recorders_own_thread_is_not_in_a_ranks_stacks() -> None:
    here = f"/site/pytest_dsrepro{nccl_diagnostics.HERE}"
    dump = (
        f'Thread 0x01 (most recent call first):\n  File "{here}", line 81 in serve\n  File "threading.py", line 982 in '
        'run\n\nThread 0x02 (most recent call first):\n  File "user.py", line 3 in worker\n\nCurrent thread 0x03 '
        '(most recent call first):\n  File "test_x.py", line 9 in test_hangs'
    )
    kept = nccl_diagnostics.without_recorder_thread(dump)
    assert here not in kept
    assert kept.startswith("Thread 0x02")
    assert kept.endswith("line 9 in test_hangs")


def test_a_poisoning_install_is_noted_for_later_fork_servers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server that found DeepSpeed poisoning its forks notes it; the next one for that install, accelerator and
    torch starts without DeepSpeed at once, instead of importing it only to restart."""
    from pytest_dsrepro.core import versions

    release = versions.resolved("deepspeed", "deepspeed")
    found = cuda_reexec.Deferred(
        "importing it initialises CUDA", str(release.version), str(release.path), "cuda", "nccl"
    )
    noted = cuda_reexec.verdict_file(tmp_path, release.version, release.path, "2.13.0", "cuda")
    noted.parent.mkdir(parents=True)
    noted.write_text(found.dumps())
    monkeypatch.delenv(cuda_reexec.DEFERRED, raising=False)
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    monkeypatch.setattr(device_nodes, "DEVICE_DIR", tmp_path)
    assert cuda_reexec.deferred(tmp_path, "2.13.0") is None  # a CPU machine never looks
    (tmp_path / "nvidia0").touch()
    assert cuda_reexec.deferred(tmp_path, "2.13.0") == dataclasses.replace(
        found, reason=f"importing it initialises CUDA; noted by an earlier fork server in {noted}"
    )
    assert cuda_reexec.deferred(tmp_path, "2.14.0") is None  # another torch: asked again
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert cuda_reexec.deferred(tmp_path, "2.13.0") is None  # another accelerator: asked again
