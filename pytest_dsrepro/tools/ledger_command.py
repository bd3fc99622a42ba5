"""``dsrepro ledger``: the fix ledger (``triage.ledger``: every DeepSpeed fix since v0.14.0, each with its disposition)
listed by first release, disposition or area, filtered, counted; ``--check --repo CLONE``: the rule run again on a
clone's history, every commit it selects without a row named (exit 1), and every row whose commit the rule no longer
selects.

The rule's third clause (a catalogued repro or a known fix names the pull request) reads the catalogue's own markers
(``catalogue.collect``) and the known fixes (``triage.known_fixes``); a ``repro`` row is checked against the same
markers. Bad input is one line and exit code 2.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

from packaging.version import Version

from ..core.text import aligned
from ..triage import known_fixes
from ..triage import ledger as ledger_file
from ..triage.ledger import FixRow
from . import arguments, atlas, catalogue, catalogue_run, history

#: Exit codes: 0 listed, or every selected commit has a row; 1 a commit without a row (or a row the rule does not
#: select); 2 bad input.
OK, UNACCOUNTED, USAGE = 0, 1, 2
BY = ("release", "disposition", "area")
#: The range ``--check`` reads by default: from the ledger's start to the clone's HEAD.
RANGE = f"{ledger_file.START}..HEAD"


class LedgerUsage(Exception):
    """An option is wrong, or the clone cannot answer: one line, exit code 2."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "The fix ledger: every commit since v0.14.0 that fixes DeepSpeed's Python runtime, each a catalogued repro, "
        "a known fix (what users see, the release that fixes it), not for users, or not a fix. Lists it grouped and "
        "filtered, with counts; --check --repo CLONE runs the rule again on a clone and names the commits without a "
        "row (exit 1)."
    )
    parser.add_argument("--by", choices=BY, default="release", help="group by first release (default), disposition "
                        "or area")  # fmt: skip
    parser.add_argument("--release", metavar="VERSION", help="only the fixes first shipped in this release")
    parser.add_argument("--disposition", metavar="WHAT", help="only rows of one disposition: "
                        f"{', '.join(ledger_file.DISPOSITIONS)}")  # fmt: skip
    parser.add_argument("--area", metavar="AREA", help="only rows of one area (zero3, offload, checkpoint, ...)")
    parser.add_argument("--cpu", action="store_true", help="only known fixes a CPU world could show: the repro queue")
    parser.add_argument("--check", action="store_true", help="run the rule on --repo's history: a row for every fix?")
    parser.add_argument("--repo", type=Path, metavar="CLONE", help="with --check: your DeepSpeed clone (only read)")
    parser.add_argument("--range", default=None, metavar="A..B", help=f"with --check: the commits (default {RANGE})")
    parser.add_argument("--ledger", type=Path, metavar="DIR", help="a folder of ledger files (default: the package's)")
    parser.add_argument("--catalogue", type=arguments.directory, metavar="DIR", help="with --check: the repros whose "
                        "markers name their fixes (default: the installed catalogue)")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    try:
        fixes = ledger_file.load(args.ledger)
        if args.check:
            return check(args, fixes)
        if args.repo is not None or args.range is not None or args.catalogue is not None:
            raise LedgerUsage("--repo, --range and --catalogue are for --check")
        chosen = chosen_rows(fixes, args)
    except (LedgerUsage, ledger_file.LedgerError, history.HistoryError, catalogue_run.ScanError) as exc:
        print(f"dsrepro ledger: {exc}", file=sys.stderr)
        return USAGE
    width = shutil.get_terminal_size((120, 24)).columns
    for line in [*listing(chosen, args.by, width), "", *counts(chosen, args.by)]:
        print(line)
    return OK


# --- the list ------------------------------------------------------------------------------------------------------


def chosen_rows(fixes: Sequence[FixRow], args: argparse.Namespace) -> list[FixRow]:
    """The rows the filters keep: first shipped in ``--release``, of ``--disposition``, of ``--area``; ``--cpu``: the
    known fixes a CPU world could show."""
    if args.disposition is not None and args.disposition not in ledger_file.DISPOSITIONS:
        raise LedgerUsage(f"--disposition {args.disposition!r}: one of {', '.join(ledger_file.DISPOSITIONS)}")
    if args.area is not None and args.area not in ledger_file.AREAS:
        raise LedgerUsage(f"--area {args.area!r}: one of {', '.join(ledger_file.AREAS)}")
    try:
        release = None if args.release is None else Version(args.release)
    except ValueError:  # InvalidVersion, or a part of 4300 digits or more (int())
        raise LedgerUsage(f"--release {arguments.shown(args.release)!r} is not a version such as 0.18.3") from None
    keep: list[Callable[[FixRow], bool]] = [
        lambda f: release is None or Version(f.first) == release,
        lambda f: args.disposition is None or f.disposition == args.disposition,
        lambda f: args.area is None or f.area == args.area,
        lambda f: not args.cpu or (f.disposition == ledger_file.KNOWN and f.cpu is True),
    ]
    return [f for f in fixes if all(k(f) for k in keep)]


def group(fix: FixRow, by: str) -> str:
    return {"release": fix.first, "disposition": fix.disposition, "area": fix.area}[by]


def _order(by: str) -> Callable[[str], tuple[object, ...]]:
    """Groups in their natural order: releases oldest first, dispositions and areas as the ledger lists them."""
    if by == "release":
        return lambda key: (Version(key),)
    known = ledger_file.DISPOSITIONS if by == "disposition" else ledger_file.AREAS
    return lambda key: (known.index(key) if key in known else len(known), key)


def said(fix: FixRow) -> str:
    """A row's disposition in a few words: ``repro zero3-foo``, ``known, a CPU world can show it``."""
    if fix.disposition == ledger_file.REPRO:
        return f"repro {fix.repro}"
    if fix.disposition == ledger_file.KNOWN:
        return "known (CPU)" if fix.cpu else "known"
    return fix.disposition


def listing(fixes: Sequence[FixRow], by: str, width: int | None = None) -> list[str]:
    """Each group (a header with its count), then a line per row: commit, pull request, disposition, area, title."""
    if not fixes:
        return ["no row of the ledger is chosen"]
    lines: list[str] = []
    for key in sorted({group(f, by) for f in fixes}, key=_order(by)):
        mine = [f for f in fixes if group(f, by) == key]
        lines.append(f"{by} {key}: {len(mine)}")
        rows = [(f"  {f.short}", f"#{f.pr}" if f.pr else "-", f.first, said(f), f.area, f.title) for f in mine]
        lines += aligned(rows, width=width)
    return lines


def counts(fixes: Sequence[FixRow], by: str) -> list[str]:
    """The counts table: per group, each disposition (and the known fixes a CPU world could show), and the total."""
    columns = [*ledger_file.DISPOSITIONS, "known on CPU", "total"]
    keys = sorted({group(f, by) for f in fixes}, key=_order(by))

    def row(name: str, mine: Sequence[FixRow]) -> tuple[str, ...]:
        tally = Counter(f.disposition for f in mine)
        cpu = sum(1 for f in mine if f.disposition == ledger_file.KNOWN and f.cpu)
        return (name, *(str(tally[d]) for d in ledger_file.DISPOSITIONS), str(cpu), str(len(mine)))

    table = [(by, *columns), *(row(k, [f for f in fixes if group(f, by) == k]) for k in keys), row("total", fixes)]
    return aligned([(cells[0], *(c.rjust(len(n)) for c, n in zip(cells[1:], columns, strict=True))) for cells in table])


# --- --check -------------------------------------------------------------------------------------------------------


def _named(args: argparse.Namespace, fixes: Sequence[FixRow]) -> set[int]:
    """The pull requests the catalogue's markers and the known fixes name as fixes (the rule's third clause), the
    ledger's repro rows checked against the same markers."""
    where = args.catalogue.resolve() if args.catalogue is not None else catalogue_run.installed()
    try:
        entries = catalogue.collect([str(where)], ["--rootdir", str(where)])
    except catalogue.CollectionFailed as exc:
        raise LedgerUsage(str(exc).splitlines()[0]) from None
    ledger_file.check_catalogue(fixes, {e.id: e.fix_pr for e in entries})
    return {e.fix_pr for e in entries if e.fix_pr is not None} | {f.pr for f in known_fixes.load()}


def check(args: argparse.Namespace, fixes: Sequence[FixRow]) -> int:
    """The rule on ``--repo``'s ``--range``: every selected commit without a row, every row of the range the rule no
    longer selects; exit 1 when there is either."""
    if args.repo is None:
        raise LedgerUsage("--check needs --repo CLONE: the DeepSpeed clone whose history the rule reads")
    clone = history.Clone.open(args.repo)
    try:
        older, newer = atlas.parse_range(clone, args.range or RANGE)
    except atlas.AtlasError as exc:
        raise LedgerUsage(str(exc)) from None
    named = _named(args, fixes)
    changes = history.changes(clone, older.sha, newer.sha)
    rows = {f.commit: f for f in fixes}
    selected = {c.commit.sha: ledger_file.selects(c.commit.subject, c.body, c.files, c.commit.pr, named)
                for c in changes}  # fmt: skip
    missing = [c for c in changes if selected[c.commit.sha] and c.commit.sha not in rows]
    dropped = [rows[c.commit.sha] for c in changes if c.commit.sha in rows and not selected[c.commit.sha]]
    print(f"dsrepro ledger: {older.label}..{newer.label} of {args.repo}: {len(changes)} commits, "
          f"{sum(1 for s in selected.values() if s)} selected by the rule, {len(fixes)} rows")  # fmt: skip
    for c in missing:
        print(f"no row: {c.commit.short} #{c.commit.pr or '-'} {c.commit.title} ({selected[c.commit.sha]})")
    for f in dropped:
        print(f"the rule no longer selects: {f.label} {f.title} (its row: {f.place})")
    if missing or dropped:
        print(f"{len(missing)} selected commit(s) without a row, {len(dropped)} row(s) the rule does not select: "
              "docs/ledger.md says how to add a row")  # fmt: skip
        return UNACCOUNTED
    print("every commit the rule selects has a row")
    return OK
