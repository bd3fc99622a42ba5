"""lint/house_rules.py catches what each rule is for: a small package made to break every rule once."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def rules() -> ModuleType:
    spec = importlib.util.spec_from_file_location("house_rules", ROOT / "lint" / "house_rules.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def readings(rules: ModuleType, root: Path) -> dict[str, tuple[int, tuple[str, ...]]]:
    return {f.rule: (f.number, f.places) for f in rules.check(root)}


def reading(found: dict[str, tuple[int, tuple[str, ...]]], words: str) -> tuple[int, tuple[str, ...]]:
    (rule,) = [rule for rule in found if words in rule]
    return found[rule]


@pytest.fixture
def broken(tmp_path: Path) -> Path:
    body = "\n".join(f"    x{i} = {i}" for i in range(45))
    write(
        tmp_path,
        {
            "pytest_dsrepro/__init__.py": "",
            "pytest_dsrepro/plugin.py": "from .session import scan_plugin\n\nSCAN = scan_plugin\n"
            'pytest_plugins = ("pytest_dsrepro.session.scan_plugin",)\nHELP = "used by a scan"\n',
            "pytest_dsrepro/core/__init__.py": "",
            "pytest_dsrepro/core/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import b\n",
            "pytest_dsrepro/core/b.py": "def f():\n    from . import a\n\n\nclass Twice:\n    pass\n",
            "pytest_dsrepro/session/__init__.py": "",
            "pytest_dsrepro/session/scan_plugin.py": "class Scan:\n    pass\n",
            "pytest_dsrepro/session/a.py": "class Twice:\n"
            + "".join(f"    def m{i}(self):\n        pass\n" for i in range(13)),
            "pytest_dsrepro/tools/__init__.py": "",
            "pytest_dsrepro/tools/cli.py": "\n" * 201,
            "pytest_dsrepro/tools/one_command.py": "def run():\n    from . import two_command\n",
            "pytest_dsrepro/tools/two_command.py": f"def long():\n{body}\n",
            "README.md": "# x\n## Speed\n" + "row\n" * 40 + "## More\n" + "y" * 201 + "\n",
            "docs/design.md": "| `core/a` | a |\n| `core/gone` | `Vanished`, `b.missing`, `session/scan_plugin` |\n",
        },
    )
    return tmp_path


def test_every_rule_catches_its_fault(rules: ModuleType, broken: Path) -> None:
    found = readings(rules, broken)
    assert reading(found, "base names")[0] == 1  # core/a.py and session/a.py
    assert reading(found, "class names")[1] == ("Twice: pytest_dsrepro.core.b, pytest_dsrepro.session.a",)
    assert reading(found, "import cycles")[0] == 1  # a -> b under TYPE_CHECKING, b -> a inside a function
    assert reading(found, "over 12 methods")[1] == ("pytest_dsrepro/session/a.py:1 Twice: 13 methods",)
    assert reading(found, "over 40 lines")[1] == ("pytest_dsrepro/tools/two_command.py:1 long: 46 lines",)
    assert reading(found, "over 50 lines")[0] == 0
    assert reading(found, "importing another")[1] == (
        "pytest_dsrepro/tools/one_command.py:2 -> pytest_dsrepro.tools.two_command",
    )
    assert reading(found, "cli.py")[0] == 201
    assert reading(found, "function-level package imports")[0] == 1  # one_command's; core/b's is outside tools
    assert reading(found, "naming the scan")[1] == (  # a name, a one-word string; not a help text
        "pytest_dsrepro/plugin.py:1",
        "pytest_dsrepro/plugin.py:3",
        "pytest_dsrepro/plugin.py:4",
    )
    assert reading(found, "README lines over")[0] == 1
    assert reading(found, "Speed")[0] == 41
    assert reading(found, "does not name")[1] == (
        "pytest_dsrepro/core/b.py",
        "pytest_dsrepro/plugin.py",
        "pytest_dsrepro/session/a.py",
        "pytest_dsrepro/session/scan_plugin.py",  # named in a second cell only
        "pytest_dsrepro/tools/cli.py",
        "pytest_dsrepro/tools/one_command.py",
        "pytest_dsrepro/tools/two_command.py",
    )
    assert reading(found, "no longer exist")[1] == (
        "docs/design.md:2: core/gone",
        "docs/design.md:2: Vanished",
        "docs/design.md:2: b.missing",
    )
