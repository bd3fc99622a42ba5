"""Tests refused at setup, before any world: a release the test declares out of its reach (NOT-APPLICABLE), and
pytest's xunit-style methods, which would set up the pytest process instead of the ranks."""

from __future__ import annotations

import pytest

from ..core.gates import Judgement, Reason, holding, installed_deepspeed
from . import markers
from .skip_location import skip_at_test
from .stash import JUDGEMENT_KEY, Marks

#: pytest's xunit-style methods of a test class: they run in the pytest process, so what they set never reaches ranks.
XUNIT_METHODS = ("setup_method", "teardown_method", "setup_class", "teardown_class")


def where_not_applicable(item: pytest.Item, marks: Marks) -> None:
    """A release the test declares out of its reach: no world, the verdict NOT-APPLICABLE with the declared reason
    (reported by pytest as a skip at the test, since pytest has no other word for a test that did not run)."""
    version = installed_deepspeed()
    found = holding(marks.not_applicable, version)
    if found:
        reasons = "; ".join(c.describe() for c in found)
        judgement = Judgement(Reason.NOT_APPLICABLE, f"not applicable on deepspeed {version}: {reasons}")
        item.stash[JUDGEMENT_KEY] = judgement
        skip_at_test(item, judgement.message)


def xunit_setup(item: pytest.Item) -> None:
    cls = getattr(item, "cls", None)
    found = [name for name in XUNIT_METHODS if callable(getattr(cls, name, None))]
    if cls is not None and found:
        markers.fail(
            f"{item.nodeid}: {cls.__qualname__}.{found[0]} runs in the pytest process, not in the ranks, so what it "
            "sets on the instance or class never reaches them; in a world test use a fixture (its value is sent to "
            "every rank) or set up in the body"
        )
