"""The catalogue's device check as fixtures, for a ``conftest.py`` to import (the catalogue's does)::

    from pytest_dsrepro.inrank.checks import checked_directory, tensors_on_the_rank_device

Imported into a conftest, the autouse rank fixture runs ``devices.placement_check`` around every world test's body
beneath it, in each rank, for the test's directory. A module of its own (not the conftest, whose module name is not
unique in a session) so that ranks import the fixture by this name.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pytest_dsrepro.inrank.devices import placement_check
from pytest_dsrepro.inrank.fixtures import rank_fixture


@pytest.fixture
def checked_directory(request: pytest.FixtureRequest) -> str:
    """The directory of the test's file: its code, and the helpers beside it, are what ``placement_check`` checks."""
    return str(request.path.parent)


@rank_fixture(autouse=True)
def tensors_on_the_rank_device(checked_directory: str) -> Iterator[None]:
    """``placement_check`` around the body, in each rank, for the test's directory."""
    with placement_check([checked_directory]):
        yield
