"""``dsrepro install VERSION``: the recipe of ``install`` (uv, torch pinned) run on this interpreter or another, with
its exit codes; a release that cannot run here is said, and with ``--results`` recorded as unavailable."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from packaging.version import Version

from ..core.options import CACHE_ENV
from . import arguments, install
from .install import CONSTRAINTS_ENV


def _version_arg(value: str) -> str:
    try:
        Version(value)
    except ValueError:  # InvalidVersion, or a part of more digits than int() reads
        raise argparse.ArgumentTypeError(f"not a release version: {arguments.shown(value)!r}") from None
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Install a DeepSpeed release with uv (torch pinned, DS_BUILD_OPS=0, no build isolation) and prove it imports. "
        "Exit 0 when usable, 1 when the release cannot run here (the reason is printed and, with --results, written "
        "as an 'unavailable' results file), 2 on usage errors and for a release the package index does not have."
    )
    parser.add_argument("version", type=_version_arg, help="DeepSpeed release, e.g. 0.16.3")
    parser.add_argument(
        "--python", default=sys.executable, help="interpreter whose environment receives it (default: this one)"
    )
    parser.add_argument(
        "--constraints",
        type=arguments.input_file,
        default=None,
        help=f"pip constraints pinning torch (default: ${CONSTRAINTS_ENV}, else constraints.txt here or above)",
    )
    parser.add_argument("--cache-dir", type=Path, default=None, help=f"probe cache root (default: ${CACHE_ENV})")
    parser.add_argument(
        "--results",
        type=arguments.output_directory,
        default=None,
        help="on failure, write an 'unavailable' results file",
    )
    parser.add_argument(
        "--log", type=arguments.output_file, default=None, help="append every command and its output to this file"
    )


def run(args: argparse.Namespace) -> int:
    constraints: Path | None = args.constraints or install.find_constraints()
    if constraints is None or not constraints.is_file():
        where = constraints or f"${CONSTRAINTS_ENV} or constraints.txt in {Path.cwd()} and its parents"
        print(f"dsrepro install: no constraints file ({where}); refusing to install with torch unpinned",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        result = install.install_deepspeed(
            args.version, python=args.python, constraints=constraints, cache_dir=args.cache_dir, log=args.log, echo=True
        )
    except install.NoSuchRelease as exc:
        print(f"dsrepro install: {exc.reason}; nothing was installed or recorded", file=sys.stderr)
        return 2
    if result.ok:
        p = result.probe
        assert p is not None
        print(
            f"dsrepro install: deepspeed {p.deepspeed} {result.action} with torch {p.torch} "
            f"(accelerator {p.accelerator}) in {result.seconds:.1f}s"
        )
        return 0
    torch = result.torch or str(install.pinned(constraints, "torch") or "?")
    print(f"dsrepro install: deepspeed {args.version} cannot run with torch {torch}: {result.reason}", file=sys.stderr)
    if result.probe is not None and result.probe.traceback:
        print(result.probe.traceback, file=sys.stderr)
    if args.results is not None:
        path = install.write_unavailable(args.results, result, constraints)
        print(f"dsrepro install: recorded as unavailable in {path}", file=sys.stderr)
    return 1
