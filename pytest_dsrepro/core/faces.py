"""``ds_seen``: how users meet a catalogued bug, each face with the link where it was seen.

A repro's ``ds_version`` gate says what the repro itself raises on a CPU; users meet the same bug in other shapes, and
a repro declares each as a face. Faces are evidence for ``dsrepro triage`` and are shown by ``dsrepro list`` and
``--ds-report``; they are never a gate: what the repro must raise stays its ``ds_version`` marker, so a repro that
stops raising it is UNEXPECTED as before.

Pure: no pytest, no torch; a marker's arguments are validated here (``MarkerError`` naming marker, test and value).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from .errors import MarkerError

#: ``ds_seen``'s parameters, in the order positional arguments fill them.
PARAMETERS = ("where", "raises", "match", "frames", "words", "gpu")
_NAME = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
#: A frame as a face names it: a function, or ``file.py:function`` (the file's own name, no directories).
_FRAME = re.compile(r"(?:(?P<file>[\w.-]+\.py):)?(?P<function>[A-Za-z_<>]\w*>?)")
_LINK = re.compile(r"https?://\S+")
#: A message as long as this, written out in the text without its exception type, still names the bug.
LITERAL_MIN = 20


@dataclass(frozen=True)
class Face:
    """One way a bug shows: the exception's name as printed (``TypeError``, ``torch.distributed.DistBackendError``),
    a pattern of its message, DeepSpeed functions it raises through, phrases its reports use; where it was seen, and
    whether on GPUs. A gate's face also has its ``affected`` range (``gate``: the repro's own ``ds_version``).

    The shapes a face stands for: NCCL's wording of a dtype mismatch on GPUs, a fused optimizer's class name where the
    repro uses torch's, a sibling attribute of the same root cause, another release's wording, a traceback cut before
    its message, or only the words of an issue. A repro declares each beside its ``ds_repro`` marker, as a separate
    marker entry::

        pytest.mark.ds_seen(
            "https://github.com/deepspeedai/DeepSpeed/issues/8072",
            raises="TypeError", match=r"output tensor must have the same type as input tensor",
            frames=("_allgather_params_coalesced",), words=("autocast_adapter_dtype",), gpu=True,
        )

    ``Face`` is also how triage reads a gate (``affected`` set, ``gate`` true): one shape for every face.
    """

    where: str
    raises: str | None = None
    match: str | None = None
    frames: tuple[str, ...] = ()
    words: tuple[str, ...] = ()
    gpu: bool = False
    affected: str | None = None
    gate: bool = False

    @property
    def raises_name(self) -> str | None:
        """The exception's own name, without its module."""
        return None if self.raises is None else self.raises.rsplit(".", 1)[-1]

    @property
    def literal(self) -> str:
        """The plain text ``match`` starts with (escapes undone, up to its first operator): what a reader sees."""
        return literal_prefix(self.match or "")

    def covers(self, release: Version) -> bool:
        """Whether ``release`` is in the face's range (a face without one covers every release)."""
        return self.affected is None or SpecifierSet(self.affected).contains(release, prereleases=True)

    def describe(self) -> str:
        """The face in a phrase: ``TypeError matching '...' through f, g; words: ...``."""
        parts = [self.raises or "an error"] if self.raises or self.match else []
        if self.match:
            parts.append(f"matching {self.match!r}")
        if self.frames:
            parts.append(f"through {', '.join(self.frames)}")
        if self.words:
            parts.append(f"words: {', '.join(repr(w) for w in self.words)}")
        return " ".join(parts) + (" (on GPUs)" if self.gpu else "")

    def frame_hits(self, frames: Sequence[tuple[str, str]]) -> tuple[str, ...]:
        """The face's frames among ``frames`` (each a file's own name and a function), as the face names them."""
        hits = []
        for named in self.frames:
            found = _FRAME.fullmatch(named)
            if found is not None and any(
                function == found["function"] and (found["file"] is None or file == found["file"])
                for file, function in frames
            ):
                hits.append(named)
        return tuple(hits)


@functools.lru_cache(maxsize=1024)
def literal_prefix(pattern: str) -> str:
    """The text a regular expression matches literally from its start: ``r"slice\\(\\) cannot"`` -> ``slice()
    cannot``; it stops at the first operator (``.``, ``\\d``, a group, a class, a repeat, ``|``)."""
    out = []
    i = 1 if pattern.startswith("^") else 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\" and i + 1 < len(pattern):
            nxt = pattern[i + 1]
            if nxt.isalnum():
                break
            out.append(nxt)
            i += 2
            continue
        if char in ".^$*+?{}[]()|":
            if char in "*+?{" and out:
                out.pop()  # the repeated character is not there for sure
            break
        out.append(char)
        i += 1
    return "".join(out)


def parse(args: Sequence[object], kwargs: Mapping[str, object], where: str) -> Face:
    """A ``ds_seen`` marker's arguments, validated; ``MarkerError`` names ``where`` (marker and test) and the value."""
    unknown = sorted(set(kwargs) - set(PARAMETERS))
    if unknown or len(args) > 1:
        extra = [repr(a) for a in args[1:]] + unknown
        raise MarkerError(f"{where}: unexpected argument(s) {', '.join(extra)}; takes {', '.join(PARAMETERS)}")
    given = {**dict(zip(PARAMETERS, args, strict=False)), **kwargs}
    link = given.get("where")
    if not isinstance(link, str) or not _LINK.fullmatch(link):
        raise MarkerError(f"{where}: where={link!r} must be the link where the face was seen (http:// or https://)")
    face = Face(
        where=link,
        raises=_raises(given.get("raises"), where),
        match=_pattern(given.get("match"), where),
        frames=_strings("frames", given.get("frames", ()), where, _FRAME),
        words=_strings("words", given.get("words", ()), where, None),
        gpu=_flag(given.get("gpu", False), where),
    )
    if not (face.raises or face.match or face.frames or face.words):
        raise MarkerError(f"{where}: a face needs at least one of raises=, match=, frames=, words= (where={link!r})")
    return face


def parse_all(marks: Sequence[tuple[Sequence[object], Mapping[str, object]]], where: str) -> tuple[Face, ...]:
    """Every ``ds_seen`` marker of a test, validated, in marker order."""
    return tuple(parse(args, kwargs, where) for args, kwargs in marks)


def gate_face(upstream: str | None, affected: str, raises: str, match: str | None) -> Face:
    """A ``ds_version`` gate read as a face: what the repro raises in its range, seen where the repro's bug is."""
    return Face(upstream or "", raises, match, affected=affected, gate=True)


def _raises(value: object, where: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, type) and issubclass(value, BaseException):
        return value.__name__
    if isinstance(value, str) and _NAME.fullmatch(value):
        return value
    raise MarkerError(f"{where}: raises={value!r} must be an exception class or its name as printed "
                      "('TypeError', 'torch.distributed.DistBackendError')")  # fmt: skip


def _pattern(value: object, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise MarkerError(f"{where}: match={value!r} must be a regular expression of the message")
    try:
        re.compile(value)
    except re.error as exc:
        raise MarkerError(f"{where}: match={value!r} is not a regular expression: {exc}") from None
    return value


def _strings(name: str, value: object, where: str, form: re.Pattern[str] | None) -> tuple[str, ...]:
    items = (value,) if isinstance(value, str) else value
    if not isinstance(items, (tuple, list)) or not all(isinstance(v, str) and v.strip() for v in items):
        raise MarkerError(f"{where}: {name}={value!r} must be a tuple of non-empty strings")
    bad = [v for v in items if form is not None and not form.fullmatch(v)]
    if bad:
        raise MarkerError(f"{where}: {name}={bad[0]!r} must name a function, or file.py:function")
    return tuple(items)


def _flag(value: object, where: str) -> bool:
    if not isinstance(value, bool):
        raise MarkerError(f"{where}: gpu={value!r} must be True or False")
    return value
