"""``dsrepro upstream --shard I/N`` and ``--merge DIR ...``: DeepSpeed's tests split over K CI jobs (or SLURM tasks),
then merged into one report and one matrix that name every shard that is missing, died, or did not finish.

A shard is ``--ds-shard I/N`` plus the manifest plugin (``pytest_dsrepro.upstream.manifest``), which writes the
shard's plan beside its results (``core.shard_manifests``). The merge reads every results file and manifest under the
directories given (one per CI job's artifact), judges each shard, sorts the failures against the failures file, and
shows the matrix. Exit: 0 every shard complete and no new failure, 1 new failures, 3 a shard missing, dead or
incomplete, or a results file that cannot be read, 2 a usage error.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from ..core import failures, options, results, shard_manifests
from . import known_failures, matrix

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
        raise argparse.ArgumentTypeError(f"--shard {text!r} {exc}") from None


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
        "--shards", type=int, default=None, metavar="N", help="with --merge: how many shards there were"
    )


def pytest_args(shard: tuple[int, int], results_dir: Path) -> list[str]:
    """What a shard's pytest run adds: its slice, and its manifest beside its results."""
    index, count = shard
    return ["-p", PLUGIN, f"--ds-shard={index}/{count}", f"--ds-shard-manifest={results_dir}"]


def report(
    verdicts: Sequence[shard_manifests.Shard],
    sorted_failures: failures.Sorted,
    unreadable: Sequence[results.Unreadable],
) -> list[str]:
    """The merged report: each shard's state, what could not be read, then the failures, new first."""
    lines = [f"{s.name}: {s.state.value}: {s.detail}" for s in verdicts]
    for s in verdicts:
        lines += [f"    not run: {nodeid}" for nodeid in s.missing[:10]]
        if len(s.missing) > 10:
            lines.append(f"    ... and {len(s.missing) - 10} more")
    lines += [f"unreadable: {u}" for u in unreadable]
    return [*lines, *failures.summary(sorted_failures)]


def merge(args: argparse.Namespace) -> int:
    if args.targets or args.shard or args.release or args.releases:
        raise ShardError("--merge runs nothing: give it the shards' results directories alone")
    try:
        files, unreadable = results.read_all(args.merge)
        found = shard_manifests.find(args.merge)
    except (OSError, ValueError) as exc:
        raise ShardError(str(exc)) from None
    entries = known_failures.known(args.failures)
    verdicts = shard_manifests.judge(found, files, args.shards)
    sorted_failures = known_failures.sort(files, entries)
    if files:
        print(matrix.render_terminal(matrix.merge(files, unreadable)))
    print("\n".join(report(verdicts, sorted_failures, unreadable)))
    bad = [s for s in verdicts if s.state is not shard_manifests.ShardState.COMPLETE]
    if not verdicts:
        print(
            "dsrepro upstream --merge: no shard manifest found: were the shards run with --shard I/N?", file=sys.stderr
        )
    if bad or unreadable or not verdicts:
        names = ", ".join(f"{s.name} ({s.state.value})" for s in bad)
        print(f"dsrepro upstream --merge: incomplete: {names or 'unreadable results'}", file=sys.stderr)
        return INCOMPLETE
    return known_failures.exit_code(sorted_failures)
