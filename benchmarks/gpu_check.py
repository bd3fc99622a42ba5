"""The GPU check: what a machine with a GPU says of the plugin, in one table, within 8 minutes (``BUDGET``).

Two steps, because the GPU machine has no network:

    python benchmarks/gpu_check.py prepare --into build/gpu    # here, on a CPU machine that reaches PyPI
    bash build/gpu/run.sh                                       # there, from the repository's root: one command
    bash build/gpu/run.sh --only hang cost                      # there again: a rerun of what failed

``prepare`` puts into ``--into``: this plugin's wheel, the wheels of what the GPU image lacks for DeepSpeed (built
``DS_BUILD_OPS=0`` from its sdist with the torch of this interpreter, a pure-Python wheel), the CPU reference (the
catalogue's verdicts in 1-rank and 2-rank gloo worlds on the same release: ``--ds-results`` files), and ``run.sh``,
the one command that runs the check there.

``run`` installs those wheels into a directory of its own (``pip --no-index --target``: nothing is fetched), then runs
the checks in this order (``ORDER``: the most wanted first, as a lease may end before the last), each within its
time limit, and prints one table (check, result, seconds, what was seen, what stopped it):

- ``nccl-1``: the catalogue in 1-rank NCCL worlds, every verdict compared with the CPU reference;
- ``gloo-2``: the catalogue in 2-rank gloo worlds on the GPU machine (a machine with CUDA and Triton once stalled
  there), compared likewise; beside ``nccl-1``, at the same time (it never touches the GPU);
- ``hang``: a real hang (a collective queued behind a long CUDA kernel): the failure must name, per rank, the
  collective NCCL's flight recorder saw unfinished, and the dump must be kept;
- ``cost``: the cost of an NCCL world per test (pytest's call phase, a session's first test left out), fresh and in
  a ``reuse=True`` class, against a bare floor measured in the same run (a forked process's NCCL init, one
  all_reduce, destroy);
- ``leases``: GPU leases across sessions: one holds the GPU, a second with ``--ds-gpu-wait 1`` is skipped naming the
  holder, a third with the default wait runs after it;
- ``nccl-2``: on two GPUs or more, the catalogue in 2-rank NCCL worlds, on the time the others left.

The time budget (``SHARES``): the setup, each step's share (two checks side by side count once) and one stop add up
to ``BUDGET``. A step's limit is what is left of the budget less the shares of the steps after it and the stop, so
what one leaves unused passes on and none takes what a later one needs. At its limit a check leaves its evidence:
the process tree with each process's Python stacks (``py-spy``, from the prepared wheels); then pytest is
interrupted as Ctrl-C would (it writes the results of the tests that ended), and killed with its group ``STOPPING``
seconds later. In the catalogue a test's world ends at ``--ds-timeout`` (``CATALOGUE_TIMEOUT``), well inside the
limit: a hung test fails with every rank's stack and the catalogue goes on.

Every check PASSes, or names the one test and the one stack that stopped it: the first test whose verdict is not the
CPU's (its rank's stack or traceback from its record), or the test running at the limit (the stack of the rank in a
test body, else of the fork server, else of pytest).

Its evidence is three files in ``--out``, rewritten after each check (a lease that ends midway leaves what was done):
``gpu-check.md`` (the table, each stopping stack, and per catalogue test its verdict here against the CPU's),
``gpu-check.log`` (what the run printed) and ``gpu-check.tgz`` (each check's pytest log, results files, process
snapshot and flight-recorder dumps).

Without a CUDA device the GPU checks say SKIPPED, with why, and the rest runs: the script's own dry run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psutil
from packaging.tags import sys_tags
from packaging.utils import parse_wheel_filename

ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("pytest_dsrepro") is None:  # run from a checkout without the plugin installed
    sys.path.insert(0, str(ROOT))

from pytest_dsrepro.core import results  # noqa: E402 - the results schema's one reader
from pytest_dsrepro.tools.install import InstallError, uv_binary  # noqa: E402 - uv found as every install finds it

#: What the GPU image lacks for DeepSpeed and this plugin (it has torch, pytest, psutil, numpy, ninja, py-cpuinfo,
#: einops, msgpack, nvidia-ml-py and the HF stack): fetched here as wheels for its Python. typing-extensions is there,
#: but today's pydantic wants a newer one (>=4.16) than an image may have; the newer serves torch as well.
MISSING_THERE = (
    "hjson", "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions", "filelock",
)  # fmt: skip
#: Not for DeepSpeed: what a stopped check's ``snapshot`` takes each process's Python stacks with.
DIAGNOSTICS = ("py-spy",)
PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_28_x86_64")

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIPPED"

#: The checks in the order ``run`` takes them: the most wanted first, as the lease may end before the last.
ORDER = ("nccl-1", "gloo-2", "hang", "cost", "leases", "nccl-2")
#: Run side by side when both are planned: the 2-rank gloo catalogue never touches the GPU, and the machine has 16
#: cores; one after the other they would not fit the budget.
BESIDE = ("nccl-1", "gloo-2")
#: The whole run, seconds: 8 minutes, so that a 15-minute lease leaves room to rerun what failed.
BUDGET = 480.0
#: The run's own start: installing the wheels, then a torch import each to read the versions and count the devices.
SETUP = 25.0
#: Each check's share of the budget, seconds (of two side by side, the larger counts). ``nccl-2`` (two GPUs) has no
#: share of its own: it runs on what the others left. The catalogue (88 tests): in 1-rank NCCL worlds 66 worlds (the
#: CPU-only repros are NOT-APPLICABLE there, with no world; the pipeline's want two GPUs) at 2-4 s each (a fresh NCCL
#: world was 1.34 s of it on an H100, the Hugging Face repros take more); in 2-rank gloo worlds 126 worlds (a race's
#: verdict is a series of 20), 827 s on a loaded 2-core machine, about a third of it on 16 cores. Each pytest session
#: there starts a fork server that imports torch and DeepSpeed (several seconds) before its first world: the hang's
#: world then times out at 30 s; the cost's 12 worlds and 5 bare ones take about 1.4 s each; the leases' holder holds
#: the GPU 8 s while a second session is refused, and a third starts its own server after it.
SHARES = {"nccl-1": 305.0, "gloo-2": 300.0, "hang": 55.0, "cost": 40.0, "leases": 35.0, "nccl-2": 0.0}
#: After a check's limit: the snapshot gets ``SNAPSHOT`` seconds, then pytest, interrupted, the rest of ``STOPPING``
#: to write its results and end its worlds, before it is killed. The budget keeps one ``STOPPING`` at its end, and a
#: check stopped earlier takes it from the checks after it.
STOPPING = 20.0
SNAPSHOT = 8.0
#: A check with less time than this left is not started (SKIPPED, saying so).
LEAST = 15.0
#: A catalogue test's world timeout (``--ds-timeout``): a hang fails that test with every rank's stack, well inside
#: the check's limit, and the catalogue goes on. Its NCCL collectives time out at 45 s (``nccl_recorder``).
CATALOGUE_TIMEOUT = 60.0
#: How long an NCCL world of the check waits for the GPU: a lease held by something else is a skip naming the holder.
GPU_WAIT = 30.0

#: pip, for downloads: this interpreter's, else the system's (a uv-made environment has none).
PIP = (
    [sys.executable, "-m", "pip"]
    if importlib.util.find_spec("pip")
    else [shutil.which("python3") or "python3", "-m", "pip"]
)


@dataclass(frozen=True)
class Check:
    name: str
    result: str
    seconds: float
    seen: str
    limit: float = 0.0
    test: str = ""  # the one test that stopped it
    stack: str = ""  # and its one stack, innermost frame first


@dataclass(frozen=True)
class Ran:
    returncode: int | None  # None: stopped at its limit
    output: str
    seconds: float
    tree: tuple[Process, ...] = ()  # what its processes were doing at the limit


@dataclass(frozen=True)
class Process:
    """One process of a stopped check, as ``snapshot`` saw it."""

    pid: int
    parent: int
    line: str  # state, age and command
    dump: str = ""  # py-spy's dump of its threads, innermost frame first ("" without py-spy)

    def main_thread(self) -> str:
        """The main thread's frames from the dump (py-spy: ``Thread N (state): "MainThread"``)."""
        found = re.search(r'^Thread [^\n]*"MainThread"\n((?:[ \t]+\S[^\n]*\n?)*)', self.dump, re.MULTILINE)
        return textwrap.dedent(found[1]).strip() if found else ""


# ---- the time budget ------------------------------------------------------------------------------------------


def steps(planned: Sequence[str]) -> list[tuple[str, ...]]:
    """The planned checks in ``ORDER``, one step each, but ``BESIDE`` one step when both are planned."""
    ordered = [n for n in ORDER if n in planned]
    together = all(n in ordered for n in BESIDE)
    return [BESIDE if together and n == BESIDE[0] else (n,) for n in ordered if not (together and n in BESIDE[1:])]


def share(step: Sequence[str], scale: float = 1.0) -> float:
    return max(SHARES[n] for n in step) * scale


def budget_for(planned: Sequence[str], scale: float = 1.0) -> float:
    """The run's budget: ``SETUP``, each step's share and one ``STOPPING``, within ``BUDGET`` (times ``scale``)."""
    return min(BUDGET, SETUP + sum(share(step) for step in steps(planned)) + STOPPING) * scale


def limit_for(step: tuple[str, ...], planned: Sequence[str], left: float, scale: float = 1.0) -> float:
    """A step's time limit: what is ``left`` of the run's budget less the shares of the steps planned after it and
    the ``STOPPING`` kept at the end (what an earlier step left unused passes on to this one, never what a later one
    needs)."""
    later = steps(planned)[steps(planned).index(step) + 1 :]
    return left - (sum(share(s) for s in later) + STOPPING) * scale


def arithmetic(planned: Sequence[str], scale: float = 1.0) -> str:
    """The budget in one line, as the run prints it first."""
    parts = [f"setup {SETUP * scale:g}"]
    parts += [f"{' beside '.join(step)} {share(step, scale):g}" for step in steps(planned) if share(step)]
    parts.append(f"one stop {STOPPING * scale:g}")
    rest = [n for step in steps(planned) for n in step if not share(step)]
    tail = f"; {', '.join(rest)} on what the others leave" if rest else ""
    return f"budget: {' + '.join(parts)} = {budget_for(planned, scale):g} s{tail}"


# ---- running a check's pytest ---------------------------------------------------------------------------------


def run(command: Sequence[str], *, limit: float, cwd: Path, env: dict[str, str], log: Path,
        stopping: float = STOPPING) -> Ran:  # fmt: skip
    """A child in a session of its own, given ``limit`` seconds; its output kept in ``log``. At the limit what its
    processes are doing goes into ``log`` (``snapshot``), then it is interrupted as Ctrl-C would (pytest then writes
    the results of the tests that ended), and killed with its whole group ``stopping`` seconds after the limit."""
    started = time.monotonic()
    tree: tuple[Process, ...] = ()
    with log.open("w") as out:
        child = subprocess.Popen(
            command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code: int | None = child.wait(max(limit, 1.0))
        except subprocess.TimeoutExpired:
            tree = snapshot(child.pid, env.get("PATH"), time.monotonic() + min(SNAPSHOT, stopping / 2))
            out.write(f"\n==== gpu_check: stopped at its limit ({limit:.0f}s); what its processes were doing:\n")
            out.write("".join(f"{p.line}\n{textwrap.indent(p.dump, '    ')}" for p in tree) or "(none left)\n")
            out.flush()
            os.kill(child.pid, signal.SIGINT)
            try:
                child.wait(max(started + limit + stopping - time.monotonic(), 1.0))
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)  # only the group this script started
                child.wait()
            code = None
    return Ran(code, log.read_text(errors="replace"), time.monotonic() - started, tree)


def snapshot(pid: int, path: str | None, deadline: float) -> tuple[Process, ...]:
    """The process tree under ``pid`` (the pytest run, its fork servers, their ranks and throwaway children): each
    process's state, age and command, and its Python stacks where ``py-spy`` is on ``path``, the deepest processes
    first (a rank before its server, a server before pytest) as far as ``deadline`` allows. What a stall leaves to
    explain it: the GPU machine is gone by the time anyone reads the log."""
    try:
        tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return ()
    seen: dict[int, Process] = {}
    for p in tree:
        try:
            with p.oneshot():
                age, command = time.time() - p.create_time(), " ".join(p.cmdline())[:200]
                line = f"pid {p.pid} (parent {p.ppid()}) {p.status()} for {age:.0f}s: {command}"
                seen[p.pid] = Process(p.pid, p.ppid(), line, "" if "python" in p.name() else "(not Python)\n")
        except psutil.Error:
            continue
    spy = shutil.which("py-spy", path=path)
    for p in reversed(list(seen.values())):
        if p.dump:
            continue
        left = deadline - time.monotonic()
        if spy is None or left < 1:
            dump = "(py-spy is not on PATH: no Python stacks)\n" if spy is None else "(no time left for its stacks)\n"
        else:
            try:
                done = subprocess.run([spy, "dump", "--pid", str(p.pid)], capture_output=True, text=True,
                                      timeout=min(left, 6.0))  # fmt: skip
                dump = done.stdout + done.stderr
            except subprocess.TimeoutExpired:
                dump = "(py-spy took too long)\n"
        seen[p.pid] = dataclasses.replace(p, dump=dump)
    return tuple(seen.values())


# ---- naming what stopped a check -------------------------------------------------------------------------------

_STARTED = re.compile(r"^(\S+\.py::\S+)(?: +(PASSED|FAILED|SKIPPED|XFAIL|XPASS|ERROR)\b)?", re.MULTILINE)
_FRAME = re.compile(r'File "([^"]+)", line (\d+),? in (\S+)')
_SPY_FRAME = re.compile(r"^\s*(\S+) \(([^()]+):(\d+)\)", re.MULTILINE)
_CRASH = re.compile(r"^(\S+\.py):(\d+): KeyboardInterrupt", re.MULTILINE)


def running_test(output: str) -> str | None:
    """The test pytest had started and not ended (``-v`` prints a test's node id as it starts, its outcome as it
    ends), or None."""
    running = None
    for found in _STARTED.finditer(output):
        running = None if found[2] else found[1]
    return running


def frames(stack: str) -> list[str]:
    """``file:line in function``, innermost first, from a Python traceback (innermost last), a faulthandler dump of
    a rank (innermost first; the current thread's, else the first) or a py-spy dump (innermost first)."""
    if "most recent call first" in stack:
        blocks = re.split(r"^(?=(?:Current thread|Thread) 0x)", stack, flags=re.MULTILINE)
        block = next((b for b in blocks if b.startswith("Current thread")), blocks[-1] if blocks else "")
        return [f"{Path(f).name}:{n} in {fn}" for f, n, fn in _FRAME.findall(block)]
    found = [f"{Path(f).name}:{n} in {fn}" for f, n, fn in _FRAME.findall(stack)]
    if found:
        return found[::-1]
    return [f"{Path(f).name}:{n} in {fn}" for fn, f, n in _SPY_FRAME.findall(stack)]


def one_line(stack: str) -> str:
    """A stack in a table's cell: its innermost frame, and the test's own frame below it when that is another."""
    found = frames(stack)
    if not found:
        return stack.strip().splitlines()[-1][:160] if stack.strip() else ""
    body = next((f for f in found if Path(f.split(":")[0]).name.startswith("test_")), None)
    return found[0] if body in (None, found[0]) else f"{found[0]} <- {body}"


def stopping_stack(tree: Sequence[Process], output: str) -> str:
    """The one stack of a check stopped at its limit (py-spy's main threads): a rank's in a test body, else a fork
    server's, else pytest's; without py-spy, where pytest's Ctrl-C landed (its own report of the interrupt)."""
    threads = [(p, p.main_thread()) for p in tree]
    for wanted in ("run_body (", "serving.py"):
        for p, stack in threads:
            if wanted in stack:
                return f"pid {p.pid}:\n{stack}"
    if threads and threads[0][1]:
        return f"pid {threads[0][0].pid}:\n{threads[0][1]}"
    crash = _CRASH.findall(output)
    return f"pytest, interrupted at {Path(crash[-1][0]).name}:{crash[-1][1]}" if crash else ""


def record_stack(record: results.TestRecord) -> str:
    """A recorded test's one stack: its first failing rank's (its traceback, or its Python stack when it hung), else
    pytest's own report of it."""
    for story in record.ranks:
        if story.traceback.strip():
            return f"{story.ranks}: {story.error}\n{story.traceback}"
    return record.longrepr or record.error or ""


# ---- results --------------------------------------------------------------------------------------------------


def records(directory: Path) -> dict[str, results.TestRecord]:
    files, _ = results.read_all([directory]) if directory.is_dir() else ([], [])
    return {t.nodeid: t for f in files for t in f.run.tests}


def label(record: results.TestRecord) -> str:
    """A test's verdict (or pytest's outcome where it has none), as the comparison reads it."""
    return record.verdict.value if record.verdict is not None else record.outcome


def verdicts(directory: Path) -> dict[str, str]:
    """``nodeid -> verdict`` (or pytest's outcome where the test has no verdict) from a results directory."""
    return {n: label(t) for n, t in records(directory).items()}


def wanting_gpus(found: dict[str, results.TestRecord]) -> set[str]:
    """The tests skipped here because their world has more ranks than the machine has GPUs (a repro that pins its
    size): nothing to compare."""
    return {n for n, t in found.items() if t.outcome == "skipped" and "CUDA devices for a" in (t.error or "")}


def by_premise(found: dict[str, results.TestRecord]) -> set[str]:
    """The tests NOT-APPLICABLE here because their premise names another accelerator than these worlds' (a CPU-only
    bug in an NCCL world): a difference from the CPU that the repro itself explains."""
    return {n for n, t in found.items() if label(t) == "NOT-APPLICABLE" and "(its ds_premise)" in (t.error or "")}


@dataclass(frozen=True)
class Comparison:
    result: str
    seen: str
    first: str | None = None  # the first test whose verdict is not the CPU's
    explained: tuple[str, ...] = ()


def compare(found: dict[str, str], reference: dict[str, str], explained: Collection[str] = ()) -> Comparison:
    """PASS when every test the reference judged got the same verdict here, or is ``explained`` (NOT-APPLICABLE by
    its premise); else what differs, test by test."""
    if not reference:
        return Comparison(SKIP, "no CPU reference given (prepare writes it)")
    if not found:
        return Comparison(FAIL, "no test was recorded")
    differ = [n for n in sorted(reference) if found.get(n) != reference[n] and n not in explained]
    told = [f"{n}: {reference[n]} on CPU, {found.get(n, 'not run')} here" for n in differ]
    why = sorted(n for n in reference if n in explained and found.get(n) != reference[n])
    note = f"; {len(why)} NOT-APPLICABLE by their premise (CPU accelerator only)" if why else ""
    same = len(reference) - len(differ) - len(why)
    if not differ:
        return Comparison(PASS, f"{same} verdicts as on CPU{note}", explained=tuple(why))
    listed = "; ".join(told[:6]) + (" ..." if len(told) > 6 else "")
    return Comparison(FAIL, f"{same} as on CPU{note}, {len(differ)} differ: {listed}", differ[0], tuple(why))


def summary_line(output: str) -> str:
    lines = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|xfailed|skipped|error)", line)]
    return lines[-1].strip("= ") if lines else "(no pytest summary)"


# ---- the checks -----------------------------------------------------------------------------------------------


class GpuCheck:
    """The checks of ``run``, each a method that returns a ``Check`` within the ``limit`` it is given."""

    def __init__(self, input_dir: Path, evidence: Path, env: dict[str, str], gpus: int, select: str | None,
                 work: Path, catalogue: Path = ROOT / "repros", timeout: float = CATALOGUE_TIMEOUT,
                 stopping: float = STOPPING) -> None:  # fmt: skip
        self.input = input_dir
        self.select = ["-k", select] if select else []  # a slice of the catalogue, to rerun what failed
        self.evidence = evidence  # every check's logs and results, packed into the archive
        self.env = env
        self.gpus = gpus
        self.work = work  # the check's own test files
        self.catalogue = catalogue
        self.timeout = timeout  # a catalogue world's (--ds-timeout)
        self.stopping = stopping  # how long a check stopped at its limit gets to leave its evidence (``run``)
        self.pytest = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", "-rA"]

    def catalogue_run(self, title: str, name: str, size: int, backend: str, reference: str, limit: float) -> Check:
        """The catalogue in ``size``-rank ``backend`` worlds, every verdict against the CPU reference ``reference``."""
        results_dir = self.evidence / name
        ran = run([*self.pytest, str(self.catalogue), "--ds-world-size", str(size), "--ds-backend", backend,
                   "--ds-results", str(results_dir), "--ds-timeout", f"{self.timeout:g}", "--ds-gpu-wait",
                   f"{GPU_WAIT:g}", *self.select], limit=limit, cwd=self.catalogue.parent, env=self.env,
                  log=self.evidence / f"{name}.log", stopping=self.stopping)  # fmt: skip
        found = records(results_dir)
        if ran.returncode is None:
            seen = f"stopped at its limit with {len(found)} tests recorded; {summary_line(ran.output)}"
            return self._stopped(title, ran, limit, seen, found)
        wanting = wanting_gpus(found)
        here = {n: label(t) for n, t in found.items()}
        expected = {
            n: v for n, v in verdicts(self.input / reference).items()
            if n not in wanting and (not self.select or n in here)
        }  # fmt: skip
        compared = compare(here, expected, by_premise(found))
        slowest = max(found.values(), key=lambda t: t.duration, default=None)
        more = f"; {len(wanting)} skipped for want of GPUs" if wanting else ""
        more += f"; slowest {slowest.nodeid.split('::')[-1]} {slowest.duration:.1f}s" if slowest else ""
        seen = f"{summary_line(ran.output)}; {compared.seen}{more}"
        if compared.first is None:
            return Check(title, compared.result, ran.seconds, seen, limit)
        first = found.get(compared.first)
        return Check(title, FAIL, ran.seconds, seen, limit, compared.first, record_stack(first) if first else "")

    def catalogue_nccl(self, limit: float) -> Check:
        if self.gpus < 1:
            return Check("catalogue, 1-rank NCCL", SKIP, 0.0, "no CUDA device")
        return self.catalogue_run("catalogue, 1-rank NCCL", "nccl-1", 1, "nccl", "cpu-1", limit)

    def catalogue_gloo(self, limit: float) -> Check:
        return self.catalogue_run("catalogue, 2-rank gloo", "gloo-2", 2, "gloo", "cpu-2", limit)

    def catalogue_nccl_two(self, limit: float) -> Check:
        if self.gpus < 2:
            return Check("catalogue, 2-rank NCCL", SKIP, 0.0, f"{self.gpus} CUDA device(s): two are needed")
        return self.catalogue_run("catalogue, 2-rank NCCL", "nccl-2", 2, "nccl", "cpu-2", limit)

    def _write(self, name: str, text: str) -> Path:
        path = self.work / name
        path.write_text(textwrap.dedent(text))
        return path

    def _pytest(self, name: str, *args: str, limit: float, stopping: float | None = None
                ) -> tuple[Ran, dict[str, results.TestRecord]]:  # fmt: skip
        """pytest on the check's own test files, its results in the evidence under ``name``."""
        results_dir = self.evidence / name
        ran = run([*self.pytest, *args, "--ds-results", str(results_dir)], limit=limit, cwd=self.work, env=self.env,
                  log=self.evidence / f"{name}.log", stopping=stopping or self.stopping)  # fmt: skip
        return ran, records(results_dir)

    def _stopped(self, title: str, ran: Ran, limit: float, seen: str, found: dict[str, results.TestRecord],
                 otherwise: tuple[str, str] = ("", "")) -> Check:  # fmt: skip
        """A check that did not pass, and the test that stopped it: the one running at its limit, else the first that
        failed, else ``otherwise`` (what the check itself found wrong: the test, and what it printed)."""
        if ran.returncode is None:
            test = running_test(ran.output) or "(no test had started)"
            return Check(title, FAIL, ran.seconds, seen, limit, test, stopping_stack(ran.tree, ran.output))
        failed = next((t for t in found.values() if t.outcome == "failed"), None)
        test, stack = (failed.nodeid, record_stack(failed)) if failed is not None else otherwise
        return Check(title, FAIL, ran.seconds, seen, limit, test, stack)

    def leases(self, limit: float) -> Check:
        title = "GPU leases, two sessions"
        if self.gpus < 1:
            return Check(title, SKIP, 0.0, "no CUDA device")
        started = self.work / "holding"
        self._write(
            "test_hold.py",
            f"""
            import pathlib, time
            import pytest

            @pytest.mark.ds_world(size=1, backend="nccl")
            def test_holds_the_gpu(ds_rank):
                import torch
                torch.ones(1, device="cuda")
                pathlib.Path({str(started)!r}).touch()
                time.sleep(8)
            """,
        )
        began = time.monotonic()
        deadline = began + limit
        log = (self.evidence / "leases-holder.log").open("w")
        holder = subprocess.Popen([*self.pytest, "test_hold.py"], cwd=self.work, env=self.env, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            while not started.exists() and holder.poll() is None and time.monotonic() < deadline - 10:
                time.sleep(0.2)
            if not started.exists():
                return Check(title, FAIL, time.monotonic() - began, "the holder never ran (leases-holder.log)", limit,
                             "test_hold.py::test_holds_the_gpu", "")  # fmt: skip
            # Each stopped (if at all) in a few seconds: together they end within the stop the budget keeps.
            busy, busy_found = self._pytest("leases-busy", "test_hold.py", "--ds-gpu-wait", "1",
                                             limit=max(deadline - time.monotonic(), 1.0) / 2, stopping=5.0)  # fmt: skip
            after, found = self._pytest("leases-after", "test_hold.py", limit=max(deadline - time.monotonic(), 1.0),
                                        stopping=5.0)  # fmt: skip
        finally:
            try:
                holder.wait(max(deadline - time.monotonic(), 1.0))
            except subprocess.TimeoutExpired:
                os.killpg(holder.pid, signal.SIGKILL)
                holder.wait()
            log.close()
        named = re.search(r"busy: .*pid \d+", busy.output) is not None
        skipped = "1 skipped" in busy.output
        waited = after.returncode == 0
        seen = (f"second session skipped: {skipped}, naming the holder's pid: {named}; third ran after the holder: "
                f"{waited} ({after.seconds:.1f}s)")  # fmt: skip
        if named and skipped and waited:
            return Check(title, PASS, time.monotonic() - began, seen, limit)
        # The second session was not skipped as it should, or the third did not run after the holder.
        wrong, its = (busy, busy_found) if not (named and skipped) else (after, found)
        return self._stopped(title, wrong, limit, seen, its, ("test_hold.py::test_holds_the_gpu", wrong.output[-1500:]))

    def hang(self, limit: float) -> Check:
        title = "a hang, explained"
        if self.gpus < 1:
            return Check(title, SKIP, 0.0, "no CUDA device")
        self._write(
            "test_hang.py",
            """
            import pytest

            @pytest.mark.ds_world(size=1, backend="nccl", timeout=30)  # torch's timeout at 15 s, its dump before 30
            def test_collective_behind_a_long_kernel(ds_rank):
                import torch
                import torch.distributed as dist
                t = torch.ones(4, device="cuda")
                dist.all_reduce(t)
                torch.cuda.synchronize()
                torch.cuda._sleep(int(2e12))  # minutes of GPU time: the next collective waits behind it
                dist.all_reduce(t)
                torch.cuda.synchronize()
            """,
        )
        ran, found = self._pytest("hang", "test_hang.py", limit=limit)
        recorder = re.findall(r"NCCL flight recorder: (.*)", ran.output)
        told = [line for line in recorder if "no dump" not in line and "dump " in line]
        kept = [Path(p) for line in told for p in re.findall(r"dump (\S+)", line)]
        for dump in kept:  # into the evidence: the GPU machine goes back with its cache
            if dump.is_file():
                shutil.copy(dump, self.evidence / f"hang-{dump.name}")
        named = any(re.search(r"all_?reduce", line, re.IGNORECASE) for line in told)
        seen = "; ".join(recorder) or f"no flight-recorder line ({summary_line(ran.output)})"
        if ran.returncode == 1 and bool(told) and named and all(p.exists() for p in kept):
            return Check(title, PASS, ran.seconds, seen, limit)
        return self._stopped(title, ran, limit, seen, found)

    def world_cost(self, limit: float) -> Check:
        title = "an NCCL world per test"
        if self.gpus < 1:
            return Check(title, SKIP, 0.0, "no CUDA device")
        self._write(
            "test_cost.py",
            """
            import pytest

            @pytest.mark.ds_world(size=1, backend="nccl")
            @pytest.mark.parametrize("n", range(6))
            def test_fresh(ds_rank, n):
                import torch, torch.distributed as dist
                t = torch.ones(4, device="cuda")
                dist.all_reduce(t)

            @pytest.mark.ds_world(size=1, backend="nccl", reuse=True)
            class TestKept:
                @pytest.mark.parametrize("n", range(6))
                def test_kept(self, ds_rank, n):
                    import torch, torch.distributed as dist
                    t = torch.ones(4, device="cuda")
                    dist.all_reduce(t)
            """,
        )
        began = time.monotonic()
        ran, found = self._pytest("cost", "test_cost.py", "--durations=0", "--durations-min=0", limit=limit * 0.65)
        if ran.returncode is None:
            return self._stopped(title, ran, limit, f"stopped at its limit; {summary_line(ran.output)}", found)
        calls = call_seconds(ran.output)
        fresh = sorted(s for name, n, s in calls if name == "test_fresh" and n != 0)
        kept = sorted(s for name, n, s in calls if name == "TestKept::test_kept" and n != 0)
        floor = run([sys.executable, __file__, "floor", "5"], limit=max(began + limit - time.monotonic(), 1.0),
                    cwd=self.work, env=self.env, log=self.evidence / "cost-floor.log")  # fmt: skip
        bare = re.search(r"FLOOR median=([\d.]+)", floor.output)
        if not fresh or bare is None:
            seen = f"{summary_line(ran.output)}; floor: {floor.output.strip()[-200:]}"
            wrong = ("test_cost.py::test_fresh", ran.output[-1500:]) if not fresh else ("floor", floor.output[-1500:])
            return self._stopped(title, ran if not fresh else floor, limit, seen, found, wrong)
        base = float(bare.group(1))
        f, k = statistics.median(fresh), statistics.median(kept) if kept else float("nan")
        return Check(title, PASS, time.monotonic() - began,
                     f"fresh {f:.3f}s ({f / base:.2f}x the floor), reuse=True {k:.3f}s ({k / base:.2f}x), bare floor "
                     f"{base:.3f}s; medians of {len(fresh)} and {len(kept)}", limit)  # fmt: skip


def call_seconds(durations: str) -> list[tuple[str, int, float]]:
    """``(test, parameter, seconds)`` of each call phase in pytest's ``--durations`` lines for ``test_cost.py``
    (``test_fresh[3]``, ``TestKept::test_kept[3]``)."""
    found = re.findall(r"([\d.]+)s call\s+test_cost\.py::([\w:]+)\[(\d+)\]", durations)
    return [(name, int(n), float(s)) for s, name, n in found]


def floor(count: int) -> None:
    """The bare floor: this process imports torch (no CUDA), then forks 1-rank NCCL worlds one after the other."""
    import socket

    import torch
    import torch.distributed as dist

    seconds = []
    for _ in range(count):
        with socket.socket() as s:  # the floor's own port; the plugin's worlds bind theirs before they fork
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        began = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                    device_id=torch.device("cuda:0"))  # fmt: skip
            t = torch.ones(4, device="cuda")
            dist.all_reduce(t)
            torch.cuda.synchronize()
            dist.destroy_process_group()
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        if status != 0:
            raise SystemExit(f"a floor world failed (status {status})")
        seconds.append(time.perf_counter() - began)
    print(f"FLOOR median={statistics.median(seconds):.3f} min={min(seconds):.3f} n={count}")


def cuda_devices(env: dict[str, str]) -> int:
    """Counted in a child (this process forks nothing with CUDA, but its children's children may)."""
    code = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    return int(done.stdout.strip() or 0) if done.returncode == 0 else 0


def install(input_dir: Path, env: dict[str, str], site: Path) -> str:
    """The prepared wheels into a directory of their own, on ``PYTHONPATH``: nothing fetched, nothing else moved."""
    wheels = sorted((input_dir / "wheels").glob("*.whl"))
    if not wheels:
        return "no prepared wheels: the installed packages are used"
    here = set(sys_tags())
    foreign = [w.name for w in wheels if here.isdisjoint(parse_wheel_filename(w.name)[3])]
    if foreign:  # the dry run on a CPU machine, whose Python is not the GPU image's
        return f"the prepared wheels are not for this interpreter ({foreign[0]}): the installed packages are used"
    subprocess.run([*PIP, "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--target", str(site), *map(str, wheels)], check=True, env=env)  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p)
    env["PATH"] = os.pathsep.join((str(site / "bin"), env.get("PATH", "")))  # py-spy
    return f"{len(wheels)} wheels installed into {site}"


# ---- the evidence ---------------------------------------------------------------------------------------------


def table(checks: Sequence[Check]) -> str:
    rows = ["| check | result | seconds (limit) | seen | stopped by |", "|---|---|---|---|---|"]
    for c in checks:
        stopped = f"`{c.test}`: {one_line(c.stack)}" if c.test else ""
        took = f"{c.seconds:.0f} ({c.limit:.0f})" if c.limit else ""
        rows.append(f"| {c.name} | {c.result} | {took} | {c.seen.replace('|', '/')} | {stopped.replace('|', '/')} |")
    return "\n".join(rows)


def stacks(checks: Sequence[Check]) -> str:
    """Each stopped check's test and stack, whole (innermost frames first where the stack reads so)."""
    parts = []
    for c in checks:
        if c.test:
            kept = "\n".join(c.stack.strip().splitlines()[:40])
            parts.append(f"### {c.name}: `{c.test}`\n\n```\n{kept or '(no stack)'}\n```")
    return "\n\n".join(parts)


def per_test(input_dir: Path, evidence: Path) -> str:
    """Per catalogue test, its verdict here in each catalogue check against the CPU's: the table docs/gpus.md keeps."""
    columns = [("CPU, 1 rank", input_dir / "cpu-1"), ("NCCL, 1 rank", evidence / "nccl-1"),
               ("CPU, 2 ranks", input_dir / "cpu-2"), ("gloo, 2 ranks, here", evidence / "gloo-2"),
               ("NCCL, 2 ranks", evidence / "nccl-2")]  # fmt: skip
    found = [(title, records(d)) for title, d in columns]
    found = [(title, r) for title, r in found if r]
    if len(found) < 2:
        return ""
    names = sorted({n for _, r in found for n in r})
    rows = [f"| test | {' | '.join(title for title, _ in found)} |", "|---|" + "---|" * len(found)]
    for n in names:
        cells = [f"{label(r[n])} ({r[n].duration:.1f}s)" if n in r else "" for _, r in found]
        rows.append(f"| `{n.split('/')[-1]}` | {' | '.join(cells)} |")
    return "\n".join(rows)


def write_evidence(out: Path, evidence: Path, input_dir: Path, head: str, checks: Sequence[Check]) -> None:
    """The table and stacks (``gpu-check.md``) and the archive of every log and results file (``gpu-check.tgz``),
    rewritten whole after each check."""
    parts = [head, table(checks), stacks(checks), per_test(input_dir, evidence)]
    (out / "gpu-check.md").write_text("\n\n".join(p for p in parts if p) + "\n")
    partial = out / "gpu-check.tgz.part"
    with tarfile.open(partial, "w:gz") as archive:
        archive.add(evidence, arcname="gpu-check")
    partial.replace(out / "gpu-check.tgz")


def run_checks(args: argparse.Namespace) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    for old in ("gpu-check.md", "gpu-check.log", "gpu-check.tgz"):
        (args.out / old).unlink(missing_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
    env.pop("DS_ACCELERATOR", None)  # each world's backend picks DeepSpeed's accelerator
    work = Path(tempfile.mkdtemp(prefix="dsrepro-gpu-check-"))
    try:
        return _checks(args, env, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _say(out: Path) -> Callable[[str], None]:
    def say(text: str) -> None:
        print(text, flush=True)
        with (out / "gpu-check.log").open("a") as log:
            log.write(text + "\n")

    return say


def _checks(args: argparse.Namespace, env: dict[str, str], work: Path) -> int:
    began, say = time.monotonic(), _say(args.out)
    planned = [n for n in ORDER if n in args.only] if args.only else list(ORDER)
    deadline = began + budget_for(planned, args.scale)
    say(f"gpu_check: {arithmetic(planned, args.scale)}; each check's unused time passes on to the next")
    installed = install(args.input, env, work / "site")
    versions = subprocess.run([sys.executable, "-c", "import torch, deepspeed, pytest_dsrepro; print("
                               "'torch', torch.__version__, 'deepspeed', deepspeed.__version__)"],
                              env=env, capture_output=True, text=True)  # fmt: skip
    gpus = cuda_devices(env)
    said = (versions.stdout.strip().splitlines() or [versions.stderr.strip()[-300:]])[-1]  # DeepSpeed logs to stdout
    head = f"gpu_check: {installed}; {said}; {gpus} CUDA devices; set up in {time.monotonic() - began:.0f}s"
    say(head)
    evidence = work / "evidence"
    evidence.mkdir()
    check = GpuCheck(args.input, evidence, env, gpus, args.k, work)
    checks = {"nccl-1": check.catalogue_nccl, "gloo-2": check.catalogue_gloo, "nccl-2": check.catalogue_nccl_two,
              "leases": check.leases, "hang": check.hang, "cost": check.world_cost}  # fmt: skip
    done: list[Check] = []
    for step in steps(planned):
        limit = limit_for(step, planned, deadline - time.monotonic(), args.scale)
        if limit < LEAST:
            left = f"{max(limit, 0):.0f}s left of the {deadline - began:.0f}s budget"
            ended = [Check(name, SKIP, 0.0, left) for name in step]
        else:  # a step of two: side by side, each within the step's limit
            with ThreadPoolExecutor(len(step)) as pool:
                ended = list(pool.map(lambda name, limit=limit: checks[name](limit), step))
        for c in ended:
            done.append(c)
            took = f" in {c.seconds:.0f}s of {c.limit:.0f}" if c.limit else ""
            say(f"gpu_check: {c.name}: {c.result}{took}: {c.seen}"
                + (f"; stopped by {c.test}: {one_line(c.stack)}" if c.test else ""))  # fmt: skip
        write_evidence(args.out, evidence, args.input, head, done)
    say(table(done))
    say(f"gpu_check: {time.monotonic() - began:.0f}s in all, of a {deadline - began:.0f}s budget")
    return 1 if any(c.result == FAIL for c in done) else 0


# ---- prepare --------------------------------------------------------------------------------------------------


def reference(py: str, catalogue: Path, into: Path, size: int, select: Sequence[str]) -> float:
    """The CPU reference: the catalogue's verdicts in ``size``-rank gloo worlds here, into ``into``; its seconds."""
    shutil.rmtree(into, ignore_errors=True)
    began = time.monotonic()
    subprocess.run([py, "-m", "pytest", "-p", "no:cacheprovider", "-q", str(catalogue), "--ds-world-size", str(size),
                    "--ds-results", str(into), *select], cwd=catalogue.parent,
                   env={**os.environ, "DS_ACCELERATOR": "cpu"})  # fmt: skip
    return time.monotonic() - began


SCRIPT = """\
#!/bin/bash
# pytest-dsrepro's GPU check, as one command (written by `gpu_check.py prepare` at {commit}, {date}): DeepSpeed
# {release} for Python {python}. On the GPU machine, from the repository's root:
#     bash {script}                     (every check, within {budget:g} s)
#     bash {script} --only hang cost    (a rerun of what failed)
# The evidence goes to $OUT (where the device tool brings files back from), else to /tmp/gpu-check: three files,
# gpu-check.md (the table), gpu-check.log and gpu-check.tgz.
set -u
cd {root} || exit 1
export PYTHONUNBUFFERED=1
exec python3 benchmarks/gpu_check.py run --input {input} --out "${{OUT:-/tmp/gpu-check}}" "$@"
"""


def script(into: Path, release: str, python: str) -> Path:
    """``run.sh`` in ``into``: the one command the GPU machine runs (paths relative to the repository, which travels
    with ``into`` inside it; absolute where ``into`` is elsewhere)."""
    into = into.resolve()
    inside = into.is_relative_to(ROOT)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    path = into / "run.sh"
    path.write_text(SCRIPT.format(
        commit=commit.stdout.strip() or "an unknown commit", date=datetime.date.today().isoformat(), release=release,
        python=python, script=_shown(path), budget=BUDGET,
        root=f'"$(dirname "$0")/{os.path.relpath(ROOT, into)}"' if inside else shlex.quote(str(ROOT)),
        input=shlex.quote(str(into.relative_to(ROOT) if inside else into)),
    ))  # fmt: skip
    path.chmod(0o755)
    return path


def _shown(path: Path) -> Path:
    """``path`` as a command run from the repository's root names it."""
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def prepare(args: argparse.Namespace) -> int:
    """The inputs of ``run``: wheels for the GPU image's Python, the CPU reference verdicts, and ``run.sh``. Without
    uv (neither its package nor on ``PATH``): one line saying so, exit 2."""
    try:
        uv = uv_binary()
    except InstallError as exc:
        print(f"gpu_check prepare: {exc.reason}: it builds the wheels", file=sys.stderr)
        return 2
    wheels = args.into / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir(parents=True)
    py = sys.executable
    subprocess.run([uv, "build", "--wheel", "--out-dir", str(wheels), str(ROOT)], check=True)
    platforms = [flag for p in PLATFORMS for flag in ("--platform", p)]
    subprocess.run([*PIP, "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
                    args.python_version, "--implementation", "cp", *platforms, "-d", str(wheels), *MISSING_THERE,
                    *DIAGNOSTICS], check=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as sdists:
        subprocess.run([*PIP, "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", sdists,
                        f"deepspeed=={args.release}"], check=True)  # fmt: skip
        sdist = next(Path(sdists).glob("deepspeed-*.tar.gz"))
        subprocess.run([uv, "build", "--wheel", "--no-build-isolation", "--python", py, "--out-dir", str(wheels),
                        str(sdist)], check=True, env={**os.environ, "DS_BUILD_OPS": "0"})  # fmt: skip
    for size in (1, 2):
        into = args.into / f"cpu-{size}"
        if args.keep_reference and verdicts(into):
            print(f"gpu_check prepare: the CPU reference at {size} rank(s) kept ({len(verdicts(into))} verdicts)")
            continue
        took = reference(py, ROOT / "repros", into, size, ["-k", args.k] if args.k else [])
        print(f"gpu_check prepare: {len(verdicts(into))} CPU verdicts at {size} rank(s) in {into}, {took:.0f}s")
    written = script(args.into, args.release, args.python_version)
    print(f"gpu_check prepare: there, from the repository's root:  bash {_shown(written)}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="on a CPU machine with PyPI: wheels, the CPU reference and run.sh")
    p.add_argument("--into", type=Path, required=True, help="inside the repository, so that it travels with it")
    p.add_argument("--release", default="0.19.8", help="the DeepSpeed release to check (its sdist, built here)")
    p.add_argument("--python-version", default="3.12", help="the GPU image's Python")
    p.add_argument("-k", help="the CPU reference of only the tests pytest's -k selects")
    p.add_argument("--keep-reference", action="store_true", help="keep a CPU reference already in --into")
    r = sub.add_parser("run", help="on the GPU machine: every check, one table")
    r.add_argument("--input", type=Path, required=True, help="what prepare wrote")
    r.add_argument("--out", type=Path, required=True, help="gpu-check.md, gpu-check.log and gpu-check.tgz")
    r.add_argument("--scale", type=float, default=1.0, help="the budget and every check's share, times this")
    r.add_argument("--only", nargs="+", choices=ORDER,
                   help="run these checks only (in the usual order): a rerun of what failed")  # fmt: skip
    r.add_argument("-k", help="the catalogue checks run only the tests pytest's -k selects")
    f = sub.add_parser("floor", help=argparse.SUPPRESS)
    f.add_argument("count", type=int)
    args = parser.parse_args(argv)
    if args.command == "floor":
        floor(args.count)
        return 0
    return prepare(args) if args.command == "prepare" else run_checks(args)


if __name__ == "__main__":
    sys.exit(main())
