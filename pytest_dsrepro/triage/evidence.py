"""What a log shows of one known bug: its faces (``core.faces``) looked for in a ``triage.logread`` reading, in points.

A face's message found in the log is the only evidence that makes a candidate confident; frames, words and types rank
the candidates, and without a matched message the evidence stays below ``CONFIDENT`` (the points of each kind:
``Evidence``). Pure: no pytest, no torch.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePath
from types import MappingProxyType

from ..core.faces import LITERAL_MIN, Face
from .logread import Raised, Reading, ends

#: A candidate at or above this score is a known bug with confidence: a face's message matched.
CONFIDENT = 50
#: The most that shared words add to a matched message (they rank candidates that have no message).
_MATCHED_OVERLAP = 5
#: Words too common in DeepSpeed's errors and reports to tell bugs apart.
_COMMON = frozenset({
    "with", "from", "that", "this", "have", "been", "when", "were", "will", "then", "than", "into", "only", "also",
    "does", "each", "every", "there", "their", "other", "after", "before", "while", "which", "what", "where", "some",
    "more", "most", "first", "last", "same", "just", "like", "none", "true", "false", "self", "error", "object",
    "attribute", "deepspeed", "zero", "rank", "ranks", "step", "steps", "param", "params", "parameter", "parameters",
    "model", "engine", "module", "tensor", "tensors", "call", "calls", "called", "raise", "raises", "raised", "line",
    "file", "python", "site", "packages", "return", "value", "values", "given", "expected", "instead", "should",
    "would", "could", "need", "needs", "used", "uses", "using", "stage", "config", "training", "train", "the", "and",
    "for", "not", "but", "are", "its", "was", "can", "has", "all", "any", "one", "two", "out", "set", "get", "new",
    "bug", "fix", "fixes", "issue", "run", "runs", "use", "code", "import", "torch", "data", "https",
    "github", "com", "main", "def", "len", "lib", "home", "user", "users", "src", "init", "version",
})  # fmt: skip
#: Frame functions that wrap everything (torch's module call, decorators): never evidence.
_WRAPPERS = frozenset({"<module>", "__call__", "_call_impl", "_wrapped_call_impl", "wrapper", "wrapped_fn", "inner",
                       "decorate_context", "forward", "main", "_fn", "fn", "backward", "step", "train", "__init__",
                       "initialize"})  # fmt: skip
#: Frames every traceback of a step, a load or a context passes through: a fix's face that names one is not told
#: apart by it (a known fix's frames weigh only where they are its own).
_COMMON_FRAMES = _WRAPPERS | {"__enter__", "__exit__", "__getattr__", "__del__", "wait", "run", "py"}
#: The engine's entry points into a subsystem: every failure of building a ZeRO optimizer, of a load or of a save
#: passes through them, so without the message they corroborate no bug of that subsystem in particular.
_ENTRY_FRAMES = frozenset({"_configure_optimizer", "_configure_zero_optimizer", "_configure_basic_optimizer",
                           "_configure_bf16_optimizer", "_configure_fp16_optimizer", "load_checkpoint",
                           "_load_checkpoint", "save_checkpoint", "_save_checkpoint"})  # fmt: skip
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*[A-Za-z0-9_]")
#: The names Python's and torch's own messages use of any program: a message that names only these is no bug's own.
_STOCK_NAMES = frozenset({"nonetype", "int", "str", "list", "tuple", "dict", "float", "bool", "bytes", "object",
                          "tensor", "type", "set", "function", "module", "torch.tensor", "cpu", "cuda"})  # fmt: skip
#: What Python and torch say of any program's mistake (an index, an attribute of None, a device, an argument).
_STOCK = re.compile(
    r"out of range|object has no attribute|is not callable|values to unpack|unsupported operand type|division by "
    r"zero|pop from empty|local variable|can only concatenate|multiple values for argument|unexpected keyword "
    r"argument|no backend type associated|on the same device|re-initialize cuda|illegal memory access|same type as "
    r"input tensor|not compiled with cuda|has already been set|must be non-negative|0-dim tensor|must be \w+, not|"
    r"must be 2-d",
    re.IGNORECASE,
)
#: A name in a message: an identifier (``_``, a dot, camelCase) or a quoted name that starts with a capital.
_NAME = re.compile(r"[A-Za-z_]\w*(?:\.\w+)+|\w*_\w+|\w*[a-z0-9][A-Z]\w*|(?<=')[A-Z]\w+(?=')")
#: One spelling for what reports write several ways: ``ZeRO-3``, ``zero3``, ``Z3``, ``stage 3`` -> ``zero3``;
#: ``ZeRO-1/2`` -> ``zero1 zero2``; ``grad_norm``, ``gradient norm`` -> ``gradnorm``; ``bfloat16`` -> ``bf16``.
_SPELLINGS = (
    (re.compile(r"\b(?:zero|z)[-_ ]?(?:stage[-_ ]?)?([0-3])/([0-3])\b", re.I), r"zero\1 zero\2"),
    (re.compile(r"\b(?:zero|z)[-_ ]?(?:stage[-_ ]?)?([0-3])\b", re.I), r"zero\1"),
    (re.compile(r"\bstage[-_ ]?([0-3])\b", re.I), r"zero\1"),
    (re.compile(r"\bgrad(?:ient)?[-_ ]?norms?\b", re.I), "gradnorm"),
    (re.compile(r"\bb(?:float|f)[-_ ]?16\b", re.I), "bf16"),
    (re.compile(r"\bf(?:loat|p)[-_ ]?32\b", re.I), "fp32"),
    (re.compile(r"\bf(?:loat|p)[-_ ]?16\b", re.I), "fp16"),
)


@dataclass(frozen=True)
class Evidence:
    """One bug's evidence in a log: its points, why (strongest first), the face whose message matched (if any).

    The evidence, strongest first:

    - a face's message pattern finds an exception's message: 70 with the face's type (or a face that names none: 65),
      55 with another type (a wrapper), and up to 5 more the more of the message it covers; a face's message written
      out in the text without its type (a title, prose, a type whose first letter the paste lost) 50; these are the
      only evidence that makes a candidate confident;
    - a face with a type and frames but no message: that type raised through one of those frames, 60;
    - a message cut short that is the start of a face's message: 45 with the type, 35 without;
    - the type alone: 35 for a face that declares no message nor frames (plus shared words), 10 otherwise;
    - the face's frames among the log's (any path: a cut traceback's, rich's, a source checkout's): 10 each, at most
      30, and the functions the bug's title and root cause name: 6 each, files 3;
    - the face's words in the text: 8 each, at most 24;
    - the words the text shares with the bug's own (title, root cause, faces' words and messages), each weighed by how
      few bugs use it: at most 20 (5 beside a matched message, whose words it would count again); an exception type
      the text only names (a title's "RuntimeError when ..."): 5.
    """

    points: int
    why: tuple[str, ...]
    face: Face | None = None
    matched: bool = False  # a face's message (or type and frame) matched: the evidence that may make it confident
    corroborated: bool = False  # no message, but more than shared words: two of its faces' phrases, or its frames
    contradicted: str = ""  # a face's message matched where its frames say it is not the bug (why), and nothing else


@dataclass(frozen=True)
class _Hit:
    points: int
    why: str
    face: Face | None = None
    matched: bool = False
    contradicted: str = ""  # the message matched, but the traceback's DeepSpeed frames hold none of the face's
    retyped: bool = False  # the message matched under another exception type than the face's: another raise site
    written: bool = False  # the message only written out in the text: no exception of it was read


# --- words ---------------------------------------------------------------------------------------------------------


def spelled(text: str) -> str:
    """``text`` with the spellings reports vary in made one (``_SPELLINGS``)."""
    for pattern, one in _SPELLINGS:
        text = pattern.sub(one, text)
    return text


@functools.lru_cache(maxsize=512)
def words(text: str) -> Mapping[str, int]:
    """Distinctive words of ``text``, lower-cased, each weighed: 2 for an identifier (``_``, a dot or camelCase), else
    1; a dotted or underscored identifier counts its parts too."""
    found: dict[str, int] = {}
    for word in _WORD.findall(spelled(text)):
        parts = [word, *re.split(r"[._]", word)] if ("_" in word.strip("_") or "." in word) else [word]
        for part in parts:
            low = part.lower()
            if len(low) < 3 or low in _COMMON or low.isdigit():
                continue
            identifier = "_" in word.strip("_") or "." in word or word[1:] != word[1:].lower()
            found[low] = max(found.get(low, 0), 2 if part is word and identifier else 1)
    return MappingProxyType(found)  # kept by the cache: read-only


@dataclass(frozen=True)
class Vocabulary:
    """The catalogue's words: how many bugs use each (a word every bug uses tells none apart)."""

    bugs: int
    used_by: Mapping[str, int]

    @classmethod
    @functools.lru_cache(maxsize=8)  # one catalogue, triaged many times
    def of(cls, documents: tuple[str, ...]) -> Vocabulary:
        counts: dict[str, int] = {}
        for document in documents:
            for word in words(document):
                counts[word] = counts.get(word, 0) + 1
        return cls(len(documents), counts)

    def weight(self, word: str) -> float:
        """How much a shared word tells: 1 for a word one bug uses, nothing for one every bug uses (however many bugs
        the catalogue holds)."""
        rarest = math.log((self.bugs + 1) / 1.5)
        return max(0.0, math.log((self.bugs + 1) / (self.used_by.get(word, 0) + 0.5)) / rarest) if rarest > 0 else 0.0


def shared(theirs: Mapping[str, int], mine: Mapping[str, int], vocabulary: Vocabulary) -> tuple[float, list[str]]:
    """How much ``mine`` (a text's words) and ``theirs`` (a bug's) have in common, the rarest words weighing most."""
    common = sorted(theirs.keys() & mine.keys(), key=lambda w: (-vocabulary.weight(w) * theirs[w], w))
    return sum(vocabulary.weight(w) * theirs[w] for w in common), common


@functools.lru_cache(maxsize=1024)
def _phrase(phrase: str) -> re.Pattern[str]:
    """A face's words as found in a text: case aside, whole words, any run of spaces, spellings made one."""
    parts = [re.escape(p) for p in spelled(phrase).split()]
    return re.compile(r"(?<![\w])" + r"\s+".join(parts) + r"(?![\w])", re.IGNORECASE)


@functools.lru_cache(maxsize=1024)
def _one(phrase: str) -> str:
    return spelled(phrase).lower()


def phrases(faces: Iterable[Face], text: str, lower: str) -> list[str]:
    """The faces' words found in ``text`` (already ``spelled``; ``lower``: the same lower-cased), each once
    (``grad_norm`` and ``gradient norm`` are one)."""
    found: dict[str, str] = {}
    for face in faces:
        for phrase in face.words:
            one = _one(phrase)
            if one not in found and one.split()[0] in lower and _phrase(phrase).search(text):
                found[one] = phrase
    return list(found.values())


# --- messages and frames -------------------------------------------------------------------------------------------


def _variants(message: str) -> tuple[str, ...]:
    """A message as a pattern may need it: as shown, its lines joined without and with a space."""
    return (message, message.replace("\n", ""), message.replace("\n", " "))


def _search(pattern: str, message: str) -> re.Match[str] | None:
    """Where ``pattern`` finds ``message`` as shown or with its lines joined (``_variants``)."""
    return next((m for m in (re.search(pattern, v) for v in _variants(message)) if m), None)


def _typed(face: Face, error: Raised) -> bool | None:
    """Whether ``error`` is of the face's type (None: the face names none)."""
    return None if face.raises_name is None else face.raises_name in error.type_names


def contradiction(face: Face, error: Raised) -> str:
    """Why ``error``'s frames say it is not the bug ``face`` shows: the face names where it raises, the traceback shows
    DeepSpeed's frames, and none of them is one of the face's (the same message from another call: a forward's fetch,
    not the step's all-gather). Empty when they agree, or when either says nothing. Only the traceback that raised it
    counts: frames a paste puts elsewhere (after its message, another traceback) may be another error's."""
    if not face.frames or not error.deepspeed_frames or face.frame_hits([(f.file, f.function) for f in error.frames]):
        return ""
    where = error.innermost_deepspeed
    return f"its message is raised through {', '.join(face.frames)}, and this log raised it at {where}, not there"


def against(face: Face, error: Raised) -> _Hit:
    """One face against one exception: the message, a message cut short, or the type."""
    typed = _typed(face, error)
    found = _search(face.match, error.message) if face.match else None
    if found is not None:
        covered = round(5 * min(len(found.group()) / max(len(error.first_line), 1), 1.0))  # the more it says, the more
        contradicted = contradiction(face, error)
        if typed is None:
            why = f"the message is one it is seen with: {face.describe()}"
            return _Hit(65 + covered, why, face, True, contradicted)
        if typed:
            why = f"the message is the one it declares: {face.describe()}"
            return _Hit(70 + covered, why, face, True, contradicted)
        why = f"the message matches its {face.match!r} (raised as {error.name}, not {face.raises})"
        return _Hit(55 + covered, why, face, True, contradicted, retyped=True)
    short = error.first_line.rstrip()
    if face.match and len(short) >= LITERAL_MIN and face.literal.startswith(short) and short != face.literal:
        points = (45 if typed is not False else 35) - (0 if specific(re.escape(short)) else 20)  # stock words so far
        return _Hit(points, f"the message is cut short of {face.match!r}", face)
    if typed and face.match is None and not face.frames:  # a face with frames needs one of them (``typed_through``)
        return _Hit(35, f"it declares {face.raises} with any message", face)
    if typed:
        return _Hit(10, f"the same exception type ({face.raises}), another message", face)
    return _Hit(0, "")


@functools.lru_cache(maxsize=1024)
def specific(pattern: str) -> bool:
    """Whether a message pattern is a bug's own: it names something (an identifier, a class: ``'BF16_Optimizer'
    object has no attribute 'state'``), or it is long and none of Python's or torch's stock phrases (DeepSpeed's own
    wording). ``list index out of range``, ``'NoneType' object has no attribute 'to'``, ``No backend type associated
    with device type cpu`` are not: they are raised from any cause."""
    said = re.sub(r"\\(.)", r"\1", pattern)
    names = [n for n in _NAME.findall(said) if not re.fullmatch(r"\w*(?:Error|Exception)", n)]
    if any(name.strip("_.").lower() not in _STOCK_NAMES for name in names):
        return True
    return len(re.findall(r"[A-Za-z]", said)) >= LITERAL_MIN and not _STOCK.search(said)


def _own_frames(face: Face, log: Log, strict: bool) -> tuple[str, ...]:
    """The face's frames among the log's; ``strict``: not those every traceback of a training step passes through
    (``engine.py:backward``, ``step``, a wrapper), which tell no bug apart."""
    hits = face.frame_hits(log.frames)
    return tuple(h for h in hits if h.rpartition(":")[2] not in _COMMON_FRAMES) if strict else hits


def agrees(face: Face, log: Log) -> bool:
    """Whether the log puts the face's message where the face raises it: one of its own frames among the log's
    (``_own_frames``), or one (an identifier, not a wrapper) named in the text (``log_summary(show_straggler=1)``)."""
    if _own_frames(face, log, True):
        return True
    functions = (f.rpartition(":")[2] for f in face.frames)
    return any("_" in f.strip("_") and f not in _COMMON_FRAMES and _phrase(f).search(log.text) for f in functions)


def placed(face: Face, log: Log) -> bool:
    """Whether a face's matched message names the bug: a message of its own (``specific``), or one the log raises
    where the face does (``agrees``)."""
    return face.match is None or specific(face.match) or agrees(face, log)


def written_out(face: Face, text: str, whole: str | None = None) -> _Hit:
    """A face's message written in the text (``text``: lower-cased) without its type (a title, prose, a type the paste
    cut). Where the pattern says more than its literal start (``'ds_shape': \\((?:\\d+, )*0...``), the whole text
    (``whole``, as read) must match it too: the start alone is another message's as well."""
    literal = face.literal
    if not (face.match and len(literal) >= LITERAL_MIN and _one(literal) in text):
        return _Hit(0, "")
    if whole is not None and not _literal_only(face.match) and not re.search(face.match, whole, re.IGNORECASE):
        return _Hit(0, "")
    return _Hit(50, f"the text writes out its message {literal!r}", face, True, written=True)


def _literal_only(pattern: str) -> bool:
    """Whether a message pattern is all literal (no unescaped operator): nothing for a regular expression to add."""
    return not re.search(r"(?<!\\)[\[\](){}?*+|^$]", pattern)


def typed_through(face: Face, reading: Reading, hits: Sequence[str]) -> _Hit:
    """A face with a type and frames but no message: that type raised (or named) and one of its frames shown."""
    if face.match or not face.raises_name or not hits:
        return _Hit(0, "")
    raised = any(face.raises_name in e.type_names for e in reading.errors) or face.raises_name in reading.named
    if not raised:
        return _Hit(0, "")
    return _Hit(60, f"{face.raises} through {', '.join(hits)}, as it is seen", face, True)


@functools.lru_cache(maxsize=1024)
def _said(named: str) -> frozenset[str]:
    return frozenset(re.findall(r"\w+", named))


def named_frames(named: str, log: Log) -> tuple[list[str], list[str]]:
    """The log's DeepSpeed functions and files that ``named`` (a bug's title and root cause) names in its words."""
    said = _said(named)
    hit_functions = [f for f in log.deepspeed_functions if f in said]
    return hit_functions, [s for s in log.deepspeed_files if s in said and s not in hit_functions]


def _overlap(bug_words: Mapping[str, int], log: Log) -> tuple[int, list[str]]:
    """The points the words a bug and a log share are worth (at most 20), and those words, rarest first."""
    weight, common = shared(bug_words, log.words, log.vocabulary)
    return round(20 * (1 - math.exp(-weight / 6))), common


# --- one bug -------------------------------------------------------------------------------------------------------


def document(title: str, root_cause: str, faces: Sequence[Face]) -> str:
    """A bug in words, as a text is compared with it: title, root cause, its faces' words, messages and frames."""
    said = [f"{' '.join(f.words)} {f.literal} {' '.join(f.frames)}" for f in faces]
    return " ".join([title, root_cause, *said])


@dataclass(frozen=True)
class Reach:
    """What can show a bug in a log at all, made once per catalogue (``Reach.of``): the exception names its faces
    declare, their frames' functions, the words of its title and root cause, the start of each message pattern (a
    pattern that starts with an operator: ``always``), the first word of each phrase. A log that shows none of them
    gives the bug nothing but the words it shares (``collect`` skips the rest: most bugs, for most logs)."""

    types: frozenset[str]
    functions: frozenset[str]
    named: frozenset[str]
    literals: tuple[str, ...]
    always: bool
    first_words: tuple[str, ...]

    @classmethod
    def of(cls, faces: Sequence[Face], named: str) -> Reach:
        patterns = [f for f in faces if f.match]
        return cls(frozenset(f.raises_name for f in faces if f.raises_name),
                   frozenset(name.rpartition(":")[2] for f in faces for name in f.frames), _said(named),
                   tuple(f.literal for f in patterns if f.literal), any(not f.literal for f in patterns),
                   tuple(_one(w).split()[0] for f in faces for w in f.words if w.split()))  # fmt: skip

    def within(self, log: Log) -> bool:
        """Whether ``log`` shows anything of the bug but shared words: a type, a frame, a function its words name, a
        message's start (or a message cut short of one), a phrase's first word."""
        if self.always or self.types & log.types or self.functions & log.functions:
            return True
        if self.named & log.deepspeed_names:
            return True
        if any(w in log.lower for w in self.first_words):
            return True
        return any(lit.lower() in log.messages or _one(lit) in log.lower or any(map(lit.startswith, log.shorts))
                   for lit in self.literals)  # fmt: skip


@dataclass(frozen=True)
class Log:
    """A reading with what every bug is compared against, made once per triage: its text (words read from it:
    ``logread.ends``), that text's words, the catalogue's ``Vocabulary``."""

    reading: Reading
    text: str
    words: Mapping[str, int]
    vocabulary: Vocabulary
    frames: tuple[tuple[str, str], ...] = ()  # every frame as faces name them: the file's own name, the function
    deepspeed_functions: tuple[str, ...] = ()  # DeepSpeed frames' functions (not wrappers), each once
    deepspeed_files: tuple[str, ...] = ()  # DeepSpeed frames' files, without ``.py``, each once
    lower: str = ""  # the text lower-cased
    # what ``Reach.within`` looks for: every type raised or named, every frame's function, the DeepSpeed functions
    # and files, every message (as shown, its lines joined) lower-cased, the messages' first lines
    types: frozenset[str] = frozenset()
    functions: frozenset[str] = frozenset()
    deepspeed_names: frozenset[str] = frozenset()
    messages: str = ""
    shorts: tuple[str, ...] = ()

    @classmethod
    def of(cls, reading: Reading, documents: Sequence[str]) -> Log:
        text = spelled(ends(reading.text))
        ds = reading.deepspeed_frames
        functions = tuple(dict.fromkeys(f.function for f in ds if f.function not in _WRAPPERS))
        files = tuple(dict.fromkeys(PurePath(f.path).stem for f in ds))
        errors = reading.errors
        return cls(reading, text, words(text), Vocabulary.of(tuple(documents)),
                   tuple((f.file, f.function) for f in reading.frames), functions, files, text.lower(),
                   frozenset({*(n for e in errors for n in e.type_names), *reading.named}),
                   frozenset(f.function for f in reading.frames), frozenset({*functions, *files}),
                   "\n".join(v for e in errors for v in _variants(e.message)).lower(),
                   tuple(s for e in errors if len(s := e.first_line.rstrip()) >= LITERAL_MIN))  # fmt: skip


def collect(
    faces: Sequence[Face],
    named: str,
    bug_words: Mapping[str, int],
    log: Log,
    *,
    strict: bool = False,
    reach: Reach | None = None,
) -> Evidence:
    """A bug's evidence in a log: the best face's message (or type), then its frames, its words, the words it shares
    with the text and a type the text only names. ``named``: the bug's title and root cause (frames they name).
    ``strict`` (a fix known from the ledger or the atlas, whose faces no repro checked): a message that is not
    ``specific`` names it with confidence only where the log ``agrees`` on where it is raised; for any bug, so does
    such a message only written out in the text (where none of its faces agrees), and a message raised under another
    type than its face's needs its frames. ``reach`` (the bug's,
    made once): a log it does not reach gives the bug only the words they share."""
    if reach is not None and not reach.within(log):
        overlap, common = _overlap(bug_words, log)
        return Evidence(min(overlap, CONFIDENT - 1), (f"shares {', '.join(common[:4])}" if overlap >= 3 else "",))
    return _evidence(faces, named, bug_words, log, strict)


def _evidence(faces: Sequence[Face], named: str, bug_words: Mapping[str, int], log: Log, strict: bool) -> Evidence:
    """``collect``, for a bug the log reaches."""
    reading = log.reading
    errors = [e for e in reading.errors if not e.lost_peer] or list(reading.errors)
    hit_frames = {face: _own_frames(face, log, strict) for face in faces}
    hits = [against(face, e) for face in faces for e in errors]
    raised_elsewhere = {h.face for h in hits if h.contradicted}  # its message written out is that exception's too
    hits += [written_out(face, log.lower, log.text) for face in faces if face not in raised_elsewhere]
    hits += [typed_through(face, reading, hit_frames[face]) for face in faces]
    contradicted = max((h for h in hits if h.contradicted), key=lambda h: h.points, default=None)
    best = max((h for h in hits if not h.contradicted), key=lambda h: h.points, default=_Hit(0, ""))
    declared = list(dict.fromkeys(h for face in faces for h in hit_frames[face]))
    functions, files = named_frames(named, log)
    entries = sum(d.rpartition(":")[2] in _ENTRY_FRAMES for d in declared)  # every load passes there: a file's worth
    framed = min(10 * (len(declared) - entries) + 3 * entries + 6 * len(functions) + 3 * len(files), 30)
    said = phrases(faces, log.text, log.lower)
    overlap, common = _overlap(bug_words, log)
    if best.matched:  # the message's own words already counted in the match: what else the text says, a little
        overlap = min(overlap, _MATCHED_OVERLAP)
    types = {face.raises_name for face in faces if face.raises_name}
    named_types = sorted(types & set(reading.named))
    only_named = 5 if best.points < 10 and named_types else 0
    why = (
        best.why,
        f"the log's frames {', '.join(declared + functions + files)} are where it is seen" if framed else "",
        f"the text says {', '.join(repr(w) for w in said)}" if said else "",
        f"shares {', '.join(common[:4])}" if overlap >= 3 else "",
        f"the text names {', '.join(named_types)}" if only_named else "",
    )
    more = framed + min(8 * len(said), 24) + overlap + only_named
    if (
        best.matched
        and best.face is not None
        and not placed(best.face, log)
        and (strict or (best.written and not any(agrees(face, log) for face in faces)))
    ):
        said_so = f"{best.why} (a message many causes raise, and not where it raises it)"
        return Evidence(min(best.points + more, CONFIDENT - 1), (said_so, *why[1:]), best.face)
    if best.retyped and best.face is not None and not agrees(best.face, log):
        said_so = f"{best.why}: the same words from another raise, unless its frames show where the bug raises them"
        return Evidence(min(best.points + more, CONFIDENT - 1), (said_so, *why[1:]), best.face)
    if best.matched:
        return Evidence(best.points + more, why, best.face, True)
    if contradicted is not None:  # the message is the bug's, where the bug does not raise it: what it would have had
        return Evidence(contradicted.points + more, (contradicted.why, *why[1:]), contradicted.face, False, False,
                        contradicted.contradicted)  # fmt: skip
    telling = [p for p in said if not strict or len(p.split()) > 1 or _NAME.fullmatch(p)]
    corroborated = len(telling) >= 2 or any(d.rpartition(":")[2] not in _ENTRY_FRAMES for d in declared)
    return Evidence(min(best.points + more, CONFIDENT - 1), why, best.face, False, corroborated)
