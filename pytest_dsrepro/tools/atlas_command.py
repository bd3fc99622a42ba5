"""``dsrepro atlas --repo CLONE --range A..B``: each fix commit of the range that carries its own test (``atlas``), its
tests run on the release before the fix and the first with it (``upstream_runs``, as ``dsrepro upstream --release``
runs them), and each test's observed range said."""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

from ..core import checkout
from ..core.git import GitError
from ..triage import known_fixes
from . import arguments, environments, upstream_runs
from .atlas import (
    AtlasError,
    Range,
    fixes,
    known_fix,
    listing,
    parse_range,
    releases_to_run,
    run_fix,
    run_fix_tests,
    runs_of,
)
from .environments import EnvironmentUnavailable
from .history import Clone, HistoryError, release_of


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "The regression atlas: in your DeepSpeed clone's range, the fix commits whose change adds or edits tests under "
        "tests/unit; each such test, as of the fix commit, run on the release before the fix and the first release "
        "with it (and with --releases-between, every release from the range's start), each release in its own "
        "environment: results for `dsrepro matrix`, and each test's observed affected range."
    )
    parser.add_argument("--repo", type=Path, required=True, metavar="CLONE", help="your DeepSpeed clone (only read)")
    parser.add_argument("--range", required=True, metavar="OLDER..NEWER", help="e.g. v0.16.0..master")
    parser.add_argument("--dry-run", action="store_true", help="list the fix commits and their tests; run nothing")
    parser.add_argument(
        "--releases-between", action="store_true", help="also run every release from the range's start to the fix"
    )
    parser.add_argument(
        "--limit", type=arguments.count, default=None, metavar="N", help="run the first N fixes with a release"
    )
    parser.add_argument(
        "--only", action="append", default=[], metavar="REV", help="run only this fix commit (repeatable)"
    )
    parser.add_argument(
        "--results", type=arguments.output_directory, default=Path("results"), metavar="DIR", help="(default: results/)"
    )
    parser.add_argument(
        "--cache-dir", type=arguments.output_directory, default=None, help="release environments (as dsrepro upstream)"
    )
    parser.add_argument("--constraints", type=arguments.input_file, default=None, help="constraints pinning torch")
    parser.add_argument(
        "--log-dir", type=arguments.output_directory, default=None, help="keep each release's install log here"
    )
    parser.add_argument(
        "--known-fixes", type=arguments.output_file, default=None, metavar="PATH", help="run nothing: write what "
        "dsrepro triage knows of the range's fixes (each with a clean range in --results: its PR, title, releases, "
        "failure text) to PATH"
    )  # fmt: skip
    parser.set_defaults(pytest_args=[])


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (AtlasError, HistoryError, GitError, checkout.CheckoutError, upstream_runs.UpstreamError,
            EnvironmentUnavailable) as exc:  # fmt: skip
        print(f"dsrepro atlas: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    clone = Clone.open(args.repo)
    older, newer = parse_range(clone, args.range)
    found, fix_count = fixes(clone, older, newer)
    if args.dry_run:
        print("\n".join(listing(found, fix_count, time.monotonic() - started)))
        return 0
    if args.known_fixes is not None:
        known = [k for fix in found if (k := known_fix(fix, runs_of(fix, args.results))) is not None]
        try:
            known_fixes.write(args.known_fixes, known, f"dsrepro atlas --range {args.range}")
        except OSError as exc:
            raise AtlasError(f"--known-fixes {args.known_fixes}: cannot be written ({exc.strerror or exc})") from None
        print(f"{len(known)} of {len(found)} fixes with a clean range, written to {args.known_fixes}")
        return 0

    prepare = environments.release_environment(args.cache_dir, args.constraints, log_dir=args.log_dir)

    def runner(tests: checkout.Checkout, targets: list[str], releases: list[str], where: Path) -> None:
        run_fix_tests(tests, targets, releases, where, prepare, args.pytest_args)

    start = release_of(args.range.partition("..")[0])
    available = sorted(clone.releases())
    only = {clone.commit(rev).sha for rev in args.only}
    runnable = [f for f in found if f.first and f.before and (not only or f.commit.sha in only)][: args.limit]
    ranges: list[Range] = []
    for fix in runnable:
        print(f"dsrepro atlas: {fix.commit.short} {fix.commit.subject}", file=sys.stderr, flush=True)
        releases = releases_to_run(fix, start, available, args.releases_between)
        try:
            ranges += run_fix(fix, clone, releases, args.results, runner)
        except upstream_runs.UpstreamError as exc:  # one fix's run that broke does not end an atlas of a hundred
            print(f"dsrepro atlas: {fix.commit.short}: {exc}", file=sys.stderr, flush=True)
            ranges += [Range(t.nodeid, (), False, f"its run broke: {exc}") for t in fix.tests]
    for r in ranges:
        print(f"{'clean' if r.clean else 'cannot tell':11} {r.nodeid}: {r.why}")
    whys = Counter(r.why.split(" on ")[0].split(":")[0] for r in ranges if not r.clean)
    print(f"{len(runnable)} fixes run, {len(ranges)} tests: {sum(r.clean for r in ranges)} clean ranges; "
          f"cannot tell: {dict(whys) or 0}; {time.monotonic() - started:.0f} s")  # fmt: skip
    return 0
