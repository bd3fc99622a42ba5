"""How far a performance verdict is from flipping, on a quiet and on a busy machine: repro
``zero12-hook-count-slowdown``'s measurement, with both of ``slowdown``'s clocks, side by side.

For each DeepSpeed environment given, rounds of one pytest session each, in the same 2-rank world: the repro's
training step of 256 parameter tensors against 8 steps of 32, measured as the repro does (least of 5, interleaved)
on the rank thread's CPU time and on wall time, alternately; every other round with ``--burn`` extra processes
spinning on the CPU meanwhile (on top of whatever the machine already runs). Prints, per release, clock and load,
the ratios seen and the smallest margin to the repro's limit (how many times over a ratio would have to move for the
verdict to flip), and the load average.

    python benchmarks/slowdown_margins.py --python .tox/ds0185/bin/python --python .tox/ds0187/bin/python \\
        [--rounds 3] [--burn 2]
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
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPROS = ROOT / "repros"
#: The repro measured, in its subsystem's folder; the helpers it imports are at the top of repros/.
REPRO = REPROS / "zero12" / "test_zero12_hook_count_slowdown.py"

MEASURE = """
import sys
sys.path[:0] = [{folder!r}, {repros!r}]

import pytest
from _prerequisites import ZERO12_CPU_FLAT_BUFFER
from test_zero12_hook_count_slowdown import LAYERS, SPLIT, ZERO2, batch, chain

from pytest_dsrepro import slowdown

pytestmark = [ZERO12_CPU_FLAT_BUFFER, pytest.mark.ds_world]


@pytest.mark.ds_config(ZERO2)
def test_measure(ds_engine, ds_rank):
    import torch

    def engine(layers):
        model = chain(layers)
        return ds_engine(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))

    big, small = engine(LAYERS), engine(LAYERS // SPLIT)
    x = batch(ds_rank)

    def train(model):
        model.backward(model(x).pow(2).mean())
        model.step()

    for clock in ("cpu", "wall"):
        slowdown(lambda: train(big), lambda: [train(small) for _ in range(SPLIT)], what=clock, against="reference",
                 limit=1e9, clock=clock)
"""


def _limit() -> float:
    text = REPRO.read_text()
    line = next(line for line in text.splitlines() if line.startswith("LIMIT = "))
    return float(line.split("=", 1)[1])


def _burners(count: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def _session(python: str, module: Path, out: Path) -> tuple[str, list[dict[str, object]]]:
    """One pytest session in ``python``'s environment: (its DeepSpeed, the measurements its test recorded)."""
    for old in out.glob("*.json"):
        old.unlink()
    proc = subprocess.run(
        [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--ds-results={out}", str(module)],
        capture_output=True, text=True, cwd=module.parent, timeout=1800,
    )  # fmt: skip
    files = list(out.glob("*.json"))
    if proc.returncode != 0 or not files:
        raise SystemExit(f"{python}: the measuring session failed:\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}")
    run = json.loads(files[0].read_text())
    (test,) = run["tests"]
    return run["environment"]["deepspeed"], test["measurements"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", action="append", required=True, help="an environment's python with DeepSpeed")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--burn", type=int, default=2, help="processes spinning on the CPU in the busy rounds")
    args = parser.parse_args()
    limit = _limit()
    ratios: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    loads: dict[str, list[float]] = defaultdict(list)
    with tempfile.TemporaryDirectory(prefix="slowdown-margins-") as tmp:
        module = Path(tmp) / "test_measure.py"
        module.write_text(textwrap.dedent(MEASURE.format(folder=str(REPRO.parent), repros=str(REPROS))))
        for round_ in range(args.rounds):
            for python in args.python:
                for busy in (0, args.burn):
                    burners = _burners(busy)
                    try:
                        release, measured = _session(os.path.abspath(python), module, Path(tmp) / "out")
                    finally:
                        for proc in burners:
                            proc.kill()
                            proc.wait()
                    load = f"+{busy} spinning" if busy else "as it is"
                    loads[load].append(os.getloadavg()[0])
                    for m in measured:
                        ratios[(release, str(m["clock"]), load)].append(
                            float(m["seconds"]) / float(m["reference_seconds"])  # type: ignore[arg-type]
                        )
                    print(f"round {round_ + 1}: deepspeed {release}, machine {load}: done", file=sys.stderr)
    print(f"limit {limit:g}x (repro zero12-hook-count-slowdown); margin: how many times over a ratio would have to "
          "move for the verdict to flip")  # fmt: skip
    for load, values in loads.items():
        print(f"load average (1 min) after the rounds with the machine {load}: {statistics.median(values):.1f}")
    print(f"{'release':<9} {'clock':<5} {'machine':<12} {'ratios (each round)':<30} {'least margin':>12}")
    for (release, clock, load), values in sorted(ratios.items()):
        slow = statistics.median(values) >= limit
        margin = min(v / limit if slow else limit / v for v in values)
        side = "slow" if slow else "not slow"
        shown = " ".join(f"{v:.2f}" for v in values)
        print(f"{release:<9} {clock:<5} {load:<12} {shown:<30} {margin:>8.1f}x {side}")


if __name__ == "__main__":
    main()
