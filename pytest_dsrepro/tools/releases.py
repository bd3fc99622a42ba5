"""Which DeepSpeed releases: those a releases file lists (``dsrepro upstream`` and ``scan`` with ``--releases FILE``),
and those the package index has (what ``dsrepro bisect`` searches).

A releases file is one release a line, ``#`` comments (the format of the project's releases.txt). The index is read
through its simple repository API, JSON (PEP 691) preferred, HTML (PEP 503) where a proxy or mirror serves only that;
never from pip's output.
"""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Mapping
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

from packaging.utils import InvalidSdistFilename, InvalidWheelFilename, parse_sdist_filename, parse_wheel_filename
from packaging.version import Version

from ..core.text import cut

PACKAGE = "deepspeed"
#: The index asked for the release list: uv's setting, else pip's, else PyPI.
INDEX_SETTINGS = ("UV_DEFAULT_INDEX", "UV_INDEX_URL", "PIP_INDEX_URL")
DEFAULT_INDEX = "https://pypi.org/simple"
SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"
SIMPLE_ACCEPT = f"{SIMPLE_JSON}, application/vnd.pypi.simple.v1+html;q=0.2, text/html;q=0.01"


class ReleaseListError(Exception):
    """A list of releases could not be read (a releases file, the index) or names what is no release: one line."""


def release(text: str, where: str) -> str:
    """``text`` when it is a release version; ``where`` says where it came from in the error."""
    try:
        Version(text)
    except ValueError:  # InvalidVersion, or a part of 4300 digits or more (int())
        raise ReleaseListError(f"{where}: {cut(text, 60)!r} is not a release version") from None
    return text


def read_releases(path: Path) -> list[str]:
    """The releases of a releases file, each a valid version."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ReleaseListError(f"cannot read the releases file {path}: {exc.strerror}") from None
    found = []
    for number, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if text:
            found.append(release(text, f"{path}:{number}"))
    return found


# --- the package index ---------------------------------------------------------------------------------------------


def index_url(environ: Mapping[str, str]) -> str:
    return next((environ[k] for k in INDEX_SETTINGS if environ.get(k)), DEFAULT_INDEX).rstrip("/")


class _Anchors(HTMLParser):
    """A PEP 503 project page's files, in the PEP 691 shape: ``{"filename": ..., "yanked": ...}``."""

    def __init__(self) -> None:
        super().__init__()
        self.files: list[dict[str, Any]] = []
        self._yanked: bool | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self._yanked = "data-yanked" in dict(attrs)

    def handle_data(self, data: str) -> None:
        if self._yanked is not None and data.strip():
            self.files.append({"filename": data.strip(), "yanked": self._yanked})
            self._yanked = None


def parse_project_page(page: Mapping[str, Any]) -> list[Version]:
    """The releases on a project page (PEP 691's shape): versions of its files' names, yanked files left out."""
    found = set()
    for file in page.get("files", []):
        if file.get("yanked"):
            continue
        name = file["filename"]
        try:
            found.add(parse_wheel_filename(name)[1] if name.endswith(".whl") else parse_sdist_filename(name)[1])
        except (InvalidSdistFilename, InvalidWheelFilename):
            continue  # another kind of file (an .egg, a .zip of old): not installable by uv anyway
    return sorted(found)


def available_releases(environ: Mapping[str, str] | None = None, timeout: float = 60.0) -> list[Version]:
    """DeepSpeed's releases on the configured package index."""
    url = f"{index_url(os.environ if environ is None else environ)}/{PACKAGE}/"
    request = urllib.request.Request(url, headers={"Accept": SIMPLE_ACCEPT})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            kind = response.headers.get_content_type()
            body = response.read().decode(response.headers.get_content_charset() or "utf-8")
    except OSError as exc:
        raise ReleaseListError(f"cannot read the release list from {url}: {exc}") from None
    if kind == SIMPLE_JSON:
        return parse_project_page(json.loads(body))
    anchors = _Anchors()
    anchors.feed(body)
    return parse_project_page({"files": anchors.files})
