"""The matrix as data: releases (columns), bugs and their configs (rows), one cell per row and release holding the
stock run and the run with the repro's fix, each judged against the row's declared range.

Built from results files only (``core.results``), with the gates' own ``Verdict``, ``Reason`` and range ordering;
renderers read this model and decide nothing about the results themselves.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from ...core import results
from ...core.gates import STOCK, Rate, Reason, Verdict, oldest_first
from ...core.outcome import Measurement
from ...core.results import ResultsFile, TestRecord, Unreadable

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
    except (InvalidVersion, InvalidSpecifier):
        return None


@dataclass(frozen=True)
class Run:
    """One test on one release: its record's verdict and what the matrix makes of it."""

    nodeid: str
    verdict: Verdict
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

    @property
    def runs(self) -> tuple[Run, ...]:
        return tuple(r for r in (self.stock, self.fixed) if r is not None)

    @property
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

    def counts(self) -> Counter[Verdict]:
        """How many runs have each verdict."""
        return Counter(run.verdict for _, _, run in self.placed())

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
        """The rows by repro, in order: each bug with its configs."""
        grouped: dict[str, list[Row]] = {}
        for r in self.rows:
            grouped.setdefault(r.repro, []).append(r)
        return list(grouped.items())

    def world_sizes(self) -> Counter[int]:
        """How many runs had worlds of each size."""
        return Counter(run.world_size for _, _, run in self.placed() if run.world_size)

    def not_verdicts(self) -> list[tuple[str, str, list[str]]]:
        """Why each test without a judged run on a release (NOT-APPLICABLE, SKIPPED, not run) is so: ``(name, why,
        releases)``, one entry per row and reason. Columns without runs say why in their own notes."""

        def why(run: Run | None) -> str | None:
            if run is None:
                return "not run: no results file of the release ran this test"
            if run.verdict in (Verdict.NOT_APPLICABLE, Verdict.SKIPPED):
                return f"{run.verdict.value}: {one_line(run.error or 'no reason recorded')}"
            return None

        return self._grouped(why)

    def with_prerequisites(self) -> list[tuple[str, str, list[str]]]:
        """``(name, prerequisite, releases)`` for the runs that had another bug's fix applied first."""
        return self._grouped(lambda run: "; ".join(run.prerequisites) if run and run.prerequisites else None)

    def _grouped(self, why: Callable[[Run | None], str | None]) -> list[tuple[str, str, list[str]]]:
        """What ``why`` says of each test on each release, with the releases it says it of; a row's twins said
        once where they say the same of the same releases."""
        found = []
        for r in self.rows:
            said: dict[str, dict[str, list[str]]] = {n: {} for n in r.nodeids}
            for nodeid in r.nodeids:
                for c in self.columns:
                    text = None if c.blank else why(self.run_of(r, c, nodeid))
                    if text is not None:
                        said[nodeid].setdefault(text, []).append(c.version)
            stock, fixed = said.get(r.stock or "", {}), said.get(r.fixed or "", {})
            for text, versions in stock.items():
                both = r.fixed is not None and fixed.get(text) == versions
                found.append((r.name if both else r.test_name(r.stock or ""), text, versions))
            found += [(r.test_name(r.fixed or ""), text, versions) for text, versions in fixed.items()
                      if not (r.stock is not None and stock.get(text) == versions)]  # fmt: skip
        return found

    def run_of(self, row: Row, column: Column, nodeid: str) -> Run | None:
        cell = self.cell(row, column)
        if cell is None:
            return None
        return cell.stock if nodeid == row.stock else cell.fixed


def one_line(text: str) -> str:
    return " ".join(text.split())


# ----------------------------------------------------------------------------------------------------- loading


def load(paths: Sequence[Path]) -> tuple[list[ResultsFile], list[Unreadable]]:
    """Every results file under ``paths`` (files, or directories searched for ``*.json``), and the JSON files among
    them that could not be read. Raises :class:`MatrixError` when no results file is found at all."""
    try:
        files, unreadable = results.read_all(paths)
    except FileNotFoundError as exc:
        raise MatrixError(str(exc)) from None
    if not files and not any(u.kind in DAMAGE for u in unreadable):
        where = ", ".join(str(p) for p in paths)
        detail = f" ({len(unreadable)} other JSON files)" if unreadable else ""
        raise MatrixError(f"no pytest-dsrepro results files in {where}{detail}; write them with --ds-results DIR")
    return files, unreadable


# ----------------------------------------------------------------------------------------------------- merging


def version_key(version: str) -> tuple[int, Version | str]:
    try:
        return (0, Version(version))
    except InvalidVersion:
        return (1, version)


def _run_of(record: TestRecord, source: Path) -> Run | None:
    """A record's run, or None for a test outside the catalogue's business (ungated and not failing)."""
    verdict, error = record.verdict, record.error
    if verdict is None:
        if record.outcome in ("failed", "error", "xpassed"):
            verdict = Verdict.UNEXPECTED
            error = f"no verdict, pytest outcome {record.outcome}: {error or 'no error recorded'}"
        elif record.outcome == "skipped":
            verdict = Verdict.SKIPPED
        else:
            return None
    raised = "; ".join(f"{story.ranks}: {story.error}" for story in record.ranks) or None
    return Run(record.nodeid, verdict, record.reason, record.outcome, error, source, record.prerequisites,
               record.world_size, raised, record.rate, record.measurements, record.duration)  # fmt: skip


def _test_part(nodeid: str) -> str:
    return nodeid.split("::", 1)[1] if "::" in nodeid else nodeid


def _params(nodeid: str) -> str:
    return _test_part(nodeid).partition("[")[2].removesuffix("]")


def _without_variant(nodeid: str, variant: str | None) -> str:
    """The test id a row is about: ``f.py::t[zero3-stock]`` and ``f.py::t[zero3-fixed]`` are ``f.py::t[zero3]``."""
    head, _, params = nodeid.partition("[")
    parts = params.removesuffix("]").split("-") if params else []
    if variant in parts:
        del parts[len(parts) - 1 - parts[::-1].index(variant)]
    return f"{head}[{'-'.join(parts)}]" if parts else head


def _apart(ids: Iterable[str]) -> dict[str, str]:
    """What tells test ids apart: their parameters (``zero3``), else the test (``test_a[x]``), else the whole id."""
    ids = sorted(set(ids))
    if len({n.split("::", 1)[0] for n in ids}) > 1:
        return {n: n for n in ids}
    if len({_test_part(n).split("[", 1)[0] for n in ids}) > 1:
        return {n: _test_part(n) for n in ids}
    return {n: _params(n) or _test_part(n) for n in ids}


def _age(f: ResultsFile) -> tuple[object, float, str]:
    return (f.created, f.path.stat().st_mtime, str(f.path))


def _column(
    version: str, files: Sequence[ResultsFile], unreadable: Sequence[Unreadable], runs: Sequence[Run]
) -> Column:
    """A release's column from its files (oldest first) and the runs that are its cells: the newest file's
    environment; unavailable only when the newest file says so (a later run that worked makes an older
    unavailability history)."""
    if not files:
        return Column(version, unreadable=tuple(unreadable))
    newest = files[-1]
    ran = [f for f in files if not f.run.unavailable]
    env = (ran[-1] if ran and not newest.run.unavailable else newest).run.environment
    cpus = f"{env.cpu_count} CPUs" if env.cpu_count else None
    return Column(
        version=version,
        torch=env.torch,
        backend=env.backend,
        world_size=env.world_size,
        unavailable=newest.run.unavailable,
        source=newest.path,
        sources=tuple(f.path for f in reversed(files)),
        world_sizes=tuple(sorted({r.world_size for r in runs if r.world_size})),
        unreadable=tuple(unreadable),
        created=newest.created,
        machine=", ".join(filter(None, (env.cpu, cpus, env.os))) or None,
        seconds=sum(r.duration for r in runs),
    )


@dataclass(frozen=True)
class _About:
    """What a test's newest record says about it (older records fill what a newer one leaves empty)."""

    repro: str
    title: str | None
    upstream: str | None
    variant: str | None
    declared: tuple[str, ...]

    def updated(self, record: TestRecord) -> _About:
        about = record.repro
        return _About(
            repro=(about.id if about else None) or self.repro,
            title=(about.title if about else None) or self.title,
            upstream=(about.upstream if about else None) or self.upstream,
            variant=record.variant or self.variant,
            declared=_oldest_first(about.affected) if about and about.affected else self.declared,
        )


@functools.lru_cache(maxsize=1024)
def _oldest_first(affected: tuple[str, ...]) -> tuple[str, ...]:
    """The gates' reading order of a test's ranges (the same few ranges on every record of it: kept)."""
    return tuple(oldest_first(affected))


_NOBODY = _About(NOT_A_REPRO, None, None, None, ())


def _collect(
    files: Sequence[ResultsFile],
) -> tuple[dict[tuple[str, str], Run], dict[str, _About], tuple[Disagreement, ...]]:
    """Every run, the newest file that ran its test on its release giving it; what each test is; and the tests that
    files of one release disagree about."""
    runs: dict[tuple[str, str], Run] = {}
    about: dict[str, _About] = {}
    seen: dict[tuple[str, str], list[tuple[str, Path]]] = {}
    for f in sorted(files, key=_age):  # oldest first: newer records overwrite
        if f.run.unavailable:
            continue
        for record in f.run.tests:
            run = _run_of(record, f.path)
            if record.nodeid and run is not None:
                about[record.nodeid] = about.get(record.nodeid, _NOBODY).updated(record)
                runs[(record.nodeid, f.run.version)] = run
                seen.setdefault((record.nodeid, f.run.version), []).insert(0, (run.verdict.value, f.path))
    disagreements = tuple(
        Disagreement(nodeid, version, tuple(verdicts))
        for (nodeid, version), verdicts in seen.items()
        if len({verdict for verdict, _ in verdicts}) > 1
    )
    return runs, about, disagreements


def _rows(about: Mapping[str, _About]) -> tuple[Row, ...]:
    """A repro's tests as rows: the twins of one variant pair on one row, labelled by what tells the rows apart."""
    per_repro: dict[str, list[str]] = {}
    for nodeid, a in about.items():
        per_repro.setdefault(a.repro, []).append(nodeid)
    rows: list[Row] = []
    for repro, nodeids in per_repro.items():
        pairs: dict[str, dict[str, str]] = {}
        for n in nodeids:
            variant = about[n].variant
            slot = "stock" if variant in (None, STOCK) else "fixed"
            pairs.setdefault(_without_variant(n, variant), {})[slot] = n
        labels = _apart(pairs)
        for key, pair in pairs.items():
            first = about[pair.get("stock") or pair["fixed"]]
            rows.append(Row(repro, key, labels[key], pair.get("stock"), pair.get("fixed"), first.title,
                            first.upstream, first.declared))  # fmt: skip
    return tuple(sorted(rows, key=lambda r: (r.repro, r.key)))


def _judged(row: Row, version: str, run: Run, slot: str) -> Run:
    """A stock run against its row's declared range: contradicted when ``Reason.body_failed`` says otherwise (a
    verdict judged under an older declaration among them)."""
    if slot != "stock" or not row.declared:
        return run
    failed = run.reason.body_failed if run.reason is not None else None
    affected = row.declares_affected(version)
    return dataclasses.replace(run, contradicts=failed is not None and affected is not None and failed != affected)


def merge(files: Sequence[ResultsFile], unreadable: Sequence[Unreadable] = ()) -> Matrix:
    """One column per DeepSpeed release, one row per bug and config; per test and release the newest file that ran
    it gives the run, so several files of one release (a partial re-run, the shards of a CI matrix) merge. A
    release whose only files could not be read is a column of its own that says so."""
    by_version: dict[str, list[ResultsFile]] = {}
    for f in sorted(files, key=_age):
        by_version.setdefault(f.run.version, []).append(f)
    damage: dict[str, list[Unreadable]] = {}
    for u in unreadable:
        if u.kind in DAMAGE and u.release:
            damage.setdefault(u.release, []).append(u)
    runs, about, disagreements = _collect(files)
    per_version: dict[str, list[Run]] = {}
    for (_, version), run in runs.items():
        per_version.setdefault(version, []).append(run)
    columns = tuple(
        _column(v, by_version.get(v, ()), damage.get(v, ()), per_version.get(v, ()))
        for v in sorted(by_version.keys() | damage.keys(), key=version_key)
    )
    # What older runs of a release that cannot run now said is history, not a cell.
    blank = {c.version for c in columns if c.blank}
    rows = _rows(about)
    where = {n: (r, "stock" if n == r.stock else "fixed") for r in rows for n in r.nodeids}
    cells: dict[tuple[str, str], Cell] = {}
    for (nodeid, version), run in runs.items():
        if version in blank:
            continue
        row, slot = where[nodeid]
        cell = cells.get((row.key, version), Cell())
        cells[(row.key, version)] = dataclasses.replace(cell, **{slot: _judged(row, version, run, slot)})
    return Matrix(
        columns, rows, cells, tuple(unreadable),
        disagreements=tuple(d for d in disagreements if d.version not in blank),
    )  # fmt: skip


def since(matrix: Matrix, old: Matrix, paths: Sequence[Path] = ()) -> Matrix:
    """``matrix`` with each run that differs from ``old`` marked (its ``before``), and the runs ``old`` had that
    ``matrix`` has not listed (``gone``)."""
    was = {(run.nodeid, c.version): run.verdict.value for _, c, run in old.placed()}
    old_blank = {c.version for c in old.columns if c.blank}
    blank = {c.version for c in matrix.columns if c.blank}

    def changed(run: Run | None, version: str) -> Run | None:
        if run is None:
            return None
        before = UNAVAILABLE if version in old_blank else was.get((run.nodeid, version), NOT_RUN)
        return dataclasses.replace(run, before=before) if before != run.verdict.value else run

    cells = {
        (key, version): cell if version in blank else Cell(changed(cell.stock, version), changed(cell.fixed, version))
        for (key, version), cell in matrix.cells.items()
    }
    now = {(run.nodeid, c.version) for _, c, run in matrix.placed()}
    gone = tuple((old.name(n), v, verdict) for (n, v), verdict in was.items() if (n, v) not in now)
    return dataclasses.replace(matrix, cells=cells, since=tuple(paths), gone=gone)
