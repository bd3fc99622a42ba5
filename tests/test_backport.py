"""backport: an upstream diff applied to an installed module, through a MonkeyPatch, and undone with it."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import RunPytest
from pytest_dsrepro.inrank.backport import BackportError, backport, release_has

SOURCE = """

STATE = []


def traced(fn):
    def wrapper(*args, **kwargs):  # no functools.wraps, like DeepSpeed's instrument_w_nvtx
        return fn(*args, **kwargs)
    return wrapper


class Base:
    def tag(self, module):
        return "base"


class Registry(Base):
    def register(self, module):
        module.id = len(STATE)
        STATE.append(module)
        return super().tag(module)

    @traced
    def lookup(self, module):
        return module.id

    def __private(self, module):
        return module.id

    def private(self, module):
        return self.__private(module)


def number(module):
    return module.id
"""


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "fake_ds.py").write_text(textwrap.dedent(SOURCE))
    monkeypatch.syspath_prepend(str(tmp_path))
    import fake_ds

    yield fake_ds
    sys.modules.pop("fake_ds", None)


class Module:
    pass


def test_release_has_asks_the_installed_source(fake) -> None:
    """Issue 49, item 6: a fix guard's question, "does this release have it?", asked of a function, a class, a module
    or a module's dotted name; indentation and runs of spaces aside, line ends kept."""
    assert release_has(fake.Registry.register, "module.id = len(STATE)")
    assert release_has(fake.Registry, "return super().tag(module)", "return module.id")
    assert not release_has(fake.Registry, "return super().tag(module)", "return module.ds_id")  # every line, or no
    assert release_has("fake_ds", "def number(module):\nreturn module.id")  # the line end counts, the indent not
    assert release_has(fake.number, "return   module.id")
    assert not release_has(fake.number, "return module.id\ndef")
    assert not release_has(fake.number, "return module.i\n")


def test_release_has_refuses_to_answer_without_a_source() -> None:
    with pytest.raises(BackportError, match=r"release_has\(\): the source of len cannot be read \(.*\), so whether this "
                       r"release has the fix cannot be told"):  # fmt: skip
        release_has(len, "anything")


def test_every_changed_function_moves_together_and_is_undone(fake) -> None:
    registry = fake.Registry()
    with pytest.MonkeyPatch.context() as mp:
        patched = backport(mp, "fake_ds", [(r"\bmodule\.id\b", "module.ds_id")])
        assert patched == ["Registry._Registry__private", "Registry.lookup", "Registry.register", "number"]
        m = Module()
        m.id = "user"
        assert registry.register(m) == "base"  # super() still resolves against the live class
        assert m.id == "user"
        assert m.ds_id == 0
        assert registry.lookup(m) == 0
        assert registry.private(m) == 0
        assert fake.number(m) == 0
        assert isinstance(registry, fake.Registry)
        assert [m] == fake.STATE
    m2 = Module()
    registry.register(m2)
    assert m2.id == 1
    assert not hasattr(m2, "ds_id")


def test_edits_that_do_not_fit_fail_loudly(fake) -> None:
    with pytest.MonkeyPatch.context() as mp:
        expected = "fake_ds: " + repr(r"module\.uid") + " matches nothing in the installed source"
        with pytest.raises(BackportError, match=re.escape(expected)):
            backport(mp, "fake_ds", [(r"module\.uid", "module.ds_uid")])
        with pytest.raises(BackportError, match="fake_ds: the edits changed no function or method"):
            backport(mp, "fake_ds", [(r"STATE = \[\]", "STATE = []  # same")])


def test_a_module_object_is_refused_naming_the_parameter(fake) -> None:
    with pytest.MonkeyPatch.context() as mp, pytest.raises(TypeError) as raised:
        backport(mp, fake, [(r"\bmodule\.id\b", "module.ds_id")])  # type: ignore[arg-type]
    assert str(raised.value) == (
        "backport(): module_name must be the module's dotted name as a string, such as 'deepspeed.runtime.engine', "
        "not the module object 'fake_ds': the source it recompiles is found by that name"
    )


def test_a_fix_that_raises_is_told_as_such_not_as_a_fix_that_does_not_hold(
    pytester: pytest.Pytester, run: RunPytest
) -> None:
    """The mistake the issue met: a module object given to backport. The verdict says the fix raised (it was never
    applied), names the fix and shows the TypeError; the stock variant is judged as usual."""
    pytester.makepyfile(
        """
        import json
        import pytest
        from pytest_dsrepro.inrank.backport import backport

        def give_json_an_epilogue(monkeypatch):
            backport(monkeypatch, json, [("def dumps", "def epilogue(): pass\\ndef dumps")])

        @pytest.mark.ds_world
        @pytest.mark.ds_version(affected=">=0", raises=AttributeError, match="epilogue", fix=give_json_an_epilogue)
        def test_epilogue(ds_rank):
            json.epilogue()
        """
    )
    result = run("-rx")
    result.assert_outcomes(failed=1, xfailed=1)
    result.stdout.fnmatch_lines(
        [
            "*the fix raised on deepspeed *, so it was never applied and the body never ran (give_json_an_epilogue): "
            "ranks 0-1: TypeError: backport(): module_name must be the module's dotted name as a string, such as "
            "'deepspeed.runtime.engine', not the module object 'json'*",
            "---- ranks 0-1: traceback ----",
            "the fix give_json_an_epilogue raised while it was being applied; the body never ran:",
            "*= dsrepro verdicts *",
            "REPRODUCED  *::test_epilogue[[]stock[]]",
            "UNEXPECTED  *::test_epilogue[[]fixed[]]  -- the fix raised on deepspeed *",
        ]
    )
    assert "does not hold" not in result.stdout.str()
