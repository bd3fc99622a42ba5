"""core.source: a repro's test and what it uses from its file, read with ``ast`` (pure: nothing is imported)."""

from __future__ import annotations

from pathlib import Path

from pytest_dsrepro.core.source import module_slice

SEED_A = Path(__file__).parents[1] / "repros" / "zero3" / "test_zero3_backward_without_optimizer.py"
TEST_A = "test_backward_on_zero3_engine_without_optimizer"

MODULE = '''"""The module's docstring."""

from __future__ import annotations

import os
import re

import pytest

pytestmark = pytest.mark.ds_world

UNUSED = 1
#: the pattern a match uses
PATTERN = re.compile("x")


def helper():
    return PATTERN


def fix(monkeypatch):
    monkeypatch.setenv("X", os.sep)


@pytest.mark.ds_version(affected=">=0.1", raises=KeyError, fix=fix)
def test_it(ds_rank):
    # a comment inside
    return helper()


class TestGroup:
    def test_a(self):
        return UNUSED


if __name__ == "__main__":
    test_it(0)
'''


def test_the_test_and_what_it_uses_in_file_order() -> None:
    expected = '''"""The module's docstring."""

from __future__ import annotations

import os
import re

import pytest


#: the pattern a match uses
PATTERN = re.compile("x")


def helper():
    return PATTERN


def fix(monkeypatch):
    monkeypatch.setenv("X", os.sep)


@pytest.mark.ds_version(affected=">=0.1", raises=KeyError, fix=fix)
def test_it(ds_rank):
    # a comment inside
    return helper()
'''
    assert module_slice(MODULE, ["test_it"]) == expected


def test_bare_definitions_lose_their_decorators_and_what_only_they_used() -> None:
    code = module_slice(MODULE, ["test_it"], docstring=False, drop=["pytestmark"], bare=["test_it"])
    assert "pytest" not in code
    assert "def fix" not in code
    assert "import os" not in code
    assert code.startswith("from __future__ import annotations\n\nimport re\n\n\n#: the pattern")
    assert code.endswith("def test_it(ds_rank):\n    # a comment inside\n    return helper()\n")


def test_classes_and_module_marks() -> None:
    code = module_slice(MODULE, ["TestGroup", "pytestmark"], docstring=False)
    assert "class TestGroup:" in code
    assert "UNUSED = 1" in code
    assert "pytestmark = pytest.mark.ds_world" in code
    assert "__main__" not in code
    assert "def test_it" not in code


def test_seed_repro_a() -> None:
    code = module_slice(SEED_A.read_text(), [TEST_A, "pytestmark"])
    assert code.startswith('"""``engine.backward`` on a ZeRO-3 engine built without an optimizer')
    for part in ("from pytest_dsrepro.inrank.models import make_batch, tiny_mlp", "pytestmark = [",
                 "ATTRIBUTE = ", "def guard_optimizer_hooks(monkeypatch):", f"def {TEST_A}("):  # fmt: skip
        assert part in code
    assert code.index("def guard_optimizer_hooks") < code.index(f"def {TEST_A}")
