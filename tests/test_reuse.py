"""Declared reuse (``ds_world(reuse=True)``): a class's tests on the same ranks, each with a fresh process group, and
never a cascade: after a failure of its body the next test runs on the same ranks (as DeepSpeed's ``reuse_dist_env``
pool does), after a hang or a crash it gets a new world; nothing a test sets in its environment or DeepSpeed's
modules reaches the next one, and no test's verdict depends on reuse: what a kept rank cannot put back ends its world.

Each test runs pytest in a subprocess with real gloo worlds and real DeepSpeed; the ranks write their pids into the
test directory, which is how a test tells kept ranks from new ones.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import RunPytest, leftovers
from pytest_dsrepro.core import results

#: Helpers every test file below starts with: which rank process ran which test.
PIDS = """
import os
from pathlib import Path

import pytest

def note(name, rank):
    Path(f"pid-{name}-{rank}").write_text(str(os.getpid()))

def pid(name, rank):
    return int(Path(f"pid-{name}-{rank}").read_text())
"""


def test_a_reuse_class_runs_on_the_same_ranks_with_a_fresh_process_group_and_nothing_leaks(
    pytester: pytest.Pytester, run: RunPytest, private_tmp: Path
) -> None:
    """Three ZeRO-3 engines, written DeepSpeed's way, one after another on the same two processes: each test gets a
    new default process group, DeepSpeed's cached groups and comm layer are forgotten (else the second engine would
    use a destroyed group), and an environment variable or a patched DeepSpeed function set by one test is gone in
    the next. Another class gets ranks of its own."""
    pytester.makepyfile(
        PIDS
        + """
import deepspeed
import torch
import torch.distributed as dist

CONFIG = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "zero_optimization": {"stage": 3}}
class SEEN:  # the module lives as long as its ranks (a class, not a dict: a kept rank refills the module's
    group = None  # containers as the rank imported them, a class's attributes it leaves)

def step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.Adam(model.parameters()), config=CONFIG)
    engine.backward(torch.nn.functional.mse_loss(engine(torch.randn(2, 16)), torch.randn(2, 4)))
    engine.step()

@pytest.mark.ds_world(size=2, reuse=True)
class TestKept:
    def test_1_leaks(self, ds_rank):
        step()
        note("1", ds_rank)
        Path("port").write_text(os.environ["MASTER_PORT"])  # DeepSpeed's /dev/shm buffers are named after it
        SEEN.group = dist.group.WORLD
        os.environ["DSREPRO_LEAK"] = "1"
        deepspeed.comm.get_rank = lambda group=None: 99

    def test_2_finds_nothing(self, ds_rank):
        assert os.getpid() == pid("1", ds_rank)
        assert "DSREPRO_LEAK" not in os.environ
        assert deepspeed.comm.get_rank() == ds_rank
        assert dist.is_initialized() and dist.group.WORLD is not SEEN.group
        from deepspeed.utils import groups
        assert groups._WORLD_GROUP is None
        step()
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == 2

    def test_3_again(self, ds_rank):
        assert os.getpid() == pid("1", ds_rank)
        step()

@pytest.mark.ds_world(size=2, reuse=True)
class TestOther:
    def test_own_ranks(self, ds_rank):
        assert os.getpid() != pid("1", ds_rank)
"""
    )
    result = run("-v")
    result.assert_outcomes(passed=4)
    assert leftovers(private_tmp, [(pytester.path / "port").read_text()]) == []  # the kept world's buffers too


def test_faults_in_a_reused_world(pytester: pytest.Pytester, run: RunPytest, private_tmp: Path) -> None:
    """Faults injected in a reused gloo world: each fails its own test only, with its own story. After a failure of
    the body (one rank failed, the other passed, leaving a collective unmatched) the next test runs on the same ranks,
    with what the failed test set put back and a new group; after a hang or a crash it runs on new ranks. Either way
    it passes (no cascade), and is then kept again."""
    pytester.makepyfile(
        PIDS
        + """
import time

import torch
import torch.distributed as dist

@pytest.mark.ds_world(size=2, reuse=True, timeout=20)
class TestFaults:
    def test_1_passes(self, ds_rank):
        note("1", ds_rank)

    def test_2_fails(self, ds_rank):
        assert os.getpid() == pid("1", ds_rank)
        os.environ["DSREPRO_LEAK"] = "1"
        if ds_rank == 0:
            dist.all_reduce(torch.ones(1), async_op=True)  # never matched: rank 1 fails first
        assert ds_rank == 0, "rank 1 fails on purpose"

    def test_3_same_ranks(self, ds_rank):
        assert os.getpid() == pid("1", ds_rank)
        assert "DSREPRO_LEAK" not in os.environ
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == 2
        note("3", ds_rank)

    def test_4_hangs(self, ds_rank):
        assert os.getpid() == pid("3", ds_rank)
        time.sleep(3600)

    def test_5_new_world(self, ds_rank):
        assert os.getpid() != pid("3", ds_rank)
        note("5", ds_rank)

    def test_6_crashes(self, ds_rank):
        assert os.getpid() == pid("5", ds_rank)
        if ds_rank == 1:
            os._exit(7)

    def test_7_new_world(self, ds_rank):
        assert os.getpid() != pid("5", ds_rank)
        note("7", ds_rank)

    def test_8_kept_again(self, ds_rank):
        assert os.getpid() == pid("7", ds_rank)
"""
    )
    result = run("-v")
    result.assert_outcomes(passed=5, failed=3)
    result.stdout.fnmatch_lines(
        [
            "*::TestFaults::test_2_fails - WorldFailed: rank 1: AssertionError: rank 1 fails on purpose*",
            "*::TestFaults::test_4_hangs - WorldFailed: ranks 0-1: hung: still running when the 20s world timeout*",
            "*::TestFaults::test_6_crashes - WorldFailed: rank 1: crashed: exit code 7*",
        ]
    )
    result.stdout.fnmatch_lines(["*(2-rank gloo world, on ranks kept from an earlier test (reuse=True), *"])
    assert leftovers(private_tmp) == []


#: A failed rank whose peer waits on it in a group the failed body still holds (as a failed engine holds its groups).
PEER_WAITS = """
import torch
import torch.distributed as dist

@pytest.mark.ds_world(size=2, reuse=True, timeout=120)
class TestPeerWaits:
    def test_1_fails_while_its_peer_waits(self, ds_rank):
        note("1", ds_rank)
        held = dist.new_group([0, 1])
        if ds_rank == 0:
            raise AssertionError("rank 0 fails on purpose")
        dist.recv(torch.zeros(1), src=0, group=held)

    def test_2_fresh_ranks(self, ds_rank):
        note("2", ds_rank)

    def test_3_kept(self, ds_rank):
        assert os.getpid() == pid("2", ds_rank)
"""


def test_a_failed_rank_whose_peer_waits_on_it_leaves_the_world(pytester: pytest.Pytester, run: RunPytest,
                                                                private_tmp: Path) -> None:  # fmt: skip
    """A rank of a reused gloo world whose body failed while a peer's runs on leaves the world, as a fresh rank's
    exit would: the peer waiting on it loses it at once (not stopped after the failure grace), and the next test
    gets fresh ranks, kept again after it."""
    pytester.makepyfile(PIDS + PEER_WAITS)
    result = run("-v")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines([
        "*::test_1_fails_while_its_peer_waits - WorldFailed: rank 0: AssertionError: rank 0 fails on purpose; "
        "rank 1 (lost a*",
    ])  # fmt: skip
    result.stdout.fnmatch_lines(["*not kept for the next test, which gets fresh ranks: rank 0: its body ended failed "
                                 "while a peer's ran on*"])  # fmt: skip
    assert "stopped" not in result.stdout.str()
    assert [pytester.path.joinpath(f"pid-1-{r}").read_text() == pytester.path.joinpath(f"pid-2-{r}").read_text()
            for r in range(2)] == [False, False]  # fmt: skip
    assert leftovers(private_tmp) == []


#: One reuse scope with every kind of leftover the issue names, each left by one test and looked for by the next (the
#: ``{reuse}`` of its markers filled in twice), and three gated repros whose first leaves float64 behind. Each test notes
#: which process ran it.
LEFTOVERS = """
import fcntl, io, random, sys, threading, time

import deepspeed
import torch

CONFIG = {{"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "zero_optimization": {{"stage": 3}}}}
HELD = []  # the module lives as long as its ranks


def zero3_step():
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.Adam(model.parameters()), config=CONFIG)
    engine.backward(torch.nn.functional.mse_loss(engine(torch.ones(2, 16)), torch.ones(2, 4)))
    engine.step()


@pytest.mark.ds_world(size=2, reuse={reuse}, timeout=120)
class TestLeftovers:
    def test_01_monkeypatch(self, ds_rank, monkeypatch):
        note("01", ds_rank)
        monkeypatch.setattr(torch, "ones", lambda *shape, **kw: torch.full(shape, 2.0))

    def test_02_should_fail(self, ds_rank):
        note("02", ds_rank)
        assert torch.ones(1).item() == 2, "torch.ones is torch's own again"

    def test_03_replaces_a_function(self, ds_rank):
        note("03", ds_rank)
        torch.nn.functional.gelu = lambda x: x * 0

    def test_04_default_dtype(self, ds_rank):
        note("04", ds_rank)
        assert torch.nn.functional.gelu(torch.ones(1)).item() > 0.8
        torch.set_default_dtype(torch.float64)

    def test_05_grad_mode_and_fails(self, ds_rank):
        note("05", ds_rank)
        assert torch.get_default_dtype() == torch.float32
        torch.set_grad_enabled(False)
        assert ds_rank < 0, "fails, leaving grad mode off"

    def test_06_zero_init_left_entered(self, ds_rank):
        note("06", ds_rank)
        assert torch.is_grad_enabled()
        deepspeed.zero.Init(config_dict_or_path=CONFIG).__enter__()
        torch.nn.Linear(4, 4)

    def test_07_zero3_engine(self, ds_rank):
        note("07", ds_rank)
        from deepspeed.runtime.zero.partition_parameters import Init
        assert Init.param_id == 0 and torch.nn.Linear(4, 4).weight.numel() == 16  # Init left, nothing partitioned
        zero3_step()  # moves Init.param_id on and swaps torch.nn.functional.linear: both put back

    def test_08_thread(self, ds_rank):
        note("08", ds_rank)
        from deepspeed.runtime.zero.partition_parameters import Init
        assert Init.param_id == 0 and torch.nn.functional.linear is torch._C._nn.linear
        zero3_step()
        threading.Thread(target=time.sleep, args=(120,), daemon=True).start()

    def test_09_file_lock(self, ds_rank):
        note("09", ds_rank)
        assert threading.active_count() == 1
        HELD.append(open(f"lock-{{ds_rank}}", "w"))
        fcntl.flock(HELD[-1], fcntl.LOCK_EX | fcntl.LOCK_NB)

    def test_10_random_streams(self, ds_rank):
        note("10", ds_rank)
        with open(f"lock-{{ds_rank}}", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free again
        Path(f"draw-{{ds_rank}}").write_text(repr(torch.rand(3).tolist()))
        torch.rand(1000)

    def test_11_stdout(self, ds_rank):
        note("11", ds_rank)
        assert repr(torch.rand(3).tolist()) == Path(f"draw-{{ds_rank}}").read_text()
        sys.stdout = io.StringIO()

    def test_12_last(self, ds_rank):
        note("12", ds_rank)
        print("the plugin's own code writes to sys.stdout")


@pytest.mark.ds_world(size=2, reuse={reuse})
class TestGated:
    @pytest.mark.ds_version(affected=">=0", raises=ValueError, match="broke")
    def test_1_leaves_float64(self, ds_rank):
        torch.set_default_dtype(torch.float64)
        raise ValueError("it broke")

    @pytest.mark.ds_version(affected=">=0", raises=ValueError, match="broke")
    def test_2(self, ds_rank):
        assert torch.get_default_dtype() == torch.float32
        raise ValueError("it broke")

    @pytest.mark.ds_version(affected=">=0", raises=ValueError, match="broke")
    def test_3(self, ds_rank):
        assert torch.get_default_dtype() == torch.float32
        raise ValueError("it broke")
"""


def _verdicts(directory: Path) -> dict[str, tuple[str, str | None]]:
    """Each test's pytest outcome and verdict, from the run's results file."""
    (path,) = directory.glob("*.json")
    return {t.nodeid.split("::", 1)[1]: (t.outcome, t.verdict and t.verdict.value) for t in results.read(path).tests}


def test_no_verdict_depends_on_reuse(pytester: pytest.Pytester, run: RunPytest, private_tmp: Path) -> None:
    """Issue 49, item 1: the same scope run with reuse and without, every kind of leftover in it (a ``monkeypatch``,
    a replaced function, torch's default dtype and grad mode, ``zero.Init`` left entered, ``Init.param_id`` and
    DeepSpeed's swapped ``F.linear``, a thread, a file lock, diverged random streams, a replaced ``sys.stdout``) and
    three gated repros whose first leaves float64: every test gets the same outcome and verdict both ways. With reuse,
    a test that leaves what cannot be put back ends its world (the next test runs on new ranks); one that leaves only
    what is put back does not."""
    outcomes = {}
    for reuse in (False, True):
        pytester.makepyfile(test_leftovers=PIDS + LEFTOVERS.format(reuse=reuse))
        result = run("-v", f"--ds-results=results-{reuse}")
        outcomes[reuse] = _verdicts(pytester.path / f"results-{reuse}")
        assert leftovers(private_tmp) == []
    assert outcomes[True] == outcomes[False]
    failed = {name for name, (outcome, _) in outcomes[True].items() if outcome == "failed"}
    assert failed == {"TestLeftovers::test_02_should_fail", "TestLeftovers::test_05_grad_mode_and_fails"}
    gated = {name: verdict for name, (_, verdict) in outcomes[True].items() if name.startswith("TestGated")}
    assert set(gated.values()) == {"REPRODUCED"}, gated
    result.stdout.fnmatch_lines(
        ["*not kept for the next test, which gets fresh ranks: rank 0: grad mode (torch.set_grad_enabled, *"]
    )

    def same(a: str, b: str) -> bool:
        return all(pid(a, r) == pid(b, r) for r in range(2))

    def pid(name: str, rank: int) -> int:
        return int((pytester.path / f"pid-{name}-{rank}").read_text())

    kept = [("01", "02"), ("07", "08"), ("10", "11")]  # a monkeypatch undone; a ZeRO-3 engine; random streams drawn
    ended = [("03", "04"), ("04", "05"), ("05", "06"), ("06", "07"), ("08", "09"), ("09", "10"), ("11", "12")]
    assert [pair for pair in kept if not same(*pair)] == []
    assert [pair for pair in ended if same(*pair)] == []


#: A test module's own containers, filled in place by a failed test: the next test on the kept ranks finds them as a
#: fresh rank imports them.
MODULE_STATE = """
SEEN = []
BY_NAME = {"first": 1}


@pytest.mark.ds_world(size=2, reuse=True, timeout=120)
class TestModuleState:
    def test_1_fills_and_fails(self, ds_rank):
        note("1", ds_rank)
        SEEN.append(ds_rank)
        BY_NAME["added"] = 2
        del BY_NAME["first"]
        raise AssertionError("fails on purpose, its globals filled")

    def test_2_finds_them_as_imported(self, ds_rank):
        note("2", ds_rank)
        assert pid("1", ds_rank) == pid("2", ds_rank)  # the same ranks
        assert SEEN == []
        assert BY_NAME == {"first": 1}
"""


def test_a_kept_rank_puts_back_the_test_modules_containers(pytester: pytest.Pytester, run: RunPytest) -> None:
    """Issue 54, item 4: a list a failed test appended to, a dict it changed, are as imported for the next test on
    the same ranks, as on fresh ones."""
    pytester.makepyfile(test_module_state=PIDS + MODULE_STATE)
    result = run("-v")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*test_2_finds_them_as_imported PASSED*"])
