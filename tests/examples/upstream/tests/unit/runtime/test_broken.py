"""Upstream-style test file that cannot be imported for a reason of its own (written for pytest-dsrepro)."""

import a_package_nobody_installed  # noqa: F401
