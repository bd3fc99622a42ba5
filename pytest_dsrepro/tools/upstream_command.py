"""``dsrepro upstream``: DeepSpeed's own ``tests/unit`` files, unchanged, in this plugin's worlds, on the DeepSpeed
installed here or on several releases (one uv environment each, the recipe of ``dsrepro install``).

In a DeepSpeed checkout, ``dsrepro upstream [PATH|NODEID ...] [-- PYTEST_ARGS]`` is ``python -m pytest -p
pytest_dsrepro.upstream ...`` run from the checkout's ``tests/`` (where DeepSpeed's pytest.ini and conftest.py are),
paths and node ids given as from the directory you are in. With ``--release`` (or ``--releases FILE``) each release
gets its environment and a pytest run whose results file is checked before it is kept (``upstream_runs``).
``dsrepro matrix`` then shows the tests as rows beside the catalogue's, named by node id and the checkout's revision.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from ..core import checkout
from ..core.checkout import CheckoutError
from ..core.failures import FailuresFileError
from . import arguments, known_failures, processes, shard_merge
from .environments import EnvironmentUnavailable
from .releases import ReleaseListError, read_releases
from .upstream_runs import UpstreamError, pytest_command, run_releases

#: What runs when no path is given.
DEFAULT_TARGET = "unit"


def target(given: str, cwd: Path, tests: Path) -> str:
    """A path or node id as given from ``cwd``, as pytest run from the checkout's ``tests/`` names it."""
    where, sep, names = given.partition("::")
    path = (cwd / where).resolve()
    try:
        relative = path.relative_to(tests.resolve())
    except ValueError:
        raise UpstreamError(f"{given} is not under the checkout's tests directory {tests}") from None
    if not path.exists():
        raise UpstreamError(f"{given}: no such file or directory")
    return f"{relative.as_posix() if relative.parts else '.'}{sep}{names}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Run DeepSpeed's own tests/unit files, unchanged, in pytest-dsrepro's worlds, from a DeepSpeed checkout: "
        "on the DeepSpeed installed here (what `pytest -p pytest_dsrepro.upstream` does from tests/), or with "
        "--release on each release's own environment, writing one results file per release for `dsrepro matrix`. "
        "Arguments after `--` go to pytest (-k, -x, --ds-shard I/N, ...)."
    )
    add = parser.add_argument
    add("targets", nargs="*", metavar="PATH|NODEID", help=f"test files, directories, node ids (default: tests/"
        f"{DEFAULT_TARGET})")  # fmt: skip
    add("--checkout", type=arguments.directory, help="the DeepSpeed checkout (default: the one holding this directory)")
    add("--release", action="append", default=[], type=arguments.release, metavar="VERSION",
        help="run on this release (repeatable)")  # fmt: skip
    add("--releases", type=arguments.input_file, metavar="FILE", help="releases to run on, one per line (# comments)")
    add("--results", type=arguments.output_directory, metavar="DIR",
        help="where results files go (default with --release: results/)")  # fmt: skip
    add("--cache-dir", type=arguments.output_directory, help="release environments (default: $DSREPRO_CACHE_DIR)")
    add("--constraints", type=arguments.input_file, help="constraints pinning torch (as dsrepro bisect)")
    add("--log-dir", type=arguments.output_directory, help="keep each release's install log here")
    shard_merge.add_arguments(parser)
    known_failures.add_arguments(parser)
    parser.set_defaults(pytest_args=[])


def run(args: argparse.Namespace) -> int:
    """Ctrl-C (or SIGTERM) stops pytest as Ctrl-C stops it: its summary and results file written, then ``dsrepro``
    ends as interrupted."""
    try:
        with processes.interrupting(signal.SIGTERM):
            return _run(args)
    except (UpstreamError, CheckoutError, FailuresFileError, shard_merge.ShardError, EnvironmentUnavailable,
            ReleaseListError) as exc:  # fmt: skip
        print(f"dsrepro upstream: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.merge:
        return shard_merge.merge(args)
    cwd = Path.cwd()
    root = args.checkout.resolve() if args.checkout else checkout.find(cwd)
    if root is None:
        raise UpstreamError(
            f"{cwd} is not inside a DeepSpeed checkout (no {', '.join(checkout.MARKS)}); use --checkout"
        )
    found = checkout.read(root)
    targets = [target(t, cwd, found.tests) for t in args.targets] or [DEFAULT_TARGET]
    releases = [*args.release, *(read_releases(args.releases) if args.releases else [])]  # arguments.release checked
    print(f"dsrepro upstream: DeepSpeed's tests from {found.describe()}", file=sys.stderr, flush=True)
    known = known_failures.known(args.failures)
    if args.shard:
        args.results = (args.results or Path("results")).resolve()
        args.pytest_args = [*shard_merge.pytest_args(args.shard, args.results), *args.pytest_args]
    if releases:
        args.results = (args.results or Path("results")).resolve()
        return known_failures.after_releases(args.results, lambda: run_releases(args, found, targets, releases), known)

    def command(results_dir: Path) -> list[str]:
        return pytest_command(sys.executable, targets, results_dir, args.pytest_args)

    return known_failures.run_here(args.results, found, command, known)
