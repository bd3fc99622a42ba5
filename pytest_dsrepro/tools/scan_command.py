"""``dsrepro scan CONFIG``: does a known bug hit this DeepSpeed config, on the release installed here or on others?

A thin layer over ``pytest --ds-scan`` (``scan.scanner``): the config is read and checked here first (the same
``core.userconfig``, so a mistake is one line naming file:line:col, before anything starts), then pytest runs the
catalogue with it (``scan_once``), and its results file is read back for the exit code.

With ``--release`` (or ``--releases FILE``) each release gets an environment and a scan of its own (``scan_releases``),
and the end is a table of bugs by release and the first release from which this config hits no known bug.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from packaging.version import Version

from ..core import scan_verdicts, userconfig
from ..core.results import RunRecord, ScanVerdict
from . import arguments, catalogue_run, environments, processes
from .catalogue_run import ScanError
from .environments import EnvironmentUnavailable, ReleaseEnv
from .releases import ReleaseListError, read_releases

#: Exit codes: 0 no known bug hits the config; 1 one does (AFFECTED); 3 none does, but some could not be told; 2 the
#: scan could not run (a bad config, no catalogue, a release that cannot be installed).
CLEAN, AFFECTED, UNUSABLE, UNTOLD = 0, 1, 2, 3


def scan_once(python: str, environ: dict[str, str], args: argparse.Namespace, markdown: Path | None) -> RunRecord:
    """The scan the arguments ask for, with ``python``'s pytest and DeepSpeed (``catalogue_run``: in a child process,
    from the catalogue's own directory)."""
    return catalogue_run.scan_once(
        python,
        environ,
        args.config,
        catalogue=args.catalogue,
        world_size=args.world_size,
        pytest_args=args.pytest_args,
        markdown=markdown,
    )


def exit_code(runs: Sequence[RunRecord]) -> int:
    found = [row.verdict for run in runs for row in scan_verdicts.rows(run)]
    if ScanVerdict.AFFECTED in found:
        return AFFECTED
    return UNTOLD if ScanVerdict.CANNOT_TELL in found else CLEAN


def scan_releases(
    args: argparse.Namespace, releases: Sequence[str], prepare: Callable[[Version], ReleaseEnv] | None = None
) -> list[RunRecord]:
    """Each release in its own environment (``prepare``: ``environments.release_environment`` unless given: the one
    ``dsrepro bisect`` and ``dsrepro upstream --release`` use, uv, torch pinned, the recipe of ``dsrepro install``,
    cached), scanned."""
    try:
        extra = [*environments.extra_packages(), *args.extra_packages]  # --with on top of $DSREPRO_EXTRA_PACKAGES
        prepare = prepare or environments.release_environment(args.cache_dir, args.constraints, extra=extra)
    except EnvironmentUnavailable as exc:
        raise ScanError(str(exc)) from None
    runs = []
    for release in releases:
        try:
            env = environments.prepared(prepare, release, "scan")
        except EnvironmentUnavailable as exc:
            raise ScanError(f"deepspeed {release} cannot run here: {exc}") from None
        runs.append(scan_once(env.python, dict(env.environ), args, None))
    return runs


def _requirement(text: str) -> str:
    try:
        return environments.requirement(text, "--with")
    except EnvironmentUnavailable as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--with: ")) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Run every catalogued DeepSpeed bug whose premise your config can meet with your config, in the same worlds "
        "as the catalogue, and say per bug: AFFECTED (the bug's failure appeared: the message, the first fixed "
        "release, the repro's fix to apply), NOT AFFECTED, NOT APPLICABLE (your config cannot meet its premise) or "
        "CANNOT TELL (it failed otherwise). On the DeepSpeed installed here, or with --release on others. Exit code "
        "0: no known bug hits the config; 1: one does; 3: some could not be told; 2: the scan could not run. "
        "Arguments after `--` go to pytest (-k, --ds-timeout, ...)."
    )
    add = parser.add_argument
    add("config", type=Path, metavar="CONFIG", help="your ds_config.json (// and /* */ comments allowed)")
    add("--world-size", type=arguments.count, default=None, metavar="N", help="ranks per world (default 2)")
    add("--release", action="append", default=[], type=arguments.release, metavar="VERSION",
        help="scan on this release (repeatable)")  # fmt: skip
    add("--releases", type=arguments.input_file, metavar="FILE", help="releases to scan on, one per line (# comments)")
    add("--markdown", type=arguments.output_file, metavar="PATH", help="also write the scan as Markdown to PATH")
    add(
        "--catalogue", type=arguments.directory, metavar="DIR", help="repros to scan (default: the installed catalogue)"
    )
    add("--cache-dir", type=arguments.output_directory, help="release environments (default: $DSREPRO_CACHE_DIR)")
    add("--constraints", type=arguments.input_file, help="constraints pinning torch (as dsrepro bisect)")
    parser.add_argument(
        "--with",
        dest="extra_packages",
        action="append",
        default=[],
        type=_requirement,
        metavar="PACKAGE",
        help="also install PACKAGE (a requirement, e.g. huggingface_hub) in each --release environment, for repros "
        "that need it (repeatable; $DSREPRO_EXTRA_PACKAGES does the same for bisect and upstream)",
    )
    parser.set_defaults(pytest_args=[])


def run(args: argparse.Namespace) -> int:
    try:
        with processes.interrupting(signal.SIGTERM):
            return _run(args)
    except (ScanError, userconfig.UserConfigError) as exc:
        print(f"dsrepro scan: {exc}", file=sys.stderr)
        return UNUSABLE


def _run(args: argparse.Namespace) -> int:
    userconfig.load(args.config)  # a bad config is one line now, before any environment or world
    try:
        releases = [str(Version(r)) for r in args.release] + (read_releases(args.releases) if args.releases else [])
    except ReleaseListError as exc:
        raise ScanError(str(exc)) from None
    if args.extra_packages and not releases:
        raise ScanError(f"--with {' '.join(args.extra_packages)}: it installs into --release environments; here, "
                        "install it in this environment yourself (pip install ...)")  # fmt: skip
    if not releases:
        return exit_code([scan_once(sys.executable, dict(os.environ), args, args.markdown)])
    runs = scan_releases(args, releases)
    print(f"\ndsrepro scan of {args.config} on {len(runs)} releases")
    for line in scan_verdicts.across(runs):
        print(line)
    if args.markdown is not None:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(scan_verdicts.markdown_across(runs))
    return exit_code(runs)
