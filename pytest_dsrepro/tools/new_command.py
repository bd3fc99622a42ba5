"""``dsrepro new NAME``: a repro file from the template (``scaffold``), prefilled from a log's error with
``--from-log``, and the commands that come next."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import arguments, scaffold
from .log_input import LogError, reading
from .scaffold import DEFAULT_PRESET

#: The catalogue a new repro joins: the one in this directory.
CATALOGUE = Path("repros")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "name", metavar="NAME", help="short name, e.g. zero3-module-id; the file is repros/zero3/test_<name>.py"
    )
    parser.add_argument("--issue", metavar="URL", help="upstream issue URL (the repro's ds_repro upstream=)")
    parser.add_argument(
        "--config", metavar="PRESET", default=DEFAULT_PRESET, help=f"ds_config preset (default {DEFAULT_PRESET})"
    )
    parser.add_argument(
        "--dir", type=arguments.output_directory, default=None, help="directory to write into (default: the folder "
        "of repros/ for the DeepSpeed subsystem NAME begins with, repros/zero3 for zero3-...; repros/ where it has no "
        "such folders)"
    )  # fmt: skip
    parser.add_argument(
        "--from-log", metavar="LOG", help="prefill the title, raises= and match= from the error in LOG (- for stdin)"
    )


def run(args: argparse.Namespace) -> int:
    try:
        start = scaffold.Prefill() if args.from_log is None else scaffold.prefill(reading(args.from_log))
        directory = args.dir or scaffold.folder_for(args.name, CATALOGUE)
        inside = directory.resolve().is_relative_to(CATALOGUE.resolve())
        path = scaffold.create(args.name, directory, issue=args.issue, preset=args.config, start=start,
                               catalogue=CATALOGUE if inside else directory)  # fmt: skip
    except LogError as exc:  # --from-log: a path to read, bad as every other bad input is (one line, exit 2)
        print(f"dsrepro new: {exc}", file=sys.stderr, flush=True)
        return 2
    except scaffold.ScaffoldError as exc:
        print(f"dsrepro: {exc}", file=sys.stderr, flush=True)
        return 1
    test = f"{path.as_posix()}::test_{scaffold.names(args.name).slug}"
    print(f"wrote {path}")
    print("next: fill in its TODOs (the docstring says how), then run it:")
    print(f"  pytest {path.as_posix()} -v")
    print(f"  pytest {path.as_posix()} --ds-report report.md      # Markdown for the issue")
    print(f"  dsrepro bisect {test} --good X --bad Y   # where it starts or stops")
    return 0
