"""A run split into shards (``--ds-shard I/N`` over K CI jobs or SLURM tasks), and the merge that tells whether every
shard did its part.

A results file is written when its pytest run ends; a shard that dies (its job killed, its machine lost) writes none,
and a merge of the others would look complete. So each shard also writes a manifest, once its tests are collected
(``shard-I-of-N-deepspeed-X.shard`` beside its results; not ``.json``, which results readers take for theirs): which
shard of how many, on which DeepSpeed, the node ids it plans to run, and, when pytest ends, its exit status.
``judge`` then names every shard that is missing (no manifest), dead (no results, or no exit status), or incomplete
(results lacking planned tests).

Pure: JSON through :func:`write` and :func:`read` only; the results are :mod:`core.results` records.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .files import write_atomically
from .results import ResultsFile

#: A manifest file's ending: read by the merge, never by results readers (which read ``*.json``).
SUFFIX = ".shard"
#: The manifest's own schema version.
SCHEMA = 1


@dataclass(frozen=True)
class Manifest:
    """One shard's plan: the I-th of N, on a DeepSpeed release, its planned node ids; ``exitstatus`` once pytest
    ended (None: it has not, or it died)."""

    index: int
    count: int
    deepspeed: str | None
    planned: tuple[str, ...]
    exitstatus: int | None = None

    def filename(self) -> str:
        return f"shard-{self.index}-of-{self.count}-deepspeed-{self.deepspeed or 'none'}{SUFFIX}"

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, **dataclasses.asdict(self), "planned": list(self.planned)}

    @classmethod
    def from_json(cls, data: object, where: str) -> Manifest:
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise ValueError(f"{where}: not a shard manifest of schema {SCHEMA}")
        index, count, status = data.get("index"), data.get("count"), data.get("exitstatus")
        planned, deepspeed = data.get("planned"), data.get("deepspeed")
        if not (isinstance(index, int) and isinstance(count, int) and 1 <= index <= count):
            raise ValueError(f"{where}: 'index' and 'count' must be whole numbers, 1 <= index <= count")
        if not isinstance(planned, list) or not all(isinstance(p, str) for p in planned):
            raise ValueError(f"{where}: 'planned' must be a list of node ids")
        if status is not None and not isinstance(status, int):
            raise ValueError(f"{where}: 'exitstatus' must be a whole number or null")
        if deepspeed is not None and not isinstance(deepspeed, str):
            raise ValueError(f"{where}: 'deepspeed' must be a string or null")
        return cls(index, count, deepspeed, tuple(planned), status)


def write(manifest: Manifest, directory: Path) -> Path:
    """Write (or rewrite, when pytest ends) a shard's manifest in ``directory``, whole or not at all."""
    path = directory / manifest.filename()
    write_atomically(path, json.dumps(manifest.to_json(), indent=1))
    return path


def read(path: Path) -> Manifest:
    """A manifest; ``ValueError`` (or ``OSError``) naming the file when it is not one."""
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    return Manifest.from_json(data, str(path))


def find(paths: Sequence[Path]) -> list[tuple[Path, Manifest]]:
    """Every manifest under ``paths`` (files, or directories searched), with its file."""
    found = []
    for given in paths:
        candidates = sorted(given.rglob(f"*{SUFFIX}")) if given.is_dir() else [given] if given.suffix == SUFFIX else []
        found += [(path, read(path)) for path in candidates]
    return found


# --- the merge's judgement -----------------------------------------------------------------------------------------


class ShardState(str, enum.Enum):
    COMPLETE = "complete"
    INCOMPLETE = "incomplete"  # results, but without some of its planned tests
    DEAD = "dead"  # a manifest but no results: the shard's pytest did not end
    MISSING = "missing"  # no manifest: the shard never collected (or its artifacts are not here)


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
        return f"shard {self.index}/{self.count}" + (f" on deepspeed {self.deepspeed}" if self.deepspeed else "")


def judge(
    manifests: Sequence[tuple[Path, Manifest]], files: Sequence[ResultsFile], count: int | None = None
) -> list[Shard]:
    """Each shard of each (release, count) the manifests name, and each index of ``count`` (or of the counts the
    manifests name) that none does: a shard's results are the results files in its manifest's directory, on its
    DeepSpeed release."""
    by_dir: dict[Path, list[ResultsFile]] = {}
    for f in files:
        by_dir.setdefault(f.path.parent.resolve(), []).append(f)
    shards: list[Shard] = []
    seen: dict[tuple[str | None, int], set[int]] = {}
    for path, m in manifests:
        seen.setdefault((m.deepspeed, m.count), set()).add(m.index)
        mine = [f for f in by_dir.get(path.parent.resolve(), []) if f.run.environment.deepspeed == m.deepspeed]
        ran = {t.nodeid for f in mine for t in f.run.tests}
        missing = tuple(p for p in m.planned if p not in ran)
        planned = len(m.planned)
        if not mine:
            ended = "pytest never ended" if m.exitstatus is None else f"pytest ended ({m.exitstatus}) without results"
            state, detail = (
                ShardState.DEAD,
                f"planned {planned} tests, no results file: {ended} (killed, or its machine lost?)",
            )
        elif missing:
            status = "" if m.exitstatus is None else f", pytest exit status {m.exitstatus}"
            state, detail = ShardState.INCOMPLETE, f"ran {planned - len(missing)} of {planned} planned tests{status}"
        else:
            state, detail = ShardState.COMPLETE, f"ran its {planned} planned tests"
        shards.append(Shard(m.index, m.count, m.deepspeed, state, detail, missing))
    if count is not None and not seen:
        seen[(None, count)] = set()
    for (deepspeed, n), indices in seen.items():
        for index in sorted(set(range(1, (count or n) + 1)) - indices):
            why = "no manifest: it never collected its tests, or its results are not among those given"
            shards.append(Shard(index, count or n, deepspeed, ShardState.MISSING, why))
    return sorted(shards, key=lambda s: (s.deepspeed or "", s.count, s.index))
