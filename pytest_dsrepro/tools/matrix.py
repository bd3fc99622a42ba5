"""``dsrepro matrix``: the results files of many runs (one per DeepSpeed release) as one table.

Rows are repros (one row per test id where a repro has several: variant, config, other parameters), columns are
DeepSpeed releases in version order (``packaging.version``), cells are verdicts: REPRODUCED, FIXED,
PASSES-WITH-FIX, UNEXPECTED, SKIPPED. A release that could not run at all (``"unavailable"`` in its results file,
written by ``dsrepro install``) is a column of its own that says why; it is never dropped. When several files
cover one release, the newest (``created``, then file time) wins, and the report says which files it set aside.

Everything here is a pure function of the files' contents (:func:`load`, :func:`merge`, the ``render_*``
functions), so the whole of it is tested without torch; :func:`run` is the command. The files are read, and
checked, by ``core.results``; the verdicts are the gates' own ``Verdict``.
"""

from __future__ import annotations

import argparse
import html
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from packaging.version import InvalidVersion, Version

from ..core import results
from ..core.gates import Verdict
from ..core.results import ResultsFile, TestRecord

__all__ = [
    "Cell",
    "Column",
    "Matrix",
    "MatrixError",
    "Row",
    "add_arguments",
    "exit_code",
    "load",
    "merge",
    "render_html",
    "render_markdown",
    "render_terminal",
    "run",
]

NOT_RUN = "not run"
UNAVAILABLE = "n/a"


class MatrixError(Exception):
    """A usage problem: nothing to read, or nothing readable. ``dsrepro matrix`` exits 2 with this one line."""


@dataclass(frozen=True)
class Column:
    version: str
    torch: str | None
    backend: str | None
    world_size: int | None
    unavailable: str | None
    source: Path
    superseded: tuple[Path, ...] = ()

    @property
    def environment_line(self) -> str:
        parts = [f"torch {self.torch or '?'}"]
        if self.backend:
            parts.append(self.backend)
        if self.world_size:
            parts.append(f"{self.world_size} ranks")
        return ", ".join(parts)

    @property
    def unavailable_line(self) -> str | None:
        if self.unavailable is None:
            return None
        return f"cannot run with torch {self.torch or '?'}: {self.unavailable}"


@dataclass(frozen=True)
class Row:
    repro: str
    nodeid: str
    label: str  # the repro id, plus what tells this row from the repro's other rows
    title: str | None = None
    upstream: str | None = None


@dataclass(frozen=True)
class Cell:
    verdict: Verdict
    outcome: str | None = None
    error: str | None = None

    @property
    def note(self) -> str | None:
        """The line worth a footnote or a tooltip: the failure seen, or why there was no verdict."""
        return self.error or None


@dataclass(frozen=True)
class Matrix:
    columns: tuple[Column, ...]
    rows: tuple[Row, ...]
    cells: Mapping[tuple[str, str], Cell]  # (row nodeid, column version) -> cell
    sources: tuple[Path, ...] = ()
    warnings: tuple[str, ...] = field(default=())

    def cell(self, row: Row, column: Column) -> Cell | None:
        return self.cells.get((row.nodeid, column.version))

    def count(self, verdict: Verdict) -> int:
        return sum(1 for c in self.cells.values() if c.verdict == verdict)

    def unexpected(self) -> list[tuple[Row, Column, Cell]]:
        return [
            (r, c, cell)
            for c in self.columns
            for r in self.rows
            if (cell := self.cell(r, c)) is not None and cell.verdict is Verdict.UNEXPECTED
        ]


# ----------------------------------------------------------------------------------------------------- loading


def load(paths: Sequence[Path]) -> tuple[list[ResultsFile], list[str]]:
    """Every results file under ``paths`` (files, or directories searched for ``*.json``), and warnings for the
    JSON files that are not results files. Raises :class:`MatrixError` when nothing usable is found."""
    try:
        files, warnings = results.read_all(paths)
    except FileNotFoundError as exc:
        raise MatrixError(str(exc)) from None
    if not files:
        where = ", ".join(str(p) for p in paths)
        detail = f" ({len(warnings)} unreadable JSON files)" if warnings else ""
        raise MatrixError(f"no pytest-dsrepro results files in {where}{detail}; write them with --ds-results DIR")
    return files, warnings


# ----------------------------------------------------------------------------------------------------- merging


def version_key(version: str) -> tuple[int, Version | str]:
    try:
        return (0, Version(version))
    except InvalidVersion:
        return (1, version)


def _cell_of(record: TestRecord) -> Cell | None:
    """A record's cell, or None for a test outside the catalogue's business (ungated and not failing)."""
    if record.verdict is not None:
        return Cell(record.verdict, record.outcome, record.error)
    if record.outcome in ("failed", "error", "xpassed"):
        why = f"no verdict, pytest outcome {record.outcome}: {record.error or 'no error recorded'}"
        return Cell(Verdict.UNEXPECTED, record.outcome, why)
    if record.outcome == "skipped":
        return Cell(Verdict.SKIPPED, record.outcome, record.error)
    return None


def _test_part(nodeid: str) -> str:
    return nodeid.split("::", 1)[1] if "::" in nodeid else nodeid


def _labels(repro: str, nodeids: Iterable[str]) -> dict[str, str]:
    """Row labels for one repro's test ids: the repro id alone when it has one row, else what tells them apart."""
    ids = sorted(set(nodeids))
    if len(ids) == 1:
        return {ids[0]: repro}
    files = {n.split("::", 1)[0] for n in ids}
    if len(files) > 1:
        return {n: f"{repro} {n}" for n in ids}
    functions = {_test_part(n).split("[", 1)[0] for n in ids}
    if len(functions) == 1:
        return {n: f"{repro} [{_test_part(n).partition('[')[2].rstrip(']')}]" for n in ids}
    return {n: f"{repro} {_test_part(n)}" for n in ids}


def _row_order(row: Row, variant: str | None) -> tuple[str, str, int]:
    params = _test_part(row.nodeid).partition("[")[2].rstrip("]")
    rest = "-".join(p for p in params.split("-") if p != variant) if variant else params
    base = _test_part(row.nodeid).split("[", 1)[0]
    return (row.repro, f"{base}[{rest}]", 0 if variant in (None, "stock") else 1)


def merge(files: Sequence[ResultsFile], warnings: Sequence[str] = ()) -> Matrix:
    """One column per DeepSpeed version (the newest file wins), one row per test of a repro."""
    by_version: dict[str, list[ResultsFile]] = {}
    for f in files:
        by_version.setdefault(f.run.version, []).append(f)
    columns: list[Column] = []
    winners: list[ResultsFile] = []
    for version in sorted(by_version, key=version_key):
        candidates = sorted(by_version[version], key=lambda f: (f.created, f.path.stat().st_mtime, str(f.path)))
        win = candidates[-1]
        winners.append(win)
        env = win.run.environment
        columns.append(
            Column(
                version=version,
                torch=env.torch,
                backend=env.backend,
                world_size=env.world_size,
                unavailable=win.run.unavailable,
                source=win.path,
                superseded=tuple(f.path for f in candidates[:-1]),
            )
        )
    cells: dict[tuple[str, str], Cell] = {}
    meta: dict[str, tuple[str, str | None, str | None, str | None]] = {}  # nodeid -> repro, title, upstream, variant
    for win in winners:
        for record in win.run.tests:
            nodeid = record.nodeid
            cell = _cell_of(record)
            if not nodeid or cell is None:
                continue
            about = record.repro
            old = meta.get(nodeid)
            meta[nodeid] = (
                (about.id if about else None) or (old[0] if old else "(not a repro)"),
                (about.title if about else None) or (old[1] if old else None),
                (about.upstream if about else None) or (old[2] if old else None),
                record.variant or (old[3] if old else None),
            )
            cells[(nodeid, win.run.version)] = cell
    per_repro: dict[str, list[str]] = {}
    for nodeid, (repro, *_rest) in meta.items():
        per_repro.setdefault(repro, []).append(nodeid)
    rows: list[tuple[tuple[str, str, int], Row]] = []
    for repro, nodeids in per_repro.items():
        for nodeid, label in _labels(repro, nodeids).items():
            _, title, upstream, variant = meta[nodeid]
            row = Row(repro, nodeid, label, title, upstream)
            rows.append((_row_order(row, variant), row))
    return Matrix(
        columns=tuple(columns),
        rows=tuple(r for _, r in sorted(rows, key=lambda kr: (kr[0], kr[1].nodeid))),
        cells=cells,
        sources=tuple(f.path for f in files),
        warnings=tuple(warnings),
    )


def exit_code(matrix: Matrix, *, fail_on_unavailable: bool = False) -> int:
    """1 when any cell is UNEXPECTED (or, if asked, any release could not run), else 0."""
    if matrix.unexpected():
        return 1
    if fail_on_unavailable and any(c.unavailable for c in matrix.columns):
        return 1
    return 0


# --------------------------------------------------------------------------------------------------- rendering


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _summary(matrix: Matrix) -> str:
    counts = [f"{matrix.count(v)} {v.value}" for v in Verdict if matrix.count(v)]
    unavailable = sum(1 for c in matrix.columns if c.unavailable)
    if unavailable:
        counts.append(f"{unavailable} release{'s' * (unavailable != 1)} unavailable")
    return ", ".join(counts) or "no verdicts"


_ANSI = {  # by the text shown in a cell
    Verdict.REPRODUCED.value: "\033[33m",
    Verdict.FIXED.value: "\033[32m",
    Verdict.PASSES_WITH_FIX.value: "\033[36m",
    Verdict.UNEXPECTED.value: "\033[1;31m",
    Verdict.SKIPPED.value: "\033[2m",
    UNAVAILABLE: "\033[2m",
    NOT_RUN: "\033[2m",
}


def _terminal_text(matrix: Matrix, row: Row, column: Column) -> str:
    if column.unavailable:
        return UNAVAILABLE
    cell = matrix.cell(row, column)
    return cell.verdict.value if cell else NOT_RUN


def _column_heads(matrix: Matrix) -> tuple[str | None, list[list[str]]]:
    """The environment all columns share (None when they differ), and each column's heading lines."""
    # The same torch/backend/world size everywhere (the usual case): said once above the table, columns stay narrow.
    envs = {c.environment_line for c in matrix.columns if not c.unavailable}
    common: str | None = None
    if matrix.columns and len(envs) <= 1 and len({c.torch for c in matrix.columns}) == 1:
        common = envs.pop() if envs else f"torch {matrix.columns[0].torch or '?'}"
    head: list[list[str]] = []
    for c in matrix.columns:
        setup = f"{c.backend or '?'}, {c.world_size or '?'} ranks"
        lines = [c.version] if common else [c.version, f"torch {c.torch or '?'}", setup]
        if c.unavailable:
            lines[1 if common else 2 :] = ["UNAVAILABLE"]
        head.append(lines)
    return common, head


def _terminal_notes(matrix: Matrix) -> list[str]:
    """Below the table: the unexpected cells with their errors, the unavailable releases, the files set aside."""
    lines: list[str] = []
    unexpected = matrix.unexpected()
    if unexpected:
        lines += ["", "UNEXPECTED:"]
        lines += [
            f"  {c.version}  {r.nodeid}: {_one_line(cell.error or cell.outcome or '?')}" for r, c, cell in unexpected
        ]
    unavailable = [c for c in matrix.columns if c.unavailable_line]
    if unavailable:
        lines += ["", "Unavailable releases:"]
        lines += [f"  {c.version}: {c.unavailable_line}" for c in unavailable]
    superseded = sum(len(c.superseded) for c in matrix.columns)
    if superseded:
        lines += ["", f"{superseded} older results file(s) set aside: the newest file per release wins."]
    return lines


def render_terminal(matrix: Matrix, *, color: bool = False) -> str:
    """A fixed-width table; below it the unexpected cells with their errors and the unavailable releases."""
    common, head = _column_heads(matrix)
    depth = max((len(h) for h in head), default=1)
    texts = {(r.nodeid, c.version): _terminal_text(matrix, r, c) for r in matrix.rows for c in matrix.columns}
    label_w = max([len("repro"), *(len(r.label) for r in matrix.rows)])
    widths = [
        max([*(len(x) for x in h), *(len(texts[(r.nodeid, c.version)]) for r in matrix.rows)])
        for h, c in zip(head, matrix.columns, strict=True)
    ]

    def paint(text: str, width: int) -> str:
        padded = f"{text:<{width}}"
        return f"{_ANSI[text]}{padded}\033[0m" if color and text in _ANSI else padded

    lines = [f"DeepSpeed repro matrix: {len(matrix.rows)} rows x {len(matrix.columns)} releases ({_summary(matrix)})"]
    if common:
        lines.append(f"all releases: {common}")
    lines.append("")
    for i in range(depth):
        cells = [f"{(h[i] if i < len(h) else ''):<{w}}" for h, w in zip(head, widths, strict=True)]
        lines.append("  ".join([f"{'repro' if i == 0 else '':<{label_w}}", *cells]).rstrip())
    lines.append("  ".join(["-" * label_w, *("-" * w for w in widths)]))
    for r in matrix.rows:
        cells = [paint(texts[(r.nodeid, c.version)], w) for c, w in zip(matrix.columns, widths, strict=True)]
        lines.append("  ".join([f"{r.label:<{label_w}}", *cells]).rstrip())
    lines += _terminal_notes(matrix)
    return "\n".join(lines) + "\n"


def _md(text: str) -> str:
    return _one_line(text).replace("|", "\\|")


class _Notes:
    """Footnote numbers, one per distinct text."""

    def __init__(self) -> None:
        self.texts: dict[str, int] = {}

    def ref(self, text: str) -> str:
        number = self.texts.setdefault(_one_line(text), len(self.texts) + 1)
        return f"[^{number}]"


def render_markdown(matrix: Matrix) -> str:
    """A GitHub-flavoured Markdown table; error lines and unavailability reasons as footnotes."""
    notes = _Notes()
    out = [
        "# DeepSpeed repro matrix",
        "",
        f"{len(matrix.rows)} rows x {len(matrix.columns)} DeepSpeed releases: {_summary(matrix)}.",
        "",
    ]
    header = ["repro", *(c.version for c in matrix.columns)]
    out.append("| " + " | ".join(header) + " |")
    out.append("|" + "---|" * len(header))
    env_cells = [
        f"_{_md(c.environment_line)}_"
        + (f" **unavailable**{notes.ref(c.unavailable_line)}" if c.unavailable_line else "")
        for c in matrix.columns
    ]
    out.append("| _environment_ | " + " | ".join(env_cells) + " |")
    for r in matrix.rows:
        label = f"[{_md(r.label)}]({r.upstream})" if r.upstream else _md(r.label)
        cells = []
        for c in matrix.columns:
            cell = matrix.cell(r, c)
            if c.unavailable:
                cells.append(UNAVAILABLE)
            elif cell is None:
                cells.append(f"_{NOT_RUN}_")
            else:
                text = f"**{cell.verdict.value}**" if cell.verdict is Verdict.UNEXPECTED else cell.verdict.value
                cells.append(text + (f" {notes.ref(cell.note)}" if cell.note else ""))
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    titled = [r for r in matrix.rows if r.title]
    seen: set[str] = set()
    if titled:
        out += ["", "## Repros", ""]
        for r in titled:
            if r.repro not in seen:
                seen.add(r.repro)
                out.append(f"- **{_md(r.repro)}**: {_md(r.title or '')}" + (f" ({r.upstream})" if r.upstream else ""))
    if notes.texts:
        out.append("")
        out += [f"[^{n}]: {text}" for text, n in notes.texts.items()]
    out += ["", "Sources: " + ", ".join(f"`{c.source.name}`" for c in matrix.columns), ""]
    return "\n".join(out)


_CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: center; vertical-align: middle; }
th.row, td.row { text-align: left; }
th small { display: block; font-weight: normal; color: #555; }
td.REPRODUCED { background: #fde2a7; }
td.FIXED { background: #bfe8c0; }
td.PASSES-WITH-FIX { background: #b9e3ee; }
td.UNEXPECTED { background: #f4a3a3; font-weight: bold; }
td.SKIPPED, td.not-run { background: #eee; color: #777; }
td.unavailable { background: repeating-linear-gradient(45deg, #eee, #eee 6px, #ddd 6px, #ddd 12px);
  color: #555; font-size: 12px; max-width: 14em; }
td[title] { cursor: help; text-decoration: underline dotted; }
"""

_LEGEND = {
    Verdict.REPRODUCED: "the bug shows on this release as declared",
    Verdict.FIXED: "stock code passes: the release is not affected",
    Verdict.PASSES_WITH_FIX: "the repro's fix makes it pass",
    Verdict.UNEXPECTED: "anything else: look at it",
    Verdict.SKIPPED: "skipped (reason on hover)",
}


def render_html(matrix: Matrix) -> str:
    """A self-contained page (inline CSS, no scripts); errors on hover (``title``) and listed below the table."""
    e = html.escape
    head = "".join(
        f"<th>{e(c.version)}<small>{e(c.environment_line)}</small></th>" for c in matrix.columns
    )  # fmt: skip
    body = []
    for i, r in enumerate(matrix.rows):
        label = f'<a href="{e(r.upstream)}">{e(r.label)}</a>' if r.upstream else e(r.label)
        title = f' title="{e(r.title)}"' if r.title else ""
        tds = [f'<td class="row"{title}>{label}</td>']
        for c in matrix.columns:
            if c.unavailable:
                if i == 0:
                    tds.append(
                        f'<td class="unavailable" rowspan="{len(matrix.rows)}">{e(c.unavailable_line or "")}</td>'
                    )
                continue
            cell = matrix.cell(r, c)
            if cell is None:
                tds.append(f'<td class="not-run">{NOT_RUN}</td>')
            else:
                tip = f' title="{e(_one_line(cell.note))}"' if cell.note else ""
                tds.append(f'<td class="{e(cell.verdict.value)}"{tip}>{e(cell.verdict.value)}</td>')
        body.append("<tr>" + "".join(tds) + "</tr>")
    if not matrix.rows:
        body.append(
            '<tr><td class="row">(no tests)</td>'
            + "".join(
                f'<td class="unavailable">{e(c.unavailable_line or "")}</td>' if c.unavailable else "<td></td>"
                for c in matrix.columns
            )
            + "</tr>"
        )
    details = [
        f"<li><b>{e(c.version)}</b> <code>{e(r.nodeid)}</code>: {e(_one_line(cell.note or cell.outcome or ''))}</li>"
        for r, c, cell in matrix.unexpected()
    ]
    unavailable_items = [
        f"<li><b>{e(c.version)}</b>: {e(c.unavailable_line or '')}</li>" for c in matrix.columns if c.unavailable
    ]
    sections = []
    if details:
        sections.append(f"<h2>UNEXPECTED</h2><ul>{''.join(details)}</ul>")
    if unavailable_items:
        sections.append(f"<h2>Unavailable releases</h2><ul>{''.join(unavailable_items)}</ul>")
    sources = "".join(f"<li><code>{e(str(c.source))}</code></li>" for c in matrix.columns)
    legend_cells = "".join(
        f'<td class="{v.value}">{v.value}</td><td class="row">{e(t)}</td>' for v, t in _LEGEND.items()
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>DeepSpeed repro matrix</title>
<style>{_CSS}</style></head>
<body>
<h1>DeepSpeed repro matrix</h1>
<p>{len(matrix.rows)} rows x {len(matrix.columns)} DeepSpeed releases: {e(_summary(matrix))}.</p>
<table>
<thead><tr><th class="row">repro</th>{head}</tr></thead>
<tbody>
{chr(10).join(body)}
</tbody></table>
{"".join(sections)}
<h2>Legend</h2><table><tr>{legend_cells}</tr></table>
<h2>Sources</h2><ul>{sources}</ul>
</body></html>
"""


# ----------------------------------------------------------------------------------------------------- command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Merge pytest-dsrepro results files (--ds-results, dsrepro install --results) into one repro x DeepSpeed "
        "release table: printed, and written as Markdown and HTML. Exit 1 on any UNEXPECTED cell, 2 on usage errors."
    )
    parser.add_argument("paths", nargs="*", type=Path, default=[Path("results")], help="results files or directories")
    parser.add_argument("--markdown", type=Path, default=None, help="Markdown output (default: DIR/matrix.md)")
    parser.add_argument("--html", type=Path, default=None, help="HTML output (default: DIR/matrix.html)")
    parser.add_argument("--no-write", action="store_true", help="print only; write no Markdown or HTML")
    parser.add_argument("--color", choices=("auto", "always", "never"), default="auto", help="terminal colours")
    parser.add_argument(
        "--fail-on-unavailable", action="store_true", help="exit 1 also when a release could not run at all"
    )


def _use_color(choice: str) -> bool:
    if choice != "auto":
        return choice == "always"
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR")


def run(args: argparse.Namespace) -> int:
    paths: list[Path] = list(args.paths) or [Path("results")]
    try:
        files, warnings = load(paths)
    except MatrixError as exc:
        print(f"dsrepro matrix: {exc}", file=sys.stderr)
        return 2
    for warning in warnings:
        print(f"dsrepro matrix: warning: {warning}", file=sys.stderr)
    matrix = merge(files, warnings)
    sys.stdout.write(render_terminal(matrix, color=_use_color(args.color)))
    if not args.no_write:
        base = paths[0] if paths[0].is_dir() else paths[0].parent
        for path, text in ((args.markdown or base / "matrix.md", render_markdown(matrix)),
                           (args.html or base / "matrix.html", render_html(matrix))):  # fmt: skip
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
    return exit_code(matrix, fail_on_unavailable=args.fail_on_unavailable)
