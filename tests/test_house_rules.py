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
    """A package that breaks every rule once: each over its budget (``test_every_rule_fails_over_its_budget``)."""
    long = "\n".join(f"    x{i} = {i}" for i in range(52))
    over_40 = "\n".join(f"    y{i} = {i}" for i in range(42))
    forty = "\n\n\n".join(f"def over_40_{i}():\n{over_40}\n" for i in range(6))  # 7 with long: the budget is 6
    imports = "".join(f"    from . import m{i}\n" for i in range(6))  # the budget is 5
    helpers = "".join(f"    def _h{i}(self):\n        pass\n" for i in range(5))
    write(
        tmp_path,
        {
            "pytest_dsrepro/__init__.py": "",
            "pytest_dsrepro/plugin.py": "from .scan import scanner\n\nSCAN = scanner\n"
            'pytest_plugins = ("pytest_dsrepro.scan.scanner",)\nHELP = "used by a scan"\n',
            "pytest_dsrepro/core/__init__.py": "",
            "pytest_dsrepro/core/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import b\n",
            "pytest_dsrepro/core/b.py": "def f():\n    from . import a\n\n\nclass Twice:\n    pass\n",
            **{f"pytest_dsrepro/core/c{i}.py": '"""' + "why\n" * 11 + '"""\n' for i in range(33)},
            "pytest_dsrepro/scan/__init__.py": "",
            "pytest_dsrepro/scan/scanner.py": "class Scan:\n    pass\n",
            "pytest_dsrepro/session/__init__.py": "",
            "pytest_dsrepro/session/a.py": "class Twice:\n"
            + "".join(f"    def m{i}(self):\n        pass\n" for i in range(13))
            + helpers,
            **{f"pytest_dsrepro/session/s{i}.py": "" for i in range(12)},
            "pytest_dsrepro/tools/__init__.py": "",
            "pytest_dsrepro/tools/cli.py": "\n" * 201,
            "pytest_dsrepro/tools/one_command.py": "def run():\n    from . import two_command\n" + imports,
            "pytest_dsrepro/tools/two_command.py": f"def long():\n{long}\n\n\n{forty}",
            "README.md": "# x\n## Speed\n" + "row\n" * 40 + "## More\n" + "y" * 201 + "\n" + "z\n" * 160,
            "docs/design.md": "| `core/a` | a |\n| `core/gone` | `Vanished`, `b.missing`, `scan/scanner` |\n",
        },
    )
    return tmp_path


def test_every_rule_catches_its_fault(rules: ModuleType, broken: Path) -> None:
    found = readings(rules, broken)
    assert reading(found, "base names")[0] == 1  # core/a.py and session/a.py
    assert reading(found, "class names")[1] == ("Twice: pytest_dsrepro.core.b, pytest_dsrepro.session.a",)
    assert reading(found, "import cycles")[0] == 1  # a -> b under TYPE_CHECKING, b -> a inside a function
    # its 5 helpers do not count: 13 public methods
    assert reading(found, "over 12 public methods")[1] == ("pytest_dsrepro/session/a.py:1 Twice: 13 public methods",)
    assert reading(found, "over 50 lines")[1] == ("pytest_dsrepro/tools/two_command.py:1 long: 53 lines",)
    assert reading(found, "over 40 lines")[1] == tuple(sorted([
        "pytest_dsrepro/tools/two_command.py:1 long: 53 lines",
        *(f"pytest_dsrepro/tools/two_command.py:{56 + 46 * i} over_40_{i}: 43 lines" for i in range(6)),
    ]))  # fmt: skip
    assert reading(found, "docstrings over 10 lines")[1][0] == "pytest_dsrepro/core/c0.py: 11 lines"
    assert reading(found, "docstrings over 10 lines")[0] == 33
    assert reading(found, "session/ modules")[0] == 13
    assert reading(found, "importing another")[1] == (
        "pytest_dsrepro/tools/one_command.py:2 -> pytest_dsrepro.tools.two_command",
    )  # its other imports name modules that are not there
    assert reading(found, "cli.py")[0] == 201
    assert reading(found, "function-level package imports")[0] == 7  # one_command's; core/b's is outside tools
    assert reading(found, "naming the scan")[1] == (  # a name, a one-word string; not a help text
        "pytest_dsrepro/plugin.py:1",
        "pytest_dsrepro/plugin.py:3",
        "pytest_dsrepro/plugin.py:4",
    )
    assert reading(found, "README lines over")[0] == 1
    assert found["README lines"][0] == 204
    assert reading(found, "Speed")[0] == 41
    unnamed = reading(found, "does not name")[1]
    assert "pytest_dsrepro/core/a.py" not in unnamed
    assert "pytest_dsrepro/scan/scanner.py" in unnamed  # named in a second cell only
    assert len(unnamed) == 52  # every module but core/a and the empty __init__ files
    assert reading(found, "no longer exist")[1] == (
        "docs/design.md:2: core/gone",
        "docs/design.md:2: Vanished",
        "docs/design.md:2: b.missing",
    )


def test_every_rule_fails_over_its_budget(rules: ModuleType, broken: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every rule of the broken package is over its budget, and the run says so with exit 1; the repository's own
    package is within every budget, exit 0."""
    assert [f"{f.rule}: {f.number} of {f.budget}" for f in rules.check(broken) if f.holds] == []
    assert rules.main(broken) == 1
    out = capsys.readouterr().out
    assert out.count("OVER") == len(rules.check(broken))
    assert "over budget: functions over 50 lines (1 > 0)" in out
    assert rules.main(ROOT) == 0
    assert "OVER" not in capsys.readouterr().out
