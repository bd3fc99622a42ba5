"""Faults injected for real (issues 11, 27, 38 and 49): how long each takes to reach its verdict, what is left after
it, and how many worlds in a row run without a flake. Numbers to compare release to release; tests/test_faults.py
holds the assertions on what the user reads (tests/test_matrix_command.py for ``dsrepro matrix``'s, 19 and 20;
tests/test_shards.py, test_scaffold.py, test_packaging.py, test_install.py and test_run_end.py for issue 49's).

Each fault runs pytest in a subprocess, in a directory of its own, with its own TMPDIR (world directories and
server logs land there) and a tag in the environment that every process it starts inherits. "Leftovers" counts,
after pytest has exited (and 2 s more): tagged processes still running, DeepSpeed /dev/shm buffers that appeared,
world directories and server logs in its TMPDIR, torch build locks in its cache.

    python benchmarks/faults.py [--worlds 700] [--only NAME ...] [--json PATH]

Run the plugin of another tree by putting it first on PYTHONPATH (the fork server follows the plugin's own tree).
Run it on a quiet machine: /dev/shm buffers that other processes' worlds make meanwhile count as leftovers.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

TAG = "DSREPRO_BENCH_TAG"
SHM = Path("/dev/shm")
PYTEST = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly"]


@dataclass
class Figure:
    fault: str
    seconds: float | None  # to the verdict (or to pytest's exit after the interruption)
    sees: str  # what the user sees, in one line
    leftovers: list[str] = field(default_factory=list)
    extra: dict[str, object] = field(default_factory=dict)


class Run:
    """One pytest in a subprocess, in its own directory, TMPDIR and process tag; its output read as it comes."""

    def __init__(self, workdir: Path, body: str, *args: str, cache: Path | None = None) -> None:
        self.dir = workdir
        self.tmp = workdir / "tmp"
        self.tmp.mkdir(parents=True)
        (workdir / "test_fault.py").write_text(textwrap.dedent(body))
        self.tag = uuid.uuid4().hex
        env = dict(os.environ, TMPDIR=str(self.tmp), COLUMNS="200")
        env[TAG] = self.tag
        if cache is not None:
            env["DSREPRO_CACHE_DIR"] = str(cache)
        self.shm_before = set(SHM.glob("deepspeed_allreduce_buffer_*"))
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [*PYTEST, *args], cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.peak_rss = 0

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def out(self) -> str:
        return "\n".join(self.lines)

    def processes(self) -> list[psutil.Process]:
        found = []
        for p in psutil.process_iter():
            try:
                if p.environ().get(TAG) == self.tag and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return found

    def wait_for(self, condition: Callable[[], bool], timeout: float = 240) -> bool:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                return condition()
            time.sleep(0.05)
        return True

    def finish(self, timeout: float = 600, watch_rss: bool = False) -> float:
        """Wait for pytest to exit; seconds since ``started``."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            if watch_rss:
                try:
                    self.peak_rss = max(self.peak_rss, psutil.Process(self.proc.pid).memory_info().rss)
                except psutil.NoSuchProcess:
                    break
            time.sleep(0.02)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        elapsed = time.monotonic() - self.started
        self.reader.join(5)
        return elapsed

    def leftovers(self, cache: Path | None = None) -> list[str]:
        time.sleep(2)  # what is still going away is not a leftover
        left = [f"process {p.name()}" for p in self.processes()]
        for p in self.processes():
            p.kill()  # leave the machine clean for the next fault
        left += [f"shm {p.name}" for p in set(SHM.glob("deepspeed_allreduce_buffer_*")) - self.shm_before]
        left += [f"tmp {p.name}" for p in self.tmp.glob("dsrepro-*")]
        if cache is not None:
            left += [f"torch lock {p.relative_to(cache)}" for p in cache.rglob("lock")]
        return left

    def first(self, *prefixes: str) -> str:
        return next((line for line in self.lines if line.startswith(prefixes)), "")


ONE_WORLD = "import pytest\n\n@pytest.mark.ds_world\ndef test_x(ds_rank):\n    pass\n"
SLEEPING_WORLD = """
    import os, time
    import pytest

    @pytest.mark.ds_world(timeout=600)
    def test_sleeps(ds_rank):
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo")
        with open(f"ready-{ds_rank}", "w") as f:
            f.write(os.environ["MASTER_PORT"])
        time.sleep(3600)
"""


def ready(run: Run) -> Callable[[], bool]:
    return lambda: all((run.dir / f"ready-{r}").exists() for r in range(2))


def ctrl_c_during_build(base: Path) -> Figure:
    cache = base / "cold-cache"
    run = Run(base, ONE_WORLD, cache=cache)
    building = run.wait_for(lambda: any(p.name() == "cc1plus" for p in run.processes()))
    announced = any("building DeepSpeed's CPU comm op" in line for line in run.lines)
    pressed = time.monotonic()
    run.proc.send_signal(signal.SIGINT)
    run.finish()
    seconds = time.monotonic() - pressed
    sees = f"compilers running: {building}; build announced: {announced}; exit {run.proc.returncode}"
    return Figure("1 ctrl-c during the first build", seconds, sees, run.leftovers(cache))


def ctrl_c_mid_world(base: Path, presses: int) -> Figure:
    run = Run(base, SLEEPING_WORLD)
    run.wait_for(ready(run))
    pressed = time.monotonic()
    run.proc.send_signal(signal.SIGINT)
    for _ in range(presses - 1):
        time.sleep(0.5)
        if run.proc.poll() is None:
            run.proc.send_signal(signal.SIGINT)
    run.finish()
    seconds = time.monotonic() - pressed
    name = "2 ctrl-c twice (0.5 s apart) mid-world" if presses > 1 else "3 ctrl-c once mid-world"
    return Figure(name, seconds, f"exit {run.proc.returncode}", run.leftovers())


def crash_after_result(base: Path) -> Figure:
    run = Run(
        base,
        """
        import os, signal
        import pytest

        @pytest.mark.ds_world
        def test_dies_on_exit(ds_rank):
            if ds_rank == 1:
                os._exit = lambda code: os.kill(os.getpid(), signal.SIGSEGV)
        """,
    )
    seconds = run.finish()
    sees = run.first("rank ", "ranks ") or next((line for line in run.lines if " passed" in line), "?")
    return Figure("4 rank crashes after writing PASSED", seconds, sees, run.leftovers())


def server_death(base: Path) -> Figure:
    run = Run(
        base,
        """
        import os, signal, time
        import pytest

        @pytest.mark.ds_world(timeout=30)
        def test_server_dies(ds_rank):
            if ds_rank == 0:
                os.kill(os.getppid(), signal.SIGKILL)
            time.sleep(3600)
        """,
    )
    started = time.monotonic()
    cpu = 0.0
    me = psutil.Process(run.proc.pid)
    while run.proc.poll() is None:
        try:
            cpu = sum(me.cpu_times()[:2])
        except psutil.NoSuchProcess:
            break
        time.sleep(0.1)
    seconds = run.finish()
    sees = run.first("pytest-dsrepro could not run", "ranks ", "rank ")[:150]
    return Figure(
        "6 fork server dies mid-world",
        seconds,
        sees,
        run.leftovers(),
        {"pytest_cpu_seconds": round(cpu, 1), "wall": round(time.monotonic() - started, 1)},
    )


def timeout_plugin(base: Path) -> Figure:
    try:
        import pytest_timeout  # noqa: F401
    except ImportError:
        return Figure("3 pytest-timeout fires (5 s)", None, "pytest-timeout not installed: not measured")
    run = Run(
        base,
        """
        import time
        import pytest

        @pytest.mark.timeout(5)
        @pytest.mark.ds_world(timeout=600)
        def test_hangs(ds_rank):
            import torch.distributed as dist
            if ds_rank == 0:
                dist.barrier()
            else:
                time.sleep(3600)
        """,
        "-p",
        "timeout",
    )
    seconds = run.finish()
    failures = run.out.split("= FAILURES =")[-1].split("short test summary")[0]
    stacks = failures.count("Python stacks when hung")
    return Figure(
        "3 pytest-timeout fires (5 s)",
        seconds,
        f"rank stacks shown: {stacks}; failure text: {len(failures.splitlines())} lines",
        run.leftovers(),
    )


def world_too_big(base: Path) -> Figure:
    base.mkdir(parents=True)
    helptext = subprocess.run([*PYTEST, "--help"], capture_output=True, text=True, cwd=base).stdout
    if "--ds-max-world-size" not in helptext:
        return Figure("7 --ds-world-size 100000", None, "no limit: not run (it forks until fork() fails)")
    run = Run(base / "run", ONE_WORLD, "--ds-world-size", "100000")
    seconds = run.finish()
    return Figure("7 --ds-world-size 100000", seconds, run.first("ERROR:")[:150], run.leftovers())


def output_flood(base: Path) -> Figure:
    run = Run(
        base,
        """
        import pytest

        @pytest.mark.ds_world
        def test_floods(ds_rank):
            if ds_rank == 0:
                print("x" * 10_000_000)
            else:
                for i in range(2_000_000):
                    print(f"line {i:>12} of a rank that prints in a loop")
            raise RuntimeError("flooded")
        """,
        "--junitxml=junit.xml",
        "--ds-results=results",
    )
    seconds = run.finish(watch_rss=True)
    results = sum(p.stat().st_size for p in (base / "results").glob("*.json"))
    junit = (base / "junit.xml").stat().st_size if (base / "junit.xml").exists() else 0
    rss = run.peak_rss >> 20
    sees = f"terminal {len(run.out):,} B, results {results:,} B, junit {junit:,} B, pytest peak RSS {rss} MiB"
    return Figure("8 ranks print 10 MB + 100 MB", seconds, sees, run.leftovers())


def input_errors(base: Path) -> Figure:
    run = Run(
        base,
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
        """,
    )
    seconds = run.finish()
    told = sum(("unknown preset 'zero9'" in line or "cannot be sent to the ranks" in line) for line in run.lines)
    return Figure("11 preset typo + unpicklable fixture (warm cache)", seconds, f"{told} error lines", run.leftovers())


def cause_first(base: Path) -> Figure:
    run = Run(
        base,
        """
        import ctypes, time
        import pytest

        @pytest.mark.ds_world
        def test_segfaults(ds_rank):
            import torch, torch.distributed as dist
            if ds_rank == 1:
                time.sleep(0.3)
                ctypes.string_at(0)
            dist.all_reduce(torch.ones(1))
        """,
    )
    seconds = run.finish()
    summary = run.first("FAILED")
    stack = "Fatal Python error: Segmentation fault" in run.out
    sees = f"summary: {summary.split(' - ', 1)[-1][:90]}; crashed rank's stack shown: {stack}"
    return Figure("10 rank segfaults while its peer waits", seconds, sees, run.leftovers())


def flakes(base: Path, worlds: int) -> Figure:
    run = Run(
        base,
        f"""
        import pytest

        @pytest.mark.ds_world
        @pytest.mark.parametrize("i", range({worlds}))
        def test_empty(ds_rank, i):
            pass
        """,
        "-q",
    )
    seconds = run.finish(timeout=3600)
    counted = (line for line in reversed(run.lines) if " in " in line and ("passed" in line or "failed" in line))
    summary = next(counted, "")
    failed = sum(line.startswith("FAILED") for line in run.lines)
    return Figure(
        f"5 {worlds} worlds whose body runs no collective",
        seconds,
        f"{failed} failed ({summary.strip('= ')})",
        run.leftovers(),
        {"flakes": failed, "worlds": worlds},
    )


# ---- issue 27: the newer surfaces --------------------------------------------------------------------------------


def _built_op() -> Path:
    """This environment's comm-op directory in the real cache, built there first if it is not (a warm-up world)."""
    code = "from pytest_dsrepro.worlds.server.comm_op import op_directory; print(op_directory())"
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    found = Path(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
                 .stdout.strip().splitlines()[-1])  # fmt: skip
    if not (found / "deepspeed_shm_comm").is_dir():
        with tempfile.TemporaryDirectory() as tmp:
            Run(Path(tmp), ONE_WORLD).finish(timeout=1800)
    return found


def _cache_with_op(base: Path) -> tuple[Path, Path]:
    """A private cache holding a copy of the built op: ``(cache, its shared object)``."""
    source = _built_op()
    cache = base / "cache"
    shutil.copytree(source, cache / "torch_extensions" / source.name)
    return cache, cache / "torch_extensions" / source.name / "deepspeed_shm_comm" / "deepspeed_shm_comm.so"


@contextlib.contextmanager
def _read_only(path: Path) -> Iterator[None]:
    """Nothing under ``path`` can be written, root included (immutable for root, permission bits for others)."""
    root = os.geteuid() == 0
    if root:
        subprocess.run(["chattr", "-R", "+i", str(path)], check=True, capture_output=True)
    else:
        subprocess.run(["chmod", "-R", "a-w", str(path)], check=True)
    try:
        yield
    finally:
        if root:
            subprocess.run(["chattr", "-R", "-i", str(path)], capture_output=True)
        else:
            subprocess.run(["chmod", "-R", "u+w", str(path)])


def damaged_cache(base: Path) -> Figure:
    cache, library = _cache_with_op(base / "setup")
    library.write_bytes(library.read_bytes()[: library.stat().st_size // 3])
    run = Run(base / "run", ONE_WORLD, cache=cache)
    seconds = run.finish(timeout=1800)
    discarded = run.first("pytest-dsrepro: the cached build")[:110]
    return Figure("12 a truncated comm-op build in the cache", seconds, f"{discarded}...; {run.lines[-1].strip('= ')}",
                  run.leftovers(cache))  # fmt: skip


def read_only_cache(base: Path) -> Figure:
    cache, _ = _cache_with_op(base / "setup")
    with _read_only(cache):
        run = Run(base / "run", ONE_WORLD, cache=cache)
        seconds = run.finish()
    said = run.first("pytest-dsrepro: the cache directory")[:100]
    return Figure("13 a read-only cache holding the build", seconds, f"{said}...; {run.lines[-1].strip('= ')}",
                  run.leftovers())  # fmt: skip


def read_only_cold_cache(base: Path) -> Figure:
    cache = base / "empty-cache"
    cache.mkdir(parents=True)
    with _read_only(cache):
        run = Run(base / "run", ONE_WORLD, cache=cache)
        seconds = run.finish()
    return Figure("14 a read-only cache holding nothing", seconds, f"exit {run.proc.returncode}: " +
                  run.first("! _pytest.outcomes.Exit")[:110], run.leftovers())  # fmt: skip


def unwritable_outputs(base: Path) -> Figure:
    locked = base / "locked"
    locked.mkdir(parents=True)
    with _read_only(locked):
        run = Run(base / "run", ONE_WORLD, f"--ds-results={locked / 'r'}", f"--junitxml={locked / 'j.xml'}")
        seconds = run.finish()
    return Figure("15 --ds-results and --junitxml unwritable", seconds,
                  f"exit {run.proc.returncode}: {run.first('ERROR:')[:110]}", run.leftovers())  # fmt: skip


def outputs_lost_at_end(base: Path) -> Figure:
    run = Run(
        base,
        """
        import shutil
        import pytest

        @pytest.mark.ds_world
        def test_takes_the_path(ds_rank):
            if ds_rank == 0:
                shutil.rmtree("results")
                open("results", "w").close()
        """,
        "--ds-results=results",
    )
    seconds = run.finish()
    return Figure("16 the results directory gone at the end", seconds,
                  f"exit {run.proc.returncode}: {run.first('pytest-dsrepro: NOT SAVED')}", run.leftovers())  # fmt: skip


def _tagged(command: list[str], base: Path, **more: str) -> tuple[subprocess.Popen[str], str]:
    """``command`` in ``base``, in a session of its own (as a shell's job), every process it starts tagged."""
    tag = uuid.uuid4().hex
    env = dict(os.environ, TMPDIR=str(base), COLUMNS="200", **{TAG: tag}, **more)
    proc = subprocess.Popen(command, cwd=base, env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    return proc, tag


def _left(tag: str) -> list[str]:
    """Tagged processes still running 2 s after the end (killed, so that the next fault starts clean)."""
    time.sleep(2)
    left = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if p.environ().get(TAG) == tag and p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"process {p.name()}")
                p.kill()
    return left


def _recorded(directory: Path) -> list[str]:
    return sorted(t["nodeid"].split("::")[-1] for f in directory.glob("*.json")
                  for t in json.loads(f.read_text())["tests"])  # fmt: skip


def _until_exists(*paths: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() and p.stat().st_size for p in paths) and time.monotonic() < deadline:
        time.sleep(0.02)


#: What every torchrun fault's test file starts with: a world test that passes before the fault.
TORCHRUN_FIRST = """
import os, signal, subprocess, time
import pytest

@pytest.mark.ds_world
def test_1(ds_rank):
    pass
"""


def _torchrun(base: Path, tests: str, *args: str) -> tuple[subprocess.Popen[str], str]:
    """``test_1`` (which passes), then ``tests``, run by 2 ranks of torchrun on this machine, rank 0's results in
    ``base/results``."""
    base.mkdir(parents=True)
    (base / "test_fault.py").write_text(TORCHRUN_FIRST + textwrap.dedent(tests))
    return _tagged([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    *PYTEST[1:], "--ds-results=results", "-q", *args], base)  # fmt: skip


def torchrun_ctrl_c(base: Path) -> Figure:
    proc, tag = _torchrun(
        base,
        """
        @pytest.mark.ds_world
        def test_2(ds_rank):
            subprocess.Popen(["sleep", "600"])
            open(f"ready-{ds_rank}", "w").write("1")
            time.sleep(600)

        @pytest.mark.ds_world
        def test_3(ds_rank):
            pass
    """,
    )
    _until_exists(*(base / f"ready-{r}" for r in (0, 1)))
    pressed = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    out = proc.communicate(timeout=120)[0]
    seconds = time.monotonic() - pressed
    interrupts = out.count("KeyboardInterrupt")
    recorded = _recorded(base / "results")
    sees = f"'KeyboardInterrupt' lines {interrupts}; test_3 started: {'test_3' in out}; recorded {recorded}"
    return Figure("17 ctrl-c under torchrun (2 ranks, mid-body)", seconds, sees, _left(tag))


def torchrun_rank_killed(base: Path) -> Figure:
    """Issue 38, item 2: rank 1's pytest SIGKILLed in a body that started a ``sleep``; seconds from the kill to
    torchrun's end (it used to be torchrun's 30 s before its own SIGKILL)."""
    proc, tag = _torchrun(
        base,
        """
        @pytest.mark.ds_world
        def test_2(ds_rank):
            if ds_rank == 1:
                subprocess.Popen(["sleep", "600"])
                open("dying", "w").write("1")
                os.kill(os.getpid(), signal.SIGKILL)
    """,
        "--ds-timeout=120",
    )
    _until_exists(base / "dying")
    died = time.monotonic()
    out = proc.communicate(timeout=300)[0]
    seconds = time.monotonic() - died
    summaries = sum(" in " in line and line.strip().endswith("s") and "passed" in line for line in out.splitlines())
    sees = f"exit {proc.returncode}; pytest summaries {summaries}; recorded {_recorded(base / 'results')}"
    return Figure("21 a rank SIGKILLed under torchrun", seconds, sees, _left(tag))


def _checkout(base: Path, path: str, tests: str) -> None:
    """A DeepSpeed-shaped checkout at ``base`` (tests/examples/upstream) with ``tests`` at ``tests/unit/<path>``,
    committed."""
    root = Path(__file__).resolve().parents[1]
    shutil.copytree(root / "tests" / "examples" / "upstream", base)
    (base / "tests" / "unit" / path).write_text(textwrap.dedent(tests))
    for git in (["init", "-q"], ["add", "-A"], ["-c", "user.name=b", "-c", "user.email=b@b", "commit", "-qm", "t"]):
        subprocess.run(["git", "-C", str(base), *git], check=True, capture_output=True)


def upstream_ctrl_c(base: Path) -> Figure:
    """Issue 38, item 3: Ctrl-C in ``dsrepro upstream`` while its second test runs; seconds to its exit."""
    _checkout(base, "comm/test_interrupted.py", """
        import time
        from pathlib import Path

        from unit.common import DistributedTest


        class TestInterrupted(DistributedTest):
            world_size = 1

            def test_1_passes(self):
                pass

            def test_2_interrupted(self):
                Path("ready").write_text("1")
                time.sleep(600)
    """)  # fmt: skip
    command = [sys.executable, "-m", "pytest_dsrepro.tools.cli", "upstream", "unit/comm/test_interrupted.py",
               "--results", str(base / "results"), "--", "-p", "no:cacheprovider"]  # fmt: skip
    proc, tag = _tagged(command, base / "tests")
    _until_exists(base / "tests" / "ready")
    pressed = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    out = proc.communicate(timeout=120)[0]
    seconds = time.monotonic() - pressed
    summary = next((line.strip("= ") for line in out.splitlines() if " in " in line and "passed" in line), "none")
    logs = [f"tmp {p.name}" for p in (base / "tests").glob("dsrepro-*")]
    sees = f"exit {proc.returncode}; pytest's summary: {summary}; recorded {_recorded(base / 'results')}"
    return Figure("22 ctrl-c in dsrepro upstream", seconds, sees, _left(tag) + logs)


def damaged_user_extensions(base: Path) -> Figure:
    """Issue 38, item 4: the op truncated in a TORCH_EXTENSIONS_DIR the user set (torch's JIT builds it again)."""
    extensions = base / "extensions"
    shutil.copytree(_built_op() / "deepspeed_shm_comm", extensions / "deepspeed_shm_comm")
    library = extensions / "deepspeed_shm_comm" / "deepspeed_shm_comm.so"
    library.write_bytes(library.read_bytes()[: library.stat().st_size // 3])
    os.environ["TORCH_EXTENSIONS_DIR"] = str(extensions)
    try:
        run = Run(base / "run", ONE_WORLD)
    finally:
        del os.environ["TORCH_EXTENSIONS_DIR"]
    seconds = run.finish(timeout=1800)
    discarded = run.first("pytest-dsrepro: the cached build")[:110]
    return Figure("23 a truncated comm op in the user's TORCH_EXTENSIONS_DIR", seconds,
                  f"{discarded}...; {run.lines[-1].strip('= ')}", run.leftovers(extensions))  # fmt: skip


def empty_op(base: Path) -> Figure:
    """Issue 38, item 5: a 0-byte op in the cache, said as such; rebuilt beside the worlds: seconds to the first
    world's verdict and to the run's end."""
    cache, library = _cache_with_op(base / "setup")
    library.write_bytes(b"")
    run = Run(base / "run", ONE_WORLD, "-v", cache=cache)
    run.wait_for(lambda: any("PASSED" in line or "FAILED" in line for line in run.lines), timeout=1800)
    verdict = time.monotonic() - run.started
    seconds = run.finish(timeout=1800)
    said = run.first("pytest-dsrepro: the cached build")
    said = said[said.find("(") : said.find(")") + 1]
    return Figure("24 a 0-byte comm op in the cache", seconds, f"said: {said}; first verdict at {verdict:.1f} s",
                  run.leftovers(cache))  # fmt: skip


def duplicate_keys(base: Path) -> Figure:
    """Issue 38, item 5: ``dsrepro scan`` of a config with a key given twice."""
    base.mkdir(parents=True)
    config = base / "ds_config.json"
    config.write_text('{\n  "train_batch_size": 8,\n  "zero_optimization": {"stage": 1, "stage": 3}\n}\n')
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest_dsrepro.tools.cli", "scan", str(config)],
                          capture_output=True, text=True, cwd=base)  # fmt: skip
    said = proc.stderr.strip().splitlines()[-1][:120] if proc.stderr.strip() else ""
    return Figure("25 dsrepro scan of a config with a key twice", time.monotonic() - started,
                  f"exit {proc.returncode}: {said}")  # fmt: skip


def install_typo(base: Path) -> Figure:
    base.mkdir(parents=True)
    started = time.monotonic()
    env = dict(os.environ, DSREPRO_CONSTRAINTS=str(Path(__file__).resolve().parents[1] / "constraints.txt"))
    proc = subprocess.run([sys.executable, "-m", "pytest_dsrepro.tools.cli", "install", "9.9.9", "--results",
                           str(base / "results")], capture_output=True, text=True, cwd=base, env=env)  # fmt: skip
    seconds = time.monotonic() - started
    said = proc.stderr.strip().splitlines()[-1][:120] if proc.stderr.strip() else ""
    recorded = list((base / "results").glob("*.json")) if (base / "results").exists() else []
    return Figure("18 dsrepro install 9.9.9", seconds, f"exit {proc.returncode}, recorded {len(recorded)}: {said}")


def _results_dir(base: Path) -> Path:
    """A results directory holding one run of one test, written by core.results as a run would write it."""
    from pytest_dsrepro.core import results
    from pytest_dsrepro.core.gates import Reason, Verdict

    record = results.TestRecord(nodeid="t.py::test_x", repro=None, variant=None, verdict=Verdict.FIXED,
                                reason=Reason.NOT_AFFECTED, outcome="passed", error=None, duration=1.0,
                                config=None)  # fmt: skip
    directory = base / "results"
    results.write(results.RunRecord(environment=results.environment("gloo", 2), tests=(record,)), directory)
    return directory


def _matrix(base: Path, *args: str) -> tuple[float, subprocess.CompletedProcess[str]]:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest_dsrepro.tools.cli", "matrix", *args], capture_output=True,
                          text=True, cwd=base)  # fmt: skip
    return time.monotonic() - started, proc


def matrix_read_only(base: Path) -> Figure:
    directory = _results_dir(base)
    before = sorted(p.name for p in directory.iterdir())
    with _read_only(directory):
        seconds, proc = _matrix(base, str(directory))
    left = [p.name for p in directory.iterdir() if p.name not in before]
    said = proc.stderr.splitlines()[0][:110] if proc.stderr else ""
    return Figure("19 dsrepro matrix in a read-only results directory", seconds, f"exit {proc.returncode}: {said}",
                  left)  # fmt: skip


def matrix_cut_short(base: Path) -> Figure:
    directory = _results_dir(base)
    (path,) = directory.glob("*.json")
    path.write_text(path.read_text()[:200])
    seconds, proc = _matrix(base, str(directory), "--no-write")
    said = next((line.strip() for line in proc.stdout.splitlines() if "cut short" in line), "")
    return Figure("20 dsrepro matrix with a results file cut short", seconds, f"exit {proc.returncode}: {said[:110]}")


# ---- issue 49: shards, authoring, the end of a run ------------------------------------------------------------


DSREPRO = [sys.executable, "-m", "pytest_dsrepro.tools.cli"]


def _dsrepro(base: Path, *args: str, **more: str) -> tuple[float, subprocess.CompletedProcess[str]]:
    started = time.monotonic()
    env = dict(os.environ, COLUMNS="200", **more)
    proc = subprocess.run([*DSREPRO, *args], cwd=base, env=env, capture_output=True, text=True, timeout=600)
    return time.monotonic() - started, proc


def _said(text: str, *starts: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip().startswith(starts)), "")[:120]


def shard_rerun_killed(base: Path) -> Figure:
    """Item 3: a shard run, then run again into the same results directory and SIGKILLed once collected; the
    merge's exit code (3: dead; it was 1, the run before's outcomes read as this one's) and the seconds it took."""
    _checkout(base, "runtime/test_shard.py", """
        import os, time

        def test_a():
            time.sleep(float(os.environ.get("SHARD_WAIT", "0")))

        def test_b():
            assert 1 == 2
    """)  # fmt: skip
    tests, results_dir = base / "tests", base / "results-1"
    shard = ["upstream", "unit/runtime/test_shard.py", "--shard", "1/1", "--results", str(results_dir), "--",
             "-p", "no:cacheprovider"]  # fmt: skip
    _dsrepro(tests, *shard)
    (manifest,) = results_dir.glob("*.shard")
    before = manifest.read_text()
    proc, tag = _tagged([*DSREPRO, *shard], tests, SHARD_WAIT="600")
    deadline = time.monotonic() + 240
    while manifest.read_text() == before and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    seconds, merged = _dsrepro(base, "upstream", "--merge", str(results_dir))
    sees = f"exit {merged.returncode}: {_said(merged.stdout, 'shard 1/1')}"
    return Figure("26 a shard re-run into its directory, killed", seconds, sees, _left(tag))


def _shard_dir(directory: Path, index: int, outcome: str = "passed") -> None:
    """A shard's directory as its run leaves it: its manifest and results (``core``'s writers, as a run writes)."""
    from pytest_dsrepro.core import results, shard_manifests

    nodeid = f"unit/t.py::test_{index}"
    shard_manifests.write(shard_manifests.Manifest(index, 2, "0.19.8", (nodeid,), exitstatus=0), directory)
    record = results.TestRecord(nodeid=nodeid, repro=None, variant=None, verdict=None, reason=None, outcome=outcome,
                                error=None, duration=0.1, config=None)  # fmt: skip
    env = dataclasses.replace(results.environment("gloo", 2), deepspeed="0.19.8")
    results.write(results.RunRecord(environment=env, tests=(record,)), directory)


def shard_artifact_twice(base: Path) -> Figure:
    """Item 3: one shard's artifact downloaded twice: counted once (its failure too), said; exit 1 (a new failure)."""
    _shard_dir(base / "job-1", 1, "failed")
    _shard_dir(base / "job-2", 2)
    shutil.copytree(base / "job-1", base / "job-1-again")
    seconds, merged = _dsrepro(base, "upstream", "--merge", "job-1", "job-1-again", "job-2")
    failed = _said(merged.stdout, "1 failed", "2 failed")
    sees = f"exit {merged.returncode}: {failed}; {_said(merged.stdout, 'counted once')[:60]}..."
    return Figure("27 a shard's artifact merged twice", seconds, sees)


def shard_bad_manifest(base: Path) -> Figure:
    """Item 3: a damaged manifest among good shards: named, the merge goes on, exit 3."""
    _shard_dir(base / "job-1", 1)
    _shard_dir(base / "job-2", 2)
    (manifest,) = (base / "job-2").glob("*.shard")
    manifest.write_text(manifest.read_text()[:40])
    seconds, merged = _dsrepro(base, "upstream", "--merge", "job-1", "job-2")
    sees = f"exit {merged.returncode}: {_said(merged.stdout, 'unreadable manifest')[-70:]}"
    return Figure("28 a damaged shard manifest", seconds, sees)


def scaffold_checked(base: Path) -> Figure:
    """Item 6: ``dsrepro new``'s file run at once beside the catalogue's conftest (its device check on)."""
    base.mkdir(parents=True)
    _dsrepro(base, "new", "first repro")
    shutil.copy(Path(__file__).resolve().parents[1] / "repros" / "conftest.py", base / "repros" / "conftest.py")
    started = time.monotonic()
    proc, tag = _tagged([*PYTEST, "repros", "-q"], base)
    out = proc.communicate(timeout=600)[0]
    seconds = time.monotonic() - started
    summary = next((line.strip("= ") for line in reversed(out.splitlines()) if " in " in line), "?")
    return Figure("29 dsrepro new's body under the catalogue's check", seconds, summary, _left(tag))


def editable_catalogue(base: Path) -> Figure:
    """Item 6: ``uv pip install -e`` of this checkout in a new environment (offline, this one's setuptools lent),
    then ``import pytest_dsrepro.catalogue.prerequisites``'s spec."""
    import setuptools
    from uv import find_uv_bin

    root = Path(__file__).resolve().parents[1]
    venv, lent = base / "venv", base / "setuptools-lent"
    lent.mkdir(parents=True)
    here = Path(setuptools.__file__).parent.parent
    for name in ("setuptools", "_distutils_hack", f"setuptools-{setuptools.__version__}.dist-info"):
        (lent / name).symlink_to(here / name)
    uv = find_uv_bin()
    subprocess.run([uv, "venv", "-q", str(venv)], check=True, capture_output=True)
    site = next((venv / "lib").glob("python*/site-packages"))
    (site / "lent.pth").write_text(f"{lent}\n")
    started = time.monotonic()
    install = [uv, "pip", "install", "-q", "--offline", "--python", str(venv / "bin" / "python"),
               "--no-build-isolation", "--no-deps", "-e", str(root)]  # fmt: skip
    installed = subprocess.run(install, capture_output=True, text=True)
    seconds = time.monotonic() - started
    spec = "import importlib.util as u; print(u.find_spec('pytest_dsrepro.catalogue.prerequisites').origin)"
    found = subprocess.run([venv / "bin" / "python", "-c", spec], cwd=base, capture_output=True, text=True)
    said = found.stdout.strip() or (found.stderr.strip().splitlines() or ["?"])[-1]
    return Figure("30 uv pip install -e, then the catalogue imported", seconds,
                  f"install exit {installed.returncode}; {said[-90:]}")  # fmt: skip


def extra_package_option(base: Path) -> Figure:
    """Item 7: ``$DSREPRO_EXTRA_PACKAGES`` holding uv options: refused before any environment or index."""
    base.mkdir(parents=True)
    cache = base / "cache"
    options = "--index-url=http://127.0.0.1:9/simple einops"
    seconds, proc = _dsrepro(base, "bisect", "t.py::test_x", "--good", "0.16.3", "--bad", "0.16.4", "--cache-dir",
                             str(cache), DSREPRO_EXTRA_PACKAGES=options)  # fmt: skip
    made = [f"cache {p.relative_to(base)}" for p in cache.rglob("*")] if cache.exists() else []
    return Figure("31 an extra package that is a uv option", seconds, f"exit {proc.returncode}: "
                  + _said(proc.stderr, "dsrepro bisect")[:100], made)  # fmt: skip


def sigterm_mid_world(base: Path) -> Figure:
    """Item 7: SIGTERM to pytest while its second test's world runs: seconds to pytest's exit (as Ctrl-C's, 3: no
    ``--ds-report``, whose diagnostics take 10-20 s on a busy machine), what was recorded."""
    run = Run(base, """
        import time
        import pytest

        @pytest.mark.ds_world
        def test_1(ds_rank):
            pass

        @pytest.mark.ds_world(timeout=600)
        def test_2(ds_rank):
            open(f"ready-{ds_rank}", "w").write("1")
            time.sleep(600)
    """, "--ds-results=results")  # fmt: skip
    run.wait_for(ready(run))
    sent = time.monotonic()
    run.proc.send_signal(signal.SIGTERM)
    run.finish()
    seconds = time.monotonic() - sent
    recorded = _recorded(base / "results") if (base / "results").exists() else []
    return Figure("32 SIGTERM to pytest mid-world", seconds, f"exit {run.proc.returncode}; recorded {recorded}",
                  run.leftovers())  # fmt: skip


def full_disk_at_end(base: Path) -> Figure:
    """Item 7: every write fails once the tests are done (RLIMIT_FSIZE 0 from ``pytest_sessionfinish``, as a full
    disk): what is in the results directory and the report after, and whether ``dsrepro matrix`` reads it."""
    directory = _results_dir(base)
    (base / "report.md").write_text("# the earlier report\n")
    (base / "run").mkdir()
    (base / "run" / "conftest.py").write_text(textwrap.dedent("""
        import resource, signal
        import pytest

        @pytest.hookimpl(tryfirst=True)
        def pytest_sessionfinish(session):
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    """))  # fmt: skip
    run = Run(base / "run", ONE_WORLD, f"--ds-results={directory}", f"--ds-report={base / 'report.md'}")
    seconds = run.finish()
    empty = [p.name for p in directory.iterdir() if p.stat().st_size == 0 or p.name.startswith(".")]
    _, matrix = _matrix(base, str(directory), "--no-write")
    report = "kept" if (base / "report.md").read_text() == "# the earlier report\n" else "changed"
    sees = (f"exit {run.proc.returncode}; {len(list(directory.iterdir()))} file(s) in results, empty or partial "
            f"{empty}; report {report}; matrix exit {matrix.returncode}")  # fmt: skip
    return Figure("33 a full disk when results and report are written", seconds, sees, run.leftovers())


def workflow_audit(base: Path) -> Figure:
    """Item 7: zizmor (offline) over the GitHub workflow docs/upstream.md offers."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "upstream.md").read_text()
    start = text.index("name: DeepSpeed tests/unit on CPU worlds")
    path = base / ".github" / "workflows" / "dsrepro-upstream.yml"
    path.parent.mkdir(parents=True)
    path.write_text(text[start : text.index("```", start)])
    zizmor = shutil.which("zizmor", path=str(Path(sys.executable).parent)) or shutil.which("zizmor")
    if zizmor is None:
        return Figure("34 zizmor over the documented workflow", None, "zizmor not installed: not measured")
    started = time.monotonic()
    proc = subprocess.run([zizmor, "--offline", "--no-progress", str(path)], capture_output=True, text=True)
    return Figure("34 zizmor over the documented workflow", time.monotonic() - started,
                  f"exit {proc.returncode}: {proc.stdout.strip().splitlines()[-1][:100]}")  # fmt: skip


# ---- issue 49 items 2, 5 and 7: every op built beside the worlds, the first world's warm-up -----------------------

#: Two tests of ``size`` ranks that load DeepSpeed's CPU Adagrad (its smallest CPU op); with ``fails``, rank 1 of the
#: first fails at once, and its world is stopped while rank 0 waits for the op's first build.
OP_TESTS = """
import pytest
from deepspeed.accelerator import get_accelerator

@pytest.mark.ds_world(size={size})
@pytest.mark.parametrize("first", [True, False])
def test_op(ds_rank, first):
    if {fails} and first and ds_rank == 1:
        raise RuntimeError("rank 1 fails while rank 0 waits for the op")
    get_accelerator().create_op_builder("CPUAdagradBuilder").load()
"""
WAITS_FOR_A_MARK = """
import os, time
import pytest

@pytest.mark.ds_world(size=1, timeout=600)
def test_waits(ds_rank):
    while not os.path.exists("checked"):
        time.sleep(0.1)
"""
FIRST_RUN = """
import deepspeed
import pytest

@pytest.mark.ds_world(size=2)
@pytest.mark.parametrize("n", range(4))
def test_trivial(ds_rank, n):
    pass
"""
#: What a build beside the worlds or a search apart is called while it goes on after its run (``worlds.server.builds``).
APART = ("dsrepro-build", "dsrepro-scout")


def _op_cache(base: Path, lists: bool = True) -> Path:
    """A cache holding this environment's comm op and (``lists``) the preload lists, copied from the real cache, and
    no other op."""
    source = _built_op()
    cache = base / "cache"
    shutil.copytree(source, cache / "torch_extensions" / source.name,
                    ignore=shutil.ignore_patterns("fused_adam", "cpu_adam", "cpu_adagrad"))  # fmt: skip
    if lists:
        shutil.copytree(source.parent.parent / "preload", cache / "preload")
    return cache


def _summary(run: Run) -> str:
    return next((line.strip("= ") for line in reversed(run.lines) if " in " in line and "=" in line), "no summary")


def _names(run: Run) -> list[str]:
    """The names of the run's live processes (one may end while it is asked)."""
    names = []
    for p in run.processes():
        with contextlib.suppress(psutil.NoSuchProcess):
            names.append(p.name())
    return names


def _compilers_gone_after(run: Run, victim: str) -> tuple[bool, float | None]:
    """Once a compiler runs, SIGKILL the tagged process named ``victim``: (compilers seen, seconds until none is
    left)."""
    compiling = run.wait_for(lambda: "cc1plus" in _names(run), timeout=600)
    for p in run.processes():
        with contextlib.suppress(psutil.NoSuchProcess):
            if p.name() == victim:
                p.kill()
    killed = time.monotonic()
    gone = run.wait_for(lambda: not {"cc1plus", "ninja"} & set(_names(run)), timeout=30)
    return compiling, (time.monotonic() - killed) if gone else None


def _went_apart(run: Run, limit: float = 1800) -> float:
    """Seconds that what the run let go on apart (a build, the preload search) took to end after pytest did."""
    ended = time.monotonic()
    while set(APART) & set(_names(run)) and time.monotonic() - ended < limit:
        time.sleep(0.2)
    return time.monotonic() - ended


def op_build_world_stopped(base: Path) -> Figure:
    """A world stopped while its rank waits for an op's first build (its other rank failed); the next test needs the
    op, with a 10 s timeout: seconds to the run's end, the verdicts, what is left (a torch baton blocks builds)."""
    cache = _op_cache(base / "setup")
    run = Run(base / "run", OP_TESTS.format(size=2, fails=True), "-v", "--ds-timeout", "10", cache=cache)
    seconds = run.finish(timeout=3600)
    said = sum("building DeepSpeed's cpu_adagrad op" in line for line in run.lines)
    return Figure("49.2 a world stopped mid op build", seconds, f"{_summary(run)}; build said {said}x",
                  run.leftovers(cache))  # fmt: skip


def op_build_killed(base: Path) -> Figure:
    """The process compiling an op a rank asked for, SIGKILLed mid-compile: its compilers' end, and the next test's
    build (through the baton the killed one left)."""
    cache = _op_cache(base / "setup")
    run = Run(base / "run", OP_TESTS.format(size=1, fails=False), "-v", "--ds-timeout", "10", cache=cache)
    compiling, gone = _compilers_gone_after(run, "dsrepro-compile")
    seconds = run.finish(timeout=3600)
    sees = f"compilers running: {compiling}; none left {gone and round(gone, 2)} s after the kill; {_summary(run)}"
    return Figure("49.2 a SIGKILLed op build", seconds, sees, run.leftovers(cache))


def comm_op_build_killed(base: Path) -> Figure:
    """Item 7: a first comm-op build beside the worlds, its warden SIGKILLed mid-compile: its compilers' end (they
    raced the next build before), then the run's."""
    cache = base / "cold-cache"
    run = Run(base, WAITS_FOR_A_MARK, "-v", cache=cache)
    compiling, gone = _compilers_gone_after(run, "dsrepro-build")
    (run.dir / "checked").touch()
    seconds = run.finish(timeout=600)
    sees = f"compilers running: {compiling}; none left {gone and round(gone, 2)} s after the kill; {_summary(run)}"
    return Figure("49.7 a SIGKILLed comm-op build", seconds, sees, run.leftovers(cache))


def op_build_damaged(base: Path) -> Figure:
    """A cached op cut short: discarded, said once, built again: seconds to the verdict."""
    cache = _op_cache(base / "setup")
    tests = OP_TESTS.format(size=1, fails=False)
    with tempfile.TemporaryDirectory() as tmp:  # the op built once, in a cache of its own
        Run(Path(tmp), tests, cache=cache).finish(timeout=3600)
    (library,) = (cache / "torch_extensions").glob("cpu_adagrad-*/cpu_adagrad/cpu_adagrad.so")
    library.write_bytes(library.read_bytes()[:4096])  # its headers: a third would keep the code (-g)
    run = Run(base / "run", tests, "-v", "--ds-timeout", "10", cache=cache)
    seconds = run.finish(timeout=3600)
    said = sum("does not load" in line for line in run.lines)
    return Figure("49.2 a damaged op build in the cache", seconds, f"damage said {said}x; {_summary(run)}",
                  run.leftovers(cache))  # fmt: skip


def first_run_short_timeout(base: Path) -> Figure:
    """Item 5: four trivial DeepSpeed tests with --ds-timeout 5 on a cache that never found a first engine step's
    imports: seconds to the run's end, the verdicts, how long the search went on apart afterwards."""
    cache = _op_cache(base / "setup", lists=False)
    run = Run(base / "run", FIRST_RUN, "-v", "--ds-timeout", "5", cache=cache)
    seconds = run.finish(timeout=600)
    apart = _went_apart(run)
    listed = len(list((cache / "preload").glob("*.json"))) if (cache / "preload").exists() else 0
    sees = f"{_summary(run)}; the search went on {apart:.0f} s after it, lists kept: {listed}"
    return Figure("49.5 a first run with --ds-timeout 5", seconds, sees, run.leftovers(cache))


FAULTS: dict[str, Callable[[Path, argparse.Namespace], Figure]] = {
    "build": lambda d, a: ctrl_c_during_build(d),
    "ctrl-c": lambda d, a: ctrl_c_mid_world(d, 1),
    "ctrl-c-twice": lambda d, a: ctrl_c_mid_world(d, 2),
    "crash-after-result": lambda d, a: crash_after_result(d),
    "server-death": lambda d, a: server_death(d),
    "pytest-timeout": lambda d, a: timeout_plugin(d),
    "too-big": lambda d, a: world_too_big(d),
    "flood": lambda d, a: output_flood(d),
    "input-errors": lambda d, a: input_errors(d),
    "cause-first": lambda d, a: cause_first(d),
    "flakes": lambda d, a: flakes(d, a.worlds),
    "damaged-cache": lambda d, a: damaged_cache(d),
    "read-only-cache": lambda d, a: read_only_cache(d),
    "read-only-cold-cache": lambda d, a: read_only_cold_cache(d),
    "unwritable-outputs": lambda d, a: unwritable_outputs(d),
    "outputs-lost-at-end": lambda d, a: outputs_lost_at_end(d),
    "torchrun-ctrl-c": lambda d, a: torchrun_ctrl_c(d),
    "torchrun-rank-killed": lambda d, a: torchrun_rank_killed(d),
    "upstream-ctrl-c": lambda d, a: upstream_ctrl_c(d),
    "damaged-user-extensions": lambda d, a: damaged_user_extensions(d),
    "empty-op": lambda d, a: empty_op(d),
    "duplicate-keys": lambda d, a: duplicate_keys(d),
    "install-typo": lambda d, a: install_typo(d),
    "matrix-read-only": lambda d, a: matrix_read_only(d),
    "matrix-cut-short": lambda d, a: matrix_cut_short(d),
    "shard-rerun-killed": lambda d, a: shard_rerun_killed(d),
    "shard-artifact-twice": lambda d, a: shard_artifact_twice(d),
    "shard-bad-manifest": lambda d, a: shard_bad_manifest(d),
    "scaffold-checked": lambda d, a: scaffold_checked(d),
    "editable-catalogue": lambda d, a: editable_catalogue(d),
    "extra-package-option": lambda d, a: extra_package_option(d),
    "sigterm-mid-world": lambda d, a: sigterm_mid_world(d),
    "full-disk-at-end": lambda d, a: full_disk_at_end(d),
    "workflow-audit": lambda d, a: workflow_audit(d),
    "op-build-world-stopped": lambda d, a: op_build_world_stopped(d),
    "op-build-killed": lambda d, a: op_build_killed(d),
    "comm-op-build-killed": lambda d, a: comm_op_build_killed(d),
    "op-build-damaged": lambda d, a: op_build_damaged(d),
    "first-run-short-timeout": lambda d, a: first_run_short_timeout(d),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, default=700, help="empty worlds in a row for the flake count")
    parser.add_argument("--only", nargs="*", choices=sorted(FAULTS), help="run only these faults")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    figures = []
    print(f"{'fault':<52} {'seconds':>8}  leftovers\n{'':<52}          what the user sees", flush=True)
    with tempfile.TemporaryDirectory(prefix="faults-bench-") as tmp:
        for i, name in enumerate(args.only or FAULTS):
            figure = FAULTS[name](Path(tmp) / f"{i}-{name}", args)
            figures.append(figure)
            seconds = "-" if figure.seconds is None else f"{figure.seconds:.1f}"
            left = ", ".join(figure.leftovers) or "none"
            extra = "".join(f"; {k} {v}" for k, v in figure.extra.items())
            print(f"{figure.fault:<52} {seconds:>6} s  leftovers: {left}", flush=True)
            print(f"{'':<52}          {figure.sees}{extra}", flush=True)
    if args.json:
        args.json.write_text(json.dumps([asdict(f) for f in figures], indent=2))


if __name__ == "__main__":
    main()
