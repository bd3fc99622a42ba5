"""Hostile texts, written once: what an exception message, a repro marker, a results file or a pasted log may hold
that no one checked. ``tests/test_hostile.py`` renders every output with each and fails on anything that leaves its
code (Markdown, HTML, SVG) or reaches a terminal unshown."""

from __future__ import annotations

#: A link a page must never follow.
JAVASCRIPT = "javascript:alert(document.domain)"

#: One text per way out; each would break its medium if written as it is.
TEXTS = {
    "backtick": "one ` backtick then @octocat [click](https://evil.example/x) ![img](https://evil.example/i.png)",
    "backticks": "``` a fence `` two <img src=x onerror=alert(1)> @octocat",
    "html": "<script>alert(1)</script><b onmouseover=alert(1)>bold</b><!-- open comment",
    "details": "</code></details><details open><summary>pwn</summary>",
    "mention": "@octocat and @deepspeedai/team see www.evil.example or http://evil.example/x",
    "link": "[click me](javascript:alert(1)) <https://evil.example> [ref][1]\n\n[1]: https://evil.example",
    "image": "![tracker](https://evil.example/pixel.png)",
    "entity": "&lt;script&gt; &#x3C;img src=x&#x3E; &#64;octocat",
    "lines": "first line\n# a heading\n- a list item\n> a quote\n\n<div>block</div>\n    indented code",
    "pipe": "a | b || c \\| d",
    "terminal": "\x1b[2J\x1b[H\x1b]0;pwned title\x07\x1b]52;c;ZXZpbA==\x07\x1b[31mred\x9b31m\rovertype",
    "control": "nul\x00 bell\x07 backspace\x08 vt\x0b ff\x0c del\x7f c1\x85 \u202eevil\u202c \ufffe",
    "backslash": "ends in a backslash \\",
    "emphasis": "**bold** _under_ ~~strike~~ <em>em</em>",
}

#: A repro id (also a file name part and an SVG title): control characters and markup.
REPRO_ID = "zero3-\x1b]0;title\x07<b>@octocat</b>`x`\x00"


def adversarial_lines(size: int = 64 * 1024) -> dict[str, str]:
    """One line of ``size`` characters per shape that a regex with nested or overlapping repeats takes the square
    of its length on: dotted words, spaces, colons, brackets, quotes, paths, exception names, rank prefixes."""
    shapes = {
        "dotted words": "word.",
        "dotted names": "torch.distributed.",
        "spaces": "x ",
        "colons": "a: ",
        "brackets": "[rank0]: ",
        "parentheses": "(",
        "quotes": "'a' ",
        "paths": "/usr/lib/",
        "exception names": "ValueError ",
        "File lines": 'File "x.py", line 1, in ',
        "versions": "deepspeed 0.",
        "equals": "deepspeed==",
        "digits": "1",
        "one word": "A",
        "ansi": "\x1b[31m",
        "json": '{"a": ',
        "comments": "= {/*",
        "escaped quotes": '= {"\\"',
    }
    return {name: (unit * (size // len(unit) + 1))[:size] for name, unit in shapes.items()}
