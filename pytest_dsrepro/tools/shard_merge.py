"""``dsrepro upstream --shard I/N`` and ``--merge DIR ...``: DeepSpeed's tests split over K CI jobs (or SLURM tasks),
then merged into one report and one matrix that name every shard that is missing, died, or did not finish.

A shard is ``--ds-shard I/N`` plus the manifest plugin (``pytest_dsrepro.upstream.manifest``), which writes the
shard's plan beside its results (``core.shard_manifests``). The merge reads every results file and manifest under the
directories given (one per CI job's artifact), leaves out the earlier runs a shard's re-run replaced, counts a test
that several files hold once, judges each shard, sorts the failures against the failures file, and shows the matrix.
Exit: 0 every shard complete and no new failure, 1 new failures, 3 a shard missing, dead or incomplete, a manifest
or a results file that cannot be read, 2 a usage error.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..core import failures, options, results, shard_manifests
from . import arguments, known_failures, matrix

#: The pytest plugin that writes a shard's manifest.
PLUGIN = "pytest_dsrepro.upstream.manifest"
#: A shard missing, dead or incomplete, or results that cannot be read.
INCOMPLETE = 3


class ShardError(Exception):
    """A wrong --shard or --merge: one line, exit 2."""


def parse_shard(text: str) -> tuple[int, int]:
    """``--shard I/N`` as ``--ds-shard`` reads it (one validator)."""
    try:
        return options.shard(text)
    except options.OptionError as exc:
        raise argparse.ArgumentTypeError(f"--shard {arguments.shown(text)!r} {exc}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--shard",
        type=parse_shard,
        default=None,
        metavar="I/N",
        help="run the I-th of N shards (every N-th test), writing its results and its manifest (which shard, its "
        "planned tests) into --results (default results/); merge the shards with --merge",
    )
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        default=None,
        metavar="DIR",
        help="merge the results of shards (one directory per CI job, or one with all): one report and one matrix, "
        "naming each shard that is missing, died or did not finish (exit 3); run nothing",
    )
    parser.add_argument(
        "--shards", type=arguments.count, default=None, metavar="N", help="with --merge: how many shards there were"
    )


def pytest_args(shard: tuple[int, int], results_dir: Path) -> list[str]:
    """What a shard's pytest run adds: its slice, and its manifest beside its results."""
    index, count = shard
    return ["-p", PLUGIN, f"--ds-shard={index}/{count}", f"--ds-shard-manifest={results_dir}"]


@dataclass(frozen=True)
class Merged:
    """What the merge read: each shard judged, and what it set aside or could not read, in words."""

    shards: list[shard_manifests.Shard]
    files: list[results.ResultsFile]  # those that count: no earlier run replaced, each test once
    unreadable: list[results.Unreadable]
    bad_manifests: list[shard_manifests.BadManifest]
    notes: list[str]  # what was left out or counted once

    @property
    def incomplete(self) -> list[shard_manifests.Shard]:
        return [s for s in self.shards if s.state is not shard_manifests.ShardState.COMPLETE]


def read(paths: Sequence[Path], count: int | None) -> Merged:
    """The shards' results under ``paths``, judged (``ShardError``: a path that does not exist)."""
    try:
        files, unreadable = results.read_all(paths)
    except OSError as exc:
        raise ShardError(str(exc)) from None
    found, bad = shard_manifests.find(paths)
    replaced = shard_manifests.superseded(found, files)
    notes = [f"left out: {path}: an earlier run, replaced by the run of {by} in its directory"
             for path, by in sorted(replaced.items())]  # fmt: skip
    kept, repeated = shard_manifests.counted_once(f for f in files if f.path not in replaced)
    notes += [f"counted once: {r}" for r in repeated]
    return Merged(shard_manifests.judge(found, kept, count), kept, unreadable, bad, notes)


def report(merged: Merged, sorted_failures: failures.Sorted) -> list[str]:
    """The merged report: each shard's state, what was left out, counted once or could not be read, then the
    failures, new first."""
    lines = [f"{s.name}: {s.state.value}: {s.detail}" for s in merged.shards]
    for s in merged.shards:
        lines += [f"    not run: {nodeid}" for nodeid in s.missing[:10]]
        if len(s.missing) > 10:
            lines.append(f"    ... and {len(s.missing) - 10} more")
    lines += merged.notes
    lines += [f"unreadable manifest: {b} (its shard is not known: run it again)" for b in merged.bad_manifests]
    lines += [f"unreadable: {u}" for u in merged.unreadable]
    return [*lines, *failures.summary(sorted_failures)]


def merge(args: argparse.Namespace) -> int:
    if args.targets or args.shard or args.release or args.releases:
        raise ShardError("--merge runs nothing: give it the shards' results directories alone")
    merged = read(args.merge, args.shards)
    sorted_failures = known_failures.sort(merged.files, known_failures.known(args.failures))
    if merged.files:
        print(matrix.render_terminal(matrix.merge(merged.files, merged.unreadable)))
    print("\n".join(report(merged, sorted_failures)))
    if not merged.shards:
        print(
            "dsrepro upstream --merge: no shard manifest found: were the shards run with --shard I/N?", file=sys.stderr
        )
    if merged.incomplete or merged.unreadable or merged.bad_manifests or not merged.shards:
        names = [f"{s.name} ({s.state.value})" for s in merged.incomplete]
        names += ["unreadable manifests"] * bool(merged.bad_manifests)
        names += ["unreadable results"] * bool(merged.unreadable)
        print(f"dsrepro upstream --merge: incomplete: {', '.join(names) or 'no shard found'}", file=sys.stderr)
        return INCOMPLETE
    return known_failures.exit_code(sorted_failures)
