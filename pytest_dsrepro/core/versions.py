"""Installed distributions, read from package metadata and import specs (never by importing the package)."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
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


def location(package: str) -> str | None:
    """The directory ``import package`` would load from in this interpreter (its spec; nothing is executed)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    return os.path.dirname(os.path.realpath(spec.origin))


@dataclass(frozen=True)
class Release:
    """A package's version and where it is imported from: what the run is about, or what a process imported."""

    version: str | None
    path: str | None

    def __str__(self) -> str:
        return f"{self.version or 'none'} from {self.path or 'nowhere'}"


def resolved(distribution: str, package: str) -> Release:
    """What this interpreter would import as ``package`` (the distribution's metadata for its version)."""
    return Release(installed_text(distribution), location(package))


def same_release(expected: Release, seen: Release) -> bool:
    """One release at one place. Versions compare as versions; paths as real paths."""
    try:
        versions_match = Version(expected.version or "") == Version(seen.version or "")
    except ValueError:  # InvalidVersion, or a part of 4300 digits or more (int())
        versions_match = expected.version == seen.version
    paths = {os.path.realpath(p) if p else None for p in (expected.path, seen.path)}
    return versions_match and len(paths) == 1
