"""The ``dsrepro`` command: the catalogue, new repros, bisecting releases, and (from their own modules) the
version matrix and per-release installs.

Every subcommand is a thin layer over a module with plain, tested functions; nothing heavy is imported until a
subcommand needs it, so ``dsrepro --help`` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from packaging.version import Version

Handler = Callable[[argparse.Namespace], int]

DESCRIPTION = "pytest-dsrepro: DeepSpeed bugs as pytest tests in real N-rank torch.distributed worlds."
EPILOG = (
    "A contributor's path: `dsrepro new NAME --issue URL`, edit the file until it fails like the issue, "
    "`pytest FILE --ds-report report.md`, `dsrepro bisect FILE::TEST --good X --bad Y`. See docs/contributing.md."
)


def _err(message: str) -> None:
    print(f"dsrepro: {message}", file=sys.stderr, flush=True)


# --- list --------------------------------------------------------------------------------------------------------


def _list(args: argparse.Namespace) -> int:
    from . import catalogue

    paths = args.paths or (["repros"] if Path("repros").is_dir() else [])
    if not paths:
        _err("no repros/ directory here; give the paths to collect (dsrepro list PATH ...)")
        return 2
    try:
        entries = catalogue.collect(paths)
    except catalogue.CollectionFailed as exc:
        _err(str(exc))
        return 1
    if not entries:
        _err(f"no repros (tests with a ds_repro marker) under {' '.join(paths)}")
        return 1
    sys.stdout.write(catalogue.render(entries, args.format))
    return 0


def _add_list(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("list", help="show the catalogue: id, title, upstream, affected releases, fixed in")
    p.add_argument("paths", nargs="*", metavar="PATH", help="files or directories to collect (default: repros/)")
    p.add_argument("--format", choices=("table", "markdown", "json"), default="table", help="output format")
    p.set_defaults(handler=_list)


# --- new ---------------------------------------------------------------------------------------------------------


def _new(args: argparse.Namespace) -> int:
    from . import scaffold

    try:
        path = scaffold.create(args.name, Path(args.dir), issue=args.issue, preset=args.config)
    except scaffold.ScaffoldError as exc:
        _err(str(exc))
        return 1
    test = f"{path.as_posix()}::test_{scaffold.names(args.name).slug}"
    print(f"wrote {path}")
    print("next: fill in its TODOs (the docstring says how), then run it:")
    print(f"  pytest {path.as_posix()} -v")
    print(f"  pytest {path.as_posix()} --ds-report report.md      # Markdown for the issue")
    print(f"  dsrepro bisect {test} --good X --bad Y   # where it starts or stops")
    return 0


def _add_new(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from .scaffold import DEFAULT_PRESET

    p = sub.add_parser("new", help="write a new repro from the template into repros/ (never overwrites)")
    p.add_argument("name", metavar="NAME", help="short name, e.g. zero3-module-id; the file is repros/test_<name>.py")
    p.add_argument("--issue", metavar="URL", help="upstream issue URL (the repro's ds_repro upstream=)")
    p.add_argument(
        "--config", metavar="PRESET", default=DEFAULT_PRESET, help=f"ds_config preset (default {DEFAULT_PRESET})"
    )
    p.add_argument("--dir", default="repros", help="directory to write into (default repros/)")
    p.set_defaults(handler=_new)


# --- bisect ------------------------------------------------------------------------------------------------------


def _progress(out: TextIO) -> Callable[[object, int, int], None]:
    def show(version: object, step: int, estimate: int) -> None:
        print(f"[{step}/~{estimate}] deepspeed {version}: installing and running ...", file=out, flush=True)

    return show


def _bisect(args: argparse.Namespace) -> int:
    from . import bisect

    out = sys.stderr
    started = time.monotonic()
    try:
        available = bisect.available_releases()
        releases = bisect.releases_between(available, args.good, args.bad)
    except bisect.BisectError as exc:
        _err(str(exc))
        return 1
    print(
        f"bisecting {args.nodeid} over {len(releases)} deepspeed releases {releases[0]} .. {releases[-1]} "
        f"(about {bisect.estimated_steps(len(releases))} probes)",
        file=out,
        flush=True,
    )
    log_dir = Path(args.log_dir) if args.log_dir else None
    try:
        prepare = bisect.release_environment(args.cache_dir, args.constraints, log_dir=log_dir)
    except bisect.BisectError as exc:
        _err(str(exc))
        return 1
    inner = bisect.Prober(
        args.nodeid,
        prepare=prepare,
        pytest_args=tuple(args.pytest_args),
        log_dir=log_dir,
        timeout=args.timeout,
    )

    def oracle(version: Version) -> bisect.Probe:
        probe = inner(version)
        detail = f" ({probe.detail})" if probe.detail else ""
        print(f"    deepspeed {version}: {probe.word}{detail} in {probe.timing}", file=out, flush=True)
        return probe

    try:
        result = bisect.search(releases, oracle, progress=_progress(out))
    except bisect.BisectError as exc:
        _err(str(exc))
        return 1
    print(bisect.summary(result, args.good, args.bad, time.monotonic() - started))
    return 0


def _add_bisect(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "bisect",
        help="find the first DeepSpeed release where a test's outcome flips",
        description="Install DeepSpeed releases from PyPI (cached per release) and binary-search the first one where "
        "TEST_NODEID's outcome flips. Arguments after `--` go to pytest.",
    )
    p.add_argument("nodeid", metavar="TEST_NODEID", help="e.g. repros/test_zero3_module_id.py::test_user_ids_survive")
    p.add_argument("--good", required=True, metavar="VERSION", help="a release at one end (e.g. where it passes)")
    p.add_argument("--bad", required=True, metavar="VERSION", help="a release at the other end (where it fails)")
    p.add_argument(
        "--cache-dir", type=Path, default=None, help="release cache (default: $DSREPRO_CACHE_DIR, shared with tox)"
    )
    p.add_argument(
        "--constraints",
        type=Path,
        default=None,
        help="pip constraints pinning torch (default: $DSREPRO_CONSTRAINTS, constraints.txt here or above, "
        "else the torch installed here)",
    )
    p.add_argument("--log-dir", metavar="DIR", help="keep each probe's install log and pytest output here")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds one probe's pytest run may take")
    p.set_defaults(handler=_bisect, pytest_args=[])


# --- matrix and install: other modules' subcommands ----------------------------------------------------------------


def _partner(name: str) -> ModuleType | None:
    """``pytest_dsrepro.<name>`` if it offers ``add_arguments(parser)`` and ``run(args) -> int``."""
    try:
        module = importlib.import_module(f"pytest_dsrepro.{name}")
    except ImportError:
        return None
    return module if hasattr(module, "add_arguments") and hasattr(module, "run") else None


def _add_partners(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    helps = {
        "matrix": "merge results files of several DeepSpeed releases into the bug x version table",
        "install": "install one DeepSpeed release (torch pinned) and prove it imports",
    }
    for name, text in helps.items():
        module = _partner(name)
        if module is None:
            continue
        p = sub.add_parser(name, help=text, description=text)
        module.add_arguments(p)  # may set its own description
        p.set_defaults(handler=module.run)


# --- main --------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsrepro", description=DESCRIPTION, epilog=EPILOG)
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")
    _add_list(sub)
    _add_new(sub)
    _add_bisect(sub)
    _add_partners(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if argv[:1] == ["bisect"] and "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1 :]
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    if passthrough:
        args.pytest_args = passthrough
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
