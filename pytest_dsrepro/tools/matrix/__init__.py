"""``dsrepro matrix``: the results files of many runs (one or more per DeepSpeed release) as one table.

The table as data (:mod:`.model`), made from results files (:mod:`.build`), drawn (:mod:`.symbols`) and said in words
(:mod:`.notes`) alike by one renderer per form: :mod:`.terminal` (120 columns), :mod:`.markdown`, :mod:`.html` (a
fixed layout that fits 1400 pixels), :mod:`.svg` (an image for an issue).

Everything here is a pure function of the files' contents, tested without torch (the command, its output checks and
its exit codes: ``tools/matrix_command``). The files are read, and checked, by ``core.results``; verdicts and reasons
are the gates' own ``Verdict`` and ``Reason``.
"""

from __future__ import annotations

from .build import load, merge, since
from .html import render_html
from .markdown import render_markdown
from .model import Cell, Column, Disagreement, Matrix, MatrixError, Row, Run
from .svg import render_svg
from .terminal import render_terminal

__all__ = [
    "Cell",
    "Column",
    "Disagreement",
    "Matrix",
    "MatrixError",
    "Row",
    "Run",
    "load",
    "merge",
    "render_html",
    "render_markdown",
    "render_svg",
    "render_terminal",
    "since",
]
