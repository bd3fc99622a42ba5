"""The results file: the one definition of its schema, and the only code that writes or reads it.

A results file is one pytest run (``--ds-results DIR``) or one release that could not run at all (``dsrepro install
--results DIR``): a :class:`RunRecord` holding the :class:`Environment` and one :class:`TestRecord` per test report.
Recording (the pytest side), ``dsrepro install``, ``dsrepro matrix``, ``dsrepro bisect`` and the Markdown report all
go through the typed records here; nobody else reads or writes the JSON, and verdicts are the gates' own
:class:`~pytest_dsrepro.core.gates.Verdict` and :class:`~pytest_dsrepro.core.gates.Reason`, never strings of their own.

Pure: no pytest, no torch.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import json
import os
import platform
import re
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Annotated, Any

from . import json_input, paths, typed_json, versions
from .faces import Face
from .files import write_atomically
from .gates import Rate, Reason, Verdict
from .outcome import Measurement, Status, WorldOutcome, group_ranks
from .typed_json import Fields, Inconsistent, Least, OneOf, Seconds, Unit

__all__ = [
    "OUTCOMES",
    "SCHEMA",
    "Environment",
    "Origin",
    "RankStory",
    "ReproMeta",
    "ResultsFile",
    "RunRecord",
    "Source",
    "TestRecord",
    "Unreadable",
    "affected_specifiers",
    "environment",
    "now",
    "rank_stories",
    "read",
    "read_all",
    "repro_meta",
    "write",
]

#: The one schema version. 2: test records carry the gates' ``reason``; environments name ``os`` (install wrote
#: ``platform``) and always have every field. 3: test records carry their world's size, the attempts pytest made
#: (reruns) and the repro's source; environments carry pytest's and the plugin's versions, the accelerator, and
#: DeepSpeed's ``ds_report`` and torch's environment summary when a report asked for them. 4: test records carry
#: the prerequisite fixes applied to the run (``ds_prerequisite``); verdict NOT-APPLICABLE. 5: verdict
#: NOT-YET-AFFECTED (reason ``not-yet-affected``), reasons ``failed-outside-affected-range`` and ``fix-raised``; test
#: records carry ``rate`` (a nondeterministic repro's series: ``runs`` made of ``planned``, ``failed`` of them as
#: declared, ``needed`` for REPRODUCED, ``seconds`` of all runs; null for one run) and ``measurements`` (what the
#: body timed against a reference in the same run: ``what``, ``reference``, ``seconds``, ``reference_seconds``,
#: ``limit`` (the ratio from which it is the slowdown), ``repeats``, ``clock`` (``cpu``: the rank's thread's CPU
#: time, ``wall``); the ratio and margin follow from them); ``origin``, where a test that is not the catalogue's came
#: from (``ds_origin``: DeepSpeed's own tests run by ``dsrepro upstream``, with the project, the full revision of its
#: checkout, and a readable name of that revision).
#: 6: a scan (``--ds-scan``): the run names the config it scanned (``scan``: ``path``, ``config`` as written,
#: ``notes``), each scanned test its finding (``scan``: ``verdict``, one of AFFECTED, NOT AFFECTED, NOT APPLICABLE,
#: CANNOT TELL; ``detail``; ``notes``, the premise's settings put on the user's config); null outside a scan.
#: 7: a repro's metadata carries its faces (``ds_seen``: ``where``, ``raises``, ``match``, ``frames``, ``words``,
#: ``gpu``, and ``affected`` and ``gate``, which a declared face leaves null and false).
SCHEMA = 7


def _from_5(data: dict[str, Any]) -> dict[str, Any]:
    """Schema 6 only added the scan's fields: a schema-5 file is a schema-6 one that scanned nothing."""
    tests = [{**t, "scan": None} if isinstance(t, dict) else t for t in data.get("tests", [])]
    return {**data, "schema": 6, "scan": None, "tests": tests}


def _from_6(data: dict[str, Any]) -> dict[str, Any]:
    """Schema 7 only added a repro's faces: a schema-6 repro declared none."""
    tests = [
        {**t, "repro": {**t["repro"], "faces": []}} if isinstance(t, dict) and isinstance(t.get("repro"), dict) else t
        for t in data.get("tests", [])
    ]
    return {**data, "schema": 7, "tests": tests}


#: Older schemas this one reads losslessly, each by the step that makes it the next: results written before an
#: additive change still merge into one matrix with new ones, instead of having to be run again.
UPGRADES: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {5: _from_5, 6: _from_6}


def upgraded(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` brought to :data:`SCHEMA` through :data:`UPGRADES` where its schema has a step (else as it was)."""
    while isinstance(found := data.get("schema"), int) and found in UPGRADES:
        data = UPGRADES[found](data)
    return data


#: What pytest calls a test's ending, as the records spell it (``error``: setup or teardown failed).
OUTCOMES = ("passed", "failed", "skipped", "error", "xfailed", "xpassed")
#: How much of one rank group's own output a record keeps.
OUTPUT_KEPT = 4000
#: What a series' rate and a body's measurement hold beyond their types, said here: ``core.gates`` and
#: ``core.outcome`` define them free of any schema (``dsrepro export`` inlines ``Measurement`` into scripts).
_RATE = Fields(runs=Least(1), planned=Least(1), needed=Least(1), seconds=Unit("seconds"))
_MEASUREMENT = Fields(
    seconds=Unit("seconds"), reference_seconds=Unit("seconds"), repeats=Least(1), clock=OneOf(("cpu", "wall"))
)


# --- the records ---------------------------------------------------------------------------------------------------


class ScanVerdict(str, enum.Enum):
    """A scan's word for one bug with one config (``core.scan_verdicts`` derives it)."""

    AFFECTED = "AFFECTED"
    NOT_AFFECTED = "NOT AFFECTED"
    NOT_APPLICABLE = "NOT APPLICABLE"
    CANNOT_TELL = "CANNOT TELL"


@dataclass(frozen=True)
class Finding:
    """One test's verdict in a scan: the word, what the user reads, and what was done to their config for it."""

    verdict: ScanVerdict
    detail: str
    notes: tuple[str, ...] = ()  # the premise's settings put on top of the user's config, each with its reason


@dataclass(frozen=True)
class ScanSource:
    """The config a run scanned: where it was read from, as written there (comments gone), what reading it said."""

    path: str
    config: dict[str, object] = field(default_factory=dict)
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Environment:
    """Where a run happened. None: not known (e.g. an install that never got as far as a world)."""

    deepspeed: str | None
    torch: str | None
    python: str | None
    backend: str | None
    world_size: int | None
    os: str | None
    cpu: str | None
    cpu_count: int | None
    gpu: str | None  # the distinct GPU models, joined
    gpu_count: int | None
    pytest: str | None = None
    plugin: str | None = None  # pytest-dsrepro's own version
    accelerator: str | None = None  # DeepSpeed's accelerator (``cpu``, ``cuda``), as the ranks got it
    ds_report: str | None = None  # DeepSpeed's own ``ds_report`` output, when a report asked for it
    torch_env: str | None = None  # ``python -m torch.utils.collect_env``, when a report asked for it

    def to_json(self) -> dict[str, Any]:
        return typed_json.written(self)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(backend: str | None, world_size: int | None, gpus: Sequence[str] | None = None) -> Environment:
    """This machine and this interpreter's DeepSpeed and torch (read from package metadata, never imported)."""
    return Environment(
        deepspeed=versions.installed_text("deepspeed"),
        torch=versions.installed_text("torch"),
        python=platform.python_version(),
        backend=backend,
        world_size=world_size,
        os=platform.platform(),
        cpu=_cpu_model(),
        cpu_count=os.cpu_count(),
        gpu=", ".join(sorted(set(gpus))) if gpus else None,
        gpu_count=len(gpus or ()),
        pytest=versions.installed_text("pytest"),
        plugin=versions.installed_text("pytest-dsrepro"),
    )


@dataclass(frozen=True)
class ReproMeta:
    """A catalogued repro: the ``ds_repro`` marker's fields, plus the ``affected`` ranges of its ``ds_version``."""

    id: str
    title: str = ""
    upstream: str | None = None
    fix_ref: str | None = None
    fixed_in: str | None = None  # the first release without the bug; None: unfixed
    root_cause: str = ""
    affected: tuple[str, ...] = ()  # the test's ds_version specifiers, in marker order
    faces: tuple[Face, ...] = ()  # its ds_seen markers: how users meet the bug, each with where it was seen


#: ``ds_repro``'s parameters, in the order positional arguments fill them (see the marker's registered help).
REPRO_PARAMETERS = ("id", "title", "upstream", "fix_ref", "fixed_in", "root_cause")

MarkerArgs = tuple[Sequence[object], Mapping[str, object]]  # one marker's (args, kwargs)


def affected_specifiers(ds_versions: Iterable[MarkerArgs]) -> tuple[str, ...]:
    """The ``affected`` specifier of each ``ds_version`` marker (positional or keyword), distinct, in marker order.

    Taken as written: the gates validate them; a listing shows what the author wrote.
    """
    found: list[str] = []
    for args, kwargs in ds_versions:
        spec = kwargs.get("affected", args[0] if args else None)
        if spec is not None and str(spec) not in found:
            found.append(str(spec))
    return tuple(found)


def repro_meta(
    args: Sequence[object],
    kwargs: Mapping[str, object],
    path: str | PurePath,
    ds_versions: Iterable[MarkerArgs],
    seen: Sequence[Face] = (),
) -> ReproMeta:
    """A ``ds_repro`` marker (its args and kwargs) of the test in ``path``, with the test's ``ds_version`` markers
    and its faces (``ds_seen``, parsed by ``core.faces``).

    The id defaults to the module's name without ``test_``. Values are kept as text; parameters the marker does not
    declare are left out. The one reading of the marker: recording and ``dsrepro list`` both call it.
    """
    given: dict[str, object] = dict(zip(REPRO_PARAMETERS, args, strict=False))  # extra positionals: left out
    given.update((k, v) for k, v in kwargs.items() if k in REPRO_PARAMETERS)

    def text(name: str) -> str | None:
        value = given.get(name)
        return None if value is None else str(value)

    return ReproMeta(
        id=text("id") or PurePath(path).stem.removeprefix("test_"),
        title=text("title") or "",
        upstream=text("upstream"),
        fix_ref=text("fix_ref"),
        fixed_in=text("fixed_in"),
        root_cause=text("root_cause") or "",
        affected=affected_specifiers(ds_versions),
        faces=tuple(seen),
    )


@dataclass(frozen=True)
class Source:
    """A repro's source as a reader needs it (``core.source.module_slice``): the test and what it uses from its file.

    ``path`` is the file as the test's node id names it (relative to the run's root, never a local absolute path).
    ``fix`` names the ``ds_version`` fix; ``fix_code`` is the fix's own source when it lives outside ``code``.
    ``world_elsewhere``: the test runs in a world by a ``ds_world`` marker from outside its file (a conftest.py).
    """

    path: str
    code: str
    fix: str | None = None
    fix_code: str | None = None
    world_elsewhere: bool = False


@dataclass(frozen=True)
class Origin:
    """Where a test that is not the catalogue's came from: a project's checkout at a revision (``ds_origin``).

    ``revision`` is the checkout's full commit id, with ``+dirty`` when its tests had uncommitted changes;
    ``described`` names it for people (``v0.19.5-46-gedaa722``); None when unknown.
    """

    project: str
    revision: str
    described: str | None = None

    @property
    def short(self) -> str:
        """``DeepSpeed@edaa722`` (``+dirty`` kept): how a row names the revision its test came from."""
        commit, plus, rest = self.revision.partition("+")
        return f"{self.project}@{commit[:10]}{plus}{rest}"

    @classmethod
    def from_marker(cls, args: Sequence[object], kwargs: Mapping[str, object]) -> Origin:
        """A ``ds_origin(project, revision, described=None)`` marker's origin; ``ValueError`` names what is wrong."""
        names = tuple(f.name for f in dataclasses.fields(cls))
        given: dict[str, object] = dict(zip(names, args, strict=False))
        given.update(kwargs)
        unknown = sorted(set(given) - set(names))
        if unknown or len(args) > len(names):
            raise ValueError(f"unexpected argument(s) {', '.join(unknown) or repr(args)}; takes {', '.join(names)}")
        return typed_json.read(cls, {name: given.get(name) for name in names}, "ds_origin")


@dataclass(frozen=True)
class RankStory:
    """Ranks that ended the same way, told once: their label (``ranks 0-1``), error line, traceback, output tail."""

    ranks: str
    error: str
    traceback: str
    output: str


def rank_stories(outcome: WorldOutcome | None) -> tuple[RankStory, ...]:
    """A world's ranks that did not pass, one story per distinct ending (``core.outcome.group_ranks``)."""
    if outcome is None:
        return ()
    bad = [r for r in outcome.ranks if r.status is not Status.PASSED]
    stories = []
    for group in group_ranks(bad):
        first = group.ranks[0]
        trace = first.error.traceback if first.error else first.stack
        stories.append(RankStory(group.label, group.headline, trace, _tail(first.output)))
    return tuple(stories)


def _tail(output: str) -> str:
    """The last ``OUTPUT_KEPT`` characters, from the start of a line (a cut line reads as someone else's words)."""
    if len(output) <= OUTPUT_KEPT:
        return output
    kept = output[-OUTPUT_KEPT:]
    return kept.partition("\n")[2] if "\n" in kept[:-1] else kept


@dataclass(frozen=True, kw_only=True)
class TestRecord:
    """One test report (the call, or a setup/teardown that failed).

    ``verdict`` and ``reason`` come from the gates' judgement: a verdict other than SKIPPED always has its reason,
    and ``reason.verdict`` is the verdict. ``reason`` is what tools decide on (``Reason.body_failed``); ``error``
    is the line a person reads.
    """

    __test__ = False  # not a pytest test class, whatever its name
    named_by = "nodeid"  # how messages about a record read from a file name it (``typed_json.read``)

    nodeid: str
    repro: ReproMeta | None
    variant: str | None  # "stock" or "fixed" when the gates declare a fix
    verdict: Verdict | None
    reason: Reason | None
    outcome: Annotated[str, OneOf(OUTCOMES)]
    error: str | None
    duration: Seconds
    config: dict[str, Any] | None  # the DeepSpeed config the world was given
    config_notes: tuple[str, ...] = ()
    ranks: tuple[RankStory, ...] = ()
    longrepr: str | None = None
    world_size: int | None = None  # the ranks of the test's world; None: not a world test
    # how many times pytest ran it (pytest-rerunfailures); the record is the last attempt's
    attempts: Annotated[int, Least(1)] = 1
    source: Source | None = None
    prerequisites: tuple[str, ...] = ()  # the ds_prerequisite fixes applied in the ranks, each with its reason
    rate: Annotated[Rate, _RATE] | None = None  # a nondeterministic repro's series of runs (``ds_nondeterministic``)
    # what the body timed against its reference, in the same run
    measurements: tuple[Annotated[Measurement, _MEASUREMENT], ...] = ()
    origin: Origin | None = None  # where a test that is not the catalogue's came from (``ds_origin``)
    scan: Finding | None = None  # the test's verdict in a scan of a user's config (``--ds-scan``)

    @property
    def label(self) -> str:
        """The verdict as users read it (``REPRODUCED 9/20`` for a series); pytest's outcome for a test without one."""
        word = self.verdict.value if self.verdict else self.outcome.upper()
        return f"{word} {self.rate}" if self.rate is not None and self.verdict else word

    def __post_init__(self) -> None:
        problem = _verdict_problem(self.verdict, self.reason)
        if problem:
            raise Inconsistent(problem, self.nodeid)
        if self.outcome not in OUTCOMES:
            raise Inconsistent(f"outcome {self.outcome!r} is not one of {', '.join(OUTCOMES)}", self.nodeid)
        if self.attempts < 1:
            raise Inconsistent(f"attempts is {self.attempts}, not a whole number >= 1", self.nodeid)

    def to_json(self) -> dict[str, Any]:
        return typed_json.written(self)

    @classmethod
    def from_json(cls, data: object, where: str = "test") -> TestRecord:
        return typed_json.read(cls, data, where)


def _verdict_problem(verdict: Verdict | None, reason: Reason | None) -> str | None:
    if verdict in (None, Verdict.SKIPPED):
        return None if reason is None else f"reason {reason.value!r} without its verdict {reason.verdict.value}"
    if reason is None:
        return f"verdict {verdict.value} without a reason"
    if reason.verdict is not verdict:
        return f"verdict {verdict.value} does not follow from reason {reason.value!r} ({reason.verdict.value})"
    return None


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    """One results file: a pytest run's tests, or (``unavailable``) a release that could not run here.

    The records are read and written by their type hints (:mod:`core.typed_json`): :func:`RunRecord.from_json`
    validates everything and raises ``ValueError`` saying what is wrong and where; a file of another schema version is
    refused by name rather than half read.
    """

    schema: int = SCHEMA
    created: datetime.datetime | None = None  # None: not recorded (readers fall back to the file's time)
    environment: Environment
    unavailable: str | None = None  # why the release could not run at all
    tests: tuple[TestRecord, ...] = ()
    scan: ScanSource | None = None  # the user's config this run scanned (``--ds-scan``)

    def __post_init__(self) -> None:
        if self.schema != SCHEMA:
            raise ValueError(_schema_problem(self.schema))

    def to_json(self) -> dict[str, Any]:
        return typed_json.written(self)

    @classmethod
    def from_json(cls, data: object) -> RunRecord:
        """A run record from a file's JSON; ``ValueError`` says what is wrong and where."""
        if not isinstance(data, dict) or "schema" not in data:
            raise ValueError("not a pytest-dsrepro results file (no 'schema')")
        data = upgraded(data)
        if data["schema"] != SCHEMA:
            raise ValueError(_schema_problem(data["schema"]))
        return typed_json.read(cls, data, "results file", inside="")

    @property
    def version(self) -> str:
        """The DeepSpeed release the run is about, as text (``unknown`` when not recorded)."""
        return self.environment.deepspeed or "unknown"


def _schema_kind(found: object) -> str:
    """``older`` or ``newer`` for a schema number other than :data:`SCHEMA`; ``foreign`` for what is no number."""
    if isinstance(found, int) and not isinstance(found, bool):
        return "newer" if found > SCHEMA else "older"
    return "foreign"


def _schema_problem(found: object, writer: str | None = None) -> str:
    """What a file of another schema is, and what to do: an older one is written anew by running its tests again,
    a newer one is read by upgrading this pytest-dsrepro (running the tests again would not help)."""
    by = f" ({writer})" if writer else ""
    only = f"this one reads results files of schema {min(UPGRADES, default=SCHEMA)} to {SCHEMA}"
    kind = _schema_kind(found)
    if kind == "newer":
        return f"schema {found}: written by a newer pytest-dsrepro{by}; {only}: upgrade pytest-dsrepro to read it"
    if kind == "older":
        return f"schema {found}: written by an older pytest-dsrepro{by}; {only}: run those tests again to write it anew"
    return f"schema {found!r}: not a pytest-dsrepro schema; {only}"


def now() -> datetime.datetime:
    """A run's ``created`` time: UTC, to the second."""
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)


# --- files ---------------------------------------------------------------------------------------------------------


def write(run: RunRecord, directory: Path, *, amend: bool = False) -> Path:
    """Write ``run`` as a new file in ``directory`` (created if needed), whole or not at all; files never overwrite
    each other. ``amend``: ``directory`` is the results file this wrote for the run, written again (the run amended);
    a directory that has become a file meanwhile is never written over.

    ``results-deepspeed-<release>-<random>.json``, with ``-unavailable`` before the random part for a release
    that could not run.
    """
    kind = "-unavailable" if run.unavailable else ""
    path = directory if amend else (
        directory / f"results-deepspeed-{run.environment.deepspeed}{kind}-{uuid.uuid4().hex[:8]}.json"
    )  # fmt: skip
    write_atomically(path, json.dumps(run.to_json(), indent=2, default=str))
    return path


def read(path: Path) -> RunRecord:
    """One results file; ``OSError`` when it cannot be read, ``ValueError`` when it is not a valid results file."""
    return RunRecord.from_json(json_input.loads(paths.read_text(path)))  # JSONDecodeError, BadJSON: ValueErrors


@dataclass(frozen=True)
class ResultsFile:
    """A results file read from disk."""

    path: Path
    run: RunRecord

    @property
    def created(self) -> datetime.datetime:
        """When the run was recorded; the file's modification time when the record does not say."""
        if self.run.created is not None:
            return self.run.created
        return datetime.datetime.fromtimestamp(self.path.stat().st_mtime, datetime.timezone.utc)


@dataclass(frozen=True)
class Unreadable:
    """A ``*.json`` file among results files that this pytest-dsrepro cannot read: what it is and what to do.

    ``kind``: ``foreign`` (JSON, but no results file), ``truncated`` (no valid JSON: cut short), ``older`` or
    ``newer`` (a results file of another schema), ``invalid`` (this schema, but not what it allows), ``unreadable``
    (the file could not be read at all). ``release``: the DeepSpeed release it is about, when its content or its name
    (as :func:`write` names files) says, so that a reader can name the release it lacks.
    """

    path: Path
    kind: str
    problem: str
    release: str | None = None

    def __str__(self) -> str:
        return f"{self.path}: {self.problem}"


#: What :func:`write` names a file: the release, then ``-unavailable`` or not, then eight random hex digits.
_NAME = re.compile(r"results-deepspeed-(?P<release>.+?)(?:-unavailable)?-[0-9a-f]{8}\.json")


def _examine(path: Path) -> ResultsFile | Unreadable:
    named = m.group("release") if (m := _NAME.fullmatch(path.name)) else None
    try:
        text = paths.read_text(path)
    except (OSError, UnicodeDecodeError) as exc:
        return Unreadable(path, "unreadable", f"cannot be read: {exc}", named)
    try:
        data = json_input.loads(text)
    except json_input.BadJSON as exc:
        return Unreadable(path, "invalid", f"not a results file this pytest-dsrepro reads: {exc}", named)
    except ValueError as exc:
        cut = "empty" if not text.strip() else f"not valid JSON ({exc})"
        why = (
            f"{cut}: cut short by an interrupted run, a full disk or a partial copy? Run its tests again, or delete it"
        )
        return Unreadable(path, "truncated", why, named)
    env = data.get("environment") if isinstance(data, dict) else None
    release = env.get("deepspeed") if isinstance(env, dict) and isinstance(env.get("deepspeed"), str) else named
    if not isinstance(data, dict) or "schema" not in data:
        return Unreadable(path, "foreign", "not a pytest-dsrepro results file (no 'schema')", release)
    data = upgraded(data)
    found = data["schema"]
    if found != SCHEMA:
        writer = env.get("plugin") if isinstance(env, dict) and isinstance(env.get("plugin"), str) else None
        return Unreadable(path, _schema_kind(found), _schema_problem(found, writer), release)
    try:
        return ResultsFile(path, RunRecord.from_json(data))
    except ValueError as exc:
        why = f"not a valid schema-{SCHEMA} results file: {exc}; edited or damaged: run its tests again, or delete it"
        return Unreadable(path, "invalid", why, release)


def read_all(given_paths: Sequence[Path]) -> tuple[list[ResultsFile], list[Unreadable]]:
    """Every results file under ``given_paths`` (files, or directories searched for ``*.json``; a file reached twice is
    read once), and each JSON file among them that is not a results file this pytest-dsrepro can read.

    ``FileNotFoundError`` when a given path does not exist.
    """
    files: list[ResultsFile] = []
    unreadable: list[Unreadable] = []
    seen: set[Path] = set()
    for given in given_paths:
        if given.is_dir():
            candidates = sorted(given.rglob("*.json"))
        elif (why := paths.not_a_file(given)) is not None:
            raise FileNotFoundError(
                f"no such file or directory: {given}" if why == "no such file" else f"{given}: {why}"
            )
        else:
            candidates = [given]
        for path in candidates:
            if (real := paths.real(path)) in seen:  # a link loop among them: read as unreadable, not a RuntimeError
                continue
            seen.add(real)
            found = _examine(path)
            if isinstance(found, ResultsFile):
                files.append(found)
            else:
                unreadable.append(found)
    return files, unreadable
