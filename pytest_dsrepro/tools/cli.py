"""The ``dsrepro`` command: the catalogue, new repros, per-release installs, bisecting releases, the version matrix.

Every subcommand is a ``Command``: a name, a help line, a function that declares its arguments and one that runs it,
each a thin layer over a module of plain, tested functions. Nothing heavy is imported until a subcommand runs, so
``dsrepro --help`` is instant.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from . import atlas, install, matrix, scan_command, triage_command, upstream_command

if TYPE_CHECKING:
    from packaging.version import Version

Handler = Callable[[argparse.Namespace], int]

DESCRIPTION = "pytest-dsrepro: DeepSpeed bugs as pytest tests in real N-rank torch.distributed worlds."
EPILOG = (
    "A contributor's path: `dsrepro new NAME --issue URL`, edit the file until it fails like the issue, "
    "`pytest FILE --ds-report report.md`, `dsrepro bisect FILE::TEST --good X --bad Y`. See docs/contributing.md."
)


def _err(message: str, command: str = "") -> None:
    print(f"dsrepro{' ' if command else ''}{command}: {message}", file=sys.stderr, flush=True)


def terminal_width(limit: int = 120) -> int:
    """The terminal's width (``COLUMNS`` when set), never over ``limit``: tables stay readable when pasted."""
    return min(limit, shutil.get_terminal_size((limit, 24)).columns)


def version_line() -> str:
    """``dsrepro --version``: this plugin's version, and the DeepSpeed and torch it would run (package metadata)."""
    from ..core.versions import installed_text

    found = [f"{name} {installed_text(name) or 'not installed'}" for name in ("deepspeed", "torch")]
    return f"pytest-dsrepro {installed_text('pytest-dsrepro') or 'unknown'} ({', '.join(found)})"


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
    sys.stdout.write(catalogue.render(entries, args.format, terminal_width()))
    return 0


def _list_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="*", metavar="PATH", help="files or directories to collect (default: repros/)")
    p.add_argument("--format", choices=("table", "markdown", "json"), default="table", help="output format")


# --- new ---------------------------------------------------------------------------------------------------------


def _new(args: argparse.Namespace) -> int:
    from . import scaffold, triage_command

    try:
        start = scaffold.Prefill()
        if args.from_log is not None:
            start = scaffold.prefill(triage_command.reading(args.from_log))
        path = scaffold.create(args.name, Path(args.dir), issue=args.issue, preset=args.config, start=start)
    except (scaffold.ScaffoldError, triage_command.TriageError) as exc:
        _err(str(exc))
        return 1
    test = f"{path.as_posix()}::test_{scaffold.names(args.name).slug}"
    print(f"wrote {path}")
    print("next: fill in its TODOs (the docstring says how), then run it:")
    print(f"  pytest {path.as_posix()} -v")
    print(f"  pytest {path.as_posix()} --ds-report report.md      # Markdown for the issue")
    print(f"  dsrepro bisect {test} --good X --bad Y   # where it starts or stops")
    return 0


def _new_arguments(p: argparse.ArgumentParser) -> None:
    from .scaffold import DEFAULT_PRESET

    p.add_argument("name", metavar="NAME", help="short name, e.g. zero3-module-id; the file is repros/test_<name>.py")
    p.add_argument("--issue", metavar="URL", help="upstream issue URL (the repro's ds_repro upstream=)")
    p.add_argument(
        "--config", metavar="PRESET", default=DEFAULT_PRESET, help=f"ds_config preset (default {DEFAULT_PRESET})"
    )
    p.add_argument("--dir", default="repros", help="directory to write into (default repros/)")
    p.add_argument(
        "--from-log", metavar="LOG", help="prefill the title, raises= and match= from the error in LOG (- for stdin)"
    )


# --- bisect ------------------------------------------------------------------------------------------------------


def _progress(out: TextIO) -> Callable[[object, int, int], None]:
    def show(version: object, step: int, estimate: int) -> None:
        print(f"[{step}/~{estimate}] deepspeed {version}: installing and running ...", file=out, flush=True)

    return show


def _bisect(args: argparse.Namespace) -> int:
    """Exit codes: 0 a verdict, 1 none (an end could not be tested, or both ends agree), 2 a bisect that cannot
    start (its ends, test, options, clone or release list), 130 interrupted (``main``)."""
    from . import bisect, environments, history

    try:
        return _bisect_releases(args) if args.repo is None else _bisect_repo(args)
    except bisect.NoVerdict as exc:
        _err(str(exc), "bisect")
        return 1
    except (bisect.BisectError, history.HistoryError, environments.EnvironmentUnavailable) as exc:
        _err(str(exc), "bisect")
        return 2


def _bisect_repo(args: argparse.Namespace) -> int:
    from . import bisect_repo

    return bisect_repo.run(args)


def _bisect_releases(args: argparse.Namespace) -> int:
    from . import bisect, environments

    if args.fresh or args.env_cache is not None:
        raise bisect.BisectError("--fresh and --env-cache apply to commits: give --repo PATH, your DeepSpeed clone")
    out = sys.stderr
    started = time.monotonic()
    available = bisect.available_releases()
    releases = bisect.releases_between(available, args.good, args.bad)
    print(
        f"bisecting {args.nodeid} over {len(releases)} deepspeed releases {releases[0]} .. {releases[-1]} "
        f"(about {bisect.estimated_steps(len(releases))} probes)",
        file=out,
        flush=True,
    )
    log_dir = Path(args.log_dir) if args.log_dir else None
    prepare = environments.release_environment(args.cache_dir, args.constraints, log_dir=log_dir)
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

    result = bisect.search(releases, oracle, progress=_progress(out))
    print(bisect.summary(result, args.good, args.bad, time.monotonic() - started))
    return 0


def _size(text: str) -> int:
    from .bisect_cache import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _runs(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of runs >= 1")
    return int(text)


def _bisect_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("nodeid", metavar="TEST_NODEID", help="e.g. repros/test_zero3_module_id.py::test_user_ids_survive")
    p.add_argument(
        "--good",
        required=True,
        metavar="VERSION",
        help="a release at one end, e.g. where it passes (--repo: or a revision)",
    )
    p.add_argument("--bad", required=True, metavar="VERSION", help="a release at the other end, where it fails")
    p.add_argument(
        "--repo",
        type=Path,
        metavar="PATH",
        help="your DeepSpeed clone (never written to): after the releases, bisect the commits between the two that "
        "flip, and name the pull request; --good/--bad may then be any revisions of it too",
    )
    p.add_argument(
        "--chdir", type=Path, metavar="DIR", help="run each probe's pytest from DIR (node ids relative to it)"
    )
    p.add_argument(
        "--runs",
        type=_runs,
        default=1,
        metavar="N",
        help="run the test up to N times per probe (a race shows in some runs only): the bug shows if any run "
        "shows it (default 1)",
    )
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
        type=Path,
        default=None,
        help="where the releases' environments live, and with --repo the commits' and the stored outcomes "
        "(default: $DSREPRO_CACHE_DIR or ~/.cache/pytest-dsrepro, shared with tox)",
    )
    p.add_argument(
        "--constraints",
        type=Path,
        default=None,
        help="pip constraints pinning torch (default: $DSREPRO_CONSTRAINTS, constraints.txt here or above, "
        "else the torch installed here)",
    )
    p.add_argument("--log-dir", metavar="DIR", help="keep each probe's install log and pytest output here")
    p.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        help="seconds one pytest run of a probe may take before it is stopped (a hung world ends first, at pytest's "
        "--ds-timeout: give it after --)",
    )
    p.set_defaults(pytest_args=[])


# --- export ------------------------------------------------------------------------------------------------------


def _export(args: argparse.Namespace) -> int:
    from . import export

    return export.run(args)


def _export_arguments(p: argparse.ArgumentParser) -> None:
    """As ``export.add_arguments`` declares them, without importing it (and pytest) for ``dsrepro --help``."""
    p.add_argument("nodeid", metavar="NODEID", help="e.g. repros/test_x.py::test_y[zero3-stock]")
    p.add_argument("-o", "--output", metavar="FILE", default="-", help="where to write it (default: stdout)")


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Handler
    description: str | None = None


COMMANDS = (
    Command("list", "show the catalogue: id, title, upstream, affected releases, fixed in", _list_arguments, _list),
    Command("new", "write a new repro from the template into repros/ (never overwrites)", _new_arguments, _new),
    Command(
        "bisect",
        "find the first DeepSpeed release (with --repo: commit, pull request) where a test's outcome flips",
        _bisect_arguments,
        _bisect,
        "Install DeepSpeed releases from PyPI (cached per release) and binary-search the first one where "
        "TEST_NODEID's outcome flips; with --repo, the releases of your clone and then the commits between the two "
        "that flip, naming the pull request. Arguments after `--` go to pytest.",
    ),
    # These two declare their own description in add_arguments.
    Command(
        "install",
        "install one DeepSpeed release (torch pinned) and prove it imports",
        install.add_arguments,
        install.run,
    ),
    Command(
        "matrix",
        "merge results files of several DeepSpeed releases into the bug x version table",
        matrix.add_arguments,
        matrix.run,
    ),
    Command(
        "upstream",
        "run DeepSpeed's own tests/unit files, unchanged, in these worlds (on releases too)",
        upstream_command.add_arguments,
        upstream_command.run,
    ),
    Command(
        "atlas",
        "the regression atlas: each fix commit's own test run on the release before the fix and the first with it",
        atlas.add_arguments,
        atlas.run,
    ),
    Command(
        "scan",
        "does a known bug hit your ds_config.json? the catalogue run with it, per bug a verdict (on releases too)",
        scan_command.add_arguments,
        scan_command.run,
    ),
    Command(
        "triage",
        "which known bug is this error? the catalogue ranked against a log (with --confirm: reproduced here)",
        triage_command.add_arguments,
        triage_command.run,
    ),
    Command(
        "export",
        "write one test as a standalone script for torchrun (torch and DeepSpeed only)",
        _export_arguments,
        _export,
        "Write one test of the catalogue as a standalone script (torch, DeepSpeed and the standard library only) "
        "that reproduces its stock variant under `torchrun --standalone --nproc-per-node N FILE`.",
    ),
)


# --- main --------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsrepro", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=version_line())
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.help, description=command.description or command.help)
        command.arguments(p)
        p.set_defaults(handler=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if argv[:1] in (["bisect"], ["upstream"], ["scan"]) and "--" in argv:
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
    try:
        return handler(args)
    except KeyboardInterrupt:  # Ctrl-C: the command's children got it too; one line, not a traceback
        print(f"dsrepro {argv[0]}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
