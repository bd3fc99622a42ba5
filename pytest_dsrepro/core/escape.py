"""Texts from outside (exception messages, repro markers, results files, pasted logs) made safe for each medium the
plugin writes, in one place per medium: every writer of HTML, SVG, Markdown or terminal text goes through here.

- HTML and SVG (``html_text``, ``html_link``): escaped for text and attributes alike, with the characters XML 1.0
  forbids (and the other control characters) removed; a link survives only as http(s) or relative, never
  ``javascript:`` or ``data:``.
- Markdown (``md_code``, ``md_fence``, ``md_text``, ``md_link``): a text stays inside its code, or every character
  Markdown reads is escaped and mentions and bare links are broken: no HTML, mention, image or link gets out.
- Terminals (``terminal``): escape sequences and control characters shown (``\\x1b``), never executed.
"""

from __future__ import annotations

import html
import re
from typing import Any, TextIO
from urllib.parse import quote, urlsplit

#: C0 controls but tab and newline; DEL and the C1 controls; the bidirectional overrides and
#: isolates (text that reads otherwise than it is); the non-characters XML forbids; lone surrogates.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ufffe\uffff\ud800-\udfff]")
#: Every control character, newlines and tabs too: what a one-line medium must not hold.
_ANY_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ufffe\uffff\ud800-\udfff]")
#: The ASCII punctuation a Markdown reader (GitHub's: ``~`` strikes, ``$`` is maths) may act on anywhere in a line:
#: code, emphasis (``_`` only at a word's edge), links (a ``[`` that a ``](``, ``][``, ``]:`` or a reference's
#: number may close), HTML (a ``<`` that opens a tag), entities, table cells. Escaping any ASCII punctuation is
#: valid CommonMark; the rest (paths, versions: ``/``, ``.``, ``+``) stays as written, so that a report can still make
#: its local paths neutral and a reader's search finds a version.
_MD_PUNCTUATION = re.compile(
    r"([\\`*|~$]|<(?=[A-Za-z/!?])|(?<!\w)_|_(?!\w)|&(?=#?\w+;)|\[(?=[^\]]*\][(\[:]|[\d^][^\]]*\]))"
)
#: What only the start of a line makes a block: a list item (``-``, ``+``, ``1.``, ``1)``), a quote, a heading, a
#: setext underline.
_MD_LINE_START = re.compile(r"^(\d{0,9})([-+#=>]|[.)](?=\s|$))")
#: What GitHub turns into a link or a mention in plain text: ``@name``, ``scheme://``, ``www.``.
_MD_LIVE = re.compile(r"((?<!\w)@(?=\w)|@(?=[\w-]+\.\w)|:(?=//)|(?<![\w.])www(?=\\?\.))", re.IGNORECASE)
WORD_JOINER = "\u2060"
#: The schemes a link may have; a link with none is relative.
SAFE_SCHEMES = ("http", "https")


def printable(text: str) -> str:
    """``text`` without control characters (newlines and tabs kept): what any medium may hold."""
    return _CONTROL.sub("", text)


def one_line(text: str) -> str:
    """``text`` on one line, its whitespace runs (newlines too) one space, control characters removed."""
    return " ".join(_ANY_CONTROL.sub(" ", text).split())


# --- HTML and SVG --------------------------------------------------------------------------------------------------


def html_text(value: object) -> str:
    """``value`` as HTML or XML text, good in an attribute too (quotes escaped); control characters removed."""
    return html.escape(printable(str(value)), quote=True)


def safe_link(url: str) -> str | None:
    """``url`` if a reader may follow it: http(s) with a host, or relative (a relative path that would read as a
    scheme, ``javascript:x.json``, gets ``./`` before it); None for any other."""
    url = url.strip()
    if not url or _ANY_CONTROL.search(url):
        return None
    try:
        parts = urlsplit(url)
    except ValueError:
        return None
    if parts.scheme:
        return url if parts.scheme.lower() in SAFE_SCHEMES and parts.netloc else None
    if url.startswith("//") or url.startswith("\\"):
        return None  # another host, whatever scheme the page has
    head = url.split("/", 1)[0]
    return f"./{url}" if ":" in head else url


def html_link(url: str) -> str | None:
    """``url`` escaped for an ``href``, or None where it is no link to follow (:func:`safe_link`)."""
    safe = safe_link(url)
    return None if safe is None else html_text(safe)


def path_link(path: str) -> str | None:
    """A relative file path as an ``href``: percent-quoted (``#``, ``?``, ``:`` and spaces are part of its name)."""
    return html_link(quote(path, safe="/"))


# --- Markdown ------------------------------------------------------------------------------------------------------


def md_code(value: object) -> str:
    """``value`` as one Markdown code span, whatever backticks it holds (its fence longer than any run of backticks in
    it); ``-`` shown for nothing."""
    text = one_line(str(value)) or "-"
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if text[0] in "` " or text[-1] in "` " else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def md_fence(text: str, lang: str = "") -> str:
    """A fenced code block that holds ``text`` whole: its fence longer than any run of backticks inside."""
    longest = max((len(m) for m in re.findall(r"`{3,}", text)), default=2)
    fence = "`" * (longest + 1)
    return f"{fence}{lang}\n{printable(text).rstrip()}\n{fence}"


def md_text(value: object) -> str:
    """``value`` as Markdown text read as it is written: one line, every punctuation Markdown acts on escaped, and
    mentions and bare links (``@name``, ``http://``, ``www.``) broken by a word joiner."""
    escaped = _MD_LINE_START.sub(r"\1\\\2", _MD_PUNCTUATION.sub(r"\\\1", one_line(str(value))))
    return _MD_LIVE.sub(lambda m: m[0] + WORD_JOINER, escaped)


#: An address GitHub shows and links as it is written: nothing in it that Markdown reads.
_PLAIN_URL = re.compile(r"https?://[\w.-]+(?::\d+)?(?:/[\w./%#?=&:+~,;@-]*)?", re.ASCII)


def md_link(url: str | None, label: str | None = None) -> str:
    """A Markdown link to ``url`` where it is an http(s) address (bare where Markdown reads nothing in it), shown as
    ``label`` if given; any other address (``javascript:``, a relative one) as text, never a link."""
    if not url:
        return md_text(label or "not recorded")
    safe = safe_link(url)
    if safe is None or not urlsplit(safe).scheme:
        return md_text(url)
    plain = _PLAIN_URL.fullmatch(safe) is not None
    if label is None and plain:
        return safe
    if label == url and plain:  # an address shown as itself: nothing in it that Markdown reads
        return f"[{safe}]({safe})"
    target = safe if plain else "<" + quote(safe, safe="/:?#[]@!$&'*+,;=%~") + ">"
    return f"[{md_text(label or safe)}]({target})"


# --- terminals -----------------------------------------------------------------------------------------------------

_TERMINAL_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def terminal(text: str) -> str:
    """``text`` for a terminal: every escape and control character (newlines and tabs aside) shown as ``\\xNN``
    (``\\u202e`` for the bidirectional ones), so a results file or a log can neither clear the screen, set the
    window's title, write the clipboard, nor hide what it says."""
    return _TERMINAL_CONTROL.sub(lambda m: f"\\x{ord(m[0]):02x}" if ord(m[0]) < 0x100 else f"\\u{ord(m[0]):04x}", text)


class ShownStream:
    """A text stream (``sys.stdout``, ``sys.stderr``) whose every write goes through :func:`terminal`: what the
    ``dsrepro`` command prints (commit subjects, ledger rows, failure texts, paths) can run no escape sequence,
    whichever code printed it. Everything else is the stream's own; ``raw`` is the stream itself, for text whose
    colours are the command's own and whose other texts went through :func:`terminal` already."""

    def __init__(self, raw: TextIO) -> None:
        self.raw = raw

    def write(self, text: str) -> int:
        return self.raw.write(terminal(text))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)
