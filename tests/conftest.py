"""Shared helpers for the plugin's own tests.

End-to-end tests run pytest in a subprocess (``pytester.runpytest_subprocess``), as pytest-timeout does: worlds fork
processes and handle signals, which an in-process run must not share with the test-suite itself.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import ModuleType

import psutil
import pytest

from pytest_dsrepro.core.options import CACHE_ENV, OPTIONS, default_cache_dir

#: Files that tests copy into their pytester directories (pyproject's pytester_example_dir), never collected here.
collect_ignore = ["examples"]

#: A test-suite started as a background job (``cmd &`` in a script) inherits SIGINT ignored, and so would every
#: pytest, fork server and rank it starts: the Ctrl-C tests would interrupt processes that cannot hear it. A handler
#: here is reset to the default in every program it starts, as at a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

TAG = "DSREPRO_TEST_TAG"
#: pytester points HOME at a fresh directory; keep DeepSpeed's comm-op builds in the real cache (read before that).
REAL_CACHE = str(default_cache_dir())


def load_benchmark(name: str) -> ModuleType:
    """A script of ``benchmarks/`` (not a package) imported as module ``name``, for tests of its logic."""
    spec = importlib.util.spec_from_file_location(
        name, Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def tagged_processes(tag: str) -> list[psutil.Process]:
    """Every live process started under this test (pytest runs, fork servers, ranks), found by an env tag."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(TAG) == tag and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def named(tag: str, name: str) -> list[psutil.Process]:
    """This test's live processes of that name (a compiler may end between being listed and being asked)."""
    found = []
    for proc in tagged_processes(tag):
        with contextlib.suppress(psutil.NoSuchProcess):
            if proc.name() == name:
                found.append(proc)
    return found


def wait_for_no_processes(tag: str, timeout: float = 15.0) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while (left := tagged_processes(tag)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def wait_for_builds_apart() -> list[psutil.Process]:
    """For a test whose run left work going on apart (a build, ``builds.BuildChild.detach``, or the search for what a
    first engine step imports): wait, within its bounded life, until no process of this test (``process_tag``) still
    does it; those that still do."""
    from pytest_dsrepro.worlds.server.builds import BUILD_LOCK_TIMEOUT, BUILDER_NAME, SCOUT_NAMES

    deadline = time.monotonic() + BUILD_LOCK_TIMEOUT + 30
    while (left := named(os.environ[TAG], BUILDER_NAME) + named(os.environ[TAG], SCOUT_NAMES[0])) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.5)
    return left


@pytest.fixture(autouse=True)
def hermetic_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite's pytest runs see only the settings each test gives them, not the caller's DSREPRO_* choices."""
    for option in OPTIONS:
        if option.name != "cache_dir":
            monkeypatch.delenv(option.env, raising=False)


#: What ``warm_comm_op`` runs: the comm op built (or waited for) to its end, and the preload list found, in the cache.
WARM_UP = """
from pytest_dsrepro.worlds.server import comm_op, preload, warmup
comm_op.warm_up()
install = warmup.install()
if not preload.ready(install, None):
    preload.find(install)
"""


@pytest.fixture(scope="session")
def warm_comm_op() -> None:
    """The test environment's first world JIT-builds DeepSpeed's CPU comm op (45-200 s, far more on a busy machine)
    and finds what a first engine step imports (10-30 s), both beside the worlds: a first test would see the build
    go on after its run as processes left behind, and its worlds unwarmed. Done once, here, to the end, with no time
    limit of its own, so that no subprocess run's time limit has to include it."""
    env = {**os.environ, CACHE_ENV: os.environ.get(CACHE_ENV, REAL_CACHE), "DS_ACCELERATOR": "cpu"}
    subprocess.run([sys.executable, "-c", WARM_UP], env=env, capture_output=True)  # the tests that need it say why


@pytest.fixture
def process_tag(monkeypatch: pytest.MonkeyPatch, warm_comm_op: None) -> Iterator[str]:
    """Tags every process this test starts; fails the test if any of them outlives it."""
    tag = uuid.uuid4().hex
    monkeypatch.setenv(TAG, tag)
    monkeypatch.setenv(CACHE_ENV, os.environ.get(CACHE_ENV, REAL_CACHE))
    monkeypatch.setenv("COLUMNS", "200")  # keep pytest's short summary lines whole
    yield tag
    left = wait_for_no_processes(tag)
    assert not left, f"processes left behind: {[(p.pid, p.cmdline()) for p in left]}"


RunPytest = Callable[..., pytest.RunResult]


@pytest.fixture
def run(pytester: pytest.Pytester, process_tag: str) -> RunPytest:
    """``run(*args)``: pytest in a subprocess with the plugin, no cache, and a hard time limit."""

    def _run(*args: str, timeout: float = 300) -> pytest.RunResult:
        return pytester.runpytest_subprocess("-p", "no:cacheprovider", *args, timeout=timeout)

    return _run


def run_marked(pytester: pytest.Pytester, run: RunPytest, marker: str) -> pytest.RunResult:
    """Run one empty test ``test_marked`` carrying ``@pytest.mark.<marker>``."""
    pytester.makepyfile(f"import pytest\n\n@pytest.mark.{marker}\ndef test_marked():\n    pass\n")
    return run()


def assert_clear_error(result: pytest.RunResult, marker: str, message: str) -> None:
    """The message names the marker, the test and the value, without a traceback."""
    result.stdout.fnmatch_lines([f"*@pytest.mark.{marker} on *::test_marked: {message}*"])
    assert "Traceback" not in result.stdout.str()


@functools.cache
def comm_op_directory() -> Path | None:
    """Where this environment's DeepSpeed keeps its comm op in the real cache (``comm_op.op_directory``).

    Asked in a child: importing torch here, where pytester restores ``sys.modules`` between tests, breaks torch.
    """
    code = "from pytest_dsrepro.worlds.server.comm_op import op_directory; print(op_directory() or '')"
    env = {**os.environ, CACHE_ENV: REAL_CACHE, "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    line = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    return Path(line) if line else None


def cache_with_comm_op(path: Path, preload_lists: bool = True) -> Path:
    """A cache at ``path`` that holds this environment's comm op and (``preload_lists``) the lists of a first engine
    step's imports, copied from the real cache, and no other op: as a first run of the release finds them."""
    source = comm_op_directory()
    assert source is not None
    assert (source / "deepspeed_shm_comm").is_dir(), "the suite's warm-up (warm_comm_op) builds it"
    target = path / "torch_extensions" / source.name
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("fused_adam", "cpu_adam", "cpu_adagrad"))
    if preload_lists:
        shutil.copytree(Path(REAL_CACHE) / "preload", path / "preload")
    return path


def first_run_without_a_preload_list(
    pytester: pytest.Pytester, run: RunPytest, monkeypatch: pytest.MonkeyPatch, source: str, passed: int
) -> pytest.RunResult:
    """``source``'s tests, which use DeepSpeed, run with ``--ds-timeout 5`` on a cache that holds the comm op but
    never found what a first engine step imports: every test passes, the search said to run beside the worlds (which
    do not wait for it), and whatever goes on apart after the run has ended, before the next one."""
    monkeypatch.setenv(CACHE_ENV, str(cache_with_comm_op(pytester.path / "cache", preload_lists=False)))
    pytester.makepyfile(source)
    result = run("-v", "--ds-timeout", "5")
    result.assert_outcomes(passed=passed)
    result.stdout.fnmatch_lines(
        [
            "pytest-dsrepro: finding what a first DeepSpeed engine step imports, first time only for deepspeed *, "
            "beside the worlds: until it is found, they run without it",
        ]
    )
    assert "did not start" not in result.stdout.str()
    assert wait_for_builds_apart() == []
    return result


def deepspeed_version() -> str:
    from importlib import metadata

    return metadata.version("deepspeed")


SHM = Path("/dev/shm")


@pytest.fixture
def private_tmp(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """TMPDIR of the processes this test starts: their world directories and server logs land here, apart from
    whatever else runs on the machine, so that a test can say nothing of its own was left behind."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    return tmp


def leftovers(tmp: Path, ports: Iterable[str] = ()) -> list[str]:
    """World directories and server logs under ``tmp``, and the /dev/shm buffers of the worlds on ``ports``."""
    left = [str(p) for p in tmp.glob("dsrepro-*")]
    for port in ports:
        left += [str(p) for p in SHM.glob(f"deepspeed_allreduce_buffer_*_{port}_*")]
    return left


ROOT = Path(__file__).parents[1]
#: Never copied: environments, build outputs, caches and results of this checkout.
LOCAL = shutil.ignore_patterns(".tox", ".venv", ".git", "build", "dist", "*.egg-info", "results", "__pycache__",
                               ".pytest_cache", ".mypy_cache", ".ruff_cache")  # fmt: skip


@pytest.fixture(scope="session")
def plugin_dists(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """This tree's sdist and wheel, built from a copy of it (no isolation: no download)."""
    tree = tmp_path_factory.mktemp("tree") / "pytest-dsrepro"
    shutil.copytree(ROOT, tree, ignore=LOCAL)
    out = tree / "dist"
    proc = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(tree)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return sdist, wheel


@pytest.fixture
def read_only() -> Iterator[Callable[[Path], None]]:
    """``read_only(path)``: nothing under ``path`` can be written any more, root included (an immutable tree for
    root, which permission bits do not stop; the bits for anyone else); undone at teardown."""
    made: list[Path] = []

    def make(path: Path) -> None:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-R", "+i", str(path)], check=True, capture_output=True)
        else:
            for p in [path, *path.rglob("*")]:
                if not p.is_symlink():
                    p.chmod(p.stat().st_mode & ~0o222)
        made.append(path)

    yield make
    for path in made:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-R", "-i", str(path)], capture_output=True)
        else:
            for p in [path, *path.rglob("*")]:
                if not p.is_symlink():
                    p.chmod(p.stat().st_mode | 0o200)


def git_in(root: Path, *args: str) -> str:
    """git in ``root`` as a test's own author, its output stripped: for the small repositories tests write."""
    command = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@example.com", *args]
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip()


def commit_files(root: Path, message: str, files: dict[str, str], tag: str | None = None) -> str:
    """``files`` written into ``root`` and committed with ``message`` (tagged ``tag``); the commit's hash."""
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    git_in(root, "add", "-A")
    git_in(root, "commit", "-qm", message)
    if tag:
        git_in(root, "tag", tag)
    return git_in(root, "rev-parse", "HEAD")
