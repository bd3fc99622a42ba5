"""A DeepSpeed error as users paste it, read back into what triage compares: exceptions, DeepSpeed frames, the
release the log states and a config it shows.

Logs arrive in the shapes terminals and issue trackers give them, never as Python wrote them; ``read`` undoes each
shape and reads every exception the text shows, or only names.

Pure: no pytest, no torch, no DeepSpeed; the text is never executed or imported from.
"""

from __future__ import annotations

import builtins
import collections
import itertools
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any, NamedTuple

from packaging.version import Version

from ..core import json_input
from ..core.outcome import PEER_LOST
from ..core.text import strip_ansi

#: Per-line rank prefixes: torch's ``[rank3]:``, torchrun's ``--tee`` ``[default3]:``, mpirun's ``[1,3]<stderr>:``,
#: each possibly after spaces (GitHub's rendering copies one), a launcher's ``host: `` (DeepSpeed's pdsh runner) or
#: a process id in brackets.
_RANK_PREFIX = re.compile(
    r"^\s*(?:[\w.-]+: |\[\d+\] )?(?:\[(?:rank|default)(?P<rank>\d+)\]:|\[\d+,(?P<mpi>\d+)\]<std(?:out|err)>:) ?"
)
#: A launcher's host before every line of a multi-node log (``node-07: ``): a name with a digit in it.
_HOST_PREFIX = re.compile(r"^(?P<host>[A-Za-z][\w.-]*\d[\w.-]*): ")
#: A frame as Python prints it, under any prefix (``>``, a host, spaces).
_FRAME = re.compile(r'(?:^|\s)File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<function><?[\w.]+>?)')
#: A frame written compactly: probes and summaries (``deepspeed/runtime/engine.py:2187 in _forward_prologue``), rich
#: (``/x/stage_1_and_2.py:2073 in _get_state_without_padding``), IPython (``File /x/engine.py:1184, in E.f(self)``).
_COMPACT_FRAME = re.compile(
    r"(?P<path>(?:[\w.~+-]*/)*[\w.-]+\.py):(?P<line>\d+),? in (?:[A-Za-z_]\w*\.)*(?P<function><?[A-Za-z_]\w*>?)"
)
_TRACEBACK = "Traceback (most recent call last):"
#: The line that ends a traceback: the exception's (dotted) type, then its message. pytest writes ``E   `` before it.
_RAISED = re.compile(r"^(?:E\s+)?(?P<type>[A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)*)(?::\s?(?P<message>.*))?$")
#: An error line outside a traceback: a type that names itself an error (``...Error``, ``...Exception``), anywhere
#: on the line (``ranks 0-1: KeyError: 2``, ``E   AttributeError: ...``, a title's ``[BUG]AttributeError: ...``, a
#: quoted ```IndexError: ...```).
_BARE = re.compile(
    r"(?:^|(?<=[\s:;(\[\]`'\"*>]))(?P<type>(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Interrupt))"
    r"(?::\s?(?P<message>.*))?$"
)
#: An exception type the text names, with or without a message (``ZeRO-1 RuntimeError when using ...``).
_NAMED = re.compile(r"\b(?P<type>[A-Z]\w*(?:Error|Exception))\b")
#: Lines that start Markdown of an issue's own (a heading, a fence, an elision), never a message's continuation.
_MARKDOWN = ("#", "```", "[...]")
_CHAIN = ("During handling of the above exception", "The above exception was the direct cause")
#: Lines that start something else (a logger's record, a new launcher line), ending a multi-line message.
_NEW_RECORD = re.compile(
    r"^(?:\d{4}-\d\d-\d\d[ T]|\[\d{4}-\d\d-\d\d|\[?(?:INFO|WARNING|ERROR|DEBUG|CRITICAL)\b|\[rank)"
)
#: Lines inside a traceback that are not frames: code, carets, rich's box, IPython's arrows.
_CODE = ("  ", "\t", "^", "~", "->", "-->", "\u2502", "\u256d", "\u2570", "\u2771")
#: What the plugin's own failure text adds after an exception's message (``core.gates``, ``session.verdicts``):
#: not the exception's words.
_PLUGIN_SUFFIX = re.compile(
    r"(?:; collateral: .*? then lost a peer)?(?: \(with the prerequisite fix for .*\))?(?:; measured: .*)?$"
)
#: A rank prefix that a progress bar pushed to the middle of a line.
_MID_RANK = re.compile(r"(?<=\S)(?=\[rank\d+\]:)")
#: The next rank group of the plugin's one-line failure text (``ranks 0-1: KeyError: 2; rank 2: ...``).
_NEXT_GROUP = re.compile(r"; (?=ranks? \d[\d, -]*: )")
#: Statements of the DeepSpeed release: ``deepspeed==0.18.3``, ``DeepSpeed version 0.18.3``, ds_report's ``deepspeed
#: info ....... 0.18.3``, the engine's ``DeepSpeed info: version=0.18.3``, a wheel's ``deepspeed-0.18.3``, a
#: Markdown ``**DeepSpeed Version:** 0.17.6`` or ``deepspeed `0.15.4```.
_VERSION = re.compile(
    r"\bdeepspeed(?:[ _-]?(?:version|info))?(?:[\s.:=*`]|-(?=\d)|==)*(?:version\s*[=:]\s*)?v?"
    r"(?P<version>\d+\.\d+\.\d+(?:\.?(?:post|dev|rc|a|b)\d+)?(?:\+[\w.]+)?)",
    re.IGNORECASE,
)
#: Keys that make a JSON object in a log a DeepSpeed config.
CONFIG_KEYS = frozenset({
    "zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "fp16",
    "bf16", "optimizer", "scheduler", "zero_allow_untested_optimizer",
})  # fmt: skip
_ISSUE_URL = re.compile(r"https://github\.com/(?:deepspeedai|microsoft)/DeepSpeed/(?:issues|pull)/\d+")
#: How many ``{`` a log may make ``read`` try as JSON, and how much text each try may span.
_CONFIG_TRIES, _CONFIG_SPAN = 200, 64 * 1024
#: How much of a long text's start and end is read for types it only names, and for its words (``ends``).
_ENDS_SPAN = 64 * 1024
#: Lines a message may span; characters kept of it.
_MESSAGE_LINES, _MESSAGE_CHARS = 30, 4000
#: A hard wrap is recognised at this width or wider, when at least this many lines end exactly there.
_WRAP_MIN_WIDTH, _WRAP_MIN_LINES = 60, 3


@dataclass(frozen=True)
class Frame:
    """One traceback frame: the file as written (from ``deepspeed/`` on for DeepSpeed's), its line and function."""

    path: str
    line: int
    function: str

    @property
    def deepspeed(self) -> bool:
        return self.path.startswith("deepspeed/") and "site-packages/deepspeed-" not in self.path

    @property
    def file(self) -> str:
        """The file's own name (``stage_1_and_2.py``), as a face names it."""
        return PurePath(self.path).name

    def __str__(self) -> str:
        return f"{self.path}:{self.line} in {self.function}"

    @classmethod
    def of(cls, path: str, line: str, function: str) -> Frame:
        """A frame under any prefix: site-packages, a source checkout, an egg, a Windows path, a relative one."""
        cut = path.replace("\\", "/")
        at = cut.rfind("/deepspeed/")
        return cls(cut[at + 1 :] if at >= 0 else cut, int(line), function)


@dataclass(frozen=True)
class Raised:
    """An exception the log shows: its type as written (``torch.distributed.DistBackendError``), its message (wrapped
    lines rejoined, further lines kept), the traceback's frames outermost first (none for a bare error line), and the
    ranks whose streams showed it (empty: no rank prefix)."""

    type: str
    message: str
    frames: tuple[Frame, ...] = ()
    ranks: tuple[int, ...] = ()

    @property
    def name(self) -> str:
        """The type's own name, without its module."""
        return self.type.rsplit(".", 1)[-1]

    @property
    def type_names(self) -> tuple[str, ...]:
        """The names this exception is an instance of, as far as the text tells: a built-in exception's MRO, else
        its own name only."""
        found = getattr(builtins, self.name, None)
        if isinstance(found, type) and issubclass(found, BaseException):
            return tuple(c.__name__ for c in found.__mro__ if c is not object)
        return (self.name,)

    @property
    def deepspeed_frames(self) -> tuple[Frame, ...]:
        return tuple(f for f in self.frames if f.deepspeed)

    @property
    def innermost_deepspeed(self) -> Frame | None:
        frames = self.deepspeed_frames
        return frames[-1] if frames else None

    @property
    def lost_peer(self) -> bool:
        """Only lost a peer (gloo's "Connection closed by peer", ...): collateral of another rank's failure."""
        return any(marker in self.message for marker in PEER_LOST)

    @property
    def first_line(self) -> str:
        return self.message.split("\n", 1)[0]

    @property
    def headline(self) -> str:
        return f"{self.type}: {self.first_line}" if self.first_line else self.type


@dataclass(frozen=True)
class Reading:
    """What a log shows, as triage compares it."""

    errors: tuple[Raised, ...]  # distinct exceptions: the unprefixed lines' first, then each rank's, in order
    versions: tuple[str, ...] = ()  # DeepSpeed releases the log states, the most often stated first
    config: dict[str, Any] | None = None  # the DeepSpeed config the log shows (the largest one)
    issues: tuple[str, ...] = ()  # DeepSpeed issue and pull-request addresses in the text
    text: str = field(default="", repr=False)  # the cleaned text (free-text evidence when no exception shows)
    lines: int = 0
    cut: tuple[Frame, ...] = ()  # frames of tracebacks cut before their exception, each once, in order
    named: tuple[str, ...] = ()  # exception types the text names (in a title, in prose), each once

    @property
    def primary(self) -> Raised | None:
        """The error a reader should look at: the first with DeepSpeed frames that did not only lose a peer; else the
        first of its own; else the first."""
        own = [e for e in self.errors if not e.lost_peer] or list(self.errors)
        return next((e for e in own if e.deepspeed_frames), own[0] if own else None)

    @property
    def frames(self) -> tuple[Frame, ...]:
        """Every frame of every traceback, cut ones too, each once, in order."""
        return tuple(dict.fromkeys([*(f for e in self.errors for f in e.frames), *self.cut]))

    @property
    def deepspeed_frames(self) -> tuple[Frame, ...]:
        """Every DeepSpeed frame of every traceback (cut ones and compact ones written in the text too), each once."""
        return tuple(f for f in self.frames if f.deepspeed)


# --- cleaning ------------------------------------------------------------------------------------------------------


def _lines(text: str) -> list[str]:
    """Lines without colours, each ``\\r``-rewritten line as its last state (a progress bar's final value), a rank
    prefix that a progress bar pushed mid-line put at a line's start, a Markdown quote's ``> `` and a launcher's
    host prefix taken off, the plugin's one-line failure text split into one line per rank group."""
    out = []
    for raw in strip_ansi(text).replace("\r\n", "\n").split("\n"):
        parts = [p for p in raw.split("\r") if p.strip()]
        line = (parts[-1] if parts else "").rstrip()
        line = line[2:] if line.startswith("> ") else "" if line == ">" else line
        pieces = _MID_RANK.split(line) if "[rank" in line else [line]  # a cheap look first: most lines have none
        for piece in pieces:
            out += _NEXT_GROUP.split(piece) if "; rank" in piece else [piece]
    return _without_hosts(out)


def _without_hosts(lines: list[str]) -> list[str]:
    """Lines with a launcher's host prefix (on at least three lines, a name with a digit) taken off."""
    hosts = collections.Counter(m["host"] for m in map(_HOST_PREFIX.match, lines) if m is not None)
    seen = {host for host, count in hosts.items() if count >= 3}
    if not seen:
        return lines
    out = []
    for line in lines:
        m = _HOST_PREFIX.match(line)
        out.append(line[m.end() :] if m is not None and m["host"] in seen else line)
    return out


def streams(lines: Iterable[str]) -> dict[int | None, list[str]]:
    """Lines split by the rank prefix they carry (None: no prefix), each stream in its own order: interleaved ranks
    come apart, and each rank's traceback reads whole."""
    found: dict[int | None, list[str]] = collections.defaultdict(list)
    for line in lines:
        m = _RANK_PREFIX.match(line)
        if m is None:
            found[None].append(line)
        else:
            found[int(m["rank"] or m["mpi"])].append(line[m.end() :])
    return dict(found)


def wrap_width(lines: Sequence[str]) -> int | None:
    """The column a text was hard-wrapped at (a terminal copy, ``fold``), or None: a width of at least
    ``_WRAP_MIN_WIDTH`` that several lines end exactly at, that no line passes, and after which the next line mostly
    continues rather than starts a record (a logger's fixed-width records are not cut lines)."""
    lengths = collections.Counter(len(line) for line in lines if len(line) >= _WRAP_MIN_WIDTH)
    if not lengths:
        return None
    widest = max(lengths)
    if lengths[widest] < _WRAP_MIN_LINES:
        return None
    followed = [after for line, after in itertools.pairwise(lines) if len(line) == widest]
    cut = sum(not _starts_record(after) for after in followed)
    return widest if 2 * cut > len(followed) else None


def unwrap(lines: Sequence[str]) -> list[str]:
    """Lines that a hard wrap cut (exactly ``wrap_width`` long, or a multiple once joined) joined with the line that
    continues them, unless that line starts a record of its own."""
    width = wrap_width(lines)
    if width is None:
        return list(lines)
    out: list[str] = []
    for line in lines:
        if out and len(out[-1]) % width == 0 and not _starts_record(line):
            out[-1] += line
        else:
            out.append(line)
    return out


def _starts_record(line: str) -> bool:
    """A line that starts something of its own, never the rest of a cut one: indented (a frame, code), a logger's
    record, a traceback's header, blank."""
    return not line or line.startswith(("  ", "\t", _TRACEBACK)) or bool(_NEW_RECORD.match(line))


# --- exceptions ----------------------------------------------------------------------------------------------------


def _message(first: str, rest: Sequence[str], known: _Known | None = None) -> str:
    """A message's first line (the plugin's own suffixes left out, a pasted repr's ``\\'`` undone) and the lines
    that continue it, up to a blank line or the start of something else."""
    kept = [_PLUGIN_SUFFIX.sub("", first.strip().replace("\\'", "'"), count=1)]
    for line in rest[:_MESSAGE_LINES]:
        if not line.strip() or line.startswith((_TRACEBACK, *_CHAIN, *_MARKDOWN)) or _NEW_RECORD.match(line):
            break
        if _frame(line) or _bare(line.strip(), known):
            break
        kept.append(line.strip())
    return "\n".join(kept)[:_MESSAGE_CHARS]


def _frame(line: str) -> Frame | None:
    """The frame a line states, as Python, rich, IPython or a probe writes it."""
    found = _FRAME.search(line) if 'File "' in line else None  # cheap looks first: most lines of a log are no frame
    if found is None and ".py:" in line and " in " in line:
        found = _COMPACT_FRAME.search(line)
    return None if found is None else Frame.of(found["path"], found["line"], found["function"])


def _is_exception(name: str, known: _Known | None) -> bool:
    """Whether a traceback's last line names an exception: an error's name, a built-in exception, a dotted type, or
    one the catalogue declares (so that prose after a cut traceback is never read as its exception)."""
    own = name.rsplit(".", 1)[-1]
    builtin = getattr(builtins, own, None)
    return (
        own.endswith(("Error", "Exception", "Interrupt", "Exit", "Warning"))
        or (isinstance(builtin, type) and issubclass(builtin, BaseException))
        or ("." in name and own[:1].isupper())
        or (known is not None and own in known.names)
    )


def _exception(
    line: str, inside: bool, known: _Known | None, strict: bool = False
) -> tuple[str, str, tuple[Frame, ...]] | None:
    """The exception a line states: a traceback's last line (``inside``), else (unless ``strict``: an indented line
    inside a traceback, which is code unless it is all an exception) a bare error line; its type, its message's first
    line and a probe's compact frame written after it (``Error: message  @ deepspeed/x.py:12 in f``)."""
    if inside:
        found = _RAISED.match(line.strip())
        if found is not None and _is_exception(found["type"], known):
            return found["type"], found["message"] or "", ()
    bare = None if strict else _bare(line, known)
    if bare is None:
        return None
    text = bare["message"] or ""
    compact = _COMPACT_FRAME.search(line) if "deepspeed/" in line else None
    at = text.find("  @ ") if compact else -1
    frames = (Frame.of(compact["path"], compact["line"], compact["function"]),) if compact else ()
    return bare["type"], text[:at] if at >= 0 else text, frames


def _errors(lines: Sequence[str], known: _Known | None) -> tuple[list[Raised], list[Frame]]:
    """Every traceback's exception (with its frames) and every bare error line, in order; and the frames of
    tracebacks that end without an exception (cut where the paste stopped, or before ``[...]``)."""
    found: list[Raised] = []
    cut: list[Frame] = []
    frames: list[Frame] = []
    inside = False  # after a traceback's header or a frame: a line that is neither ends it
    i = 0
    while i < len(lines):
        line = lines[i]
        frame = None if _TRACEBACK in line else _frame(line)
        said = None
        if _TRACEBACK in line:
            cut, frames, inside = cut + frames, [], True
        elif frame is not None and _bare(line, known) is None:
            frames, inside = [*frames, frame], True
        elif inside and (not line.strip() or line.startswith(_CODE)):  # code, carets; or an indented paste's end
            said = _exception(line, inside, known, strict=True) if line.strip() else None
        else:
            said = _exception(line, inside, known)
            if said is None:
                cut, frames, inside = cut + frames, [], False
        if said is not None:
            kind, first, compact = said
            message = _message(first, lines[i + 1 :], known)
            found.append(Raised(kind, message, (*frames, *compact)))
            frames, inside = [], False
            i += message.count("\n")
        i += 1
    return found, cut + frames


def _bare(line: str, known: _Known | None) -> re.Match[str] | None:
    """The error a line outside a traceback states, if any (a cheap look first: most lines of a log state none)."""
    if "Error" in line or "Exception" in line or "Interrupt" in line:
        found = _BARE.search(line)
        if found is not None:
            return found
    if known is None or ":" not in line or not any(name in line for name in known.names):
        return None
    return known.pattern.search(line)


class _Known(NamedTuple):
    """Types the catalogue declares whose names do not say they are errors (``Slowdown``), and their bare lines."""

    names: tuple[str, ...]
    pattern: re.Pattern[str]


def _known(names: Iterable[str]) -> _Known | None:
    """Bare lines of types the catalogue declares whose names do not say they are errors (``Slowdown: ...``); the
    others ``_BARE`` reads already."""
    own = tuple(sorted({n for n in names if not _BARE.fullmatch(n)}))
    if not own:
        return None
    alternatives = "|".join(re.escape(n) for n in own)
    return _Known(own, re.compile(rf"(?:^|(?<=[\s:;]))(?P<type>(?:\w+\.)*(?:{alternatives}))(?::\s?(?P<message>.*))?$"))


def _merge(per_rank: Iterable[tuple[int | None, list[Raised]]]) -> tuple[Raised, ...]:
    """The same exception seen in several ranks told once, with those ranks; the first with frames kept. A copy
    without frames (an issue's title, a summary line) of an exception a traceback shows adds nothing: it is left out,
    so that it never stands for that traceback."""
    merged: dict[tuple[str, str], Raised] = {}
    for rank, errors in per_rank:
        for e in errors:
            key = (e.name, e.message)
            have = merged.get(key)
            ranks = () if rank is None else (rank,)
            if have is None:
                merged[key] = Raised(e.type, e.message, e.frames, ranks)
            else:
                frames = have.frames or e.frames
                merged[key] = Raised(have.type, have.message, frames, tuple(sorted({*have.ranks, *ranks})))
    framed = [e for e in merged.values() if e.frames]
    return tuple(e for e in merged.values() if e.frames or not any(_repeats(e, f) for f in framed))


def _repeats(copy: Raised, shown: Raised) -> bool:
    """Whether ``copy`` repeats ``shown``: the same type, and one's first line holds the other's (a title adds words
    around the message, a summary cuts it)."""
    a, b = copy.first_line.strip(" `'\".:"), shown.first_line.strip(" `'\".:")
    short = min(len(a), len(b))
    return copy.name == shown.name and ((short >= 8 and (a in b or b in a)) or a == b)


# --- what else the log states --------------------------------------------------------------------------------------


def versions(text: str) -> tuple[str, ...]:
    """The DeepSpeed releases ``text`` states, the most often stated first (ties: the first stated)."""
    said: collections.Counter[str] = collections.Counter()
    for m in _VERSION.finditer(text):
        try:
            said[str(Version(m["version"]))] += 1
        except ValueError:  # InvalidVersion, or a part of 4300 digits or more (int())
            continue
    return tuple(v for v, _ in said.most_common())


def config(text: str) -> dict[str, Any] | None:
    """The largest JSON object in ``text`` that is a DeepSpeed config (``CONFIG_KEYS``), comments allowed; None when
    there is none. Only a ``{`` that starts a line or follows ``=``/``:`` is tried, at most ``_CONFIG_TRIES``; the
    comments are blanked once per window of the text (``_Uncommented``), never once per try: linear in the text."""
    best: dict[str, Any] | None = None
    plain = _Uncommented(text)
    for tries, m in enumerate(re.finditer(r"(?:^|[=:]\s*)(\{)", text, re.MULTILINE)):
        if tries >= _CONFIG_TRIES:
            break
        try:
            found, _ = json_input.raw_decode(plain.at(m.start(1)))
        except ValueError:
            continue
        if isinstance(found, dict) and CONFIG_KEYS & set(found) and (best is None or _size(found) > _size(best)):
            best = found
    return best


#: A comment in JSON with comments, or a string (whose slashes are text).
#: Each alternative ends at the end of its line or chunk when nothing closes it: one pass, whatever the text.
_COMMENT = re.compile(r'"(?:[^"\\\n]|\\.)*(?:"|$)|//[^\n]*|/\*.*?(?:\*/|\Z)', re.DOTALL | re.MULTILINE)


class _Uncommented:
    """``text`` with its comments blanked, a window of ``2 * _CONFIG_SPAN`` at a time: a try inside the last
    window reads it again, so no character is blanked more than twice."""

    def __init__(self, text: str) -> None:
        self.text, self.start, self.window = text, -_CONFIG_SPAN - 1, ""

    def at(self, start: int) -> str:
        """``_CONFIG_SPAN`` characters from ``start``, comments blanked."""
        if not self.start <= start <= self.start + _CONFIG_SPAN:
            chunk = self.text[start : start + 2 * _CONFIG_SPAN]
            self.start, self.window = start, _COMMENT.sub(_blank, chunk)
        offset = start - self.start
        return self.window[offset : offset + _CONFIG_SPAN]


def _blank(m: re.Match[str]) -> str:
    """A comment as spaces (its newlines kept: lines and columns stay); a string as it is."""
    return m[0] if m[0].startswith('"') else re.sub(r"[^\n]", " ", m[0])


def _size(node: object) -> int:
    return sum(1 + _size(v) for v in node.values()) if isinstance(node, Mapping) else 0


def ends(text: str) -> str:
    """All of a short text, the start and end of a long one (a title and its prose; the error): where types are only
    named, and where triage reads words."""
    return text if len(text) <= 2 * _ENDS_SPAN else f"{text[:_ENDS_SPAN]}\n{text[-_ENDS_SPAN:]}"


def read(text: str, known: Iterable[str] = ()) -> Reading:
    """Everything triage compares, from a log as pasted. ``known``: exception names that do not end in ``Error``
    but that a catalogued bug raises (``Slowdown``), recognised on bare lines too.

    Logs arrive as terminals and issue trackers give them: ANSI colours (or what is left of them once the escape
    character is lost in a paste), every line prefixed by its rank (``[rank3]:``, torchrun's ``[default3]:``,
    mpirun's ``[1,3]<stderr>:``), several ranks' tracebacks interleaved line by line, lines hard-wrapped at a
    terminal's width, ``\\r`` progress bars, a Markdown quote's ``> ``, a launcher's ``host:`` before every line. Each
    of these is undone, then the text is split into one stream per rank so that interleaved tracebacks come apart, and
    every traceback is read (a cut one too: its frames without its exception; frames written as ``File "..."``, as
    rich and IPython write them, under any path), every bare ``SomeError: message`` line (in a title, in prose, after
    ``[BUG]``), and every exception type the text only names.
    """
    lines = _lines(text)
    pattern = _known(known)
    per_rank, cut = [], []
    for rank, stream in streams(lines).items():
        errors, cut_here = _errors(unwrap(stream), pattern)
        per_rank.append((rank, errors))
        cut += cut_here
    clean = "\n".join(lines)
    return Reading(
        errors=_merge(per_rank),
        versions=versions(clean),
        config=config(clean),
        issues=tuple(dict.fromkeys(_ISSUE_URL.findall(clean))),
        text=clean,
        lines=len(lines),
        cut=tuple(dict.fromkeys(cut)),
        named=tuple(dict.fromkeys(m["type"] for m in _NAMED.finditer(ends(clean)))),
    )
