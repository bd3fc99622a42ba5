"""Every catalogued body judged on a generated grid of config shapes (issue 54): no false regression, by construction.

A shape is a ZeRO stage x a precision (fp32, fp16, bf16) x an accumulation (1, 4 given, or 16 derived from the batch
sizes with no ``gradient_accumulation_steps`` key) x one feature (none, clipping, a micro-batch of 8, each scheduler,
optimizer or parameter offload, the flops profiler, the comms logger, ``"auto"`` values, an optimizer section). Each is
scanned on each release, in that release's environment, with the whole catalogue; a bug's AFFECTED on a release
outside its catalogued range is a false regression, and the summary lists every one (there should be none).

    nice -n 10 python benchmarks/scan_grid.py --out /tmp/grid [--release 0.18.3 ...] [--shape ID ...] [--every N]
    python benchmarks/scan_grid.py --summary /tmp/grid [--before /tmp/grid-before]
    python benchmarks/scan_grid.py --list

``--catalogue DIR`` scans another catalogue (an older commit's ``repros/``, for the count before a change);
``--every N`` takes every N-th shape of the grid (on 2 shared cores the whole grid on two releases takes hours).
Records and logs go to ``--out`` as ``scan_corpus.py`` keeps them (a shape already there is not run again).
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import scan_corpus
from packaging.version import Version

from pytest_dsrepro.core import scan_verdicts
from pytest_dsrepro.core.results import ScanVerdict

RELEASES = ("0.18.3", "0.19.8")
STAGES = (0, 1, 2, 3)
PRECISIONS = ("fp32", "fp16", "bf16")
ACCUMULATIONS = ("ga1", "ga4", "derived")
WORLD, MICRO, DERIVED = 2, 2, 16

SCHEDULERS: dict[str, dict[str, Any]] = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 2},
    "WarmupDecayLR": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 2, "total_num_steps": 20},
    "WarmupCosineLR": {"warmup_num_steps": 2, "total_num_steps": 20},
    "OneCycle": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 2},
}
#: One feature per shape, on top of its stage, precision and accumulation.
FEATURES: dict[str, dict[str, Any]] = {
    "plain": {},
    "clipping": {"gradient_clipping": 1.0},
    "micro8": {"train_micro_batch_size_per_gpu": 8},
    **{name.lower(): {"scheduler": {"type": name, "params": params}} for name, params in SCHEDULERS.items()},
    "offload_optimizer": {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
    "offload_param": {"zero_optimization": {"offload_param": {"device": "cpu"},
                                            "offload_optimizer": {"device": "cpu"}}},
    "flops_profiler": {"flops_profiler": {"enabled": True, "profile_step": 1}},
    "comms_logger": {"comms_logger": {"enabled": True, "verbose": False}},
    "auto": {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
             "gradient_clipping": "auto", "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}},
    "optimizer": {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}},
}  # fmt: skip


def fits(feature: str, stage: int, accumulation: str) -> bool:
    """What DeepSpeed can run: offload from ZeRO-1 (parameters: ZeRO-3), "auto" accumulation given as a key."""
    if feature == "offload_optimizer":
        return stage >= 1
    if feature == "offload_param":
        return stage == 3
    return not (feature == "auto" and accumulation == "derived")


def _merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        merged[key] = _merged(merged[key], value) if isinstance(value, dict) and key in merged else value
    return merged


def shape(stage: int, precision: str, accumulation: str, feature: str) -> dict[str, Any]:
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0,
                              "zero_optimization": {"stage": stage}}  # fmt: skip
    if precision != "fp32":
        config[precision] = {"enabled": True}
    config = _merged(config, FEATURES[feature])
    if accumulation == "derived":  # 16 micro-steps of the shape's micro-batch size
        config["train_batch_size"] = config["train_micro_batch_size_per_gpu"] * DERIVED * WORLD
    elif feature != "auto":
        config["gradient_accumulation_steps"] = int(accumulation[2:])
    return config


def grid() -> Iterator[tuple[str, dict[str, Any]]]:
    """Every stage x precision x accumulation x feature DeepSpeed can run, named ``z2-bf16-derived-warmuplr``."""
    for stage, precision, accumulation, feature in itertools.product(STAGES, PRECISIONS, ACCUMULATIONS, FEATURES):
        if fits(feature, stage, accumulation):
            yield f"z{stage}-{precision}-{accumulation}-{feature}", shape(stage, precision, accumulation, feature)


def chosen(names: list[str], every: int) -> list[tuple[str, dict[str, Any]]]:
    """The shapes asked for by name, else every ``every``-th of the grid (spread over every axis: the grid's order
    runs the feature fastest, and ``every`` is prime to the feature count)."""
    shapes = list(grid())
    if names:
        missing = sorted(set(names) - {name for name, _ in shapes})
        if missing:
            raise SystemExit(f"not in the grid: {', '.join(missing)} (--list lists it)")
        return [(name, config) for name, config in shapes if name in names]
    return shapes[::every]


def run(args: argparse.Namespace) -> None:
    """Each chosen shape written as a config file, then scanned as the corpus is (``scan_corpus.scan_all``)."""
    with tempfile.TemporaryDirectory(prefix="dsrepro-grid-") as folder:
        named = []
        for name, config in chosen(args.shape, args.every):
            path = Path(folder) / f"{name}.json"
            path.write_text(json.dumps(config, indent=2))
            named.append((name, path))
        scan_corpus.scan_all(args, named, args.catalogue, tuple(args.pytest_args))


def regressions(scans: list[scan_corpus.Scan]) -> list[str]:
    """Every AFFECTED on a release outside its bug's catalogued range: a false regression."""
    return [line for s in scans for line in scan_corpus.checked(s) if "AFFECTED outside" in line]


def summary(scans: list[scan_corpus.Scan], before: list[scan_corpus.Scan] | None) -> list[str]:
    releases = sorted({s.release for s in scans}, key=Version)
    lines = [f"{len({s.config for s in scans})} shapes x {len(releases)} releases ({', '.join(releases)}): "
             f"{len(scans)} scans"]  # fmt: skip
    for release in releases:
        rows = [row for s in scans if s.release == release and s.record for row in scan_verdicts.rows(s.record)]
        counted = {v: sum(row.verdict is v for row in rows) for v in ScanVerdict}
        lines.append(f"- {release}: " + ", ".join(f"{n} {v.value}" for v, n in counted.items()))
    now = regressions(scans)
    said = f"AFFECTED outside the bug's range: {len(now)}"
    if before is not None:
        said += f" (before: {len(regressions(before))})"
    lines += ["", said, *(f"- {line}" for line in now)]
    if before is not None:
        lines += ["", "before:", *(f"- {line}" for line in regressions(before))]
    untold = scan_corpus.untold(scans)
    lines += ["", f"CANNOT TELL cells: {len(untold)}", *(f"- {line}" for line in untold)]
    return lines + scan_corpus.not_scanned(scans, "shapes")


def main() -> None:
    parser = scan_corpus.arguments(__doc__.splitlines()[0], RELEASES)
    parser.add_argument("--shape", action="append", default=[], help="a shape's name (default: the grid)")
    parser.add_argument("--every", type=int, default=1, help="every N-th shape of the grid only")
    parser.add_argument("--catalogue", type=Path, default=None, help="the catalogue to scan (default: the installed)")
    parser.add_argument("--list", action="store_true", help="list the grid's shapes and stop")
    parser.add_argument("pytest_args", nargs="*", help="after --: arguments for each scan's pytest (-k ...)")
    args = parser.parse_args()
    if args.list:
        print("\n".join(name for name, _ in grid()))
        return
    args.release = args.release or list(RELEASES)
    if args.summary is None:
        if args.out is None:
            parser.error("--out DIR (or --summary DIR)")
        run(args)
    before = scan_corpus.load(args.before) if args.before else None
    print("\n".join(summary(scan_corpus.load(args.summary or args.out), before)))


if __name__ == "__main__":
    main()
