"""Which catalogued bug is this error? The catalogue's bugs ranked against what a log shows.

Every piece of evidence comes from the catalogue's own markers, read into ``KnownBug``; there is no second list of
patterns. ``triage.evidence`` scores one bug's faces against the log; here the release and the config rule candidates
in or out (the release by where it came from: ``Judged``), and the results are said.

Pure: no pytest, no torch; the renderers for the terminal and for a GitHub comment live here too.
"""

from __future__ import annotations

import functools
import re
import shlex
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import PurePath
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from ..core.escape import md_code, md_fence, md_link, md_text
from ..core.escape import terminal as terminal_text
from ..core.faces import Face
from ..core.gates import oldest_first
from ..core.premises import Premise
from ..core.results import Finding, RunRecord, ScanVerdict, TestRecord
from ..core.scan_verdicts import SEVERITY, finding
from ..core.text import markdown_table
from . import evidence, logread
from .evidence import CONFIDENT, Evidence
from .known_fixes import KnownFix
from .ledger import KNOWN, FixRow
from .logread import Reading

#: Below this a bug is not a candidate at all.
FLOOR = 10
#: Named with confidence without a matched message: the first candidate's evidence reaches this, corroborated (two of
#: its faces' phrases, or its frames), and leads the next by ``LEAD``. Calibrated on corpus/reports' tuning half:
#: every text of another cause stays below (31 its highest, a look-alike's words), the catalogued texts with a face's
#: phrases and frames reach 34-49 (benchmarks/triage.py).
SURE = 32
LEAD = 10
#: A ruled-out bug is named only when its evidence reached this (more than an exception type in common).
RULED_FLOOR = 20
#: Where the release judged on came from: given, stated, or only assumed (which never rules a bug out).
GIVEN, STATED, ASSUMED = "--release", "stated in the log", "installed here, assumed"
#: A known fix's test failure is a face when its message is at least this long; at most this much of it is matched.
_FAILURE_MIN, _FAILURE_CHARS = 16, 160


@functools.lru_cache(maxsize=1024)
def _specifiers(affected: str) -> SpecifierSet:
    """A range as ``packaging`` reads it, once (every bug's range is asked about in every triage)."""
    return SpecifierSet(affected)


@functools.lru_cache(maxsize=1024)
def _version(release: str) -> Version:
    return Version(release)


@dataclass(frozen=True)
class KnownBug:
    """A catalogued bug, from its markers: ``faces`` its gates' (``gate``, with their ranges) and its ``ds_seen``
    ones, ``affected`` its ranges, ``fix`` the repro's fix by name, ``folder`` the catalogue's folder its repro is in
    (``zero3``). Or a fix the ledger knows (``ledger``: its row, ``ledger_bug``), with its own upstream tests where
    the atlas has them (``fixed_by``), or a fix only the atlas knows (``fix_bug``): no repro.

    A catalogued bug's markers: ``ds_repro`` (title, root cause, upstream, first fixed release), ``ds_version`` (each
    gate a face: what the repro raises in its range), ``ds_seen`` (the other faces users meet it in: GPUs' messages,
    other optimizers and releases, cut tracebacks, the words of its reports) and ``ds_premise``.
    """

    id: str
    title: str
    upstream: str | None
    fixed_in: str | None
    root_cause: str
    path: str
    faces: tuple[Face, ...]
    premise: Premise | None = None
    fix: str | None = None
    affected: tuple[str, ...] = ()
    fixed_by: KnownFix | None = None
    folder: str = ""
    ledger: FixRow | None = None

    @property
    def catalogued(self) -> bool:
        """A catalogued bug (a repro), not a fix known from the ledger or the atlas."""
        return self.fixed_by is None and self.ledger is None

    @property
    def fix_link(self) -> str | None:
        """The pull request that fixed a known fix (a catalogued bug's is its upstream link)."""
        return self.ledger.link if self.ledger is not None else self.fixed_by.link if self.fixed_by else None

    @property
    def ranges(self) -> str:
        return " or ".join(oldest_first(self.affected)) or "no declared range"

    def covers(self, release: Version) -> bool:
        return any(_specifiers(a).contains(release, prereleases=True) for a in self.affected)

    @property
    def document(self) -> str:
        """The bug in words, as a text is compared with it."""
        return evidence.document(self.title, self.root_cause, self.faces)

    @property
    def file(self) -> str:
        """The repro's file as the repository names it (the wheel installs ``repros/`` under another name)."""
        return str(PurePath("repros", self.folder, PurePath(self.path).name))

    @property
    def workaround(self) -> str:
        """What to do: the repro's fix; for a known fix, the release with it, and the ledger's workaround before it."""
        if not self.catalogued:
            before = self.ledger.workaround if self.ledger is not None else None
            upgrade = f"upgrade to deepspeed {self.fixed_in} or later"
            return f"{upgrade}; before that: {before.rstrip('.')}" if before else upgrade
        if self.fix:
            return f"the repro's fix `{self.fix}` in {self.file}"
        return "none catalogued"

    @property
    def fixed_text(self) -> str:
        pr = self.ledger.pr if self.ledger is not None else self.fixed_by.pr if self.fixed_by else None
        by = f" by pull request #{pr}" if pr is not None else ""
        return f"fixed in {self.fixed_in}{by}" if self.fixed_in else "unfixed upstream"


@dataclass(frozen=True)
class Candidate:
    bug: KnownBug
    score: int
    reason: str  # one line: the evidence, strongest first
    note: str = ""  # what the release only assumed says of it ("fixed in X; ... was the log from an older release?")
    corroborated: bool = False  # no message matched, but more than shared words (``Evidence.corroborated``)
    sure: bool = False  # named with confidence without a message (``calibrated``)

    @property
    def confident(self) -> bool:
        return self.score >= CONFIDENT or self.sure

    @property
    def word(self) -> str:
        return "KNOWN BUG" if self.confident else "possible"


@dataclass(frozen=True)
class RuledOut:
    bug: KnownBug
    reason: str
    score: int = 0  # what its evidence scored before the rule


@dataclass(frozen=True)
class Judged:
    """The releases a triage judges on and where they came from (``GIVEN``, ``STATED``, ``ASSUMED``, or "": none).

    Where they came from decides what they may do:

    - ``--release``, or a release the log states: a bug whose ranges hold none of them is ruled out, with the reason;
      one whose matched gate's range holds it gains;
    - a release only assumed from the DeepSpeed installed here never rules a bug out and weighs nothing: a maintainer
      triaging an issue, or a user pasting a cluster's log on a laptop, is not running the release that failed. A
      candidate it would have ruled out is said so ("fixed in 0.19.2; the DeepSpeed installed here is 0.19.8: was the
      log from an older release?").
    """

    releases: tuple[Version, ...] = ()
    origin: str = ""

    @property
    def firm(self) -> tuple[Version, ...]:
        """The releases that may rule a bug in or out: given or stated, never assumed."""
        return () if self.origin == ASSUMED else self.releases

    @property
    def release(self) -> Version | None:
        return self.releases[0] if self.releases else None

    def describe(self) -> str:
        if not self.releases:
            return "no release known (all ranges kept)"
        also = f"; it also states {', '.join(map(str, self.releases[1:]))}" if len(self.releases) > 1 else ""
        return f"deepspeed {self.releases[0]} ({self.origin}{also})"


@dataclass(frozen=True)
class Triage:
    """A log judged against the catalogue: candidates best first, the bugs that pointed here but cannot be it."""

    reading: Reading
    judged: Judged
    config_from: str | None  # where the config came from, None: no config
    candidates: tuple[Candidate, ...]
    ruled_out: tuple[RuledOut, ...]
    unmatched: int  # bugs named neither as candidates nor as ruled out: little or no evidence

    @property
    def release(self) -> str | None:
        """The release judged on, as text (None: none known)."""
        return None if self.judged.release is None else str(self.judged.release)

    @property
    def release_from(self) -> str:
        return self.judged.origin

    @property
    def known(self) -> Candidate | None:
        """The best candidate, when it is confident."""
        return self.candidates[0] if self.candidates and self.candidates[0].confident else None

    def to_confirm(self, top: int) -> list[KnownBug]:
        """What ``--confirm`` runs: the best ``top`` of the candidates and of the bugs ruled out despite confident
        evidence (a run shows whether the rule holds: "not reproduced here" said from a run, not only from a range)."""
        strong = [r for r in self.ruled_out if r.score >= CONFIDENT]
        judged: list[Candidate | RuledOut] = [*self.candidates, *strong]
        ranked = sorted(judged, key=lambda j: -j.score)
        return [j.bug for j in ranked[:top]]


@functools.lru_cache(maxsize=256)
def test_faces(fix: KnownFix) -> tuple[Face, ...]:
    """Each of an atlas fix's tests' failure on the release before the fix as a face (numbers as any number; a
    test's own assertion or a failure too short to tell anything is no face)."""
    found = []
    for test in fix.tests:
        error = logread.read(test.failure).primary
        first = error.first_line[:_FAILURE_CHARS] if error is not None else ""
        if error is None or len(first) < _FAILURE_MIN or error.name == "Failed" or first.startswith("assert "):
            continue
        found.append(Face(fix.link, error.type, re.sub(r"\d+", r"\\d+", re.escape(first))))
    return tuple(dict.fromkeys(found))


def fix_bug(fix: KnownFix) -> KnownBug:
    """A fix only the atlas knows, as triage ranks it: its pull request's title and link, its first fixed release,
    its tests' failures (``test_faces``)."""
    return KnownBug(f"fix-{fix.pr}", fix.title, fix.link, fix.first, "", "", test_faces(fix),
                    affected=(f"<{fix.first}",), fixed_by=fix)  # fmt: skip


def ledger_bug(fix: FixRow, atlas: KnownFix | None = None) -> KnownBug:
    """A known fix of the ledger, as triage ranks it: its faces (what users see, GPUs' wording too) and, where the
    atlas has the same pull request, its own tests' failures (``test_faces``) as more faces; its range (from
    ``since`` where the row knows it, up to the first release with the fix); the issue it closes as upstream."""
    found = [*fix.faces, *(test_faces(atlas) if atlas is not None else ())]
    upstream = (*fix.issue_links, fix.link)[0]
    return KnownBug(f"fix-{fix.pr or fix.short}", fix.title, upstream, fix.first, fix.reason, "",
                    tuple(dict.fromkeys(found)), affected=(fix.affected,), fixed_by=atlas, ledger=fix)  # fmt: skip


def fix_bugs(rows: Sequence[FixRow], atlas: Sequence[KnownFix], catalogued: Collection[int]) -> list[KnownBug]:
    """One candidate per fix triage knows beside the catalogue: every ``known`` row of the ledger (with the atlas's
    tests of the same pull request), and every atlas fix the ledger has no row for (a change outside DeepSpeed's
    Python runtime: op builders, accelerators, kernels). A repro row is its catalogued bug already (``catalogued``:
    the pull requests the repros name), and a row not for users or not a fix is no bug users meet."""
    tested = {f.pr: f for f in atlas}
    rowed = {row.pr for row in rows}
    known = [ledger_bug(r, tested.get(r.pr or -1)) for r in rows if r.disposition == KNOWN and r.pr not in catalogued]
    return known + [fix_bug(f) for f in atlas if f.pr not in rowed and f.pr not in catalogued]


def declared_types(bugs: Sequence[KnownBug]) -> set[str]:
    """Every exception name the bugs' faces declare (``logread.read`` recognises bare lines of those that do not
    end in ``Error``, such as ``Slowdown``)."""
    return {face.raises_name for bug in bugs for face in bug.faces if face.raises_name}


# --- judging -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Compared:
    """A bug as every triage compares it, made once per catalogue (``_catalogue``): the words that name its frames
    (title, root cause, upstream), its document's words, what can show it in a log at all (``evidence.Reach``)."""

    bug: KnownBug
    named: str
    words: Mapping[str, int]
    reach: evidence.Reach


class _Same:
    """The bugs of one catalogue as a cache key: the same objects, in order (a catalogue is read once and triaged
    many times; hashing every bug's faces for each triage would cost what the cache saves)."""

    def __init__(self, bugs: Sequence[KnownBug]) -> None:
        self.bugs = tuple(bugs)  # held, so that no id below is another object's while the key lives
        self.ids = tuple(map(id, self.bugs))

    def __hash__(self) -> int:
        return hash(self.ids)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and self.ids == other.ids


@functools.lru_cache(maxsize=4)
def _catalogue(same: _Same) -> tuple[tuple[_Compared, ...], tuple[str, ...]]:
    """Each bug as compared (``_Compared``) and the documents of all (their ``evidence.Vocabulary``)."""
    documents = tuple(bug.document for bug in same.bugs)
    known = tuple(
        _Compared(bug, named := f"{bug.title} {bug.root_cause} {bug.upstream or ''}", evidence.words(document),
               evidence.Reach.of(bug.faces, named))
        for bug, document in zip(same.bugs, documents, strict=True)
    )  # fmt: skip
    return known, documents


@dataclass(frozen=True)
class _Context:
    """What every bug is judged against, made once per triage."""

    log: evidence.Log
    judged: Judged
    config: Mapping[str, Any] | None


def _release(bug: KnownBug, found: Evidence, release: Version) -> tuple[int, str]:
    face = found.face
    if found.matched and face is not None and face.gate and not face.covers(release):
        here = next((f for f in bug.faces if f.gate and f.covers(release)), None)
        said = f"; on {release} it raises {here.describe()}" if here is not None else ""
        return 0, f"that message is the one of deepspeed{face.affected}{said}"
    if found.matched and face is not None and face.gate:
        return 8, f"deepspeed {release} is in that range"
    return 4, f"deepspeed {release} is in its range {bug.ranges}"


def _outside(bug: KnownBug, releases: Sequence[Version]) -> str:
    """Why ``releases`` (none in the bug's ranges) rule it out: the range, and the fixed release where past it."""
    said = ", ".join(map(str, releases))
    fixed = bug.fixed_in is not None and all(r >= Version(bug.fixed_in) for r in releases)
    return f"deepspeed {said} is outside its affected range {bug.ranges}" + (
        f": fixed in {bug.fixed_in}" if fixed else ""
    )


def _assumed(bug: KnownBug, release: Version) -> str:
    """What a release only assumed says of a bug outside its ranges: a question, never a rule."""
    if bug.covers(release) or not bug.affected:
        return ""
    if bug.fixed_in is not None and release >= _version(bug.fixed_in):
        return f"fixed in {bug.fixed_in}; the DeepSpeed installed here is {release}: was the log from an older release?"
    return (f"affected {bug.ranges}; the DeepSpeed installed here is {release}: was the log from another "
            "release?")  # fmt: skip


def _premise_unmet(bug: KnownBug, config: Mapping[str, Any] | None) -> str | None:
    unmet = bug.premise.unmet(config) if config is not None and bug.premise is not None else ()
    return f"the config cannot meet its premise: {'; '.join(unmet)}" if unmet else None


def judge(known: _Compared, context: _Context) -> Candidate | RuledOut:
    """One bug against the log: a scored candidate, or ruled out (a firm release, the premise) with the reason and
    the score its evidence had, so that only the bugs the log points to need be named as ruled out. A known fix (no
    repro checked its faces) is named with confidence by a message of its own, or one raised where it raises it."""
    bug = known.bug
    found = evidence.collect(bug.faces, known.named, known.words, context.log, strict=not bug.catalogued,
                             reach=known.reach)  # fmt: skip
    points, parts = found.points, list(found.why)
    if found.contradicted:
        return RuledOut(bug, found.contradicted, min(points, 100))
    firm = context.judged.firm
    inside = [r for r in firm if bug.covers(r)] if bug.affected else list(firm)
    if firm and not inside:
        return RuledOut(bug, _outside(bug, firm), min(points, 100))
    unmet = _premise_unmet(bug, context.config)
    if unmet is not None:
        return RuledOut(bug, unmet, min(points, 100))
    if inside:
        more, said = _release(bug, found, inside[0])
        points, parts = points + more, [*parts, said]
    if context.config is not None and bug.premise is not None:
        points, parts = points + 4, [*parts, f"the config meets its premise ({bug.premise.describe()})"]
    if bug.fixed_by is not None and found.matched and found.face in test_faces(bug.fixed_by):
        fix = bug.fixed_by
        parts.append(f"the fix's own test failed so on {fix.before} and passes from {fix.first}")
    assumed = context.judged.release
    note = _assumed(bug, assumed) if context.judged.origin == ASSUMED and assumed is not None else ""
    return Candidate(bug, min(points, 100), "; ".join(p for p in parts if p), note, found.corroborated)


def calibrated(candidates: Sequence[Candidate]) -> tuple[Candidate, ...]:
    """The candidates, the first named with confidence where its evidence is strong without a message: ``SURE``
    points, corroborated, ``LEAD`` ahead of the next (a look-alike's words come close to the bug's own)."""
    if not candidates:
        return ()
    first, runner = candidates[0], candidates[1].score if len(candidates) > 1 else 0
    if first.confident and runner >= CONFIDENT and first.score - runner < LEAD and first.bug.catalogued:
        # two catalogued bugs the log fits alike (one message, raised by both): it names neither
        tie = f"{first.reason}; {candidates[1].bug.id} fits the log as well: the log does not tell them apart"
        return (replace(first, score=CONFIDENT - 1, reason=tie), *candidates[1:])
    if first.confident:
        return tuple(candidates)
    sure = first.corroborated and first.score >= SURE and first.score - runner >= LEAD
    return (replace(first, sure=True), *candidates[1:]) if sure else tuple(candidates)


def rank(
    bugs: Sequence[KnownBug],
    reading: Reading,
    judged: Judged = Judged(),
    config: Mapping[str, Any] | None = None,
    *,
    config_from: str | None = None,
) -> Triage:
    """Every bug judged (``judge``): the candidates at or above ``FLOOR``, best first; the ruled-out bugs whose
    evidence reached ``RULED_FLOOR``; how many are left unnamed."""
    known, documents = _catalogue(_Same(bugs))
    context = _Context(evidence.Log.of(reading, documents), judged, config)
    every = [judge(k, context) for k in known]
    candidates = sorted((j for j in every if isinstance(j, Candidate) and j.score >= FLOOR),
                        key=lambda c: (-c.score, not c.bug.catalogued, c.bug.id))  # fmt: skip
    ruled = tuple(j for j in every if isinstance(j, RuledOut) and j.score >= RULED_FLOOR)
    return Triage(reading, judged, config_from, calibrated(candidates), ruled, len(bugs) - len(candidates) - len(ruled))


# --- confirmation --------------------------------------------------------------------------------------------------


def confirmations(run: RunRecord, fixed_in: Mapping[str, str | None]) -> dict[str, Finding]:
    """Per bug id in ``fixed_in``, what its tests' stock runs in ``run`` said, in a scan's words: a scan's own finding,
    else the gates' judgement read as a scan reads it (a pass, which records no error line, said with its verdict);
    the most severe test decides."""
    found: dict[str, list[Finding]] = {}
    for test in run.tests:
        if test.repro is None or test.repro.id not in fixed_in or test.variant == "fixed":
            continue
        bug = test.repro.id
        if test.scan is not None:
            said = test.scan
        elif test.reason is not None:
            told = test.error or f"{test.label.lower()}: passes on deepspeed {run.version}"
            said = finding(test.reason, told, fixed_in=fixed_in[bug])
        else:
            said = Finding(ScanVerdict.CANNOT_TELL, f"{test.outcome}: {test.error or 'no verdict'}")
        found.setdefault(bug, []).append(said)
    return {bug: min(said, key=lambda f: SEVERITY.index(f.verdict)) for bug, said in found.items()}


def fix_confirmation(fix: KnownFix, release: str, records: Sequence[TestRecord]) -> Finding:
    """What a known fix's own tests said on ``release``: one failing, as before the fix, is the bug here."""
    mine = [r for r in records if r.nodeid.split("[")[0] in {t.nodeid for t in fix.tests}]
    failed = next((r for r in mine if r.outcome in ("failed", "error")), None)
    if failed is not None:
        told = (failed.error or failed.outcome).removeprefix("WorldFailed: ")
        return Finding(ScanVerdict.AFFECTED, f"its own test {failed.nodeid} fails on deepspeed {release}, as before "
                       f"the fix ({fix.first}): {told}")  # fmt: skip
    if mine and all(r.outcome == "passed" for r in mine):
        return Finding(ScanVerdict.NOT_AFFECTED, f"its own tests pass on deepspeed {release}")
    said = ", ".join(sorted({r.outcome for r in mine})) or "no record"
    return Finding(ScanVerdict.CANNOT_TELL, f"its own tests on deepspeed {release}: {said}")


def confirmed_word(said: Finding) -> str:
    """A confirmation as triage says it: "looks like" becomes "reproduced here", or honestly not."""
    return {
        ScanVerdict.AFFECTED: "REPRODUCED here",
        ScanVerdict.NOT_AFFECTED: "not reproduced here",
        ScanVerdict.NOT_APPLICABLE: "not applicable here",
        ScanVerdict.CANNOT_TELL: "cannot tell here",
    }[said.verdict]


# --- what the user reads -------------------------------------------------------------------------------------------


def showed(reading: Reading) -> str:
    """What the log showed, in one line: the exception, the innermost DeepSpeed frame (a cut traceback's too), the
    ranks."""
    error = reading.primary
    cut = [f for f in reading.cut if f.deepspeed]
    if error is None:
        if cut:
            return f"a traceback cut before its exception, at {cut[-1]}"
        return "no exception (no traceback, no `...Error: message` line)"
    frame = error.innermost_deepspeed
    where = f" at {frame}" if frame else f" (named; a traceback cut before it, at {cut[-1]})" if cut else (
        " (no DeepSpeed frame)"
    )  # fmt: skip
    ranks = f" (ranks {', '.join(map(str, error.ranks))})" if len(error.ranks) > 1 else ""
    return f"{error.headline[:300]}{where}{ranks}"


def _judged_on(t: Triage) -> str:
    return f"{t.judged.describe()}; config: {t.config_from or 'none given, none in the log'}"


def terminal(t: Triage, confirmed: Mapping[str, Finding] | None = None, top: int = 5) -> list[str]:
    """The triage as the terminal shows it: what the log showed, the candidates (why, and what to do), the ruled out."""
    confirmed = confirmed or {}
    lines = [f"the log shows: {showed(t.reading)}", f"judged on: {_judged_on(t)}"]
    if t.candidates:
        lines.append("candidates:")
    for i, c in enumerate(t.candidates[:top], 1):
        b = c.bug
        lines.append(f"  {i}. {c.score:3d} {c.word:<9}  {b.id}: {b.title}")
        lines.append(f"       why: {c.reason}")
        lines.append(f"       {b.fixed_text}; workaround: {b.workaround}; upstream: {b.upstream or '-'}")
        if c.note:
            lines.append(f"       release: {c.note}")
        if b.id in confirmed:
            said = confirmed[b.id]
            lines.append(f"       confirm: {confirmed_word(said)}: {said.detail}")
    for r in t.ruled_out:
        lines.append(f"  ruled out {r.bug.id}: {r.reason}")
        if r.bug.id in confirmed:
            lines.append(f"       confirm: {confirmed_word(confirmed[r.bug.id])}: {confirmed[r.bug.id].detail}")
    lines.append(f"  ({t.unmatched} other known bugs and fixes: little or nothing in the log points to them)")
    lines.append(verdict(t, confirmed))
    return [terminal_text(line) for line in lines]


def verdict(t: Triage, confirmed: Mapping[str, Finding] | None = None) -> str:
    confirmed = confirmed or {}
    reproduced = [
        c for c in t.candidates if c.bug.id in confirmed and confirmed[c.bug.id].verdict is ScanVerdict.AFFECTED
    ]
    if reproduced:
        return f"a known bug, reproduced here: {reproduced[0].bug.id}"
    if t.known is not None:
        return f"a known bug: {t.known.bug.id} ({t.known.note or t.known.bug.fixed_text})"
    strong = next((r for r in t.ruled_out if r.score >= CONFIDENT), None)
    if strong is not None:
        return f"no known bug here: the log looks like {strong.bug.id}, but {strong.reason}"
    if t.candidates:
        return f"no known bug with confidence; the closest is {t.candidates[0].bug.id} ({t.candidates[0].score})"
    return "no known bug matches this log"


def new_repro_hint(log: str) -> str:
    return f"to catalogue it: dsrepro new NAME --from-log {log}   (a repro prefilled from the log's exception)"


def markdown(t: Triage, confirmed: Mapping[str, Finding] | None = None, log: str = "LOG") -> str:
    """A comment for the GitHub issue: the candidate, the evidence, the upstream link, the fixed release, the
    workaround and the command that reproduces it; the other candidates and the ruled out below."""
    confirmed = confirmed or {}
    strong = next((r for r in t.ruled_out if r.score >= CONFIDENT), None)
    out = _headline(t, strong)
    out.append(f"- The log shows: {md_code(showed(t.reading))}")
    out.append(f"- Judged on: {md_text(_judged_on(t))}")
    if t.known is not None:
        out += _known_bug(t.known, t.release, confirmed, log)
    elif strong is None:
        command = md_code(f"dsrepro new NAME --from-log {log}")
        out += ["", f"To catalogue it: {command} writes a repro prefilled from this error."]
    others = [c for c in t.candidates if c is not t.known]
    if others:
        rows = [(f"{md_code(c.bug.id)} {md_text(c.bug.title)}", c.score, md_text(c.reason)) for c in others[:5]]
        out += ["", *markdown_table(("other candidate", "score", "why"), rows)]
    if t.ruled_out:
        out += ["", "Ruled out:", ""]
        for r in t.ruled_out:
            said = confirmed.get(r.bug.id)
            also = f"; {confirmed_word(said)}: {md_text(said.detail)}" if said else ""
            out.append(f"- {md_code(r.bug.id)}: {md_text(r.reason)}{also}")
    out += ["", "_Found by `dsrepro triage` (pytest-dsrepro), from the catalogue's own markers and the fix ledger._"]
    return "\n".join(out) + "\n"


def _headline(t: Triage, strong: RuledOut | None) -> list[str]:
    """The comment's title: the known bug, the one a strong match was ruled out from (and why), or none."""
    if t.known is not None:
        b = t.known.bug
        return [f"### This looks like a known DeepSpeed bug: {md_code(b.id)}", "", f"**{md_text(b.title)}**", ""]
    if strong is not None:
        b = strong.bug
        fixed = b.fixed_in or "none yet"
        return [f"### This looks like the known DeepSpeed bug {md_code(b.id)}, but {md_text(strong.reason)}", "",
                f"**{md_text(b.title)}**", "",
                f"- Upstream: {md_link(b.upstream)}; fixed release: {md_text(fixed)}"]  # fmt: skip
    return ["### No known DeepSpeed bug matches this log with confidence", ""]


def _known_bug(known: Candidate, release: str | None, confirmed: Mapping[str, Finding], log: str) -> list[str]:
    """What a user of the known bug needs: evidence, cause, upstream, fix, workaround, the command that confirms."""
    b = known.bug
    out = [
        f"- Evidence ({known.score}/100): {md_text(known.reason)}",
        *([f"- Root cause: {md_text(b.root_cause)}"] if b.root_cause else []),
        *([f"- Upstream: {md_link(b.upstream)}"] if b.upstream != b.fix_link else []),
        f"- Fixed release: {md_text(b.fixed_in or 'none yet (unfixed upstream)')}",
        *([f"- Fixed by: {md_link(b.fix_link)} ({md_text(b.title)})"] if b.fix_link else []),
        f"- Workaround: {_workaround(b)}",
    ]
    if known.note:
        out.append(f"- Release: {md_text(known.note)}")
    if b.id in confirmed:
        out.append(f"- Reproduced: **{confirmed_word(confirmed[b.id])}**: {md_text(confirmed[b.id].detail)}")
    return [*out, "", *_reproduce(b, f" --release {shlex.quote(release)}" if release else "", shlex.quote(log))]


def _reproduce(b: KnownBug, flag: str, log: str) -> list[str]:
    """How to see it here: the repro; a known fix's own test from a DeepSpeed clone; or that no repro exists yet.
    ``log`` and ``flag`` come quoted for a shell."""
    if b.catalogued:
        commands = f"dsrepro triage {log}{flag} --confirm\npytest {shlex.quote(b.file)} -rx   # in a pytest-dsrepro " \
            "checkout"  # fmt: skip
        return ["Reproduce it (`pip install pytest-dsrepro`):", "", md_fence(commands, "bash")]
    said = []
    if b.fixed_by is not None:
        said = ["Confirm it with the fix's own test (`pip install pytest-dsrepro`, a DeepSpeed clone):", "",
                md_fence(f"dsrepro triage {log}{flag} --confirm --repo ~/DeepSpeed", "bash"), ""]  # fmt: skip
    if b.ledger is not None and b.ledger.cpu:
        start = md_code(f"dsrepro new NAME --issue {b.upstream}")
        return [*said, f"No repro is catalogued for it yet; a CPU world could show it: {start} starts one."]
    return said or ["No repro is catalogued for it: it is known from DeepSpeed's fix and the reports of it."]


def _workaround(b: KnownBug) -> str:
    """The bug's workaround in Markdown: the repro's fix by name in a code span, the rest as text."""
    if b.catalogued and b.fix:
        return f"the repro's fix {md_code(b.fix)} in {md_text(b.file)}"
    return md_text(b.workaround)
