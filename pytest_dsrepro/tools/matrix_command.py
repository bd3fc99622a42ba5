"""``dsrepro matrix``: the table (``matrix``) of results files, its arguments, its exit codes, and the order that
keeps a run from losing work.

Every output is checked before anything is read or rendered (``core.paths``: tried, not asked), so a read-only
directory costs a second, not a run. Then the results are read, the table printed and the files written,
each whole or not at all (``core.files``); a file that could not be written is named, and the others are still
written.
"""

from __future__ import annotations

import argparse
import enum
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from ..core.escape import ShownStream
from ..core.files import write_atomically
from ..core.paths import unwritable_file
from .matrix import Matrix, MatrixError, build, render_html, render_markdown, render_svg, render_terminal, symbols
from .matrix.model import DAMAGE
from .matrix.terminal import WIDTH


class Exit(enum.IntEnum):
    """One meaning each; where several hold, the first of 2, 3, 4, 1 is the exit code."""

    OK = 0  # every run as declared, every file read and every output written
    UNEXPECTED = 1  # an UNEXPECTED run (or, with --fail-on-unavailable, a release that cannot run)
    USAGE = 2  # nothing to read, or a path that does not exist: nothing done
    NOT_SAVED = 3  # an output could not be written (said which)
    UNREADABLE = 4  # results files that could not be read: the matrix lacks them (said which, and what to do)


def exit_code(matrix: Matrix, *, fail_on_unavailable: bool = False) -> int:
    """What the matrix itself says: UNREADABLE when results files are missing from it, UNEXPECTED when a run is
    (or, if asked, a release could not run), else OK."""
    if matrix.damaged:
        return Exit.UNREADABLE
    if matrix.unexpected():
        return Exit.UNEXPECTED
    if fail_on_unavailable and any(c.unavailable for c in matrix.columns):
        return Exit.UNEXPECTED
    return Exit.OK


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Merge pytest-dsrepro results files (--ds-results, dsrepro install --results; any number of directories, "
        "such as the shards and releases of a CI matrix) into one bug x release table: printed, and written as "
        "Markdown, HTML and SVG. Exit codes: 0 as declared, 1 an UNEXPECTED run, 2 usage, 3 an output not saved, "
        "4 results files that could not be read."
    )
    parser.add_argument("paths", nargs="*", type=Path, default=[Path("results")], help="results files or directories")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="where NAME.md, NAME.html and NAME.svg go (default: the first results directory)",
    )
    parser.add_argument("--name", default="matrix", help="the files' name before .md, .html, .svg (default: matrix)")
    parser.add_argument("--markdown", type=Path, default=None, help="Markdown output (default: DIR/NAME.md)")
    parser.add_argument("--html", type=Path, default=None, help="HTML output (default: DIR/NAME.html)")
    parser.add_argument("--svg", type=Path, default=None, help="SVG image output (default: DIR/NAME.svg)")
    parser.add_argument("--no-write", action="store_true", help="print only; write no files")
    parser.add_argument("--color", choices=("auto", "always", "never"), default="auto", help="terminal colours")
    parser.add_argument(
        "--fail-on-unavailable", action="store_true", help="exit 1 also when a release could not run at all"
    )
    parser.add_argument(
        "--since", type=Path, action="append", default=None, metavar="OLD",
        help="older results files or directories (repeatable): mark the runs that changed since them",
    )  # fmt: skip


def _use_color(choice: str) -> bool:
    if choice != "auto":
        return choice == "always"
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR")


def _can_print(text: str) -> bool:
    try:
        text.encode(sys.stdout.encoding or "ascii")
    except (UnicodeEncodeError, LookupError):
        return False
    return True


def _say(message: str) -> None:
    print(f"dsrepro matrix: {message}", file=sys.stderr)


def _show(text: str) -> None:
    """``text`` on stdout; a reader that went away (``dsrepro matrix | head``) stops the printing, not the files.
    Its colours are its own: the stream itself, past ``cli``'s (``render_terminal`` shows the escapes in texts)."""
    out = sys.stdout.raw if isinstance(sys.stdout, ShownStream) else sys.stdout
    try:
        out.write(text)
        out.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's own flush finds no pipe


Renderer = Callable[[Matrix, Path], str]


def _outputs(args: argparse.Namespace, paths: Sequence[Path]) -> list[tuple[Path, Renderer]]:
    if args.no_write:
        return []
    base = args.out or (paths[0] if paths[0].is_dir() else paths[0].parent)
    markdown = args.markdown or base / f"{args.name}.md"
    html = args.html or base / f"{args.name}.html"
    svg = args.svg or base / f"{args.name}.svg"
    return [
        (markdown, lambda m, p: render_markdown(m, image=_relative(svg, p.parent))),
        (html, lambda m, p: render_html(m, links=p.parent)),
        (svg, lambda m, p: render_svg(m)),
    ]


def _relative(path: Path, start: Path) -> str:
    return os.path.relpath(path.absolute(), start.absolute())


def _build(args: argparse.Namespace, paths: Sequence[Path]) -> Matrix:
    """The matrix of ``paths``, marked against ``--since``; :class:`MatrixError` (``--since``'s said so)."""
    matrix = build.merge(*build.load(paths))
    if not args.since:
        return matrix
    try:
        files, unreadable = build.load(args.since)
        damaged = [u for u in unreadable if u.kind in DAMAGE]
        if damaged:  # compared with part of the old results, every run the damaged file held would read as changed
            more = f" (and {len(damaged) - 1} more)" if len(damaged) > 1 else ""
            raise MatrixError(f"{damaged[0]}{more}")
        return build.since(matrix, build.merge(files, unreadable), args.since)
    except MatrixError as exc:
        raise MatrixError(f"--since: {exc}") from None


def _print(matrix: Matrix, color: bool) -> None:
    """The terminal table, in letters where the terminal's encoding has no symbols; the damaged files, said again
    on stderr (where a table sent to a file or a pipe leaves them seen)."""
    width = min(WIDTH, shutil.get_terminal_size((WIDTH, 24)).columns)
    glyphs = "".join(kind.glyph for kind in symbols.KINDS.values())
    _show(render_terminal(matrix, color=color, width=width, ascii_only=not _can_print(glyphs)))
    if matrix.damaged:
        _say(f"{len(matrix.damaged)} results file{'s' * (len(matrix.damaged) != 1)} could not be read (listed above): "
             "the matrix lacks what they hold")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    paths: list[Path] = list(args.paths) or [Path("results")]
    outputs = _outputs(args, paths)
    blocked = [(path, why) for path, _ in outputs if (why := unwritable_file(path))]
    for path, why in blocked:
        _say(f"cannot write {path}: {why}")
    if blocked:
        _say("nothing was read or written; choose where the files go with --out DIR (or --markdown, --html, "
             "--svg), or print only with --no-write")  # fmt: skip
        return Exit.NOT_SAVED
    try:
        matrix = _build(args, paths)
    except MatrixError as exc:
        _say(str(exc))
        return Exit.USAGE
    _print(matrix, _use_color(args.color))
    code = exit_code(matrix, fail_on_unavailable=args.fail_on_unavailable)
    for path, render in outputs:
        try:
            write_atomically(path, render(matrix, path))
        except OSError as exc:
            _say(f"{path} not saved: {exc.strerror or exc}")
            code = Exit.NOT_SAVED
        else:
            _show(f"wrote {path}\n")
    return code
