"""A run split into shards (``--ds-shard I/N`` over K CI jobs or SLURM tasks), and the merge that tells whether every
shard did its part.

A results file is written when its pytest run ends; a shard that dies (its job killed, its machine lost) writes none,
and a merge of the others would look complete. So each shard also writes a manifest once its tests are collected, and
``judge`` names every shard that is missing (no manifest), dead (no results of its own), or incomplete (its results
lack planned tests).

Pure: JSON through :func:`write` and :func:`read` only; the results are :mod:`core.results` records.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import json_input, paths
from .files import write_atomically
from .paths import real as real_path
from .results import ResultsFile

#: A manifest file's ending: read by the merge, never by results readers (which read ``*.json``).
SUFFIX = ".shard"
#: The manifest's own schema version. 2: ``earlier``, the results files in the shard's directory before it ran.
SCHEMA = 2
#: Schema 1 (no ``earlier``) is read as a manifest whose directory held no earlier results.
OLDEST = 1


@dataclass(frozen=True)
class Manifest:
    """One shard's plan: the I-th of N, on a DeepSpeed release, its planned node ids, the names of the results files
    already in its directory when it collected (``earlier``: an earlier run's, never its own: a shard re-run into the
    same directory and killed has none of its own); ``exitstatus`` once pytest ended (None: it has not, or it died).

    Written as ``shard-I-of-N-deepspeed-X.shard`` beside the shard's results; not ``.json``, which results readers
    take for theirs."""

    index: int
    count: int
    deepspeed: str | None
    planned: tuple[str, ...]
    exitstatus: int | None = None
    earlier: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return shard_name(self.index, self.count, self.deepspeed)

    def filename(self) -> str:
        return f"shard-{self.index}-of-{self.count}-deepspeed-{self.deepspeed or 'none'}{SUFFIX}"

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, **dataclasses.asdict(self), "planned": list(self.planned),
                "earlier": list(self.earlier)}  # fmt: skip

    @classmethod
    def from_json(cls, data: object, where: str) -> Manifest:
        if not isinstance(data, dict) or data.get("schema") not in (OLDEST, SCHEMA):
            raise ValueError(f"{where}: not a shard manifest of schema {OLDEST} to {SCHEMA}")
        index, count, status = data.get("index"), data.get("count"), data.get("exitstatus")
        deepspeed = data.get("deepspeed")
        if not (isinstance(index, int) and isinstance(count, int) and 1 <= index <= count):
            raise ValueError(f"{where}: 'index' and 'count' must be whole numbers, 1 <= index <= count")
        if status is not None and not isinstance(status, int):
            raise ValueError(f"{where}: 'exitstatus' must be a whole number or null")
        if deepspeed is not None and not isinstance(deepspeed, str):
            raise ValueError(f"{where}: 'deepspeed' must be a string or null")
        planned = _names(data.get("planned"), f"{where}: 'planned' must be a list of node ids")
        earlier = _names(data.get("earlier", []), f"{where}: 'earlier' must be a list of file names")
        return cls(index, count, deepspeed, planned, status, earlier)


def _names(value: object, problem: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(problem)
    return tuple(value)


def shard_name(index: int, count: int, deepspeed: str | None) -> str:
    """``shard 2/4 on deepspeed 0.19.8``: a shard as the merge names it."""
    return f"shard {index}/{count}" + (f" on deepspeed {deepspeed}" if deepspeed else "")


def results_in(directory: Path) -> tuple[str, ...]:
    """The names of the results files (``*.json``) in ``directory`` now: what a shard starting there finds."""
    return tuple(sorted(p.name for p in directory.glob("*.json"))) if directory.is_dir() else ()


def write(manifest: Manifest, directory: Path) -> Path:
    """Write (or rewrite, when pytest ends) a shard's manifest in ``directory``, whole or not at all."""
    path = directory / manifest.filename()
    write_atomically(path, json.dumps(manifest.to_json(), indent=1))
    return path


def read(path: Path) -> Manifest:
    """A manifest; ``ValueError`` (or ``OSError``) naming the file when it is not one."""
    try:
        data = json_input.loads(paths.read_text(path))
    except ValueError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    return Manifest.from_json(data, str(path))


@dataclass(frozen=True)
class BadManifest:
    """A ``*.shard`` file that is no manifest this pytest-dsrepro reads: its shard is unknown, the merge goes on."""

    path: Path
    problem: str

    def __str__(self) -> str:
        return f"{self.path}: {self.problem}"


def find(paths: Sequence[Path]) -> tuple[list[tuple[Path, Manifest]], list[BadManifest]]:
    """Every manifest under ``paths`` (files, or directories searched; a file reached twice is read once), with its
    file, and each one that cannot be read, named with why."""
    found: list[tuple[Path, Manifest]] = []
    bad: list[BadManifest] = []
    seen: set[Path] = set()
    for given in paths:
        candidates = sorted(given.rglob(f"*{SUFFIX}")) if given.is_dir() else [given] if given.suffix == SUFFIX else []
        for path in candidates:
            if (real := real_path(path)) in seen:  # a link loop: read as unreadable, not a RuntimeError
                continue
            seen.add(real)
            try:
                found.append((path, read(path)))
            except (OSError, UnicodeDecodeError, ValueError) as exc:
                problem = str(exc).removeprefix(f"{path}: ")
                bad.append(BadManifest(path, problem))
    return found, bad


# --- the merge's judgement -----------------------------------------------------------------------------------------


class ShardState(str, enum.Enum):
    COMPLETE = "complete"
    INCOMPLETE = "incomplete"  # results, but without some of its planned tests
    DEAD = "dead"  # a manifest but no results of its own: the shard's pytest did not end
    MISSING = "missing"  # no manifest: the shard never collected (or its artifacts are not here)


#: Which of a shard's manifests counts when it was found more than once: the one that got furthest.
_FURTHEST = (ShardState.COMPLETE, ShardState.INCOMPLETE, ShardState.DEAD)


@dataclass(frozen=True)
class Shard:
    """What the merge found of one shard: its state, and in words why."""

    index: int
    count: int
    deepspeed: str | None
    state: ShardState
    detail: str
    missing: tuple[str, ...] = ()  # planned node ids no results file of the shard has

    @property
    def name(self) -> str:
        return shard_name(self.index, self.count, self.deepspeed)


def _beside(path: Path, m: Manifest, files: Sequence[ResultsFile]) -> list[ResultsFile]:
    """The results files in the directory of the shard ``m`` (its manifest at ``path``), on its release."""
    where = path.parent.resolve()
    return [f for f in files if f.path.parent.resolve() == where and f.run.environment.deepspeed == m.deepspeed]


def _own(path: Path, m: Manifest, files: Sequence[ResultsFile]) -> list[ResultsFile]:
    """The results files of the shard ``m`` (its manifest at ``path``): beside it, written after it collected."""
    return [f for f in _beside(path, m, files) if f.path.name not in m.earlier]


def superseded(manifests: Sequence[tuple[Path, Manifest]], files: Sequence[ResultsFile]) -> dict[Path, str]:
    """The results files that an earlier run of a shard's tests left in its directory before the shard ran there
    again (its manifest's ``earlier`` holding one of its planned tests on its release), each with the shard that
    replaced it: its outcomes are not the re-run's, alive or dead."""
    replaced: dict[Path, str] = {}
    for path, m in manifests:
        planned = set(m.planned)
        for f in _beside(path, m, files):
            if f.path.name in m.earlier and planned & {t.nodeid for t in f.run.tests}:
                replaced[f.path] = m.name
    return replaced


def _state(m: Manifest, mine: Sequence[ResultsFile]) -> Shard:
    ran = {t.nodeid for f in mine for t in f.run.tests}
    missing = tuple(p for p in m.planned if p not in ran)
    planned = len(m.planned)
    if not mine:
        ended = "pytest never ended" if m.exitstatus is None else f"pytest ended ({m.exitstatus}) without results"
        again = " (results of an earlier run in its directory are not its own)" if m.earlier else ""
        detail = f"planned {planned} tests, no results file: {ended} (killed, or its machine lost?){again}"
        return Shard(m.index, m.count, m.deepspeed, ShardState.DEAD, detail, missing)
    if missing:
        status = "" if m.exitstatus is None else f", pytest exit status {m.exitstatus}"
        detail = f"ran {planned - len(missing)} of {planned} planned tests{status}"
        return Shard(m.index, m.count, m.deepspeed, ShardState.INCOMPLETE, detail, missing)
    return Shard(m.index, m.count, m.deepspeed, ShardState.COMPLETE, f"ran its {planned} planned tests")


def judge(
    manifests: Sequence[tuple[Path, Manifest]], files: Sequence[ResultsFile], count: int | None = None
) -> list[Shard]:
    """Each shard of each (release, count) the manifests name, and each index of ``count`` (or of the counts the
    manifests name) that none does: a shard's results are the results files in its manifest's directory, on its
    DeepSpeed release, that were not there when it collected. A shard whose manifest is found more than once (an
    artifact copied twice, a re-run into another directory) is one shard: the manifest that got furthest counts,
    and its detail says where the others are."""
    judged: dict[tuple[str | None, int, int], list[tuple[Shard, Path]]] = {}
    for path, m in manifests:
        judged.setdefault((m.deepspeed, m.count, m.index), []).append((_state(m, _own(path, m, files)), path))
    shards = [_furthest(found) for found in judged.values()]
    seen: dict[tuple[str | None, int], set[int]] = {}
    for deepspeed, n, index in judged:
        seen.setdefault((deepspeed, n), set()).add(index)
    if count is not None and not seen:
        seen[(None, count)] = set()
    for (deepspeed, n), indices in seen.items():
        for index in sorted(set(range(1, (count or n) + 1)) - indices):
            why = "no manifest: it never collected its tests, or its results are not among those given"
            shards.append(Shard(index, count or n, deepspeed, ShardState.MISSING, why))
    return sorted(shards, key=lambda s: (s.deepspeed or "", s.count, s.index))


def _furthest(found: Sequence[tuple[Shard, Path]]) -> Shard:
    """One shard from its manifests: the one that got furthest (the last given of those), the others named."""
    best, where = min(reversed(found), key=lambda sp: _FURTHEST.index(sp[0].state))
    if len(found) == 1:
        return best
    others = ", ".join(str(p.parent) for _, p in found if p != where)
    return dataclasses.replace(best, detail=f"{best.detail} (found {len(found)} times: counted once, from "
                                            f"{where.parent}; also in {others})")  # fmt: skip


@dataclass(frozen=True)
class Repeated:
    """Tests of one release that more than one results file holds: each counted once, from the newest file."""

    deepspeed: str | None
    tests: int
    files: tuple[Path, ...]

    def __str__(self) -> str:
        on = f" of deepspeed {self.deepspeed}" if self.deepspeed else ""
        names = ", ".join(map(str, self.files))
        return f"{self.tests} tests{on} are in more than one results file ({names}): each counted once, the newest"


def counted_once(files: Iterable[ResultsFile]) -> tuple[list[ResultsFile], list[Repeated]]:
    """``files`` with each test of a release kept only in the newest file that holds it, and what was repeated."""
    ordered = sorted(files, key=lambda f: (f.created, str(f.path)))
    holders: dict[tuple[str | None, str], list[Path]] = {}
    for f in ordered:
        for t in f.run.tests:
            paths = holders.setdefault((f.run.environment.deepspeed, t.nodeid), [])
            if f.path not in paths:
                paths.append(f.path)  # oldest first: the last holds it
    kept = []
    for f in ordered:
        tests = tuple(t for t in f.run.tests if holders[(f.run.environment.deepspeed, t.nodeid)][-1] == f.path)
        same = len(tests) == len(f.run.tests)
        kept.append(f if same else ResultsFile(f.path, dataclasses.replace(f.run, tests=tests)))
    repeated: dict[tuple[str | None, tuple[Path, ...]], int] = {}
    for (deepspeed, _), paths in holders.items():
        if len(paths) > 1:
            group = (deepspeed, tuple(sorted(paths)))
            repeated[group] = repeated.get(group, 0) + 1
    return kept, [Repeated(deepspeed, n, paths) for (deepspeed, paths), n in sorted(repeated.items(), key=str)]
