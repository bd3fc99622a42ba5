"""Per-test world overhead: pytest-dsrepro's worlds against a bare fork floor and against fresh interpreters.

Measured in one run, interleaved round by round so that load changes hit every contender alike:

- **plugin**: pytest sessions of trivial world tests (one all_reduce) at each world size, timed by pytest's own
  call-phase durations (fresh rank processes per test included; the first test of a session, which starts the fork
  server, is left out); in the 2-rank session, tiny ZeRO-3 tests (build an engine, one step; the session's first
  also preloads what engines import, and is told apart); **the first world of a session**, from launching pytest
  to the end of its first world test; and the pytest process's peak resident memory (torch must stay out of it).
- **floor**: the least a forked world can cost, written here: one process that imported torch and DeepSpeed forks N
  ranks, which set up a TCPStore (rank 0 hosts it on a socket bound before the fork), initialise gloo, all_reduce,
  destroy the group and exit. Also its first world, from launching it.
- **fresh interpreters**: two new Python processes per world, as DeepSpeed's DistributedTest and
  torch.multiprocessing.spawn do (2 ranks only; it is slow).
- **the warm catalogue**: ``pytest repros/`` on this interpreter's DeepSpeed, its comm op and preload list cached:
  wall and CPU time.
- ``--against DIR``: another checkout of the plugin (``git worktree add DIR <commit>``) measured the same way in the
  same rounds, so that a change is judged side by side on a machine that is not quiet.

Prints medians, the load average, and ratios; the targets are in README.md.

    python benchmarks/world_overhead.py [--tests 10] [--rounds 3] [--sizes 1,2,4,8] [--zero3 3]
                                        [--baseline-runs 3] [--catalogue] [--against DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

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

#: Records, in the pytest process itself: each passed test's call duration, when its first test ended (wall clock,
#: as the benchmark's launch time), whether torch got imported, and its peak resident memory (KiB).
RECORDER = """
import json, resource, sys, time

calls = []
first_end = []

def pytest_runtest_logreport(report):
    if report.when == "call":
        first_end or first_end.append(time.time())
        if report.passed:
            calls.append([report.nodeid, report.duration])

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
    first_world: list[float] = field(default_factory=list)
    rss_kib: list[int] = field(default_factory=list)
    torch_in_pytest: bool = False
    catalogue_wall: list[float] = field(default_factory=list)
    catalogue_cpu: list[float] = field(default_factory=list)


def _env(plugin_root: Path) -> dict[str, str]:
    """This interpreter, with the plugin imported from ``plugin_root`` (ahead of any installed copy)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSREPRO_")}
    env["PYTHONPATH"] = os.pathsep.join([str(plugin_root), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.setdefault("DS_ACCELERATOR", "cpu")
    return env


def plugin(plugin_root: Path, size: int, n: int, zero3: int, workdir: Path, into: Figures) -> None:
    (workdir / "conftest.py").write_text(RECORDER)
    (workdir / "test_bench.py").write_text(
        PLUGIN_TESTS.format(size=size, n=n, zero3=zero3, body=textwrap.indent(BODY, "    "))
    )
    cmd = [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_bench.py"]
    launched = time.time()
    subprocess.run(cmd, cwd=workdir, check=True, stdout=subprocess.DEVNULL, env=_env(plugin_root))
    recorded = json.loads((workdir / "recorded.json").read_text())
    calls = recorded["calls"]
    trivial = [d for nodeid, d in calls if "test_all_reduce" in nodeid]
    steps = [d for nodeid, d in calls if "test_zero3_step" in nodeid]
    into.trivial.setdefault(size, []).extend(trivial[1:])  # the first also started the fork server
    into.zero3_first += steps[:1]  # the first also preloaded what engines import
    into.zero3 += steps[1:]
    into.first_world.append(recorded["first_end"] - launched)
    into.rss_kib.append(recorded["rss_kib"])
    into.torch_in_pytest |= recorded["torch"]


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


def catalogue(plugin_root: Path, into: Figures) -> None:
    """``pytest repros/`` (this checkout's), wall and CPU time of everything it ran."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    cmd = [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", "repros"]
    subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, env=_env(plugin_root))  # verdicts are not timed
    into.catalogue_wall.append(time.perf_counter() - started)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    into.catalogue_cpu.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)


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
    row("first world, after launch", [_median(f.first_world) for f in figures], _median(bare.first_world))
    row("pytest peak RSS (max)", [max(f.rss_kib) / 1024 for f in figures], unit="MiB")
    print(f"{'torch imported in pytest':<36}" + "".join(f"{f.torch_in_pytest!s:>14}" for f in figures))
    if any(f.catalogue_wall for f in figures):
        row("warm catalogue, wall", [_median(f.catalogue_wall) for f in figures])
        row("warm catalogue, CPU", [_median(f.catalogue_cpu) for f in figures])
    if fresh:
        print(f"{'fresh interpreters, 2 ranks':<36}{statistics.median(fresh):>12.3f} s (n={len(fresh)})")
        for name, f in contenders.items():
            two = _median(f.trivial.get(2, []))
            if two:
                print(f"{'  ' + name + ', speed-up on them':<36}{statistics.median(fresh) / two:>13.1f}x")
    if len(names) == 2:
        side_by_side(names, *figures, sizes)


def side_by_side(names: list[str], a: Figures, b: Figures, sizes: list[int]) -> None:
    print(f"\n{names[0]} / {names[1]}, medians of the same rounds:")
    pairs = [(f"trivial world, {s} rank(s)", a.trivial.get(s, []), b.trivial.get(s, [])) for s in sizes] + [
        ("tiny ZeRO-3 test", a.zero3, b.zero3),
        ("first world, after launch", a.first_world, b.first_world),
        ("warm catalogue, wall", a.catalogue_wall, b.catalogue_wall),
        ("warm catalogue, CPU", a.catalogue_cpu, b.catalogue_cpu),
    ]
    for label, x, y in pairs:
        if x and y:
            print(f"  {label:<34}{statistics.median(x) / statistics.median(y):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tests", type=int, default=10, help="trivial world tests per size and round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of plugin and floor")
    parser.add_argument("--sizes", default="1,2,4,8", help="world sizes, comma-separated")
    parser.add_argument("--zero3", type=int, default=3, help="tiny ZeRO-3 tests per round (2 ranks)")
    parser.add_argument("--baseline-runs", type=int, default=3, help="fresh-interpreter worlds (2 ranks)")
    parser.add_argument("--catalogue", action="store_true", help="also time the warm catalogue (repros/) each round")
    parser.add_argument("--against", type=Path, help="another checkout of the plugin, measured in the same rounds")
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    sizes = [int(s) for s in args.sizes.split(",")]
    roots = {"this": ROOT}
    if args.against is not None:
        roots["against"] = args.against.resolve()
    contenders = {name: Figures() for name in roots}
    bare = Figures()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="dsrepro-bench-") as tmp:
        workdir = Path(tmp)
        if args.catalogue:  # warm: the comm op and the preload list cached, as every later run finds them
            catalogue(ROOT, Figures())
        for _ in range(args.rounds):
            for size in sizes:
                for name, root in roots.items():
                    plugin(root, size, args.tests, args.zero3 if size == 2 else 0, workdir, contenders[name])
                floor(size, args.tests, workdir, bare)
            if args.catalogue:
                for name, root in roots.items():
                    catalogue(root, contenders[name])
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
