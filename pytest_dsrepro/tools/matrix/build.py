"""From results files to the matrix: reading them, merging the files of each release per test, rows from test ids
(a test and its ``[fixed]`` twin on one row), each stock run judged against its row's declared range, and
``--since``. Pure functions of the files' contents."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

from ...core import results
from ...core.gates import STOCK, Verdict, oldest_first
from ...core.results import ResultsFile, TestRecord, Unreadable
from .model import (
    DAMAGE,
    NOT_A_REPRO,
    NOT_RUN,
    OBSERVED,
    UNAVAILABLE,
    Cell,
    Column,
    Disagreement,
    Matrix,
    MatrixError,
    Row,
    Run,
)


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


def version_key(version: str) -> tuple[int, Version | str]:
    try:
        return (0, Version(version))
    except ValueError:  # InvalidVersion, or a part of 4300 digits or more (int())
        return (1, version)


def _run_of(record: TestRecord, source: Path) -> Run | None:
    """A record's run, or None for a test outside the matrix's business (of this project, ungated, not failing)."""
    verdict: Verdict | None = record.verdict
    error = record.error
    if verdict is None and not (record.origin is not None and record.outcome in OBSERVED):
        if record.outcome in ("failed", "error", "xpassed"):
            verdict = Verdict.UNEXPECTED
            error = f"no verdict, pytest outcome {record.outcome}: {error or 'no error recorded'}"
        elif record.outcome == "skipped":
            verdict = Verdict.SKIPPED
        else:
            return None
    raised = "; ".join(f"{story.ranks}: {story.error}" for story in record.ranks) or None
    return Run(_test_id(record), verdict, record.reason, record.outcome, error, source, record.prerequisites,
               record.world_size, raised, record.rate, record.measurements, record.duration)  # fmt: skip


def _test_id(record: TestRecord) -> str:
    """A test's id in the matrix: its node id, after the revision it came from for another project's test (one
    test of two revisions is two tests)."""
    return f"{record.origin.short} {record.nodeid}" if record.origin else record.nodeid


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
    origin: str | None = None  # another project's test: that project at the revision it came from

    def updated(self, record: TestRecord) -> _About:
        about, origin = record.repro, record.origin
        return _About(
            # another project's tests are grouped by revision and file
            repro=(about.id if about else None) or (_test_id(record).split("::")[0] if origin else self.repro),
            title=(about.title if about else None)
            or (f"{origin.project}'s own tests at {origin.described or origin.short}" if origin else self.title),
            upstream=(about.upstream if about else None) or self.upstream,
            variant=record.variant or self.variant,
            declared=_oldest_first(about.affected) if about and about.affected else self.declared,
            origin=origin.short if origin else self.origin,
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
                about[run.nodeid] = about.get(run.nodeid, _NOBODY).updated(record)
                runs[(run.nodeid, f.run.version)] = run
                seen.setdefault((run.nodeid, f.run.version), []).insert(0, (run.word, f.path))
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
            label = _test_part(key) if first.origin else labels[key]  # another project's: the test, whole
            rows.append(Row(repro, key, label, pair.get("stock"), pair.get("fixed"), first.title, first.upstream,
                            first.declared, first.origin))  # fmt: skip
    return tuple(sorted(rows, key=lambda r: (r.origin is not None, r.repro, r.key)))  # this project's first


def _marked_against_range(row: Row, version: str, run: Run, slot: str) -> Run:
    """A stock run against its row's declared range: contradicted when ``Reason.body_failed`` says otherwise (a
    verdict judged under an older declaration among them)."""
    if slot != "stock" or not row.declared:
        return run
    failed = run.reason.body_failed if run.reason is not None else None
    affected = row.declares_affected(version)
    contradicts = failed is not None and affected is not None and failed != affected
    return dataclasses.replace(run, contradicts=True) if contradicts else run


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
        cells[(row.key, version)] = dataclasses.replace(cell, **{slot: _marked_against_range(row, version, run, slot)})
    return Matrix(
        columns, rows, cells, tuple(unreadable),
        disagreements=tuple(d for d in disagreements if d.version not in blank),
    )  # fmt: skip


def since(matrix: Matrix, old: Matrix, paths: Sequence[Path] = ()) -> Matrix:
    """``matrix`` with each run that differs from ``old`` marked (its ``before``), and the runs ``old`` had that
    ``matrix`` has not listed (``gone``)."""
    was = {(run.nodeid, c.version): run.word for _, c, run in old.placed()}
    old_blank = {c.version for c in old.columns if c.blank}
    blank = {c.version for c in matrix.columns if c.blank}

    def changed(run: Run | None, version: str) -> Run | None:
        if run is None:
            return None
        before = UNAVAILABLE if version in old_blank else was.get((run.nodeid, version), NOT_RUN)
        return dataclasses.replace(run, before=before) if before != run.word else run

    cells = {
        (key, version): cell if version in blank else Cell(changed(cell.stock, version), changed(cell.fixed, version))
        for (key, version), cell in matrix.cells.items()
    }
    now = {(run.nodeid, c.version) for _, c, run in matrix.placed()}
    gone = tuple((old.name(n), v, verdict) for (n, v), verdict in was.items() if (n, v) not in now)
    return dataclasses.replace(matrix, cells=cells, since=tuple(paths), gone=gone)
