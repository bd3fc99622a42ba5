"""Which catalogued bug is this error? The catalogue's bugs ranked against what a log shows.

Every piece of evidence comes from the catalogue's own markers (``ds_repro``, ``ds_version``, ``ds_premise``), read
into ``KnownBug``; there is no second list of patterns. What weighs what, strongest first:

- the message matches a ``ds_version`` gate's ``match`` (70 with the declared type, 55 without): the only evidence
  that makes a candidate confident (``CONFIDENT``);
- a gate that declares a type with any message, and the log raised that type (35); the type alone (10);
- the words the message shares with the bug's title, root cause and declared message (up to 20);
- the DeepSpeed frames of the traceback that the bug's title or root cause names (up to 18);
- the release inside the range of the gate that matched (8), or inside one of the bug's ranges (4);
- the config meeting the bug's premise (4).

What cannot be the bug is ruled out, with the reason: a release outside every affected range, a config that cannot
meet the premise. A log with no exception is compared by its words alone, and is never confident.

Pure: no pytest, no torch; the renderers for the terminal and for a GitHub comment live here too.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from .gates import VersionGate, oldest_first
from .logread import Raised, Reading
from .premises import Premise
from .results import Finding, RunRecord, ScanVerdict
from .scan_verdicts import SEVERITY, finding
from .text import markdown_table

#: A candidate at or above this score is a known bug with confidence: its declared message matched.
CONFIDENT = 50
#: Below this a bug is not a candidate at all.
FLOOR = 10
#: A ruled-out bug is named only when its evidence reached this (more than an exception type in common).
RULED_FLOOR = 20
#: Words too common in DeepSpeed's errors and the catalogue's titles to tell bugs apart.
_COMMON = frozenset({
    "with", "from", "that", "this", "have", "been", "when", "were", "will", "then", "than", "into", "only", "also",
    "does", "each", "every", "there", "their", "other", "after", "before", "while", "which", "what", "where", "some",
    "more", "most", "first", "last", "same", "just", "like", "none", "true", "false", "self", "error", "object",
    "attribute", "deepspeed", "zero", "rank", "ranks", "step", "steps", "param", "params", "parameter", "parameters",
    "model", "engine", "module", "tensor", "tensors", "call", "calls", "called", "raise", "raises", "raised", "line",
    "file", "python", "site", "packages", "return", "value", "values", "given", "expected", "instead", "should",
    "would", "could", "need", "needs", "used", "uses", "using", "stage", "config", "training", "train",
})  # fmt: skip
#: Frame functions that wrap everything (torch's module call, decorators): never evidence.
_WRAPPERS = frozenset({"<module>", "__call__", "_call_impl", "_wrapped_call_impl", "wrapper", "wrapped_fn", "inner",
                       "decorate_context", "forward", "main", "_fn", "fn"})  # fmt: skip
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]{3,}")


@dataclass(frozen=True)
class Signature:
    """One ``ds_version`` gate as triage reads it: the range, the declared exception's name and message pattern."""

    affected: str
    raises: str
    match: str | None = None

    @classmethod
    def of(cls, gate: VersionGate) -> Signature:
        return cls(gate.range, gate.raises.__name__, gate.match)

    def covers(self, release: Version) -> bool:
        return SpecifierSet(self.affected).contains(release, prereleases=True)

    def describe(self) -> str:
        return self.raises + (f" matching {self.match!r}" if self.match else "")


@dataclass(frozen=True)
class KnownBug:
    """A catalogued bug, from its markers: ``signatures`` one per distinct gate, ``fix`` the repro's fix by name."""

    id: str
    title: str
    upstream: str | None
    fixed_in: str | None
    root_cause: str
    path: str
    signatures: tuple[Signature, ...]
    premise: Premise | None = None
    fix: str | None = None

    @property
    def ranges(self) -> str:
        return " or ".join(oldest_first(s.affected for s in self.signatures)) or "no declared range"

    def covers(self, release: Version) -> bool:
        return any(s.covers(release) for s in self.signatures)

    @property
    def prose(self) -> str:
        """What the bug says of itself in words: title, root cause, and the literal text of its declared messages."""
        patterns = " ".join(re.sub(r"\\.|[^\w\s']", " ", s.match or "") for s in self.signatures)
        return f"{self.title} {self.root_cause} {patterns}"

    @property
    def file(self) -> str:
        """The repro's file as the repository names it (the wheel installs ``repros/`` under another name)."""
        return f"repros/{PurePath(self.path).name}"

    @property
    def workaround(self) -> str:
        if self.fix:
            return f"the repro's fix `{self.fix}` in {self.file}"
        return "none catalogued"

    @property
    def fixed_text(self) -> str:
        return f"fixed in {self.fixed_in}" if self.fixed_in else "unfixed upstream"


@dataclass(frozen=True)
class Candidate:
    bug: KnownBug
    score: int
    reason: str  # one line: the evidence, strongest first

    @property
    def confident(self) -> bool:
        return self.score >= CONFIDENT

    @property
    def word(self) -> str:
        return "KNOWN BUG" if self.confident else "possible"


@dataclass(frozen=True)
class RuledOut:
    bug: KnownBug
    reason: str
    score: int = 0  # what its evidence scored before the rule


@dataclass(frozen=True)
class Triage:
    """A log judged against the catalogue: candidates best first, the bugs that pointed here but cannot be it."""

    reading: Reading
    release: str | None
    release_from: str  # where the release came from: "--release", "installed here", "stated in the log", ""
    config_from: str | None  # where the config came from, None: no config
    candidates: tuple[Candidate, ...]
    ruled_out: tuple[RuledOut, ...]
    unmatched: int  # bugs named neither as candidates nor as ruled out: little or no evidence

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


# --- evidence ------------------------------------------------------------------------------------------------------


def _words(text: str) -> dict[str, int]:
    """Distinctive words of ``text``, lower-cased, each weighed: 2 for an identifier (``_`` or camelCase), else 1."""
    found: dict[str, int] = {}
    for word in _WORD.findall(text):
        low = word.lower()
        if low in _COMMON:
            continue
        found[low] = max(found.get(low, 0), 2 if "_" in word.strip("_") or word[1:] != word[1:].lower() else 1)
    return found


def shared(text: str, bug: KnownBug) -> tuple[int, list[str]]:
    """How much ``text`` and the bug's own words have in common: the summed weights and the words, heaviest first."""
    mine, theirs = _words(text), _words(bug.prose)
    common = sorted(set(mine) & set(theirs), key=lambda w: (-theirs[w], w))
    return sum(theirs[w] for w in common), common


def _variants(message: str) -> tuple[str, ...]:
    """A message as a pattern may need it: as shown, its lines joined without and with a space."""
    return (message, message.replace("\n", ""), message.replace("\n", " "))


@dataclass(frozen=True)
class _Hit:
    points: int
    why: str
    signature: Signature | None = None
    matched: bool = False  # the signature's message pattern matched


def _against(error: Raised, signature: Signature, bug: KnownBug) -> _Hit:
    typed = signature.raises in error.type_names
    if signature.match and any(re.search(signature.match, m) for m in _variants(error.message)):
        if typed:
            return _Hit(70, f"the message is the one it declares: {signature.describe()}", signature, True)
        why = f"the message matches its declared {signature.match!r} (raised as {error.name}, not {signature.raises})"
        return _Hit(55, why, signature, True)
    weight, words = shared(error.message, bug)
    overlap = min(4 * weight, 20 if typed else 12)
    also = f"; shares {', '.join(words[:3])}" if words else ""
    if typed and signature.match is None:
        return _Hit(35 + overlap, f"it declares {signature.raises} with any message{also}", signature)
    if typed:
        return _Hit(10 + overlap, f"the same exception type ({signature.raises}), another message{also}", signature)
    return _Hit(overlap, f"its title and root cause share {', '.join(words[:3])}" if words else "", signature)


def _best(bug: KnownBug, reading: Reading) -> _Hit:
    """The bug's strongest evidence among the log's exceptions (those that only lost a peer count only when nothing
    else does); the text's words when the log shows no exception."""
    errors = [e for e in reading.errors if not e.lost_peer] or list(reading.errors)
    if not errors:
        weight, words = shared(reading.text, bug)
        return _Hit(min(3 * weight, 25), f"no exception; the text shares {', '.join(words[:4])}" if words else "")
    hits = [_against(e, s, bug) for e in errors for s in bug.signatures]
    return max(hits, key=lambda h: h.points, default=_Hit(0, ""))


def _frames(bug: KnownBug, reading: Reading) -> tuple[int, str]:
    """DeepSpeed frames of the log that the bug names in its own words: functions 6 points, files 3, at most 18."""
    named = set(re.findall(r"\w+", f"{bug.title} {bug.root_cause} {bug.upstream or ''}"))
    functions = [f.function for f in reading.deepspeed_frames if f.function not in _WRAPPERS]
    stems = [PurePath(f.path).stem for f in reading.deepspeed_frames]
    hit_functions = [f for f in dict.fromkeys(functions) if f in named]
    hit_files = [s for s in dict.fromkeys(stems) if s in named and s not in hit_functions]
    points = min(6 * len(hit_functions) + 3 * len(hit_files), 18)
    if not points:
        return 0, ""
    return points, f"its root cause names the log's DeepSpeed frames {', '.join(hit_functions + hit_files)}"


def _release(bug: KnownBug, hit: _Hit, release: Version) -> tuple[int, str]:
    if hit.matched and hit.signature is not None and not hit.signature.covers(release):
        here = next(s for s in bug.signatures if s.covers(release))
        return 0, (f"that message is the one of deepspeed{hit.signature.affected}; on {release} it raises "
                   f"{here.describe()}")  # fmt: skip
    if hit.matched:
        return 8, f"deepspeed {release} is in that range"
    return 4, f"deepspeed {release} is in its range {bug.ranges}"


def _rule(bug: KnownBug, release: Version | None, config: Mapping[str, Any] | None) -> str | None:
    """Why the bug cannot be this log's, or None: a release outside every range, a config short of the premise."""
    if release is not None and not bug.covers(release):
        fixed = bug.fixed_in is not None and release >= Version(bug.fixed_in)
        return f"deepspeed {release} is outside its affected range {bug.ranges}" + (
            f": fixed in {bug.fixed_in}" if fixed else ""
        )
    unmet = bug.premise.unmet(config) if config is not None and bug.premise is not None else ()
    return f"the config cannot meet its premise: {'; '.join(unmet)}" if unmet else None


def judge(
    bug: KnownBug, reading: Reading, release: Version | None, config: Mapping[str, Any] | None
) -> Candidate | RuledOut:
    """One bug against the log: a scored candidate, or ruled out (release, premise) with the reason and the score
    its evidence had, so that only the bugs the log points to need be named as ruled out."""
    hit = _best(bug, reading)
    frames, framed = _frames(bug, reading)
    points, parts = hit.points + frames, [hit.why, framed]
    rule = _rule(bug, release, config)
    if rule is not None:
        return RuledOut(bug, rule, min(points, 100))
    if release is not None:
        more, said = _release(bug, hit, release)
        points, parts = points + more, [*parts, said]
    if config is not None and bug.premise is not None:
        points, parts = points + 4, [*parts, f"the config meets its premise ({bug.premise.describe()})"]
    return Candidate(bug, min(points, 100), "; ".join(p for p in parts if p))


def rank(
    bugs: Sequence[KnownBug],
    reading: Reading,
    release: Version | None = None,
    config: Mapping[str, Any] | None = None,
    *,
    release_from: str = "",
    config_from: str | None = None,
) -> Triage:
    """Every bug judged (``judge``): the candidates at or above ``FLOOR``, best first; the ruled-out bugs whose
    evidence reached ``RULED_FLOOR``; how many are left unnamed."""
    judged = [judge(bug, reading, release, config) for bug in bugs]
    candidates = sorted((j for j in judged if isinstance(j, Candidate) and j.score >= FLOOR),
                        key=lambda c: (-c.score, c.bug.id))  # fmt: skip
    ruled = tuple(j for j in judged if isinstance(j, RuledOut) and j.score >= RULED_FLOOR)
    return Triage(reading, None if release is None else str(release), release_from, config_from, tuple(candidates),
                  ruled, len(bugs) - len(candidates) - len(ruled))  # fmt: skip


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
    """What the log showed, in one line: the exception, the innermost DeepSpeed frame, the ranks."""
    error = reading.primary
    if error is None:
        return "no exception (no traceback, no `...Error: message` line)"
    frame = error.innermost_deepspeed
    where = f" at {frame}" if frame else " (no DeepSpeed frame)"
    ranks = f" (ranks {', '.join(map(str, error.ranks))})" if len(error.ranks) > 1 else ""
    return f"{error.headline[:300]}{where}{ranks}"


def _judged_on(t: Triage) -> str:
    release = f"deepspeed {t.release} ({t.release_from})" if t.release else "no release known (all ranges kept)"
    return f"{release}; config: {t.config_from or 'none given, none in the log'}"


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
        if b.id in confirmed:
            said = confirmed[b.id]
            lines.append(f"       confirm: {confirmed_word(said)}: {said.detail}")
    for r in t.ruled_out:
        lines.append(f"  ruled out {r.bug.id}: {r.reason}")
        if r.bug.id in confirmed:
            lines.append(f"       confirm: {confirmed_word(confirmed[r.bug.id])}: {confirmed[r.bug.id].detail}")
    lines.append(f"  ({t.unmatched} other catalogued bugs: little or nothing in the log points to them)")
    lines.append(verdict(t, confirmed))
    return lines


def verdict(t: Triage, confirmed: Mapping[str, Finding] | None = None) -> str:
    confirmed = confirmed or {}
    reproduced = [
        c for c in t.candidates if c.bug.id in confirmed and confirmed[c.bug.id].verdict is ScanVerdict.AFFECTED
    ]
    if reproduced:
        return f"a known bug, reproduced here: {reproduced[0].bug.id}"
    if t.known is not None:
        return f"a known bug: {t.known.bug.id} ({t.known.bug.fixed_text})"
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
    out.append(f"- The log shows: `{showed(t.reading)}`")
    out.append(f"- Judged on: {_judged_on(t)}")
    if t.known is not None:
        out += _known_bug(t.known, t.release, confirmed, log)
    elif strong is None:
        out += ["", f"To catalogue it: `dsrepro new NAME --from-log {log}` writes a repro prefilled from this error."]
    others = [c for c in t.candidates if c is not t.known]
    if others:
        rows = [(f"`{c.bug.id}` {c.bug.title}", c.score, c.reason) for c in others[:5]]
        out += ["", *markdown_table(("other candidate", "score", "why"), rows)]
    if t.ruled_out:
        out += ["", "Ruled out:", ""]
        for r in t.ruled_out:
            said = confirmed.get(r.bug.id)
            also = f"; {confirmed_word(said)}: {said.detail}" if said else ""
            out.append(f"- `{r.bug.id}`: {r.reason}{also}")
    out += ["", "_Found by `dsrepro triage` (pytest-dsrepro), from the catalogue's own markers._"]
    return "\n".join(out) + "\n"


def _headline(t: Triage, strong: RuledOut | None) -> list[str]:
    """The comment's title: the known bug, the one a strong match was ruled out from (and why), or none."""
    if t.known is not None:
        b = t.known.bug
        return [f"### This looks like a known DeepSpeed bug: `{b.id}`", "", f"**{b.title}**", ""]
    if strong is not None:
        b = strong.bug
        fixed = b.fixed_in or "none yet"
        return [f"### This looks like the known DeepSpeed bug `{b.id}`, but {strong.reason}", "", f"**{b.title}**",
                "", f"- Upstream: {b.upstream or 'not recorded'}; fixed release: {fixed}"]  # fmt: skip
    return ["### No known DeepSpeed bug matches this log with confidence", ""]


def _known_bug(known: Candidate, release: str | None, confirmed: Mapping[str, Finding], log: str) -> list[str]:
    """What a user of the known bug needs: evidence, cause, upstream, fix, workaround, the command that confirms."""
    b = known.bug
    out = [
        f"- Evidence ({known.score}/100): {known.reason}",
        f"- Root cause: {b.root_cause}",
        f"- Upstream: {b.upstream or 'not recorded'}",
        f"- Fixed release: {b.fixed_in or 'none yet (unfixed upstream)'}",
        f"- Workaround: {b.workaround}",
    ]
    if b.id in confirmed:
        out.append(f"- Reproduced: **{confirmed_word(confirmed[b.id])}**: {confirmed[b.id].detail}")
    flag = f" --release {release}" if release else ""
    return [*out, "", "Reproduce it (`pip install pytest-dsrepro`):", "", "```bash",
            f"dsrepro triage {log}{flag} --confirm", f"pytest {b.file} -rx   # in a pytest-dsrepro checkout",
            "```"]  # fmt: skip
