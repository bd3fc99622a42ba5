"""``dsrepro matrix``: the results files of many runs (one or more per DeepSpeed release) as one table.

- :mod:`.model`: the table as data. Columns are releases in version order (``packaging.version``); rows are bugs
  and their configs, the stock test and its ``[fixed]`` twin in one cell; each run is judged against the row's
  declared range (``!`` against it); prerequisite fixes are marked (``+``), changes since ``--since`` (``~``).
- :mod:`.build`: the model from results files: several files of one release merge per test (the newest that ran it
  gives the run: partial re-runs, ``--ds-shard`` slices, CI matrices), files that disagree are named.
- :mod:`.symbols`: what every form draws for each kind of run, and the legend; :mod:`.notes`: what every form says
  in words (headline, hover, the notes below every table).
- One renderer per form: :mod:`.terminal` (120 columns), :mod:`.markdown`, :mod:`.html` (a fixed layout that fits
  1400 pixels), :mod:`.svg` (an image for an issue).

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
