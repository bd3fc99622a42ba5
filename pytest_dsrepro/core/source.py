"""A repro's source as a reader needs it: the test and what it uses from its file, nothing else.

``module_slice`` keeps, from a module's text, the top-level statements that define the names asked for and, again
and again, every module-level name those statements use (imports, constants, helpers, the fix), in file order,
with the comments written right above them and the module docstring. The ``--ds-report`` and ``dsrepro export``
both read repros this way. Pure: ``ast`` on text, nothing imported or executed.
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["Statement", "defined_names", "imports", "module_slice", "render", "select", "statements", "used_names"]


@dataclass(frozen=True)
class Statement:
    """One top-level statement: its lines (1-based, inclusive; decorators and the comments above included)."""

    node: ast.stmt
    first: int
    last: int
    defines: frozenset[str]
    uses: frozenset[str]


def defined_names(node: ast.stmt) -> set[str]:
    """The module-level names a top-level statement binds."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names if a.name != "*"}
    targets: list[ast.expr] = []
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        targets = [node.target]
    names: set[str] = set()
    for target in targets:
        names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def used_names(node: ast.AST) -> set[str]:
    """Every name a statement reads, anywhere inside it (a local that shadows a module name counts: harmless)."""
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def imports(text: str, package: str) -> bool:
    """Does the module import ``package`` (or one of its modules) anywhere, at the top or inside a function?"""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        else:
            continue
        if any(name == package or name.startswith(package + ".") for name in names):
            return True
    return False


def _first_line(node: ast.stmt, lines: Sequence[str]) -> int:
    decorators = getattr(node, "decorator_list", [])
    first: int = min([node.lineno, *(d.lineno for d in decorators)])
    while first > 1 and lines[first - 2].lstrip().startswith("#"):  # the comments written right above it
        first -= 1
    return first


def statements(text: str) -> tuple[Statement | None, list[Statement]]:
    """A module's docstring and its other top-level statements; ``SyntaxError`` as ``ast`` raises."""
    tree = ast.parse(text)
    lines = text.splitlines()
    body = list(tree.body)
    docstring = None
    first = body[0] if body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        body.pop(0)
        docstring = Statement(first, first.lineno, first.end_lineno or first.lineno, frozenset(), frozenset())
    found = [
        Statement(s, _first_line(s, lines), s.end_lineno or s.lineno, frozenset(defined_names(s)),
                  frozenset(used_names(s)))
        for s in body
    ]  # fmt: skip
    return docstring, found


def _uses(node: ast.stmt, decorated: bool) -> set[str]:
    if decorated or not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return used_names(node)
    parts: list[ast.AST] = list(node.body)
    if isinstance(node, ast.ClassDef):
        parts += [*node.bases, *node.keywords]
    else:
        parts += [node.args, *([node.returns] if node.returns else [])]
    return set().union(*(used_names(p) for p in parts))


def select(
    found: Sequence[Statement], names: Iterable[str], *, drop: Iterable[str] = (), bare: Iterable[str] = ()
) -> list[Statement]:
    """The statements defining ``names`` and, transitively, what they use, in file order.

    ``from __future__`` imports are always kept. Names in ``drop`` are never followed (``dsrepro export`` drops
    ``pytestmark``); definitions named in ``bare`` lose their decorators, and what only the decorators used is not
    followed. A statement that binds nothing asked for (a bare ``if __name__ == ...``) is left out.
    """
    dropped, undecorated = set(drop), set(bare)
    wanted = set(names) - dropped
    chosen: dict[int, Statement] = {}
    changed = True
    while changed:
        changed = False
        for i, s in enumerate(found):
            future = isinstance(s.node, ast.ImportFrom) and s.node.module == "__future__"
            if i in chosen or not (future or s.defines & wanted):
                continue
            if s.defines & undecorated:
                s = dataclasses.replace(s, first=s.node.lineno, uses=frozenset(_uses(s.node, decorated=False)))
            chosen[i] = s
            wanted |= set(s.uses) - dropped
            changed = True
    return [chosen[i] for i in sorted(chosen)]


def render(text: str, chosen: Sequence[Statement]) -> str:
    """The chosen statements as the file has them: neighbours in the file keep the lines between them; others are
    one blank line apart when both are imports, else two."""
    lines = text.splitlines()
    out = ""
    previous: Statement | None = None
    for s in chosen:
        if previous is not None and _adjacent(lines, previous, s):
            out += "".join(line + "\n" for line in lines[previous.last : s.first - 1])
        elif previous is not None:
            out += "\n" if _is_import(previous) and _is_import(s) else "\n\n"
        out += "\n".join(lines[s.first - 1 : s.last]) + "\n"
        previous = s
    return out


def _is_import(s: Statement) -> bool:
    return isinstance(s.node, (ast.Import, ast.ImportFrom))


def _adjacent(lines: Sequence[str], a: Statement, b: Statement) -> bool:
    """Only blank lines between ``a`` and ``b``: nothing left out lies there."""
    return all(not line.strip() for line in lines[a.last : b.first - 1])


def module_slice(
    text: str, names: Iterable[str], *, docstring: bool = True, drop: Iterable[str] = (), bare: Iterable[str] = ()
) -> str:
    """The statements of ``text`` that define ``names``, with everything they use from the module, in file order
    (see :func:`select`), after the module docstring unless ``docstring`` is false."""
    doc, found = statements(text)
    chosen = select(found, names, drop=drop, bare=bare)
    return render(text, [doc, *chosen] if docstring and doc else chosen)
