"""The plugin's own hook, for its plugin objects (``--ds-scan``'s): added by ``pytest_addhooks``."""

from __future__ import annotations

import pytest

from ..core.gates import Judgement


@pytest.hookspec(firstresult=True)
def pytest_dsrepro_conclude(item: pytest.Item, judgement: Judgement, story: str) -> object:
    """The pytest outcome of a judged test: raise it (``pytest.xfail``, ``pytest.skip``, ``pytest.fail``), or
    return True for a pass. ``story``: what the user reads under the verdict. The plugin's own conclusion comes last
    (REPRODUCED xfails, UNEXPECTED fails); a scan's, which concludes by its own verdicts, first."""
