"""The matrix as data: releases (columns, in version order: ``packaging.version``), bugs and their configs (rows), one
cell per row and release holding the stock run and the run with the repro's fix, each judged against the row's
declared range (``!`` against it); prerequisite fixes are marked (``+``), changes since ``--since`` (``~``).

``build`` makes it from results files, with the gates' own ``Verdict``, ``Reason`` and range ordering; renderers
read it and decide nothing about the results themselves.
"""

from __future__ import annotations

import datetime
import functools
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from ...core import escape
from ...core.gates import Rate, Reason, Verdict
from ...core.outcome import Measurement
from ...core.results import Unreadable

NOT_RUN = "not run"
UNAVAILABLE = "n/a"
UNREADABLE = "unreadable"
#: What a catalogue row's tests are; rows of tests without a ``ds_repro`` marker are grouped under this name.
NOT_A_REPRO = "(not a repro)"
#: Unreadable files of these kinds are damage the matrix is missing; a ``foreign`` JSON file is simply not results.
DAMAGE = ("truncated", "older", "newer", "invalid", "unreadable")


class MatrixError(Exception):
    """A usage problem: nothing to read, or nothing readable. ``dsrepro matrix`` exits 2 with this one line."""


@dataclass(frozen=True)
class Column:
    """One DeepSpeed release, from every results file about it."""

    version: str
    torch: str | None = None
    backend: str | None = None
    world_size: int | None = None  # the run's --ds-world-size (its tests' worlds: world_sizes)
    unavailable: str | None = None  # why the release could not run at all (dsrepro install)
    source: Path | None = None  # the newest file of the release (None: none of its files could be read)
    sources: tuple[Path, ...] = ()  # every file of the release, newest first
    world_sizes: tuple[int, ...] = ()  # the sizes of the worlds its tests really ran in
    unreadable: tuple[Unreadable, ...] = ()  # files about this release that could not be read
    created: datetime.datetime | None = None  # when its newest file was written
    machine: str | None = None  # where its newest run ran: CPU model and count, operating system
    seconds: float = 0.0  # its runs' durations, added up

    @property
    def blank(self) -> bool:
        """No cell of this column holds a run: the release could not run, or none of its files could be read."""
        return self.unavailable is not None or self.source is None

    @property
    def ranks(self) -> str:
        """``2 ranks``, ``2, 4 ranks``: the worlds its tests used (else the run's world size), '' when unknown."""
        sizes = self.world_sizes or ((self.world_size,) if self.world_size else ())
        return f"{', '.join(map(str, sizes))} rank{'s' * (sizes != (1,))}" if sizes else ""

    @property
    def environment_line(self) -> str:
        return ", ".join([f"torch {self.torch or '?'}", *filter(None, (self.backend, self.ranks))])

    @property
    def unavailable_line(self) -> str | None:
        if self.unavailable is None:
            return None
        return f"cannot run with torch {self.torch or '?'}: {self.unavailable}"

    @property
    def blank_line(self) -> str | None:
        """Why the column holds no run, in one line."""
        if self.unavailable is not None:
            return self.unavailable_line
        if self.source is None:
            return f"{UNREADABLE}: " + "; ".join(u.problem for u in self.unreadable)
        return None


@dataclass(frozen=True)
class Row:
    """One bug and config: the stock test (or the only one, where no fix is declared) and its ``[fixed]`` twin."""

    repro: str
    key: str  # the test id without its variant: what the row is about
    label: str  # what tells the row from the repro's other rows: the config, or the test where there are several
    stock: str | None = None  # node id of the stock (or variant-less) test
    fixed: str | None = None  # node id of the [fixed] test
    title: str | None = None
    upstream: str | None = None
    declared: tuple[str, ...] = ()  # the affected ranges its ds_version markers declare (the newest record's)
    origin: str | None = None  # another project's test (``ds_origin``): that project at its revision, ``Origin.short``

    @property
    def nodeids(self) -> tuple[str, ...]:
        return tuple(n for n in (self.stock, self.fixed) if n is not None)

    @property
    def name(self) -> str:
        return f"{self.repro} [{self.label}]"

    def test_name(self, nodeid: str) -> str:
        """A test of the row as notes name it: the row, and which of its twins."""
        return f"{self.name} with the fix" if nodeid == self.fixed else self.name

    def declares_affected(self, version: str) -> bool | None:
        """Does the declared range include ``version``? None when that cannot be said."""
        return _declares(self.declared, version)


@functools.lru_cache(maxsize=4096)
def _declares(declared: tuple[str, ...], version: str) -> bool | None:
    """Whether ``declared`` includes ``version`` (asked for every cell, of a few ranges and releases: kept)."""
    try:
        v = Version(version)
        return any(SpecifierSet(d).contains(v, prereleases=True) for d in declared)
    except ValueError:  # InvalidVersion, InvalidSpecifier, or a part of 4300 digits or more (int())
        return None


#: What pytest said of a test that declares no range (another project's test): shown as it is, never UNEXPECTED.
OBSERVED = ("passed", "failed", "error", "xfailed", "xpassed")


@dataclass(frozen=True)
class Run:
    """One test on one release: its record's verdict and what the matrix makes of it."""

    nodeid: str  # the test's id: its node id, after its origin's revision for another project's test
    verdict: Verdict | None  # None: another project's test, whose outcome no declared range judges
    reason: Reason | None = None
    outcome: str | None = None
    error: str | None = None
    source: Path | None = None  # the results file it comes from
    prerequisites: tuple[str, ...] = ()  # the other bugs' fixes applied first (ds_prerequisite), with their reasons
    world_size: int | None = None
    raised: str | None = None  # what the ranks that failed raised (``ranks 0-1: ValueError: ...``), release-free
    rate: Rate | None = None  # a nondeterministic repro's series of runs
    measurements: tuple[Measurement, ...] = ()  # what the body timed against its reference
    duration: float = 0.0  # seconds pytest took for it
    contradicts: bool = False  # the outcome contradicts the row's declared range
    before: str | None = None  # with --since: what the test was (a verdict, "not run"), when it changed

    @functools.cached_property
    def word(self) -> str:
        """What the run is called: its verdict, else pytest's outcome (``PASSED``, ``FAILED``)."""
        return self.verdict.value if self.verdict is not None else (self.outcome or "?").upper()

    @property
    def marks(self) -> str:
        return (PREREQUISITE if self.prerequisites else "") + (CONTRADICTS if self.contradicts else "") + (
            CHANGED if self.before is not None else "")  # fmt: skip


CONTRADICTS = "!"  # the run contradicts the row's declared range
CHANGED = "~"  # the run differs from the --since matrix
PREREQUISITE = "+"  # the run had another bug's fix applied first (ds_prerequisite)


@dataclass(frozen=True)
class Cell:
    """A row on a release: the stock run and the run with the fix (None: not run)."""

    stock: Run | None = None
    fixed: Run | None = None

    @functools.cached_property
    def runs(self) -> tuple[Run, ...]:
        return tuple(r for r in (self.stock, self.fixed) if r is not None)

    @functools.cached_property
    def marks(self) -> str:
        found = "".join(r.marks for r in self.runs)
        return "".join(m for m in (PREREQUISITE, CONTRADICTS, CHANGED) if m in found)


@dataclass(frozen=True)
class Disagreement:
    """Files of one release that gave one test different verdicts; the newest one's is the cell."""

    nodeid: str
    version: str
    seen: tuple[tuple[str, Path], ...]  # (verdict, file), newest first


Placed = tuple[Row, Column, Run]


@dataclass(frozen=True)
class Matrix:
    columns: tuple[Column, ...]
    rows: tuple[Row, ...]
    cells: Mapping[tuple[str, str], Cell]  # (row key, column version) -> cell
    unreadable: tuple[Unreadable, ...] = ()
    since: tuple[Path, ...] | None = None  # the older files compared with (--since), if any
    gone: tuple[tuple[str, str, str], ...] = ()  # (test name, version, verdict) of the older matrix missing here
    disagreements: tuple[Disagreement, ...] = ()

    def cell(self, row: Row, column: Column) -> Cell | None:
        return self.cells.get((row.key, column.version))

    def name(self, nodeid: str) -> str:
        """A test's name in notes (its node id when no row has it)."""
        return next((r.test_name(nodeid) for r in self.rows if nodeid in r.nodeids), nodeid)

    def placed(self) -> tuple[Placed, ...]:
        """Every run in a column that can hold runs, column by column, row by row (worked out once)."""
        return self._placed

    @functools.cached_property
    def _placed(self) -> tuple[Placed, ...]:
        found = []
        for c in self.columns:
            if c.blank:
                continue
            for r in self.rows:
                cell = self.cells.get((r.key, c.version))
                found += [(r, c, run) for run in (cell.runs if cell else ())]
        return tuple(found)

    def counts(self) -> Counter[str]:
        """How many runs have each verdict (or outcome, for tests no verdict judges)."""
        return Counter(run.word for _, _, run in self.placed())

    def unexpected(self) -> list[Placed]:
        return [p for p in self.placed() if p[2].verdict is Verdict.UNEXPECTED]

    def contradictions(self) -> list[Placed]:
        return [p for p in self.placed() if p[2].contradicts]

    def changes(self) -> list[tuple[Row, Column, Run, str]]:
        """``(row, column, run, before)`` for every run that differs from the ``--since`` matrix."""
        return [(r, c, run, run.before) for r, c, run in self.placed() if run.before is not None]

    @property
    def damaged(self) -> tuple[Unreadable, ...]:
        """The unreadable files that are results (or were meant to be): the matrix lacks what they hold."""
        return tuple(u for u in self.unreadable if u.kind in DAMAGE)

    def groups(self) -> list[tuple[str, list[Row]]]:
        """The rows by repro, in order: each bug with its configs (another project's tests: by revision and file)."""
        grouped: dict[str, list[Row]] = {}
        for r in self.rows:
            grouped.setdefault(r.repro, []).append(r)
        return list(grouped.items())

    def world_sizes(self) -> Counter[int]:
        """How many runs had worlds of each size."""
        return Counter(run.world_size for _, _, run in self.placed() if run.world_size)

    def run_of(self, row: Row, column: Column, nodeid: str) -> Run | None:
        cell = self.cell(row, column)
        if cell is None:
            return None
        return cell.stock if nodeid == row.stock else cell.fixed


def one_line(text: str) -> str:
    """``text`` on one line (``core.escape``'s: control characters removed)."""
    return escape.one_line(text)
