"""``dsrepro list [PATH ...]``: the catalogue (``catalogue``, read from its markers) as a table, Markdown or JSON."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from . import arguments, catalogue


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "paths",
        nargs="*",
        type=arguments.file_or_directory,
        metavar="PATH",
        help="files or directories to collect (default: repros/)",
    )
    parser.add_argument("--format", choices=catalogue.FORMATS, default="table", help="output format")


def run(args: argparse.Namespace) -> int:
    paths = args.paths or (["repros"] if Path("repros").is_dir() else [])
    if not paths:
        return _error("no repros/ directory here; give the paths to collect (dsrepro list PATH ...)", 2)
    try:
        entries = catalogue.collect(paths)
    except catalogue.CollectionFailed as exc:
        return _error(str(exc), 1)
    if not entries:
        return _error(f"no repros (tests with a ds_repro marker) under {' '.join(paths)}", 1)
    width = min(catalogue.WIDTH, shutil.get_terminal_size((catalogue.WIDTH, 24)).columns)  # never wider: pasted
    sys.stdout.write(catalogue.render(entries, args.format, width))
    return 0


def _error(message: str, code: int) -> int:
    print(f"dsrepro: {message}", file=sys.stderr, flush=True)
    return code
