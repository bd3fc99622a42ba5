"""The ``dsrepro`` command: the catalogue, new repros, per-release installs, bisecting releases, the version matrix.

Every subcommand is a ``Command``: a name and a help line; its module, ``tools/<name>_command``, declares its
arguments beside the code that runs it. No command module imports another (an import contract in pyproject.toml):
what two share lives below them. Only the subcommand that runs is imported, so ``dsrepro --help`` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn, Protocol, cast

from ..core.escape import ShownStream, one_line, terminal
from ..core.text import cut
from ..core.versions import installed_text

Handler = Callable[[argparse.Namespace], int]

DESCRIPTION = "pytest-dsrepro: DeepSpeed bugs as pytest tests in real N-rank torch.distributed worlds."
EPILOG = (
    "A contributor's path: `dsrepro new NAME --issue URL`, edit the file until it fails like the issue, "
    "`pytest FILE --ds-report report.md`, `dsrepro bisect FILE::TEST --good X --bad Y`. See docs/contributing.md."
)
#: The subcommands whose arguments after ``--`` go to the pytest they run.
PASSTHROUGH = ("bisect", "upstream", "scan")


def version_line() -> str:
    """``dsrepro --version``: this plugin's version, and the DeepSpeed and torch it would run (package metadata)."""
    found = [f"{name} {installed_text(name) or 'not installed'}" for name in ("deepspeed", "torch")]
    return f"pytest-dsrepro {installed_text('pytest-dsrepro') or 'unknown'} ({', '.join(found)})"


class CommandModule(Protocol):
    """What every ``tools/<name>_command`` module has (its ``add_arguments`` may set the parser's description)."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


@dataclass(frozen=True)
class Command:
    """A subcommand: its name and its line in ``dsrepro --help`` (its description, unless its module gives one)."""

    name: str
    help: str

    def module(self) -> CommandModule:
        return cast(CommandModule, importlib.import_module(f"{__package__}.{self.name}_command"))


COMMANDS = (
    Command("list", "show the catalogue: id, title, upstream, affected releases, fixed in"),
    Command("new", "write a new repro from the template into its subsystem's folder of repros/ (never overwrites)"),
    Command(
        "bisect", "find the first DeepSpeed release (with --repo: commit, pull request) where a test's outcome flips"
    ),
    Command("install", "install one DeepSpeed release (torch pinned) and prove it imports"),
    Command("matrix", "merge results files of several DeepSpeed releases into the bug x version table"),
    Command("upstream", "run DeepSpeed's own tests/unit files, unchanged, in these worlds (on releases too)"),
    Command(
        "atlas",
        "the regression atlas: each fix commit's own test run on the release before the fix and the first with it",
    ),
    Command(
        "scan",
        "does a known bug hit your ds_config.json? the catalogue run with it, per bug a verdict (on releases too)",
    ),
    Command(
        "triage",
        "which known bug is this error? the catalogue ranked against a log (with --confirm: reproduced here)",
    ),
    Command(
        "ledger",
        "every DeepSpeed fix since v0.14.0 and what it is (repro, known, not for users, not a fix); --check a clone",
    ),
    Command("export", "write one test as a standalone script for torchrun (torch and DeepSpeed only)"),
)


class Parser(argparse.ArgumentParser):
    """argparse's parser, but a bad argument is one line and exit 2 (not the usage block, then the value whole:
    a number of 5000 digits, a pasted escape sequence): ``dsrepro scan: error: argument --world-size: ...``."""

    def error(self, message: str) -> NoReturn:
        said = terminal(cut(one_line(message), 160))
        self.exit(2, f"{self.prog}: error: {said} (see {self.prog} --help)\n")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Every subcommand, with the arguments of each (``only``: of that one alone, the only module imported)."""
    parser = Parser(prog="dsrepro", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=version_line())
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.help, description=command.help)
        if only in (None, command.name):
            module = command.module()
            module.add_arguments(p)
            p.set_defaults(handler=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if argv[:1] and argv[0] in PASSTHROUGH and "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1 :]
    parser = build_parser(argv[0] if argv else "")
    args = parser.parse_args(argv)
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    if passthrough:
        args.pytest_args = passthrough
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = ShownStream(sys.stdout), ShownStream(sys.stderr)
    try:
        return handler(args)
    except KeyboardInterrupt:  # Ctrl-C: the command's children got it too; one line, not a traceback
        print(f"dsrepro {argv[0]}: interrupted", file=sys.stderr)
        return 130
    finally:
        sys.stdout, sys.stderr = streams


if __name__ == "__main__":
    sys.exit(main())
