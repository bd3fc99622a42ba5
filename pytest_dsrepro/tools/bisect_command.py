"""``dsrepro bisect NODEID --good A --bad B``: the first DeepSpeed release where a test's outcome flips (``bisect``
over the index's releases, each in its environment), or with ``--repo`` the commit and pull request
(``bisect_repo``). Exit codes: 0 a verdict, 1 none (an end could not be tested, or both ends agree), 2 a bisect that
cannot start (its ends, test, options, clone or release list), 130 interrupted (``cli.main``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from packaging.version import Version

from . import arguments, bisect, bisect_repo, environments, releases
from .bisect_cache import parse_size
from .environments import EnvironmentUnavailable
from .history import HistoryError
from .releases import ReleaseListError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Install DeepSpeed releases from PyPI (cached per release) and binary-search the first one where "
        "TEST_NODEID's outcome flips; with --repo, the releases of your clone and then the commits between the two "
        "that flip, naming the pull request. Arguments after `--` go to pytest."
    )
    _search_arguments(parser)
    _probe_arguments(parser)
    parser.set_defaults(pytest_args=[])


def _search_arguments(p: argparse.ArgumentParser) -> None:
    """What is searched: the test, its two ends, and where (the releases, or the user's clone)."""
    p.add_argument(
        "nodeid", metavar="TEST_NODEID", help="e.g. repros/zero3/test_zero3_module_id.py::test_user_ids_survive"
    )
    for end, said in (("--good", "one end, e.g. where it passes (--repo: or a revision)"),
                      ("--bad", "the other end, where it fails")):  # fmt: skip
        p.add_argument(end, required=True, type=arguments.revision, metavar="VERSION", help=f"a release at {said}")
    p.add_argument(
        "--repo",
        type=Path,
        metavar="PATH",
        help="your DeepSpeed clone (never written to): after the releases, bisect the commits between the two that "
        "flip, and name the pull request; --good/--bad may then be any revisions of it too",
    )
    p.add_argument(
        "--chdir",
        type=arguments.directory,
        metavar="DIR",
        help="run each probe's pytest from DIR (node ids relative to it)",
    )
    p.add_argument(
        "--runs",
        type=_runs,
        default=1,
        metavar="N",
        help="run the test up to N times per probe (a race shows in some runs only): the bug shows if any run "
        "shows it (default 1)",
    )


def _probe_arguments(p: argparse.ArgumentParser) -> None:
    """How probes run and what they keep: stored outcomes, environments, logs, the time one may take."""
    p.add_argument(
        "--fresh", action="store_true", help="with --repo: probe again, not from outcomes an earlier run stored"
    )
    p.add_argument(
        "--env-cache",
        type=_size,
        default=None,
        metavar="SIZE",
        help="with --repo: the disk the commits' environments may use, least recently used removed first "
        "(default 10G; what removing one frees, not files linked from uv's cache)",
    )
    p.add_argument(
        "--cache-dir",
        type=arguments.output_directory,
        default=None,
        help="where the releases' environments live, and with --repo the commits' and the stored outcomes "
        "(default: $DSREPRO_CACHE_DIR or ~/.cache/pytest-dsrepro, shared with tox)",
    )
    p.add_argument(
        "--constraints",
        type=arguments.input_file,
        default=None,
        help="pip constraints pinning torch (default: $DSREPRO_CONSTRAINTS, constraints.txt here or above, "
        "else the torch installed here)",
    )
    p.add_argument(
        "--log-dir",
        type=arguments.output_directory,
        metavar="DIR",
        help="keep each probe's install log and pytest output here",
    )
    p.add_argument(
        "--timeout",
        type=arguments.seconds,
        default=3600.0,
        help="seconds one pytest run of a probe may take before it is stopped (a hung world ends first, at pytest's "
        "--ds-timeout: give it after --)",
    )


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _runs(text: str) -> int:
    try:
        return arguments.count(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{arguments.shown(text)!r} is not a whole number of runs >= 1") from None


def run(args: argparse.Namespace) -> int:
    try:
        return _releases(args) if args.repo is None else bisect_repo.run(args)
    except bisect.NoVerdict as exc:
        print(f"dsrepro bisect: {exc}", file=sys.stderr, flush=True)
        return 1
    except (bisect.BisectError, HistoryError, EnvironmentUnavailable, ReleaseListError) as exc:
        print(f"dsrepro bisect: {exc}", file=sys.stderr, flush=True)
        return 2


def _progress(out: TextIO) -> Callable[[object, int, int], None]:
    def show(version: object, step: int, estimate: int) -> None:
        print(f"[{step}/~{estimate}] deepspeed {version}: installing and running ...", file=out, flush=True)

    return show


def _releases(args: argparse.Namespace) -> int:
    """The search over the index's releases between the two ends, each probed in its release's environment."""
    if args.fresh or args.env_cache is not None:
        raise bisect.BisectError("--fresh and --env-cache apply to commits: give --repo PATH, your DeepSpeed clone")
    out = sys.stderr
    started = time.monotonic()
    log_dir = Path(args.log_dir) if args.log_dir else None
    prepare = environments.release_environment(args.cache_dir, args.constraints, log_dir=log_dir)  # its input checked
    between = bisect.releases_between(releases.available_releases(), args.good, args.bad)
    print(
        f"bisecting {args.nodeid} over {len(between)} deepspeed releases {between[0]} .. {between[-1]} "
        f"(about {bisect.estimated_steps(len(between))} probes)",
        file=out,
        flush=True,
    )
    inner = bisect.Prober(
        bisect.Invocation(args.nodeid, tuple(args.pytest_args), args.chdir),
        prepare=bisect.entered(prepare),
        runs=args.runs,
        log_dir=log_dir,
        timeout=args.timeout,
    )

    def oracle(version: Version) -> bisect.Probe[Version]:
        probe = inner(version)
        detail = f" ({probe.detail})" if probe.detail else ""
        print(f"    deepspeed {version}: {probe.word}{detail} in {probe.timing}", file=out, flush=True)
        return probe

    result = bisect.search(between, oracle, progress=_progress(out))
    print(bisect.summary(result, args.good, args.bad, time.monotonic() - started))
    return 0
