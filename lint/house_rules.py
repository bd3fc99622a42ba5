"""The house's own rules, measured: each prints today's number beside its budget, and one over budget fails.

Run by ``tox -e lint`` (``python lint/house_rules.py``); ``tests/test_house_rules.py`` shows that every rule catches
what it is for. The rules are the kind that grow back unseen: names that mean two things, import circles, classes and
functions that keep growing, a README that turns into a diary, a design document that names what is gone.
"""

from __future__ import annotations

import ast
import functools
import io
import re
import signal
import sys
import tokenize
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "pytest_dsrepro"
#: Module docstrings over 10 lines: none since issue 54 (a module's docstring says why; the how is its functions' and
#: classes' own, or docs/design.md's), and none may come back.
DOCSTRINGS_OVER_10 = 0

#: Names in design.md's backticks that are other projects' (torch, DeepSpeed, pytest), not this package's.
FOREIGN = frozenset(
    {
        "TCPStore", "MultiProcContinuousTest", "MultiProcessTestCase", "DistributedTest", "DistributedFixture",
        "DistributedExec", "KeyboardInterrupt", "ZeROOrderedDict", "Trainer",
    }
)  # fmt: skip


@dataclass(frozen=True)
class Finding:
    """One rule's reading: the number, its budget, and the places that make it up (shown when over budget)."""

    rule: str
    number: int
    budget: int
    places: tuple[str, ...] = ()

    @property
    def holds(self) -> bool:
        return self.number <= self.budget


@dataclass(frozen=True)
class Module:
    """A module of the package: its dotted name, its path from the repository root, its syntax tree."""

    name: str
    path: Path
    source: str

    @property
    def tree(self) -> ast.Module:
        return _parse(self.source, str(self.path))

    @property
    def base(self) -> str:
        return self.path.stem

    @property
    def is_init(self) -> bool:
        return self.path.name in ("__init__.py", "__main__.py")


def modules(root: Path, package: str = PACKAGE) -> list[Module]:
    found = []
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found.append(Module(name, path.relative_to(root), path.read_text()))
    return found


@functools.cache
def _parse(source: str, filename: str) -> ast.Module:
    return ast.parse(source, filename)


def _functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    yield from (node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef))


def _classes(tree: ast.AST) -> Iterator[ast.ClassDef]:
    yield from (node for node in ast.walk(tree) if isinstance(node, ast.ClassDef))


# ---- names ----------------------------------------------------------------------------------------------------


def shared_base_names(mods: list[Module]) -> Finding:
    where = defaultdict(list)
    for m in mods:
        if not m.is_init:
            where[m.base].append(str(m.path))
    shared = [f"{base}: {', '.join(paths)}" for base, paths in sorted(where.items()) if len(paths) > 1]
    return Finding("module base names shared by two modules", len(shared), 0, tuple(shared))


def classes_defined_twice(mods: list[Module]) -> Finding:
    where = defaultdict(set)
    for m in mods:
        for cls in _classes(m.tree):
            where[cls.name].add(m.name)
    twice = [f"{name}: {', '.join(sorted(ms))}" for name, ms in sorted(where.items()) if len(ms) > 1]
    return Finding("class names defined in two modules", len(twice), 0, tuple(twice))


# ---- imports --------------------------------------------------------------------------------------------------


def _imported(m: Module, known: set[str]) -> Iterator[tuple[str, ast.stmt, bool]]:
    """Each package module ``m`` imports, with the statement and whether it sits inside a function.

    Every import counts, those under ``if TYPE_CHECKING:`` and inside functions too: a circle through either is still
    a circle to whoever reads the code.
    """
    package_parts = m.name.split(".") if m.path.name == "__init__.py" else m.name.split(".")[:-1]

    def visit(node: ast.AST, in_function: bool) -> Iterator[tuple[str, ast.stmt, bool]]:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            targets: list[str] = []
            if isinstance(child, ast.ImportFrom):
                statement: ast.stmt = child
                base = child.module or ""
                if child.level:
                    base = ".".join(package_parts[: len(package_parts) - child.level + 1] + ([base] if base else []))
                names = [f"{base}.{alias.name}" for alias in child.names]
                targets = [n for n in names if n in known] or [base]
            elif isinstance(child, ast.Import):
                statement = child
                targets = [alias.name for alias in child.names]
            for target in targets:
                while target and target not in known:
                    target = target.rpartition(".")[0]
                if target and target != m.name:
                    yield target, statement, in_function
            yield from visit(child, nested)

    yield from visit(m.tree, False)


def import_graph(mods: list[Module]) -> dict[str, set[str]]:
    known = {m.name for m in mods}
    return {m.name: {target for target, _, _ in _imported(m, known)} for m in mods}


def import_cycles(mods: list[Module]) -> Finding:
    """Modules that reach themselves through imports, grouped into their circles (strongly connected components)."""
    graph = import_graph(mods)
    reach: dict[str, set[str]] = {}
    for start in graph:
        seen, todo = set(), list(graph[start])
        while todo:
            node = todo.pop()
            if node not in seen:
                seen.add(node)
                todo.extend(graph.get(node, ()))
        reach[start] = seen
    circles = {frozenset(n for n in reach if n in reach[m] and m in reach[n]) for m in graph if m in reach[m]}
    places = tuple(sorted(f"{len(c)} modules: {', '.join(sorted(c))}" for c in circles))
    return Finding("import cycles in the package (TYPE_CHECKING, in functions: all count)", len(circles), 0, places)


def import_arrows(mods: list[Module]) -> int:
    return sum(len(targets) for targets in import_graph(mods).values())


def function_level_imports(mods: list[Module], under: str, exempt: tuple[str, ...]) -> Finding:
    known = {m.name for m in mods}
    places = [
        f"{m.path}:{node.lineno} -> {target}"
        for m in mods
        if m.name.startswith(under) and m.name not in exempt
        for target, node, in_function in _imported(m, known)
        if in_function
    ]
    rule = f"function-level package imports in {under} (outside {', '.join(exempt)})"
    return Finding(rule, len(places), 5, tuple(places))


def commands_importing_commands(mods: list[Module]) -> Finding:
    """A ``*_command`` module stands on shared layers, never on another command."""
    known = {m.name for m in mods}
    commands = {n for n in known if n.startswith(f"{PACKAGE}.tools.") and n.endswith("_command")}
    places = [
        f"{m.path}:{node.lineno} -> {target}"
        for m in mods
        if m.name in commands
        for target, node, _ in _imported(m, known)
        if target in commands
    ]
    return Finding("tools/*_command modules importing another", len(places), 0, tuple(places))


# ---- sizes ----------------------------------------------------------------------------------------------------


def big_classes(mods: list[Module], most: int = 12) -> Finding:
    """A class's budget counts what its users call (public methods and properties), not its helpers (``_name``,
    dunders): a class split only to stay under a count of every method is two classes its users must know."""
    places = []
    for m in mods:
        for cls in _classes(m.tree):
            methods = sum(isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not node.name.startswith("_")
                          for node in cls.body)  # fmt: skip
            if methods > most:
                places.append(f"{m.path}:{cls.lineno} {cls.name}: {methods} public methods")
    return Finding(f"classes over {most} public methods", len(places), 0, tuple(places))


def _long_functions(mods: list[Module], over: int) -> list[str]:
    return sorted(
        f"{m.path}:{fn.lineno} {fn.name}: {fn.end_lineno - fn.lineno + 1} lines"
        for m in mods
        for fn in _functions(m.tree)
        if fn.end_lineno is not None and fn.end_lineno - fn.lineno + 1 > over
    )


def functions_over_50(mods: list[Module]) -> Finding:
    places = _long_functions(mods, 50)
    return Finding("functions over 50 lines", len(places), 0, tuple(places))


def functions_over_40(mods: list[Module]) -> Finding:
    places = _long_functions(mods, 40)
    return Finding("functions over 40 lines", len(places), 6, tuple(places))


def long_docstrings(mods: list[Module], most: int = 10, budget: int = 0) -> Finding:
    """Module docstrings say why in a few lines; the how belongs to the functions' own."""
    places = []
    for m in mods:
        doc = ast.get_docstring(m.tree, clean=False)
        if doc is not None and len(doc.strip().splitlines()) > most:
            places.append(f"{m.path}: {len(doc.strip().splitlines())} lines")
    return Finding(f"module docstrings over {most} lines", len(places), budget, tuple(places))


def module_count(mods: list[Module], subpackage: str, most: int) -> Finding:
    inside = [str(m.path) for m in mods if m.name.startswith(f"{PACKAGE}.{subpackage}.") and not m.is_init]
    return Finding(f"{subpackage}/ modules (besides __init__)", len(inside), most, tuple(inside))


def file_lines(path: Path, most: int) -> Finding:
    return Finding(f"{path.name} lines", len(path.read_text().splitlines()), most)


# ---- the scan stays in its plugin -----------------------------------------------------------------------------


def names_outside(mods: list[Module], word: str, where: tuple[str, ...], owner: str) -> Finding:
    """Lines of code in ``where`` that name ``word``, outside its ``owner`` module: a name, or a string of one word
    (a module path, a plugin's name); comments, docstrings and help texts may speak of it."""
    places: list[str] = []
    for m in mods:
        if not m.name.startswith(where) or m.name == owner:
            continue
        lines = {
            token.start[0]
            for token in tokenize.generate_tokens(io.StringIO(m.source).readline)
            if token.type == tokenize.NAME and word in token.string.lower()
        }
        tree = m.tree
        docstrings = {id(doc) for node in ast.walk(tree) if (doc := _docstring(node)) is not None}
        lines |= {
            node.lineno
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
            if word in node.value.lower() and not any(c.isspace() for c in node.value)
        }
        places.extend(f"{m.path}:{line}" for line in sorted(lines))
    return Finding(f"lines naming the {word} outside {owner}", len(places), 0, tuple(places))


# ---- documents ------------------------------------------------------------------------------------------------


def readme(path: Path) -> list[Finding]:
    lines = path.read_text().splitlines()
    wide = tuple(f"README.md:{n}: {len(line)} characters" for n, line in enumerate(lines, 1) if len(line) > 200)
    speed = 0
    for n, line in enumerate(lines):
        if line.startswith("## Speed"):
            rest = lines[n + 1 :]
            end = next((i for i, later in enumerate(rest) if later.startswith("## ")), len(rest))
            speed = end + 1
    return [
        Finding("README lines", len(lines), 200),
        Finding("README lines over 200 characters", len(wide), 0, wide),
        Finding("README Speed section lines", speed, 30),
    ]


_NAMED = re.compile(r"`([A-Za-z_][\w./]*)`")
SUBPACKAGES = ("core", "session", "worlds", "tools", "inrank", "upstream", "scan", "triage")


def design_names(mods: list[Module], design: Path) -> list[Finding]:
    """docs/design.md names every module, and names nothing that is gone.

    A module is named in a table row's first cell, in its ``core/options`` form (a cell may list several:
    ``tools/matrix/terminal``, ``markdown``, ...). A name in backticks anywhere that looks like one of the package's
    (a path under a subpackage, ``pytest_dsrepro.x``, a class, ``owner.attribute``) must exist.
    """
    text = design.read_text()
    by_path = {_slashed(m): m for m in mods}
    named = _first_cells(text)
    unnamed = tuple(
        str(m.path)
        for path, m in sorted(by_path.items())
        if path not in named and m.name != PACKAGE and (not m.is_init or _defines_something(m))
    )
    known = _Known(
        paths=set(by_path) | {path.rpartition("/")[0] for path in by_path},
        files=design.parent.parent / PACKAGE,
        modules={m.name for m in mods},
        classes={cls.name for m in mods for cls in _classes(m.tree)},
        attributes=_attributes(mods),
    )
    gone = tuple(
        f"docs/design.md:{n}: {name}"
        for n, line in enumerate(text.splitlines(), 1)
        for name in _NAMED.findall(line)
        if not known.has(name)
    )
    return [
        Finding("package modules docs/design.md does not name", len(unnamed), 0, unnamed),
        Finding("names in docs/design.md that no longer exist", len(gone), 0, gone),
    ]


def _first_cells(text: str) -> set[str]:
    """The modules a table row's first cell names (``tools/matrix/terminal``, ``markdown``: in the same folder)."""
    named = set()
    for row in text.splitlines():
        if row.startswith("| `"):
            folder = ""
            for name in _NAMED.findall(row.split("|")[1]):
                folder = name.rpartition("/")[0] + "/" if "/" in name else folder
                named.add(name if "/" in name else folder + name)
    return named


@dataclass(frozen=True)
class _Known:
    """What the package has, for telling whether a name in the design document still exists."""

    paths: set[str]
    files: Path
    modules: set[str]
    classes: set[str]
    attributes: dict[str, set[str]]

    def has(self, name: str) -> bool:
        if name.startswith(f"{PACKAGE}."):
            module, _, attribute = name.rpartition(".")
            return name in self.modules or attribute in self.attributes.get(module.rpartition(".")[2], ())
        if "/" in name or name.endswith(".py"):
            path = name.removesuffix(".py").rstrip("/")
            ours = path.split("/")[0] in (*SUBPACKAGES, "plugin", "api")
            return not ours or path in self.paths or (self.files / name).exists()
        if name[0].isupper() and name.isidentifier() and not name.isupper():
            return name in self.classes or name in FOREIGN
        if "." in name:
            owner, _, attribute = name.rpartition(".")
            tail = owner.rpartition(".")[2]
            return tail not in self.attributes or attribute in self.attributes[tail]
        return True


def _slashed(m: Module) -> str:
    """``core/options`` for ``pytest_dsrepro.core.options``; a package's ``__init__`` as ``upstream/__init__``."""
    path = m.name.removeprefix(PACKAGE).lstrip(".").replace(".", "/")
    return f"{path}/__init__" if m.path.name == "__init__.py" and path else path or PACKAGE


def _docstring(node: ast.AST) -> ast.Constant | None:
    """The docstring of a module, class or function, as its constant; None where it has none."""
    if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) or not node.body:
        return None
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return first.value
    return None


def _defines_something(m: Module) -> bool:
    return any(isinstance(node, ast.FunctionDef | ast.ClassDef | ast.AsyncFunctionDef) for node in m.tree.body)


def _attributes(mods: list[Module]) -> dict[str, set[str]]:
    """What each module (by its last name) and each class defines at its top level, for ``owner.attribute`` names."""
    found: dict[str, set[str]] = defaultdict(set)
    for m in mods:
        own = found[m.name.rpartition(".")[2]]
        for node in m.tree.body:
            own.update(_defined(node))
        for cls in _classes(m.tree):
            for node in cls.body:
                found[cls.name].update(_defined(node))
            for fn in _functions(cls):  # attributes an instance sets on itself
                for part in ast.walk(fn):
                    if isinstance(part, ast.Attribute) and isinstance(part.value, ast.Name) and part.value.id == "self":
                        found[cls.name].add(part.attr)
    return found


def _defined(node: ast.AST) -> Iterator[str]:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        yield node.name
    elif isinstance(node, ast.Assign):
        yield from (t.id for t in node.targets if isinstance(t, ast.Name))
    elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        yield node.target.id
    elif isinstance(node, ast.ImportFrom | ast.Import):
        yield from ((alias.asname or alias.name).split(".")[0] for alias in node.names)
    elif isinstance(node, ast.If | ast.Try):
        for child in ast.iter_child_nodes(node):
            yield from _defined(child)


# ---- the whole ------------------------------------------------------------------------------------------------


def check(root: Path = ROOT) -> list[Finding]:
    mods = modules(root)
    return [
        shared_base_names(mods),
        classes_defined_twice(mods),
        import_cycles(mods),
        big_classes(mods),
        functions_over_50(mods),
        functions_over_40(mods),
        long_docstrings(mods, budget=DOCSTRINGS_OVER_10),
        module_count(mods, "session", 12),
        commands_importing_commands(mods),
        file_lines(root / PACKAGE / "tools" / "cli.py", 200),
        function_level_imports(mods, f"{PACKAGE}.tools", (f"{PACKAGE}.tools.cli",)),
        names_outside(mods, "scan", (f"{PACKAGE}.session", f"{PACKAGE}.plugin"), f"{PACKAGE}.scan"),
        *readme(root / "README.md"),
        *design_names(mods, root / "docs" / "design.md"),
    ]


def main(root: Path = ROOT) -> int:
    """Print every rule's reading; exit 1 when one is over its budget, naming its places."""
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` reads what it wants
    mods = modules(root)
    findings = check(root)
    width = max(len(f.rule) for f in findings)
    print(f"{'rule':<{width}}  today  budget")
    for f in findings:
        print(f"{f.rule:<{width}}  {f.number:>5}  {f.budget:>6}  {'' if f.holds else 'OVER'}".rstrip())
    lines = sum(len(m.source.splitlines()) for m in mods)
    print(f"(the package: {len(mods)} modules, {lines} lines, {import_arrows(mods)} import arrows)")
    over = [f for f in findings if not f.holds]
    for f in over:
        print(f"\nover budget: {f.rule} ({f.number} > {f.budget})")
        for place in f.places:
            print(f"  {place}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
