"""Per-test world overhead: pytest-dsrepro's fork-server worlds against fresh interpreters per test.

Both sides run the same trivial body (2 ranks, gloo, one all_reduce) and both import torch and DeepSpeed, as a
DeepSpeed repro does. The harness side is timed from pytest's own call-phase durations (fresh rank processes per
test included); the baseline starts two new interpreters per test, as DeepSpeed's DistributedTest and
torch.multiprocessing.spawn do. Prints both medians and the ratio; the targets are in README.md.

    python benchmarks/world_overhead.py [--tests 30] [--baseline-runs 5]
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
assert t.item() == 3.0
"""

HARNESS_TESTS = """
import pytest

@pytest.mark.ds_world(size=2, backend="gloo")
@pytest.mark.parametrize("i", range({n}))
def test_all_reduce(ds_rank, i):
    rank = ds_rank
{body}
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


def harness(n: int, workdir: Path) -> list[float]:
    (workdir / "test_bench.py").write_text(HARNESS_TESTS.format(n=n, body=textwrap.indent(BODY, "    ")))
    results = workdir / "results"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--ds-results={results}", "test_bench.py"]
    subprocess.run(cmd, cwd=workdir, check=True, stdout=subprocess.DEVNULL)
    (path,) = results.glob("*.json")
    return [t["duration"] for t in json.loads(path.read_text())["tests"]]


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tests", type=int, default=30, help="world tests for the harness side")
    parser.add_argument("--baseline-runs", type=int, default=5, help="fresh-interpreter worlds for the baseline")
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with tempfile.TemporaryDirectory(prefix="dsrepro-bench-") as tmp:
        ours = harness(args.tests, Path(tmp))
        theirs = baseline(args.baseline_runs, Path(tmp))
    ours_median, theirs_median = statistics.median(ours), statistics.median(theirs)
    for label, xs in (("pytest-dsrepro world", ours), ("fresh interpreters", theirs)):
        print(
            f"{label:<22}: median {statistics.median(xs):.3f} s/test "
            f"(n={len(xs)}, min {min(xs):.3f}, max {max(xs):.3f})"
        )
    print(f"speed-up              : {theirs_median / ours_median:.1f}x")
    print(
        f"targets               : median <= 0.15 s/test: {'met' if ours_median <= 0.15 else 'MISSED'}; "
        f">= 20x: {'met' if theirs_median / ours_median >= 20 else 'MISSED'}"
    )


if __name__ == "__main__":
    main()
