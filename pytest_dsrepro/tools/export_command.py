"""``dsrepro export NODEID``: one test of the catalogue written as a standalone script for ``torchrun`` (``export``),
to stdout or a file."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from . import arguments, export


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Write one test of the catalogue as a standalone script (torch, DeepSpeed and the standard library only) "
        "that reproduces its stock variant under `torchrun --standalone --nproc-per-node N FILE`."
    )
    parser.add_argument("nodeid", metavar="NODEID", help="e.g. repros/zero3/test_x.py::test_y[zero3-stock]")
    parser.add_argument(
        "-o", "--output", metavar="FILE", default="-", type=_output, help="where to write it (default: stdout)"
    )


def _output(text: str) -> str:
    """``-`` (standard output), or a file that can be written (``arguments.output_file``)."""
    return text if text == "-" else str(arguments.output_file(text))


def run(args: argparse.Namespace) -> int:
    try:
        test = export.collect(args.nodeid)
        name = Path(args.output).name if args.output != "-" else f"repro_{re.sub(r'[^a-z0-9]+', '_', test.repro.id)}.py"
        script = export.render(test, name)
    except export.ExportError as exc:
        print(f"dsrepro export: {exc}", file=sys.stderr)
        return 1
    if args.output == "-":
        sys.stdout.write(script)
    else:
        Path(args.output).write_text(script)
        print(f"wrote {args.output}: torchrun --standalone --nproc-per-node {test.world_size} {args.output}",
              file=sys.stderr)  # fmt: skip
    return 0
