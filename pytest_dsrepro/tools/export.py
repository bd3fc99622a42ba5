"""``dsrepro export NODEID``: one test of the catalogue as one standalone script for ``torchrun``.

A maintainer runs a script, not a plugin. The script (``render``) holds the test and all it needs besides torch,
DeepSpeed and the standard library, and does what a rank of a world does. The test is found by collecting it with
pytest in this process (``collect``); nothing of it runs here. ``export_command`` writes the script.
"""

from __future__ import annotations

import ast
import inspect
import json
import re
import string
import sys
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core import configs, source, versions
from ..core.errors import MarkerError
from ..core.gates import Nondeterministic, oldest_first, parse_nondeterministic
from ..core.results import ReproMeta, repro_meta
from ..core.text import aligned
from .catalogue import CollectionFailed, CollectionReader, collect_only

if TYPE_CHECKING:
    import pytest

__all__ = ["Collected", "ExportError", "collect", "describe", "render"]

#: The fixtures a body may take, and what the script passes in their place (names of the script's ``main``).
FIXTURES = {
    "ds_engine": "ds_engine",
    "ds_config": "_config",
    "ds_rank": "rank",
    "ds_world_size": "world_size",
    "ds_device": "device",
    "ds_variant": '"stock"',
}
#: What the script may import: the standard library, torch and DeepSpeed; and, for the repros of bugs met through
#: Hugging Face, what the hf extra installs (a maintainer reproducing such a bug has them).
HF_PACKAGES = frozenset({"transformers", "accelerate", "peft", "safetensors"})
ALLOWED = frozenset(sys.stdlib_module_names) | {"torch", "deepspeed", "__future__"} | HF_PACKAGES
PACKAGE = "pytest_dsrepro"


class ExportError(Exception):
    """The test cannot be written as a standalone script; the message says which test and why."""


@dataclass(frozen=True)
class Collected:
    """What export needs of one collected test (read from its item; nothing of it ran)."""

    nodeid: str
    path: Path
    function: str  # the test function's name
    arguments: tuple[str, ...]  # the body's parameters, in order
    repro: ReproMeta
    gates: tuple[tuple[str, str, str | None], ...]  # (affected, exception class name, match) per ds_version
    fix: Callable[..., Any] | None
    config_name: str | None
    config_spec: object
    world_size: int
    variant: str | None
    others: tuple[str, ...] = field(default=())  # node ids of the test's other parametrizations
    nondeterministic: Nondeterministic | None = None  # the bug shows in some runs only (``ds_nondeterministic``)


# ---------------------------------------------------------------------------------------------------- collecting


def _function_id(nodeid: str) -> str:
    return nodeid.split("[", 1)[0]


@dataclass(eq=False, kw_only=True)
class _Grab(CollectionReader):
    """Keeps the collected items of one test function."""

    function: str
    items: list[pytest.Item] = field(default_factory=list)

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        self.items = [i for i in items if _function_id(i.nodeid) == self.function]


def _params(item: pytest.Item) -> dict[str, Any]:
    callspec = getattr(item, "callspec", None)
    return dict(callspec.params) if callspec is not None else {}


def _pick(items: Sequence[pytest.Item], nodeid: str) -> pytest.Item:
    """The stock variant of ``nodeid`` (the test itself when it has no variants)."""
    if "[" in nodeid:
        wanted = nodeid.replace("-fixed]", "-stock]").replace("[fixed]", "[stock]")
        found = [i for i in items if i.nodeid == wanted]
    else:
        found = [i for i in items if _params(i).get("ds_variant") in (None, "stock")]
    if len(found) == 1:
        return found[0]
    ids = ", ".join(i.nodeid for i in items) or "none"
    if not found:
        raise ExportError(f"no test {nodeid} (its collected tests: {ids})")
    raise ExportError(f"{nodeid} names {len(found)} tests; give one of: {', '.join(i.nodeid for i in found)}")


def _world_size(item: pytest.Item, default: int) -> int:
    mark = item.get_closest_marker("ds_world")
    if mark is None:
        raise ExportError(f"{item.nodeid} is not a world test (no ds_world marker): there is no world to write out")
    size = mark.kwargs.get("size")
    return int(size) if isinstance(size, int) and size > 0 else default


def _gate(args: Sequence[object], kwargs: dict[str, object]) -> tuple[str, str, str | None]:
    affected = kwargs.get("affected", args[0] if args else None)
    raises = kwargs.get("raises")
    match = kwargs.get("match")
    name = raises.__name__ if isinstance(raises, type) else str(raises)
    return str(affected), name, None if match is None else str(match)


def _fix(item: pytest.Item) -> Callable[..., Any] | None:
    for mark in item.iter_markers("ds_version"):
        fix = mark.kwargs.get("fix")
        if callable(fix):
            return fix  # type: ignore[no-any-return]
    return None


def describe(item: pytest.Item, world_size: int) -> Collected:
    """The facts of a collected item export needs; ``ExportError`` when it is no catalogued world test."""
    mark = item.get_closest_marker("ds_repro")
    ds_versions = [(m.args, m.kwargs) for m in item.iter_markers("ds_version")]
    if mark is None or not ds_versions:
        raise ExportError(f"{item.nodeid} is not a catalogued repro (it needs ds_repro and ds_version markers)")
    function = getattr(item, "function", None)
    if function is None or getattr(item, "cls", None) is not None:
        raise ExportError(f"{item.nodeid}: only module-level test functions can be exported")
    arguments = tuple(inspect.signature(function).parameters)
    unknown = [a for a in arguments if a not in FIXTURES]
    if unknown:
        raise ExportError(
            f"{item.nodeid} takes {', '.join(map(repr, unknown))}: a standalone script provides only "
            f"{', '.join(FIXTURES)}"
        )
    params = _params(item)
    config = params.get("ds_config")
    name, spec = config if isinstance(config, tuple) else (None, None)
    rate = item.get_closest_marker("ds_nondeterministic")
    try:
        plan = None if rate is None else parse_nondeterministic(rate.args, dict(rate.kwargs), item.nodeid)
    except MarkerError as exc:
        raise ExportError(f"@pytest.mark.ds_nondeterministic on {exc}") from None
    return Collected(
        nodeid=item.nodeid,
        path=Path(str(item.path)),
        function=function.__name__,
        arguments=arguments,
        repro=repro_meta(mark.args, mark.kwargs, item.path, ds_versions),
        gates=tuple(_gate(args, dict(kwargs)) for args, kwargs in ds_versions),
        fix=_fix(item),
        config_name=name,
        config_spec=spec,
        world_size=_world_size(item, world_size),
        variant=params.get("ds_variant"),
        nondeterministic=plan,
    )


def collect(nodeid: str, world_size: int = 2, extra_args: Sequence[str] = ()) -> Collected:
    """Collect ``nodeid``'s test function with pytest in this process (``catalogue.collect_only``, as ``dsrepro list``
    collects) and describe its stock variant: its markers and parameters are read from the collected item through
    pytest's public API."""
    grab = _Grab(function=_function_id(nodeid))
    try:
        collect_only([grab.function], extra_args, grab)
    except CollectionFailed as exc:
        raise ExportError(str(exc)) from None
    return describe(_pick(grab.items, nodeid), world_size)


# ----------------------------------------------------------------------------------------------------- writing


def _package_file(module: str) -> Path:
    """The source file of one of this package's modules, found beside this one (never imported)."""
    root = Path(__file__).resolve().parents[1]
    parts = module.split(".")[1:]
    candidate = root.joinpath(*parts).with_suffix(".py")
    return candidate if candidate.is_file() else root.joinpath(*parts, "__init__.py")


def _inline(code: str, here: Path) -> tuple[str, list[str]]:
    """``code`` with each ``from pytest_dsrepro... import a, b``, and each import from a helper module of the test's
    (``_helper``: ``repros/_zero12.py`` for ``repros/zero12/...``), replaced by the source of ``a`` and ``b`` (and what
    they use from their module), again until none is left (a helper may import pytest-dsrepro's); the modules
    inlined. Names only the dropped decorators used, and names already inlined, are not inlined (an import of nothing
    else goes)."""
    inlined: dict[tuple[str, str], None] = {}
    while True:
        tree = ast.parse(code)
        lines = code.splitlines()
        used = source.used_names(tree)
        changed = False
        for node in reversed(tree.body):  # bottom up: line numbers above stay valid
            if not isinstance(node, ast.ImportFrom) or not _inlinable(node, here):
                continue
            module = node.module or ""
            helper = _helper(node, here)
            if helper is None:
                path, origin = _package_file(module), "pytest-dsrepro"
            else:
                where = "beside the test" if helper.parent == here else f"in {helper.parent.name}/, above the test"
                path, origin = helper, f"{helper.name}, {where}"
            names = [a.name for a in node.names if a.name in used and (module, a.name) not in inlined]
            replacement: list[str] = []
            if names:
                text = source.module_slice(path.read_text(), names, docstring=False)
                text = "\n".join(
                    line for line in text.splitlines() if line.strip() != "from __future__ import annotations"
                )
                replacement = [
                    f"# from {module} ({origin}), inlined: {', '.join(names)}",
                    *text.strip("\n").splitlines(),
                    "",
                ]
                inlined.update(((module, name), None) for name in names)
            lines[node.lineno - 1 : node.end_lineno] = replacement
            changed = True
        code = "\n".join(lines) + "\n"
        if not changed:
            return code, sorted({module for module, _ in inlined})


def _hoisted(code: str, here: Path) -> str:
    """``code`` with each import of pytest-dsrepro or of a test's helper (``_helper``) inside a function moved to
    the top level, just before the statement that holds it (where ``_inline`` inlines it); in the function it is left
    as a ``pass`` saying where it went."""
    tree = ast.parse(code)
    lines = code.splitlines()
    out: list[str] = []
    copied = 0  # lines[:copied] are in ``out``
    for statement in tree.body:
        nested = [
            n for n in ast.walk(statement)
            if isinstance(n, ast.ImportFrom) and n is not statement and _inlinable(n, here)
        ]  # fmt: skip
        if not nested:
            continue
        first = min([statement.lineno, *(d.lineno for d in getattr(statement, "decorator_list", []))])
        block = lines[first - 1 : statement.end_lineno]
        moved: dict[str, list[str]] = {}  # module -> names, one import each
        for node in sorted(nested, key=lambda n: n.lineno, reverse=True):  # bottom up: lines above stay put
            names = [a.name if a.asname is None else f"{a.name} as {a.asname}" for a in node.names]
            block[node.lineno - first : (node.end_lineno or node.lineno) - first + 1] = [
                f"{' ' * node.col_offset}pass  # from {node.module} import {', '.join(names)}: inlined at the top level"
            ]
            moved.setdefault(node.module or "", [])[:0] = [
                n for n in names if n not in moved.get(node.module or "", [])
            ]
        hoisted = [f"from {module} import {', '.join(names)}" for module, names in moved.items()]
        out += [*lines[copied : first - 1], *hoisted, *block]
        copied = statement.end_lineno or statement.lineno
    return "\n".join([*out, *lines[copied:]]) + "\n"


def _inlinable(node: ast.ImportFrom, here: Path) -> bool:
    return not node.level and ((node.module or "").split(".")[0] == PACKAGE or _helper(node, here) is not None)


def _helper(node: ast.ImportFrom, here: Path) -> Path | None:
    """The file of a helper module the test in ``here`` imports by plain name (``from _zero12 import ...``): beside
    it, else in a folder above it that holds a ``conftest.py`` (the catalogue's top): the folders pytest's default
    import mode puts on ``sys.path``, nearest first."""
    module = node.module or ""
    if node.level or "." in module or not module:
        return None
    folders = [here, *(folder for folder in here.parents if (folder / "conftest.py").is_file())]
    return next((folder / f"{module}.py" for folder in folders if (folder / f"{module}.py").is_file()), None)


def _approx_for_pytest(code: str) -> tuple[str, bool]:
    """``code`` with ``pytest.approx`` read as the script's own ``approx`` (templates/approx.py.tmpl), and whether it
    was used: then ``import pytest`` goes too, unless something else of pytest is used."""
    tree = ast.parse(code)
    found = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "approx" and _is_pytest(n.value)]
    if not found:
        return code, False
    lines = code.splitlines()
    for node in sorted(found, key=lambda n: (n.lineno, n.col_offset), reverse=True):
        line = lines[node.lineno - 1]
        lines[node.lineno - 1] = line[: node.col_offset] + "approx" + line[node.end_col_offset :]
    code = "\n".join(lines) + "\n"
    if "pytest" not in source.used_names(ast.parse(code)):
        code = "\n".join(line for line in code.splitlines() if line.strip() != "import pytest") + "\n"
    return code, True


def _is_pytest(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "pytest"


def _foreign(script: str, test_file: Path) -> list[str]:
    """Every import of the script (anywhere) of what is neither the standard library, torch nor DeepSpeed, as the
    statement reads, with its line in the test's file when it is there."""
    found: dict[str, None] = {}
    test_lines = [line.strip() for line in test_file.read_text().splitlines()]
    script_lines = script.splitlines()
    for node in ast.walk(ast.parse(script)):
        if isinstance(node, ast.Import):
            modules = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            modules = [(node.module or "").split(".")[0]]
        else:
            continue
        if set(modules) - ALLOWED:
            statement = " ".join(line.strip() for line in script_lines[node.lineno - 1 : node.end_lineno])
            where = f", {test_file.name}:{test_lines.index(statement) + 1}" if statement in test_lines else ""
            found[f"{', '.join(sorted(set(modules) - ALLOWED))} ({statement}{where})"] = None
    return list(found)


def _json(value: object) -> str:
    """A config as DeepSpeed users read it: its JSON, loaded by the script."""
    text = json.dumps(value, indent=4, sort_keys=True, default=str)
    return f'json.loads(\n    r"""\n{text}\n"""\n)' if '"""' not in text else repr(json.loads(text))


def _config(test: Collected, backend: str) -> configs.ResolvedConfig | None:
    if test.config_name is None:
        return None
    try:
        return configs.resolve(test.config_spec, test.config_name, test.world_size, backend)
    except configs.ConfigError as exc:
        raise ExportError(f"{test.nodeid}: its ds_config cannot be resolved: {exc}") from None


def _oldest_first(gates: Sequence[tuple[str, str, str | None]]) -> list[tuple[str, str, str | None]]:
    order = oldest_first([g[0] for g in gates])
    return sorted(gates, key=lambda g: order.index(g[0]))


def _affected_lines(test: Collected) -> str:
    rows = [(f"deepspeed{affected}", name + (f" matching {match!r}" if match else ""))
            for affected, name, match in _oldest_first(test.gates)]  # fmt: skip
    return "\n".join(f"    {line}" for line in aligned(rows))


def _fix_comment(test: Collected) -> str:
    if test.fix is None:
        return ""
    try:
        text = inspect.getsource(test.fix)
    except (OSError, TypeError):
        return f"\n# The fix pytest-dsrepro's [fixed] variant applies: {test.fix!r} (its source is not available).\n"
    head = textwrap.wrap(
        "The fix pytest-dsrepro's [fixed] variant applies in every rank (with a pytest MonkeyPatch, undone after "
        "the test), for reference: this script does not run it.",
        110,
    )
    return "\n\n" + "\n".join(f"# {line}".rstrip() for line in [*head, "", *text.splitlines()]) + "\n"


def _test_code(test: Collected) -> tuple[str, list[str]]:
    """The test and what it uses from its file (``core.source``), pytest-dsrepro's helpers (their source, read from
    the installed package's files, never imported here; and those beside the test) inlined, ``pytest.approx`` as the
    script's own; and the modules inlined."""
    text = test.path.read_text()
    _, found = source.statements(text)
    chosen = source.select(found, [test.function], drop=["pytestmark"], bare=[test.function])
    code, approximates = _approx_for_pytest(_hoisted(source.render(text, chosen), test.path.parent))
    code, inlined = _inline(code, test.path.parent)
    code = re.sub(r"\n{4,}", "\n\n\n", code).strip("\n") + "\n" + (_template("approx.py.tmpl") if approximates else "")
    return code, inlined


def _config_values(test: Collected) -> dict[str, str]:
    """The test's config as the script holds it: for CPU/gloo, and for CUDA/NCCL where that differs."""
    cpu, cuda = _config(test, "gloo"), _config(test, "nccl")
    config_cuda = "DS_CONFIG_CPU  # the same"
    if cpu is not None and cuda is not None and cpu != cuda and cpu.config != cuda.config:
        config_cuda = _json(cuda.config)
    return {
        "config_name": test.config_name or "none",
        "cpu_notes": f" ({'; '.join(cpu.notes)})" if cpu is not None and cpu.notes else "",
        "config_cpu": _json(cpu.config if cpu else {}),
        "config_cuda": config_cuda,
    }


def render(test: Collected, file_name: str = "repro.py") -> str:
    """The standalone script of ``test``'s stock variant (the fix, when the repro has one, appended as a comment for
    reference); ``ExportError`` when it would need more than torch, DeepSpeed and the standard library. Beside the
    test's code (``_test_code``) and the config its world gets (``_config_values``), the script writes out the
    ``ds_engine`` fixture and a ``main`` that does what a rank of a world does: picks the accelerator, sets up the
    default process group, calls the test, and says whether the error is the one declared."""
    code, inlined = _test_code(test)
    meta = test.repro
    values = {
        "title": meta.title or meta.id,
        "repro_id": meta.id,
        "plugin": versions.installed_text("pytest-dsrepro") or "(unknown version)",
        "nodeid": test.nodeid + (" (the stock variant)" if test.variant else ""),
        "upstream": meta.upstream or "-",
        "root_cause": "\n    ".join(_wrap(meta.root_cause or "-", 112)),
        "affected": _affected_lines(test),
        "fixed_in": (meta.fixed_in or "no release yet") + (f" ({meta.fix_ref})" if meta.fix_ref else ""),
        "rate": _rate_note(test.nondeterministic),
        "world_size": str(test.world_size),
        "deepspeed": versions.installed_text("deepspeed") or "X.Y.Z",
        "file": file_name,
        "path": test.path.name,
        "inlined": f" (helpers inlined from {', '.join(inlined)})" if inlined else "",
        "code": code,
        **_config_values(test),
        "expected": "[\n" + "".join(f"    {g!r},\n" for g in _oldest_first(test.gates)) + "]",
        "call": f"{test.function}({', '.join(f'{a}={FIXTURES[a]}' for a in test.arguments)})",
        "fix": _fix_comment(test),
    }
    script = string.Template(_template("export.py.tmpl")).substitute(values)
    foreign = _foreign(script, test.path)
    if foreign:
        raise ExportError(
            f"{test.nodeid} needs {'; '.join(foreign)}: a standalone script has torch, DeepSpeed and the standard "
            "library only, and the hf extra's packages for the Hugging Face repros (docs/writing-repros.md says what a "
            "test can use to be exported)"
        )
    compile(script, file_name, "exec")  # a script that does not even compile is never written
    return script


def _template(name: str) -> str:
    return resources.files("pytest_dsrepro.tools").joinpath(f"templates/{name}").read_text()


def _rate_note(plan: Nondeterministic | None) -> str:
    """For a bug that shows in some runs only: what one run of the script is worth."""
    if plan is None:
        return ""
    return (
        f"\nThe bug shows in some runs only: the repro judges it over {plan.runs} runs, each a fresh world, and calls "
        f"it\nreproduced from {plan.failures} failing ones. One passing run of this script says little: run it again."
    )


def _wrap(text: str, width: int) -> list[str]:
    return textwrap.wrap(" ".join(text.split()), width) or ["-"]
