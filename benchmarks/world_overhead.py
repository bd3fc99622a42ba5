"""Per-test world overhead: pytest-dsrepro's worlds against a bare fork floor and against fresh interpreters.

- **plugin**: trivial world tests (one all_reduce) at each world size, timed from pytest's own call-phase durations
  (fresh rank processes per test included), and a tiny ZeRO-3 test (build an engine, one step).
- **floor**: the least a forked world can cost, written here: one process that imported torch and DeepSpeed forks N
  ranks, which set up a TCPStore (rank 0 hosts it on a socket bound before the fork), initialise gloo, all_reduce,
  destroy the group and exit.
- **fresh interpreters**: two new Python processes per test, as DeepSpeed's DistributedTest and
  torch.multiprocessing.spawn do (2 ranks only; it is slow).
Plugin and floor run interleaved, round by round, so load changes hit both. Also printed: the resident memory of
the pytest process itself (torch must stay out of it). Medians and ratios; the targets are in README.md.

    python benchmarks/world_overhead.py [--tests 10] [--rounds 3] [--sizes 1,2,4,8] [--baseline-runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

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

#: Writes the pytest process's own peak resident memory (KiB) where the benchmark reads it.
RSS_CONFTEST = """
import resource

def pytest_sessionfinish(session):
    with open("pytest_rss_kib", "w") as f:
        f.write(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))
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
print(json.dumps([world(size) for _ in range(n)]))
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


def plugin(size: int, n: int, zero3: int, workdir: Path) -> tuple[list[float], list[float], int]:
    """Per-test seconds of the trivial tests and of the ZeRO-3 tests, and pytest's peak RSS in KiB."""
    (workdir / "conftest.py").write_text(RSS_CONFTEST)
    (workdir / "test_bench.py").write_text(
        PLUGIN_TESTS.format(size=size, n=n, zero3=zero3, body=textwrap.indent(BODY, "    "))
    )
    results = workdir / "results"
    for old in results.glob("*.json"):
        old.unlink()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--ds-results={results}", "test_bench.py"]
    subprocess.run(cmd, cwd=workdir, check=True, stdout=subprocess.DEVNULL)
    (path,) = results.glob("*.json")
    tests = [t for t in json.loads(path.read_text())["tests"] if t["outcome"] == "passed"]  # not empty-param skips
    # the first test of a session also starts the fork server: it is not a per-test cost
    trivial = [t["duration"] for t in tests if "test_all_reduce" in t["nodeid"]][1:]
    steps = [t["duration"] for t in tests if "test_zero3_step" in t["nodeid"]]
    return trivial, steps, int((workdir / "pytest_rss_kib").read_text())


def floor(size: int, n: int, workdir: Path) -> list[float]:
    script = workdir / "floor.py"
    script.write_text(FLOOR.format(body=textwrap.indent(BODY, "    ")))
    out = subprocess.run([sys.executable, str(script), str(size), str(n)], check=True, capture_output=True, text=True)
    return [float(x) for x in json.loads(out.stdout.splitlines()[-1])]


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


def _line(label: str, xs: list[float]) -> str:
    return f"{label:<28}: median {statistics.median(xs):.3f} s (n={len(xs)}, min {min(xs):.3f}, max {max(xs):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tests", type=int, default=10, help="trivial world tests per size and round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of plugin and floor")
    parser.add_argument("--sizes", default="1,2,4,8", help="world sizes, comma-separated")
    parser.add_argument("--zero3", type=int, default=3, help="tiny ZeRO-3 tests per round (2 ranks)")
    parser.add_argument("--baseline-runs", type=int, default=3, help="fresh-interpreter worlds (2 ranks)")
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    sizes = [int(s) for s in args.sizes.split(",")]
    ours: dict[int, list[float]] = {s: [] for s in sizes}
    bare: dict[int, list[float]] = {s: [] for s in sizes}
    steps: list[float] = []
    rss: list[int] = []
    with tempfile.TemporaryDirectory(prefix="dsrepro-bench-") as tmp:
        workdir = Path(tmp)
        for _ in range(args.rounds):
            for size in sizes:
                trivial, zero3, kib = plugin(size, args.tests, args.zero3 if size == 2 else 0, workdir)
                ours[size] += trivial
                steps += zero3
                rss.append(kib)
                bare[size] += floor(size, args.tests, workdir)
        theirs = baseline(args.baseline_runs, workdir)
    for size in sizes:
        print(_line(f"plugin, {size}-rank world", ours[size]))
        print(_line(f"bare fork floor, {size} ranks", bare[size]))
        print(f"{'ratio to the floor':<28}: {statistics.median(ours[size]) / statistics.median(bare[size]):.2f}x")
    if steps:
        print(_line("plugin, tiny ZeRO-3 test", steps))
    print(_line("fresh interpreters, 2 ranks", theirs))
    if 2 in ours:
        two = statistics.median(ours[2])
        print(f"{'speed-up on fresh (2 ranks)':<28}: {statistics.median(theirs) / two:.1f}x")
    print(f"{'pytest peak RSS':<28}: {max(rss) / 1024:.0f} MiB (median {statistics.median(rss) / 1024:.0f} MiB)")


if __name__ == "__main__":
    main()
