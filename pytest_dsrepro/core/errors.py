"""The two kinds of error the core raises, so the pytest side can tell a user's mistake from the harness's."""

from __future__ import annotations


class MarkerError(Exception):
    """A marker's arguments are wrong; the message names the marker, the test and the value."""


class HarnessError(Exception):
    """pytest-dsrepro itself could not run a world (the fork server did not start, a job could not be sent).

    Never judged as a repro's failure: a ``ds_version`` gate with ``raises=Exception`` must not call it REPRODUCED.
    """
