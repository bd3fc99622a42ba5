"""Per-test world overhead: pytest-dsrepro's worlds against a bare fork floor and against fresh interpreters.

Measured in one run, interleaved round by round so that load changes hit every contender alike:

- **plugin**: pytest sessions of trivial world tests (one all_reduce) at each world size, timed by pytest's own
  call-phase durations (fresh rank processes per test included; the first test of a session, which starts the fork
  server, is left out); in the 2-rank session, tiny ZeRO-3 tests (build an engine through ``ds_engine``, one step;
  the session's first also preloads what engines import, and is told apart); **the first world of a session**, from
  launching pytest to the end of its first world test; and the pytest process's peak resident memory (torch must
  stay out of it).
- **ZeRO-3 written DeepSpeed's way**: the same step with ``import deepspeed`` at the top of the module and
  ``deepspeed.initialize`` in the body, no fixture of the plugin's, in a session of its own (nothing there ran
  ``ds_engine`` first); and the same tests in a class that declares reuse (``ds_world(reuse=True)``), in upstream's
  style, whose first test gets a fresh world and the rest its kept ranks. Each with **where the time goes** (the
  outcome's phases: fork, rendezvous, imports, setup, body, teardown), and **first use**: the body on fresh ranks
  against the same body on kept ones.
- ``--cold``: **the first verdict on a never-seen release**: one such test with an empty ``--ds-cache-dir`` (the comm
  op built and the preload list found again), from launching pytest to the end of the test.
- ``--new-install``: **the first verdict of a never-seen install**: three such tests (so the fork server warms up
  for them) with a cache that holds the comm op but never found a first engine step's imports, to the end of the
  first test. ``--gpu-sim N``: those sessions run under the test-suite's CUDA simulation (``tests/cuda_sim``, N GPUs
  claimed), so that the fork server takes a GPU machine's path; their worlds stay gloo. Run it with the interpreter
  of an environment like a GPU image's (triton, transformers, accelerate, peft beside the CPU torch) to see what the
  search costs there.
- **floor**: the least a forked world can cost, written here: one process that imported torch and DeepSpeed forks N
  ranks, which set up a TCPStore (rank 0 hosts it on a socket bound before the fork), initialise gloo, all_reduce,
  destroy the group and exit. Also its first world, from launching it.
- **fresh interpreters**: two new Python processes per world, as DeepSpeed's DistributedTest and
  torch.multiprocessing.spawn do (2 ranks only; it is slow).
- **the warm catalogue**: ``pytest repros/`` on this interpreter's DeepSpeed, its comm op and preload list cached:
  wall and CPU time, and pytest's summary line (verdicts are not timed, but a catalogue that errors is no figure).
  ``--catalogue-from DIR``: every contender runs that checkout's ``repros/`` (an older checkout's plugin may not
  know a newer catalogue's markers and fixtures), so that both run the same repros; ``--catalogue-own``: each runs
  its own, the catalogue as it was at that commit (issue 53: 107 bugs against the 35 of b0602a0). Per contender,
  the cost per test and where it goes, from the run's results file: series of races, slowdowns, the Hugging Face
  path, other worlds.
- ``--against DIR``: another checkout of the plugin (``git worktree add DIR <commit>``) measured the same way in the
  same rounds, so that a change is judged side by side on a machine that is not quiet.

Prints medians, the load average, and ratios; the targets are in README.md.

    python benchmarks/world_overhead.py [--tests 10] [--rounds 3] [--sizes 1,2,4,8] [--zero3 3]
                                        [--baseline-runs 3] [--catalogue] [--catalogue-from DIR | --catalogue-own]
                                        [--cold] [--new-install] [--gpu-sim N] [--against DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

ROOT = Path(__file__).resolve().parents[1]

BODY = """
import torch, torch.distributed as dist
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
assert t.item() == size * (size + 1) / 2
"""

PLUGIN_TESTS = """
import pytest

@pytest.mark.ds_world(size={size}, backend="gloo")
@pytest.mark.parametrize("i", range({n}))
def test_all_reduce(ds_rank, ds_world_size, i):
    rank, size = ds_rank, ds_world_size
{body}


@pytest.mark.ds_world(size=2, backend="gloo")
@pytest.mark.ds_config("zero3")
@pytest.mark.parametrize("i", range({zero3}))
def test_zero3_step(ds_engine, ds_config, ds_rank, i):
    import torch
    from pytest_dsrepro.inrank.models import make_batch

    engine = ds_engine()
    x, y = make_batch(ds_config["train_micro_batch_size_per_gpu"], rank=ds_rank)
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()
"""

#: The tiny ZeRO-3 step as DeepSpeed users and DeepSpeed's own tests write it: DeepSpeed imported by the module,
#: ``deepspeed.initialize`` in the body; as plain tests and as a class that declares reuse.
DEEPSPEED_WAY = """
import deepspeed
import pytest
import torch

CONFIG = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "zero_optimization": {"stage": 3}}


def step(rank):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=CONFIG)
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(rank))
    engine.backward(torch.nn.functional.mse_loss(engine(x), x[:, :4]))
    engine.step()
"""

PLAIN = """

@pytest.mark.ds_world(size=2, backend="gloo")
@pytest.mark.parametrize("i", range({n}))
def test_zero3_body(ds_rank, i):
    step(ds_rank)
"""

REUSE_CLASS = """

@pytest.mark.ds_world(size=2, backend="gloo", reuse=True)
class TestZero3Reused:
    @pytest.mark.parametrize("i", range({n}))
    def test_step(self, ds_rank, i):
        step(ds_rank)
"""

#: Records, in the pytest process itself: each passed test's call duration and its world's phases, when its first
#: test ended (wall clock, as the benchmark's launch time), whether torch got imported, and its peak resident memory
#: (KiB). Phases are read from the test's outcome, where the plugin keeps it (none in a checkout without them).
RECORDER = """
import json, resource, sys, time

calls = []
first_end = []

try:
    from pytest_dsrepro.session.execution import OUTCOME_KEY
except ImportError:
    OUTCOME_KEY = None

def pytest_runtest_makereport(item, call):
    if call.when == "call" and OUTCOME_KEY is not None:
        outcome = item.stash.get(OUTCOME_KEY, None)
        item.user_properties.append(("phases", dict(getattr(outcome, "phases", ()))))

def pytest_runtest_logreport(report):
    if report.when == "call":
        first_end or first_end.append(time.time())
        if report.passed:
            phases = dict(report.user_properties).get("phases", {})
            calls.append([report.nodeid, report.duration, phases])

def pytest_sessionfinish(session):
    with open("recorded.json", "w") as f:
        json.dump({
            "calls": calls,
            "first_end": first_end[0] if first_end else None,
            "torch": "torch" in sys.modules,
            "rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        }, f)
"""

FLOOR = """
import datetime, json, os, socket, sys, time
os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch, torch.distributed as dist
import deepspeed  # the same preloaded process a fork server is

def connect(rank, size, port, listener):
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", port, size, True, wait_for_workers=False, master_listen_fd=listener.detach())
    else:
        listener.close()
        store = dist.TCPStore("127.0.0.1", port, size, False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size)

def rank_main(rank, size, port, listener):
    connect(rank, size, port, listener)
{body}
    dist.destroy_process_group()

def world(size):
    started = time.perf_counter()
    listener = socket.create_server(("127.0.0.1", 0), backlog=128)
    port = listener.getsockname()[1]
    pids = []
    for rank in range(size):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                rank_main(rank, size, port, listener)
                code = 0
            except BaseException:
                import traceback
                traceback.print_exc()
            finally:
                os._exit(code)
        pids.append(pid)
    listener.close()
    if any(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids):
        raise SystemExit("a floor rank failed")
    return time.perf_counter() - started

size, n = int(sys.argv[1]), int(sys.argv[2])
times = [world(size)]
first_end = time.time()
times += [world(size) for _ in range(n)]
print(json.dumps({{"first_end": first_end, "worlds": times[1:]}}))
"""

BASELINE_RANK = """
import os, sys, datetime
import torch, torch.distributed as dist
os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed  # what a DeepSpeed repro imports in every fresh rank
rank, size, port = int(sys.argv[1]), 2, int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=datetime.timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=size)
{body}
dist.destroy_process_group()
"""


@dataclass
class Figures:
    """Everything measured for one plugin checkout (or the floor), pooled over rounds."""

    trivial: dict[int, list[float]] = field(default_factory=dict)
    zero3: list[float] = field(default_factory=list)
    zero3_first: list[float] = field(default_factory=list)
    body: list[float] = field(default_factory=list)  # ZeRO-3 written DeepSpeed's way
    body_first: list[float] = field(default_factory=list)
    reused: list[float] = field(default_factory=list)  # ... in a reuse class, on kept ranks
    phases: dict[str, list[dict[str, float]]] = field(default_factory=dict)  # per kind of test, per test
    cold: list[float] = field(default_factory=list)
    first_search: list[float] = field(default_factory=list)  # a never-seen install's first verdict
    first_world: list[float] = field(default_factory=list)
    rss_kib: list[int] = field(default_factory=list)
    torch_in_pytest: bool = False
    catalogue_wall: list[float] = field(default_factory=list)
    catalogue_cpu: list[float] = field(default_factory=list)
    catalogue_summary: list[str] = field(default_factory=list)
    catalogue_kinds: list[dict[str, tuple[int, float]]] = field(default_factory=list)  # kind -> (tests, seconds)


def _env(plugin_root: Path, gpus: int = 0) -> dict[str, str]:
    """This interpreter, with the plugin imported from ``plugin_root`` (ahead of any installed copy); ``gpus``: the
    CUDA simulation of the test-suite claims that many."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSREPRO_")}
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # the checkout's own plugins only (_pytest)
    sim = [str(ROOT / "tests" / "cuda_sim")] if gpus else []
    env["PYTHONPATH"] = os.pathsep.join([str(plugin_root), *sim, *filter(None, [os.environ.get("PYTHONPATH")])])
    if gpus:
        env.update(DSREPRO_SIM_GPUS=str(gpus), DSREPRO_SIM_UUID=f"{os.getpid() & 0xFFFFFFFF:08x}")
    else:
        env.setdefault("DS_ACCELERATOR", "cpu")
    return env


def _pytest(plugin_root: Path) -> list[str]:
    """pytest with ``plugin_root``'s own plugins: the installed copy's entry points may name modules an older checkout
    lacks (``pytest_dsrepro.scan.scanner``), so autoloading is off (``_env``) and the checkout's are named."""
    points = tomllib.loads((plugin_root / "pyproject.toml").read_text())["project"]["entry-points"]["pytest11"]
    plugins = [arg for module in points.values() for arg in ("-p", module)]
    return [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugins]


def _session(
    plugin_root: Path, workdir: Path, source: str, *options: str, check: bool = True, gpus: int = 0
) -> tuple[dict[str, Any], float]:
    """One pytest session of ``source`` with the recorder; what it recorded, and when it was launched. ``check=False``:
    its tests may fail (a checkout from before a feature refuses it), and only those that passed are counted;
    ``gpus``: under the CUDA simulation (``_env``)."""
    (workdir / "conftest.py").write_text(RECORDER)
    (workdir / "test_bench.py").write_text(source)
    cmd = [*_pytest(plugin_root), "test_bench.py", *options]
    launched = time.time()
    subprocess.run(cmd, cwd=workdir, check=check, stdout=subprocess.DEVNULL, env=_env(plugin_root, gpus))
    return json.loads((workdir / "recorded.json").read_text()), launched


def _calls(recorded: dict[str, Any], name: str) -> list[tuple[float, dict[str, float]]]:
    return [(duration, phases) for nodeid, duration, phases in recorded["calls"] if name in nodeid]


def plugin(plugin_root: Path, size: int, n: int, zero3: int, workdir: Path, into: Figures) -> None:
    source = PLUGIN_TESTS.format(size=size, n=n, zero3=zero3, body=textwrap.indent(BODY, "    "))
    recorded, launched = _session(plugin_root, workdir, source)
    trivial = _calls(recorded, "test_all_reduce")[1:]  # the first also started the fork server
    steps = _calls(recorded, "test_zero3_step")
    into.trivial.setdefault(size, []).extend(d for d, _ in trivial)
    into.zero3_first += [d for d, _ in steps[:1]]  # the first also preloaded what engines import
    into.zero3 += [d for d, _ in steps[1:]]
    into.phases.setdefault(f"trivial world, {size} rank(s)", []).extend(p for _, p in trivial)
    into.phases.setdefault("ZeRO-3 through ds_engine", []).extend(p for _, p in steps[1:])
    into.first_world.append(recorded["first_end"] - launched)
    into.rss_kib.append(recorded["rss_kib"])
    into.torch_in_pytest |= recorded["torch"]


def deepspeed_way(plugin_root: Path, zero3: int, workdir: Path, into: Figures) -> None:
    """The ZeRO-3 step written DeepSpeed's way: plain tests in one session, a reuse class in another."""
    recorded, _ = _session(plugin_root, workdir, DEEPSPEED_WAY + PLAIN.format(n=zero3 + 1))
    steps = _calls(recorded, "test_zero3_body")
    into.body_first += [d for d, _ in steps[:1]]  # the session's first world: the server starts warm for it
    into.body += [d for d, _ in steps[1:]]
    into.phases.setdefault("ZeRO-3 DeepSpeed's way", []).extend(p for _, p in steps[1:])
    recorded, _ = _session(plugin_root, workdir, DEEPSPEED_WAY + REUSE_CLASS.format(n=zero3 + 1), check=False)
    steps = _calls(recorded, "TestZero3Reused")[1:]  # the first is the server's first world
    into.reused += [d for d, _ in steps]
    into.phases.setdefault("ZeRO-3 DeepSpeed's way, reused", []).extend(p for _, p in steps)


def cold(plugin_root: Path, workdir: Path, into: Figures) -> None:
    """The first verdict on a release this machine never ran: an empty cache directory (the comm op is built, the
    preload list found again), from launching pytest to the end of its one test."""
    with tempfile.TemporaryDirectory(prefix="dsrepro-cold-") as cache:
        recorded, launched = _session(plugin_root, workdir, DEEPSPEED_WAY + PLAIN.format(n=1), "--ds-cache-dir", cache)
    into.cold.append(recorded["first_end"] - launched)


def first_search(plugin_root: Path, workdir: Path, into: Figures, gpus: int) -> None:
    """The first verdict of a never-seen install: three DeepSpeed worlds (the server warms up for them) with a cache
    that holds the comm op (copied from the real one) but never found a first engine step's imports, from launching
    pytest to the end of its first test."""
    code = "from pytest_dsrepro.worlds.server.comm_op import op_directory; print(op_directory())"
    found = subprocess.run([sys.executable, "-c", code], env=_env(ROOT), capture_output=True, text=True, check=True)
    op = Path(found.stdout.strip().splitlines()[-1])
    with tempfile.TemporaryDirectory(prefix="dsrepro-first-") as cache:
        shutil.copytree(op, Path(cache) / "torch_extensions" / op.name)
        source = DEEPSPEED_WAY + PLAIN.format(n=3)
        recorded, launched = _session(plugin_root, workdir, source, "--ds-cache-dir", cache, gpus=gpus)
    into.first_search.append(recorded["first_end"] - launched)


def floor(size: int, n: int, workdir: Path, into: Figures) -> None:
    script = workdir / "floor.py"
    script.write_text(FLOOR.format(body=textwrap.indent(BODY, "    ")))
    launched = time.time()
    out = subprocess.run([sys.executable, str(script), str(size), str(n)], check=True, capture_output=True, text=True)
    result = json.loads(out.stdout.splitlines()[-1])
    into.trivial.setdefault(size, []).extend(result["worlds"])
    into.first_world.append(result["first_end"] - launched)


def baseline(runs: int, workdir: Path) -> list[float]:
    script = workdir / "rank.py"
    script.write_text(BASELINE_RANK.format(body=BODY))
    durations = []
    for i in range(runs):
        port = 29900 + i  # the baseline keeps the usual fixed-port habit; runs are sequential
        started = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port)]) for r in range(2)]
        if any(p.wait() for p in procs):
            raise SystemExit("baseline rank failed")
        durations.append(time.perf_counter() - started)
    return durations


def catalogue(plugin_root: Path, repros_root: Path, into: Figures) -> None:
    """``pytest repros/`` of ``repros_root``, wall and CPU time of everything it ran, its summary line, and its tests'
    durations by kind (from the results file it writes)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dsrepro-catalogue-") as results:
        cmd = [*_pytest(plugin_root), "--ds-results", results, "repros"]
        out = subprocess.run(cmd, cwd=repros_root, capture_output=True, text=True, env=_env(plugin_root))
        into.catalogue_wall.append(time.perf_counter() - started)
        into.catalogue_kinds.append(_kinds(Path(results)))
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    into.catalogue_cpu.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    summary = (out.stdout.strip().splitlines() or ["(no output)"])[-1]
    into.catalogue_summary.append(re.sub(r" in [0-9.]+s.*", "", summary.strip("= ")))  # its time is the wall's


def _kinds(results: Path) -> dict[str, tuple[int, float]]:
    """Tests and seconds per kind of test: a series of runs (a race), a timed slowdown, the Hugging Face path, a
    skip, any other world. Read loosely: an older commit's results schema has the same fields."""
    kinds: dict[str, tuple[int, float]] = {}
    for path in results.glob("*.json"):
        for test in json.loads(path.read_text())["tests"]:
            if test["outcome"] == "skipped":
                kind = "skipped"
            elif test.get("rate"):
                kind = "series of runs (races)"
            elif test.get("measurements") or test.get("measurement"):
                kind = "slowdowns"
            elif (test.get("repro") or {}).get("id", "").startswith("hf-"):
                kind = "Hugging Face path"
            else:
                kind = "other worlds"
            count, seconds = kinds.get(kind, (0, 0.0))
            kinds[kind] = (count + 1, seconds + test["duration"])
    return kinds


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _cell(x: float | None, unit: str = "s") -> str:
    if x is None:
        return "-"
    return f"{x:.0f} MiB" if unit == "MiB" else f"{x:.3f} s"


def report(contenders: dict[str, Figures], bare: Figures, fresh: list[float], sizes: list[int]) -> None:
    names = list(contenders)
    figures = list(contenders.values())
    print(
        f"{'':<36}" + "".join(f"{n:>14}" for n in names) + f"{'floor':>14}" + "".join(f"{'/floor':>10}" for _ in names)
    )

    def row(label: str, values: list[float | None], floor_value: float | None = None, unit: str = "s") -> None:
        cells = "".join(f"{_cell(v, unit):>14}" for v in values)
        ratios = "".join(f"{v / floor_value:>9.2f}x" for v in values if v) if floor_value else ""
        print(f"{label:<36}{cells}{_cell(floor_value, unit) if floor_value else '':>14}{ratios}")

    for size in sizes:
        counts = "/".join(str(len(f.trivial.get(size, []))) for f in figures)
        row(
            f"trivial world, {size} rank(s) (n={counts})",
            [_median(f.trivial.get(size, [])) for f in figures],
            _median(bare.trivial.get(size, [])),
        )
    row(f"tiny ZeRO-3 test (n={'/'.join(str(len(f.zero3)) for f in figures)})", [_median(f.zero3) for f in figures])
    row("first ZeRO-3 test (it preloads)", [_median(f.zero3_first) for f in figures])
    for label, values in [
        ("ZeRO-3 DeepSpeed's way (body)", [f.body for f in figures]),
        ("  its session's first", [f.body_first for f in figures]),
        ("ZeRO-3 DeepSpeed's way, reused", [f.reused for f in figures]),
        ("first verdict, never-seen release", [f.cold for f in figures]),
        ("first verdict, never-seen install", [f.first_search for f in figures]),
    ]:
        if any(values):
            row(label, [_median(v) for v in values])
    row("first world, after launch", [_median(f.first_world) for f in figures], _median(bare.first_world))
    row("pytest peak RSS (max)", [max(f.rss_kib) / 1024 for f in figures], unit="MiB")
    print(f"{'torch imported in pytest':<36}" + "".join(f"{f.torch_in_pytest!s:>14}" for f in figures))
    if any(f.catalogue_wall for f in figures):
        row("warm catalogue, wall", [_median(f.catalogue_wall) for f in figures])
        row("warm catalogue, CPU", [_median(f.catalogue_cpu) for f in figures])
        for name, f in contenders.items():
            print(f"  {name}'s catalogue: " + "; ".join(dict.fromkeys(f.catalogue_summary)))
            catalogue_kinds(f.catalogue_kinds)
    if fresh:
        speed_ups(contenders, fresh)
    for name, f in contenders.items():
        breakdown(name, f)
    if len(names) == 2:
        side_by_side(names, *figures, sizes)


def catalogue_kinds(rounds: list[dict[str, tuple[int, float]]]) -> None:
    """Each kind's tests, median seconds over the rounds, and seconds per test."""
    total = statistics.median(sum(s for _, s in kinds.values()) for kinds in rounds)
    tests = statistics.median(sum(n for n, _ in kinds.values() if n) for kinds in rounds)
    print(f"    {'all tests':<26}{tests:>5.0f} tests {total:>8.1f} s {total / max(tests, 1):>7.2f} s/test")
    for kind in sorted({k for kinds in rounds for k in kinds}):
        count = statistics.median(kinds.get(kind, (0, 0.0))[0] for kinds in rounds)
        seconds = statistics.median(kinds.get(kind, (0, 0.0))[1] for kinds in rounds)
        print(f"    {kind:<26}{count:>5.0f} tests {seconds:>8.1f} s {seconds / max(count, 1):>7.2f} s/test")


def speed_ups(contenders: dict[str, Figures], fresh: list[float]) -> None:
    print(f"{'fresh interpreters, 2 ranks':<36}{statistics.median(fresh):>12.3f} s (n={len(fresh)})")
    for name, f in contenders.items():
        two = _median(f.trivial.get(2, []))
        if two:
            print(f"{'  ' + name + ', speed-up on them':<36}{statistics.median(fresh) / two:>13.1f}x")


def breakdown(name: str, f: Figures) -> None:
    """Where each kind of test's time goes: median seconds per phase, and what a first use costs in the body."""
    kinds = {kind: found for kind, found in f.phases.items() if any(found)}
    if not kinds:
        return
    names = ("fork", "rendezvous", "imports", "setup", "body", "teardown")
    print(f"\n{name}: where the time goes (medians, s)" + "".join(f"{n:>11}" for n in names))
    body: dict[str, float] = {}
    for kind, found in kinds.items():
        cells = [_median([p[n] for p in found if n in p]) for n in names]
        body[kind] = cells[4] or 0.0
        print(f"  {kind:<42}" + "".join(f"{c:>11.3f}" if c is not None else f"{'-':>11}" for c in cells))
    fresh, kept = body.get("ZeRO-3 DeepSpeed's way"), body.get("ZeRO-3 DeepSpeed's way, reused")
    if fresh is not None and kept is not None:
        print(f"  first use in a fresh rank's body (fresh - reused): {fresh - kept:.3f} s")


def side_by_side(names: list[str], a: Figures, b: Figures, sizes: list[int]) -> None:
    print(f"\n{names[0]} / {names[1]}, medians of the same rounds:")
    pairs = [(f"trivial world, {s} rank(s)", a.trivial.get(s, []), b.trivial.get(s, [])) for s in sizes] + [
        ("tiny ZeRO-3 test", a.zero3, b.zero3),
        ("ZeRO-3 DeepSpeed's way", a.body, b.body),
        ("ZeRO-3 DeepSpeed's way, reused", a.reused, b.reused),
        ("first verdict, never-seen release", a.cold, b.cold),
        ("first verdict, never-seen install", a.first_search, b.first_search),
        ("first world, after launch", a.first_world, b.first_world),
        ("warm catalogue, wall", a.catalogue_wall, b.catalogue_wall),
        ("warm catalogue, CPU", a.catalogue_cpu, b.catalogue_cpu),
    ]
    for label, x, y in pairs:
        if x and y:
            print(f"  {label:<34}{statistics.median(x) / statistics.median(y):.2f}")


def one_round(
    args: argparse.Namespace,
    sizes: list[int],
    roots: dict[str, Path],
    contenders: dict[str, Figures],
    bare: Figures,
    workdir: Path,
) -> None:
    """Every contender once, one after another for each measurement, then the floor."""
    for size in sizes:
        for name, root in roots.items():
            plugin(root, size, args.tests, args.zero3 if size == 2 else 0, workdir, contenders[name])
            if size == 2 and args.zero3:
                deepspeed_way(root, args.zero3, workdir, contenders[name])
        floor(size, args.tests, workdir, bare)
    for name, root in roots.items():
        if args.cold:
            cold(root, workdir, contenders[name])
        if args.new_install:
            first_search(root, workdir, contenders[name], args.gpu_sim)
        if args.catalogue:
            catalogue(root, root if args.catalogue_own else args.catalogue_from, contenders[name])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tests", type=int, default=10, help="trivial world tests per size and round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of plugin and floor")
    parser.add_argument("--sizes", default="1,2,4,8", help="world sizes, comma-separated")
    parser.add_argument("--zero3", type=int, default=3, help="tiny ZeRO-3 tests per round (2 ranks)")
    parser.add_argument("--baseline-runs", type=int, default=3, help="fresh-interpreter worlds (2 ranks)")
    parser.add_argument("--catalogue", action="store_true", help="also time the warm catalogue (repros/) each round")
    parser.add_argument(
        "--catalogue-from", type=Path, default=ROOT, help="the checkout whose repros/ the catalogue runs (this one)"
    )
    parser.add_argument("--catalogue-own", action="store_true", help="each contender runs its own repros/")
    parser.add_argument("--cold", action="store_true", help="also time a first verdict with an empty cache, each round")
    parser.add_argument("--new-install", action="store_true", help="also time a never-seen install's first verdict")
    parser.add_argument("--gpu-sim", type=int, default=0, help="--new-install under N simulated GPUs")
    parser.add_argument("--against", type=Path, help="another checkout of the plugin, measured in the same rounds")
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    sizes = [int(s) for s in args.sizes.split(",")]
    args.catalogue_from = args.catalogue_from.resolve()
    roots = {"this": ROOT}
    if args.against is not None:
        roots["against"] = args.against.resolve()
    contenders = {name: Figures() for name in roots}
    bare = Figures()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="dsrepro-bench-") as tmp:
        workdir = Path(tmp)
        if args.catalogue:  # warm: the comm op and the preload list cached, as every later run finds them
            for root in roots.values() if args.catalogue_own else [ROOT]:
                catalogue(root, root if args.catalogue_own else args.catalogue_from, Figures())
        for _ in range(args.rounds):
            one_round(args, sizes, roots, contenders, bare, workdir)
        fresh = baseline(args.baseline_runs, workdir)
    load_after = os.getloadavg()
    print(
        f"load average (1, 5, 15 min) before: {', '.join(f'{x:.2f}' for x in load_before)}; "
        f"after: {', '.join(f'{x:.2f}' for x in load_after)}; {os.cpu_count()} CPUs"
    )
    for name, root in roots.items():
        print(f"{name}: {root}")
    report(contenders, bare, fresh, sizes)


if __name__ == "__main__":
    main()
