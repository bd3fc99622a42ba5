"""What ``dsrepro bisect --repo`` keeps between runs, under ``<cache dir>/bisect/``: one environment per commit
(``envs/``: ``CommitEnvironments``), reused by every later bisect that probes the commit, and what each probe found
(``outcomes/``: ``Outcomes``), so that a re-run resumes from what is known.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from ..core import versions
from ..core.files import write_atomically
from ..core.text import cut
from . import install, processes
from .environments import build_key
from .history import Clone, Commit, describe_left_out

READY = "ready.json"
#: The default bound on the environments' disk use (``--env-cache``).
DEFAULT_LIMIT = 10 * 2**30
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


class CannotInstall(Exception):
    """The commit does not build or does not import; the message is the one line that says why."""


def parse_size(text: str) -> int:
    """``10G``, ``500M``, ``1.5GiB`` or a number of bytes."""
    found = re.fullmatch(r"\s*(\d{1,30}(?:\.\d{1,30})?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not found:  # 30 digits at most: more is no disk, and float() of 400 is infinite (int() of it an OverflowError)
        raise ValueError(f"{cut(text, 60)!r} is not a size (e.g. 10G, 500M, or bytes)")
    return int(float(found.group(1)) * _UNITS[found.group(2).upper()])


def own_bytes(directory: Path) -> int:
    """What removing ``directory`` would free: its files that no other directory links (hard links counted once,
    by whoever else holds them)."""
    total = 0
    for base, _, files in os.walk(directory):
        for name in files:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(base, name))
                if st.st_nlink == 1:
                    total += st.st_blocks * 512
    return total


@dataclass(frozen=True)
class Ready:
    """An environment that holds one commit's DeepSpeed, ready to probe."""

    sha: str
    deepspeed: str  # the version its DeepSpeed reports (version.txt + "+<commit>")
    bytes: int  # what removing it frees (``own_bytes``), measured when it was made
    seconds: float  # how long making it took


def _ready(directory: Path) -> Ready | None:
    try:
        return Ready(**json.loads((directory / READY).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _remove(directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)


@dataclass(frozen=True)
class CommitEnv:
    """One commit's environment, as a probe uses it."""

    directory: Path
    python: str
    deepspeed: str
    made: bool  # made now (else reused)
    seconds: float  # making it took (0 when reused)


@dataclass
class CommitEnvironments:
    """One environment per commit of ``clone``, made on first use, kept within ``limit`` bytes (LRU).

    ``envs/<commit>-<python>-torch-<version>/`` holds the ``dsrepro install`` recipe on the commit's tree, this plugin
    added. Least recently used ones are removed beyond ``limit``, counting what removing one would free: the files it
    alone holds (uv links torch and the other wheels from its own cache, so those cost nothing here). ``sources/``
    holds a commit's tree while it is being installed, and only then.

    An environment is used only once its ``ready.json`` is written; one that fails or is interrupted while being made
    is removed at once, and one a killed process left half made is removed by the next prune. Each environment has a
    file lock, held while it is made and while a probe uses it: a prune never removes an environment in use.
    """

    root: Path  # <cache dir>/bisect
    clone: Clone
    constraints: Path
    limit: int = DEFAULT_LIMIT
    python: str = sys.executable
    log_dir: Path | None = None
    lock_timeout: float = 3600.0
    notes: list[str] = dataclasses.field(default_factory=list)  # what was left out of trees, what was removed

    @property
    def envs(self) -> Path:
        return self.root / "envs"

    def directory(self, commit: Commit) -> Path:
        return self.envs / f"{commit.sha}-{build_key()}"

    @contextlib.contextmanager
    def using(self, commit: Commit) -> Iterator[CommitEnv]:
        """The commit's environment, made if needed, locked while the caller uses it. Raises ``CannotInstall``."""
        directory = self.directory(commit)
        self.envs.mkdir(parents=True, exist_ok=True)
        with FileLock(f"{directory}.lock", timeout=self.lock_timeout):
            ready = _ready(directory)
            made = ready is None
            if ready is None:
                ready = self._make(commit, directory)
            else:
                self._add_plugin(str(directory / "bin" / "python"))  # this plugin as it is now, not when made
            os.utime(directory / READY)  # the least recently used go first
            yield CommitEnv(directory, str(directory / "bin" / "python"), ready.deepspeed, made,
                            ready.seconds if made else 0.0)  # fmt: skip
        if made:
            self.prune(keep=directory)

    def _make(self, commit: Commit, directory: Path) -> Ready:
        started = time.monotonic()
        _remove(directory)  # half made by a process that was killed
        log = self.log_dir / f"install-{commit.short}.log" if self.log_dir else None
        sources = self.root / "sources"
        sources.mkdir(parents=True, exist_ok=True)
        try:
            tree = Path(tempfile.mkdtemp(prefix=f"{commit.short}-", dir=sources))
            try:
                left_out = self.clone.export(commit, tree)
                if left_out:
                    self._note(
                        f"left out of commits' trees, their objects not in the clone: {describe_left_out(left_out)}"
                    )
                python = install.environment_python(directory, self.python)
                self._add_plugin(python)
                result = install.install_source(tree, f"+{commit.short}", python=python,
                                                constraints=self.constraints, log=log, name=commit.short)  # fmt: skip
            finally:
                with processes.shielded():
                    _remove(tree)
            if not result.ok or result.probe is None or result.probe.deepspeed is None:
                raise CannotInstall(result.reason or "unavailable")
            seconds = round(time.monotonic() - started, 1)
            ready = Ready(commit.sha, result.probe.deepspeed, own_bytes(directory), seconds)
            (directory / READY).write_text(json.dumps(dataclasses.asdict(ready)))
            return ready
        except BaseException:  # failed, or interrupted (a second Ctrl-C waits for it): nothing half made stays
            with processes.shielded():
                _remove(directory)
            raise

    def _note(self, note: str) -> None:
        if note not in self.notes:
            self.notes.append(note)

    def _add_plugin(self, python: str) -> None:
        try:
            install.add_this_plugin(
                python, self.constraints, self.log_dir / "install-plugin.log" if self.log_dir else None
            )
        except install.InstallError as exc:
            raise CannotInstall(exc.reason) from None

    def prune(self, keep: Path | None = None) -> list[Path]:
        """Remove environments, least recently used first, until the rest fit in ``limit``, and what a killed or
        failed install left (a half made environment, a lock). Never ``keep``, nor one another process holds.
        Returns the ready environments removed."""
        ready: list[tuple[float, int, Path]] = []  # last used, bytes, where
        names = {p.name.removesuffix(".lock") for p in self.envs.iterdir()} if self.envs.is_dir() else set()
        for directory in (self.envs / name for name in names):
            found = _ready(directory)
            if found is None:
                self._free(directory)
                continue
            with contextlib.suppress(OSError):
                ready.append(((directory / READY).stat().st_mtime, found.bytes, directory))
        total = sum(size for _, size, _ in ready)
        removed = []
        for _, size, directory in sorted(ready):
            if total <= self.limit:
                break
            if directory != keep and self._free(directory):
                removed.append(directory)
                total -= size
                self._note(f"removed the environment {directory.name} (least recently used; --env-cache)")
        return removed

    def _free(self, directory: Path) -> bool:
        """Remove ``directory`` if no process holds its lock."""
        lock = FileLock(f"{directory}.lock", timeout=0)
        try:
            with lock:
                _remove(directory)
        except Timeout:
            return False
        Path(f"{directory}.lock").unlink(missing_ok=True)
        return True


# --- probe outcomes ----------------------------------------------------------------------------------------------


def repro_key(nodeid: str, args: Sequence[str], cwd: Path, runs: int) -> str:
    """What makes two probes of one commit the same: the test and how it is run (its file's content included, so
    an edited repro is probed again)."""
    path = cwd / nodeid.split("::", 1)[0]
    try:
        content = hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        content = None
    torch = versions.installed_text("torch")
    key = json.dumps([nodeid, list(args), str(cwd.resolve()), runs, content, torch, sys.version_info[:2]])
    return hashlib.sha256(key.encode()).hexdigest()[:24]


@dataclass(frozen=True)
class Outcomes:
    """Probe outcomes of one test, one file per commit: ``outcomes/<test>/<commit>.json``, keyed by the test
    (``repro_key``: its node id, its file's content, the pytest arguments, where pytest runs, the runs per probe) and
    the commit."""

    directory: Path

    def get(self, commit: Commit) -> dict[str, Any] | None:
        """What a probe of ``commit`` found, or None (never probed, or a file this version cannot read: probe again)."""
        try:
            found = json.loads((self.directory / f"{commit.sha}.json").read_text())
        except (OSError, ValueError):
            return None
        shape: dict[str, type | tuple[type, ...]] = {
            "bug": (bool, type(None)), "detail": str, "seconds": (int, float), "install_seconds": (int, float),
        }  # fmt: skip
        if not isinstance(found, dict) or not all(isinstance(found.get(k), t) for k, t in shape.items()):
            return None
        return found

    def put(self, commit: Commit, outcome: dict[str, Any]) -> None:
        write_atomically(self.directory / f"{commit.sha}.json", json.dumps(outcome))

    def __len__(self) -> int:
        return len(list(self.directory.glob("*.json"))) if self.directory.is_dir() else 0
