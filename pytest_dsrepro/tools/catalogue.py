"""The catalogue: every repro's ``ds_repro`` metadata and affected range, read by collecting tests with pytest.

The markers are the one source of truth, so the catalogue is never written down anywhere else: ``collect`` runs
pytest's own collection in-process (``collect_only``, which ``dsrepro export`` and ``triage`` read items through too)
with a small plugin that reads each item's markers through ``item.get_closest_marker`` / ``item.iter_markers``,
turned into ``core.results.ReproMeta`` by the same function the results files use. Repro files import torch and
DeepSpeed only inside test bodies, so collecting them is fast and needs neither. ``dsrepro list`` renders it, grouped
by the folders of the catalogue (one per DeepSpeed subsystem, ``core.areas``), as docs/repros.md holds it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import textwrap
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core import areas, configs, faces, premises
from ..core.errors import MarkerError
from ..core.escape import md_code, md_link, md_text, terminal
from ..core.faces import Face
from ..core.gates import oldest_first
from ..core.results import ReproMeta, repro_meta
from ..core.text import aligned, markdown_table

if TYPE_CHECKING:
    import pytest

#: The columns ``dsrepro list`` prints, with their headers.
COLUMNS = (("id", "ID"), ("title", "TITLE"), ("upstream", "UPSTREAM"), ("affected", "AFFECTED"), ("fixed", "FIXED IN"),
           ("premise", "PREMISE"))  # fmt: skip
FORMATS = ("table", "markdown", "json")


@dataclass(frozen=True)
class Entry:
    """One catalogued repro (one module with a ``ds_repro`` marker), merged over its tests."""

    id: str
    title: str
    upstream: str | None
    fix_ref: str | None
    fixed_in: str | None
    root_cause: str
    affected: tuple[str, ...]  # every distinct ds_version ``affected`` specifier of its tests, oldest range first
    path: str
    tests: tuple[str, ...] = field(default=())
    premise: str | None = None  # its ``ds_premise``, in words (None: it declares none)
    scan_sets: str = ""  # what a scan sets on a user's config for it, ``key=value, ...``
    faces: tuple[Face, ...] = ()  # its ``ds_seen`` markers: how users meet the bug, each with where it was seen
    folder: str = ""  # its folder under the directory collected (``zero3``; ``""`` at its top), ``core.areas``

    @property
    def affected_text(self) -> str:
        """The union of the ranges, as a reader writes it: ``<0.18.3 | >=0.18.3,<0.19.5``."""
        return " | ".join(self.affected) or "-"

    @property
    def fixed_text(self) -> str:
        return self.fixed_in or "unfixed"

    @property
    def fix_pr(self) -> int | None:
        """The pull request that fixes the bug, as its markers name it (``fix_ref``, else ``upstream``): what the fix
        ledger's repro row for it is, and what triage knows no second time."""
        found = re.search(r"/pull/(\d+)\b", self.fix_ref or "") or re.search(r"/pull/(\d+)\b", self.upstream or "")
        return int(found[1]) if found else None

    @property
    def premise_text(self) -> str:
        """The premise as ``dsrepro list`` says it: what a config needs, and what a scan sets for this repro."""
        if self.premise is None:
            return "not declared (a scan cannot tell whether a config can meet it)"
        return self.premise + (f"; a scan sets {self.scan_sets}" if self.scan_sets else "")


class CollectionFailed(Exception):
    """pytest could not collect the given paths; the message carries pytest's own output."""


@dataclass(frozen=True)
class CollectedTest:
    """One collected test of a catalogued repro."""

    nodeid: str
    path: str
    repro: ReproMeta
    premise: premises.Premise | None = None


@dataclass(eq=False)  # pluggy keeps plugins in sets: identity hashing
class CollectionReader:
    """A pytest plugin object for ``collect_only``: what could not be collected, in pytest's words (and what a
    subclass, reading the items, finds wrong)."""

    errors: list[str] = field(default_factory=list)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.errors.append(f"{report.nodeid or '<session>'}: {report.longreprtext.strip()}")


def collect_only(
    paths: Sequence[str], extra_args: Sequence[str], reader: CollectionReader, plugins: Sequence[object] = ()
) -> None:
    """Collect ``paths`` with pytest in this process, ``reader`` (and ``plugins``) reading the items. pytest's own
    output is captured, and shown only when collection fails, or ``reader`` found errors (``CollectionFailed``)."""
    import pytest  # here, not above: ``dsrepro list --help`` (triage's, export's) never pays pytest's 0.25 s import

    out = io.StringIO()
    args = ["--collect-only", "-q", "-p", "no:cacheprovider", *extra_args, *paths]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = pytest.main(args, plugins=[reader, *plugins])
    if reader.errors or code not in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        detail = "\n".join(reader.errors) or out.getvalue().strip()
        raise CollectionFailed(f"pytest could not collect {' '.join(paths)} (exit code {int(code)}):\n{detail}")


@dataclass(eq=False)
class _Collector(CollectionReader):
    """Gathers each collected item's catalogue markers."""

    tests: list[CollectedTest] = field(default_factory=list)

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            mark = item.get_closest_marker("ds_repro")
            if mark is None:
                continue
            ds_versions = [(m.args, m.kwargs) for m in item.iter_markers("ds_version")]
            try:
                seen = faces.parse_all([(m.args, m.kwargs) for m in item.iter_markers("ds_seen")],
                                       f"@pytest.mark.ds_seen on {item.nodeid}")  # fmt: skip
                premise, problem = _premise(item)
            except (MarkerError, configs.ConfigError) as exc:
                self.errors.append(f"{item.nodeid}: {exc}")
                continue
            if problem is not None:  # a repro that cannot show its bug with its own config: a defect, said here
                self.errors.append(f"{item.nodeid}: @pytest.mark.ds_premise: {problem}")
            meta = repro_meta(mark.args, mark.kwargs, item.path, ds_versions, seen)
            self.tests.append(CollectedTest(item.nodeid, str(item.path), meta, premise))


def _premise(item: pytest.Item) -> tuple[premises.Premise | None, str | None]:
    """The test's ``ds_premise`` and what is wrong with its own config for it (as ``markers.check_config`` says at
    setup; the tools read markers without the plugin's session layer)."""
    mark = item.get_closest_marker("ds_premise")
    if mark is None:
        return None, None
    premise = premises.parse(mark.args, mark.kwargs, f"@pytest.mark.ds_premise on {item.nodeid}")
    callspec = getattr(item, "callspec", None)
    param = callspec.params.get("ds_config") if callspec is not None else None
    if not isinstance(param, tuple) or len(param) != 2:
        return premise, None
    name, spec = param
    resolved = configs.resolve(spec, name, 1, "gloo")
    return premise, premises.own_config_problem(premise, name, resolved.written, resolved.config)


def entries_from_tests(
    tests: Iterable[CollectedTest], root: Path | None = None, top: Path | None = None
) -> list[Entry]:
    """Merge collected tests into one entry per repro id (pure; the order is the collection order), their paths
    relative to ``root`` and their folders to the catalogue's ``top`` directory.

    A repro's metadata is its first test's; the affected ranges are the union over its tests.
    """
    merged: dict[str, dict[str, Any]] = {}
    for test in tests:
        meta = test.repro
        path = Path(test.path)
        if root is not None:
            with contextlib.suppress(ValueError):
                path = path.relative_to(root)
        premise = test.premise.describe() if test.premise else None
        sets = test.premise.describe_sets() if test.premise else ""
        first = {**asdict(meta), "affected": [], "path": str(path), "tests": [], "premise": premise, "scan_sets": sets,
                 "faces": meta.faces, "folder": areas.folder(test.path, top) if top is not None else ""}  # fmt: skip
        entry = merged.setdefault(meta.id, first)
        entry["tests"].append(test.nodeid)
        for spec in meta.affected:
            if spec not in entry["affected"]:
                entry["affected"].append(spec)
    return [
        Entry(**{**e, "affected": tuple(oldest_first(e["affected"])), "tests": tuple(e["tests"])})
        for e in merged.values()
    ]


def collect(paths: Sequence[str], extra_args: Sequence[str] = (), plugins: Sequence[object] = ()) -> list[Entry]:
    """Collect ``paths`` with pytest in this process and return the catalogue; ``plugins`` read more of the same
    collection (``dsrepro triage`` its gates)."""
    collector = _Collector()
    collect_only(paths, extra_args, collector, plugins)
    return entries_from_tests(collector.tests, Path.cwd(), _top(paths))


def _top(paths: Sequence[str]) -> Path | None:
    """The catalogue's top directory for ``paths``: the deepest directory that holds them all (``repros`` for
    ``repros``, and for ``repros/zero3 repros/checkpoint``)."""
    given = [Path(p.partition("::")[0]).absolute() for p in paths]
    folders = [str(p if p.is_dir() else p.parent) for p in given]
    return Path(os.path.commonpath(folders)) if folders else None


@dataclass(frozen=True)
class Group:
    """The repros of one folder: its heading (``ZeRO stage 3``) and where it is (``repros/zero3/``)."""

    heading: str
    where: str
    entries: list[Entry]


def groups(entries: Sequence[Entry]) -> list[Group]:
    """The entries by folder, in ``core.areas`` order, within a folder in collection order. All in one folder: one
    group, with no heading."""
    by_folder: dict[str, list[Entry]] = {}
    for e in entries:
        by_folder.setdefault(e.folder, []).append(e)
    if len(by_folder) < 2:
        return [Group("", "", list(entries))]
    ordered = sorted(by_folder.items(), key=lambda group: areas.order(group[0]))
    return [Group(areas.heading(name) or "At the top", f"{Path(members[0].path).parent.as_posix()}/", members)
            for name, members in ordered]  # fmt: skip


#: ``dsrepro list`` fits a terminal this wide (or a narrower one). A title narrower than ``MIN_TITLE`` would be
#: unreadable: then it goes below its row, like the upstream link.
WIDTH = 120
MIN_TITLE = 24


def format_table(entries: Sequence[Entry], width: int = WIDTH) -> str:
    """Aligned columns within ``width``: ID, AFFECTED (one range a line: they are alternatives), FIXED IN, and the
    TITLE wrapped in what is left; each repro's upstream link on a line of its own below, indented (a URL is never
    broken, so only a URL longer than the whole width can pass it). Each folder's repros under its heading."""
    heads = dict(COLUMNS)
    ids = max([len(heads["id"]), *(len(e.id) for e in entries)])
    affected = max([len(heads["affected"]), *(len(a) for e in entries for a in e.affected or ("-",))])
    fixed = max([len(heads["fixed"]), *(len(e.fixed_text) for e in entries)])
    room = width - ids - affected - fixed - 6
    inline = room >= MIN_TITLE
    rows: list[tuple[str, ...]] = [(heads["id"], heads["affected"], heads["fixed"], heads["title"] if inline else "")]
    for e, group in _with_groups(entries):
        if group is not None and group.heading:  # rows of one cell: lines of their own, not a column
            rows += [("",), (f"== {group.heading} ({group.where}) ==",)]
        ranges = list(e.affected) or ["-"]
        titles = textwrap.wrap(e.title, room if inline else width - 2, break_on_hyphens=False) or ["-"]
        for i in range(max(len(ranges), len(titles)) if inline else len(ranges)):
            rows.append((e.id if i == 0 else "", ranges[i] if i < len(ranges) else "", e.fixed_text if i == 0 else "",
                         titles[i] if inline and i < len(titles) else ""))  # fmt: skip
        below = [*([] if inline else titles), e.upstream or "upstream: -"]
        below += textwrap.wrap(f"premise: {e.premise_text}", width - 2, subsequent_indent="  ")
        for face in e.faces:  # the link on a line of its own: never broken
            below += [*textwrap.wrap(f"seen: {face.describe()}", width - 2, subsequent_indent="  "), f"at {face.where}"]
        rows += [(f"  {line}",) for line in below]  # a row of one cell: a line of its own, not a column
    return terminal("\n".join(aligned(rows)) + "\n")  # the markers' texts: escapes shown, never run


def _with_groups(entries: Sequence[Entry]) -> Iterator[tuple[Entry, Group | None]]:
    """Each entry in its group's order, with its group where it is the group's first."""
    for group in groups(entries):
        for i, e in enumerate(group.entries):
            yield e, group if i == 0 else None


def format_markdown(entries: Sequence[Entry]) -> str:
    """A table per folder, under its heading (of level 2, as docs/repros.md holds them)."""
    return "\n".join(
        (f"## {g.heading} (`{g.where}`)\n\n" if g.heading else "") + _markdown_table(g.entries) for g in groups(entries)
    )


def _markdown_table(entries: Sequence[Entry]) -> str:
    rows = []
    for e in entries:  # the markers' texts in code or escaped (core.escape): no HTML, mention, image or link gets out
        upstream = md_link(e.upstream, e.upstream) if e.upstream else "-"
        affected = " | ".join(md_code(a) for a in e.affected)  # alternatives: the cell escapes the pipes
        seen = "; ".join(f"{md_text(face.describe())} ({md_link(face.where, 'seen')})" for face in e.faces) or "-"
        rows.append((md_code(e.id), md_text(e.title), upstream, affected, md_text(e.fixed_text),
                     md_text(e.premise_text), seen))  # fmt: skip
    return "\n".join(markdown_table([*(head for _, head in COLUMNS), "SEEN AS"], rows)) + "\n"


def format_json(entries: Sequence[Entry]) -> str:
    return json.dumps([asdict(e) for e in entries], indent=2) + "\n"


def render(entries: Sequence[Entry], fmt: str = "table", width: int = WIDTH) -> str:
    if fmt == "markdown":
        return format_markdown(entries)
    if fmt == "json":
        return format_json(entries)
    if fmt == "table":
        return format_table(entries, width)
    raise ValueError(f"unknown format {fmt!r}; formats: {', '.join(FORMATS)}")
