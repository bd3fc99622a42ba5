"""The typed wire protocol and the rank report, without a world: what crosses a process boundary, and how."""

from __future__ import annotations

import dataclasses
import mmap
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import RunPytest
from pytest_dsrepro.core.outcome import ErrorInfo, RankResult, Status
from pytest_dsrepro.worlds import protocol, shm, workdir
from pytest_dsrepro.worlds.client import ForkServer
from pytest_dsrepro.worlds.client.world_run import _user_frames
from pytest_dsrepro.worlds.protocol import (
    CLIENT_MESSAGES,
    SERVER_MESSAGES,
    BuildEnded,
    Building,
    DumpStacks,
    Exited,
    FinishBuild,
    Finished,
    Hello,
    Kill,
    OpWait,
    RankJob,
    RankReport,
    RankValue,
    Reap,
    Reaped,
    ServerFacts,
    Spawn,
    Spawned,
    TestRef,
    WorldEnded,
)

FACTS = ServerFacts(
    pid=7, torch="2.13.0+cpu", deepspeed="0.19.8", cuda_devices=0, comm_op="loaded", comm_op_seconds=0.1
)
REF = TestRef("test_mod", "/tmp/test_mod.py", "TestGroup.test_x", ("/tmp",), "/tmp")
MESSAGES = [
    Hello(FACTS),
    Building("building DeepSpeed's CPU comm op for 0.19.8, first time only"),
    Spawned(1, (101, 102)),
    Spawned(2, (103,), "1500 modules in 2.0s (list cached)", "a thread"),
    Spawned(3, (101, 102), reused=True),
    Exited(1, 0, -9, at=12.5),
    Finished(3, 1, at=13.0),
    WorldEnded(1),
    Reaped(1),
    Spawn(1, pickle.dumps(RankJob(REF, b"payload", "gloo", 30.0)), 2, "/tmp/world"),
    Spawn(3, pickle.dumps(RankJob(REF, b"payload", "gloo", 30.0)), 2, "/tmp/world", reuse="t.py::TestX [2 gloo]"),
    DumpStacks(1, (0, 1)),
    Kill(1, (1,)),
    Reap(1),
    Reap(3, keep=True),
    FinishBuild(),
    BuildEnded("DeepSpeed's CPU comm op for 0.19.8 built beside the worlds in 70s"),
    OpWait(2, at=14.0, waiting=True),
    OpWait(2, at=84.0, waiting=False),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_is_a_frozen_dataclass_that_pickles(message: object) -> None:
    assert dataclasses.is_dataclass(message)
    assert pickle.loads(pickle.dumps(message)) == message
    field = next((f.name for f in dataclasses.fields(message)), "any")  # FinishBuild has none: no new one either
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(message, field, None)


def test_each_side_knows_every_message_of_the_other() -> None:
    assert {type(m) for m in MESSAGES} == set(SERVER_MESSAGES) | set(CLIENT_MESSAGES)
    assert not set(SERVER_MESSAGES) & set(CLIENT_MESSAGES)


def test_the_protocol_and_the_client_import_neither_torch_nor_pytest() -> None:
    """The pytest process unpickles every message: nothing in them may pull torch (or pytest itself) in."""
    code = (
        "import sys, pickle\n"
        "from pytest_dsrepro.worlds import client, protocol\n"
        f"pickle.loads({pickle.dumps(MESSAGES)!r})\n"
        "print(sorted(m for m in ('torch', 'deepspeed', 'pytest', '_pytest') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_pytest_has_no_torch_after_worlds_of_every_ending(pytester: pytest.Pytester, run: RunPytest) -> None:
    """Facts, reports and verdicts cross as plain data: after worlds that passed, failed with torch's own error,
    skipped in a rank and built a DeepSpeed engine (the fork server then preloads), the pytest process still has
    neither torch nor DeepSpeed (unpickling one TorchVersion would import all of torch: a second, ~200 MiB)."""
    pytester.makepyfile(
        """
        import sys
        import pytest

        @pytest.mark.ds_world
        def test_1_passes(ds_rank):
            import torch.distributed as dist
            dist.barrier()

        @pytest.mark.ds_world
        def test_2_fails_with_torchs_error(ds_rank):
            import torch
            torch.zeros(2, 3) @ torch.zeros(2, 3)

        @pytest.mark.ds_world
        def test_3_skips_in_its_ranks(ds_rank):
            pytest.skip("skipped in the rank")

        @pytest.mark.ds_world
        @pytest.mark.ds_config("zero1")
        def test_4_builds_an_engine(ds_engine):
            ds_engine()

        def test_5_pytest_has_neither():
            assert [m for m in ("torch", "deepspeed") if m in sys.modules] == []
        """
    )
    result = run("-rs")
    result.assert_outcomes(passed=3, failed=1, skipped=1)
    result.stdout.fnmatch_lines(["*RuntimeError: mat1 and mat2 shapes cannot be multiplied*", "*skipped in the rank*"])


def test_a_fork_hazard_the_server_reports_is_kept_and_shown(tmp_path: Path) -> None:
    """Never expected (preloading is vetted), but never silent: a world forked with a thread in the server is told
    in ``Spawned`` and shown in 'worlds ran on' for the rest of the run."""
    server = ForkServer(tmp_path, startup_timeout=1)
    server.facts = dataclasses.replace(FACTS, accelerator="cpu", accelerator_backend="gloo")
    server.noted_preload("1500 modules in 2.0s (list cached)", None)
    assert "WARNING" not in server.facts.describe()
    server.noted_preload(None, "a thread")
    server.noted_preload(None, None)  # a later world forked safely: what happened once stays told
    assert server.facts.fork_hazard == "a thread"
    assert server.facts.describe().endswith("; WARNING: the fork server forks with a thread")


def test_a_rank_report_becomes_that_ranks_result() -> None:
    error = ErrorInfo.from_exception(ValueError("bad"), "Traceback ...")
    assert RankReport(Status.FAILED, error=error).result(3, "out") == RankResult(
        3, Status.FAILED, error=error, output="out"
    )
    assert RankReport(Status.SKIPPED, detail="no GPU").result(0) == RankResult(0, Status.SKIPPED, detail="no GPU")


def test_the_report_file_round_trips_and_only_holds_a_report(tmp_path: Path) -> None:
    assert protocol.read_report(tmp_path, 0) is None  # the rank wrote nothing: a crash, judged by the client
    report = RankReport(Status.SKIPPED, detail="needs a bigger machine")
    protocol.write_report(tmp_path, 0, report)
    assert protocol.read_report(tmp_path, 0) == report
    assert [p.name for p in tmp_path.iterdir()] == [workdir.result_file(tmp_path, 0).name]  # no temporary left
    workdir.result_file(tmp_path, 1).write_bytes(pickle.dumps({"status": Status.PASSED}))
    with pytest.raises(TypeError, match="holds a dict, not a RankReport"):
        protocol.read_report(tmp_path, 1)


def test_rank_values_and_test_refs_are_plain_data() -> None:
    assert pickle.loads(pickle.dumps(RankValue("rank"))) == RankValue("rank")
    assert TestRef.__test__ is False  # never collected by pytest, whatever the name says


def test_stack_dumps_keep_only_the_users_frames() -> None:
    harness = Path("/site-packages/pytest_dsrepro/worlds")
    dump = "\n".join(
        [
            "Current thread 0x00007f (most recent call first):",
            '  File "/usr/lib/python3.11/threading.py", line 320 in wait',
            '  File "/tmp/test_hang.py", line 10 in test_hangs',
            f'  File "{harness / "rank" / "body.py"}", line 170 in run_body',
            f'  File "{harness / "rank" / "spawned_rank.py"}", line 118 in rank_life',
            '  File "<frozen runpy>", line 88 in _run_code',
        ]
    )
    assert _user_frames(dump).splitlines() == dump.splitlines()[:3]


def _buffer(shm_dir: Path, port: int, rank: int, addr: str = "127.0.0.1") -> Path:
    """A file named as DeepSpeed names a rank's allreduce buffer (csrc/cpu/comm/shm.cpp), in ``shm_dir``."""
    path = shm_dir / f"{shm.PREFIX}{os.getuid()}_{addr}_{port}_{rank}"
    path.write_bytes(b"\0" * 4096)
    return path


def test_the_buffers_a_process_maps_are_found_whatever_port_named_them(tmp_path: Path) -> None:
    """Issue 49, item 4: the fork server reads a rank's maps before it kills it; here this process maps one."""
    mapped, other = _buffer(tmp_path, 41234, 0), _buffer(tmp_path, 41234, 1)
    with mapped.open("r+b") as f, mmap.mmap(f.fileno(), 4096):
        assert shm.mapped_by([os.getpid()], tmp_path) == {mapped}
    assert shm.mapped_by([os.getpid()], tmp_path) == set()
    assert other.exists()


def test_every_ranks_buffer_of_a_group_one_of_them_names_goes(tmp_path: Path) -> None:
    """A rank that died before its peers opened its buffer is in no survivor's maps: its group's name finds it."""
    group = [_buffer(tmp_path, 5000, r) for r in range(3)]
    others = [_buffer(tmp_path, 50001, 0), _buffer(tmp_path, 5000, 0, addr="10.0.0.1"), tmp_path / "unrelated_5000_0"]
    others[-1].write_text("")
    assert shm.group_buffers([group[1]], tmp_path) == group
    shm.remove(shm.group_buffers([group[1]], tmp_path))
    assert [p for p in group + others if p.exists()] == others


def test_a_world_directory_names_the_port_of_a_bodys_own_group(tmp_path: Path) -> None:
    """Rank 0 notes the group's port before the body runs: a world whose every rank died still has it removed (in
    the real /dev/shm, on a port no socket can have)."""
    port = 9_000_000 + os.getpid()
    buffers = [_buffer(shm.SHM_DIR, port, r) for r in range(2)]
    try:
        workdir.group_port_file(tmp_path).write_text(str(port))
        workdir.discard(tmp_path)
        assert not tmp_path.exists()
        assert [p for p in buffers if p.exists()] == []
    finally:
        shm.remove(buffers)


def test_a_world_directory_removed_meanwhile_is_no_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pytest and the fork server may discard one world's directory at once (a world whose ranks all exited on their
    own, issue 53): the one that finds it gone under its feet goes on (the server died of it once)."""
    directory = tmp_path / "world"
    directory.mkdir()
    (directory / "buffers-0.txt").write_text("")

    def removed_meanwhile(self: Path, pattern: str) -> list[Path]:
        shutil.rmtree(self)
        raise FileNotFoundError(2, "No such file or directory", str(self))

    monkeypatch.setattr(Path, "glob", removed_meanwhile)
    workdir.discard(directory)
    assert not directory.exists()
    assert workdir.read_text(directory / "store_port") == ""
