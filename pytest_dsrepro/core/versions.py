"""Installed distribution versions, read from package metadata (never by importing the package)."""

from __future__ import annotations

from importlib import metadata

from packaging.version import InvalidVersion, Version


def installed(distribution: str) -> Version | None:
    """The installed version of ``distribution``, or None when it is not installed (or has no valid version)."""
    try:
        return Version(metadata.version(distribution))
    except (metadata.PackageNotFoundError, InvalidVersion):
        return None


def installed_text(distribution: str) -> str | None:
    version = installed(distribution)
    return None if version is None else str(version)
