"""``dsrepro bisect``: the first DeepSpeed release where a test's outcome flips, by binary search over PyPI releases.

Three layers, the first two pure and tested directly:

- ``releases_between`` and ``search``: which releases to probe, in which order, and what the probes prove. A
  release that cannot be installed or imported is *skipped*: never counted as good or bad, and reported.
- ``bug_present``: what one probe's ``--ds-results`` records say (the bug shows / does not show / no answer), read
  from each record's ``reason`` (the gates' own answer, ``Reason.body_failed``), never from a message's wording.
- ``probe_release``: install one release (cached per release, ``filelock``-guarded, see ``install``), run
  ``python -m pytest NODEID --ds-results DIR`` with that release, and read the records back.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

from packaging.utils import InvalidSdistFilename, InvalidWheelFilename, parse_sdist_filename, parse_wheel_filename
from packaging.version import Version

from ..core import results, versions
from ..core.gates import FIXED, Verdict
from ..core.results import TestRecord

PACKAGE = "deepspeed"


class BisectError(Exception):
    """The bisect cannot start or cannot conclude; the message says why."""


@dataclass(frozen=True)
class Probe:
    """What one release did. ``bug``: True (the bug shows), False (it does not), None (could not be tested)."""

    version: Version
    bug: bool | None
    detail: str = ""
    seconds: float = 0.0  # the whole probe
    install_seconds: float = 0.0  # of which installing (or finding) the release

    @property
    def timing(self) -> str:
        install = f", install {self.install_seconds:.1f} s" if self.install_seconds else ""
        return f"{self.seconds:.1f} s{install}"

    @property
    def word(self) -> str:
        return {True: "bug", False: "no bug", None: "skipped"}[self.bug]


Oracle = Callable[[Version], Probe]
Progress = Callable[[Version, int, int], None]  # (release about to be probed, step number, estimated steps)


@dataclass(frozen=True)
class Result:
    """The flip lies between ``last_before`` and ``first_after`` (consecutive, unless ``untested`` lie between)."""

    last_before: Probe  # the newest release tested with the older endpoint's outcome
    first_after: Probe  # the oldest release tested with the newer endpoint's outcome
    untested: tuple[Version, ...]  # releases between the two that could not be tested: the flip may be at any
    probes: tuple[Probe, ...] = field(default=())  # every probe, in the order run

    @property
    def fixed(self) -> bool:
        """True when the bug shows in the older releases and stops at ``first_after`` (a fix, not a regression)."""
        return bool(self.last_before.bug)

    @property
    def exact(self) -> bool:
        return not self.untested

    @property
    def skipped(self) -> tuple[Probe, ...]:
        return tuple(p for p in self.probes if p.bug is None)

    @property
    def specifier(self) -> str:
        """What to paste into ``ds_version(affected=...)``."""
        return specifier(self.first_after.version, fixed=self.fixed)


def specifier(flip: Version, fixed: bool) -> str:
    """``<0.16.4`` when ``flip`` is the first release without the bug, ``>=0.18.3`` when it is the first with it."""
    return f"<{flip}" if fixed else f">={flip}"


def releases_between(available: Iterable[Version | str], low: Version | str, high: Version | str) -> list[Version]:
    """Final releases from ``low`` to ``high`` (either order), both included and both required to exist."""
    versions = sorted({v if isinstance(v, Version) else Version(v) for v in available})
    a, b = sorted((Version(str(low)), Version(str(high))))
    if a == b:
        raise BisectError(f"--good and --bad are the same release ({a}); give two different releases")
    for end in (a, b):
        if end not in versions:
            finals = [v for v in versions if not v.is_prerelease]
            at = bisect_left(finals, end)
            near = ", ".join(str(v) for v in finals[max(at - 1, 0) : at + 1])
            raise BisectError(f"deepspeed {end} is not a release on the index (nearest: {near})")
    return [v for v in versions if a <= v <= b and (not v.is_prerelease or v in (a, b))]


def estimated_steps(candidates: int) -> int:
    """Probes a search over ``candidates`` releases needs when none is skipped: both ends, then halving."""
    return 2 + math.ceil(math.log2(max(candidates - 1, 1)))


def _nearest(indices: Sequence[int], lo: int, hi: int) -> int:
    middle = (lo + hi) / 2
    return min(indices, key=lambda i: (abs(i - middle), i))


def search(releases: Sequence[Version], oracle: Oracle, progress: Progress | None = None) -> Result:
    """Binary search for the first release whose outcome differs from the oldest one's.

    Both ends are probed first and must differ. A skipped release is removed from the candidates and the one
    nearest the middle is tried instead (as ``git bisect skip`` does); skipped releases left between the two
    closest tested releases make the result inexact, and ``Result.untested`` names them.
    """
    if len(releases) < 2:
        raise BisectError("need at least two releases to bisect")
    ordered = list(releases)
    probes: list[Probe] = []
    estimate = estimated_steps(len(ordered))

    def run(index: int) -> Probe:
        if progress is not None:
            progress(ordered[index], len(probes) + 1, max(estimate, len(probes) + 1))
        probe = oracle(ordered[index])
        probes.append(probe)
        return probe

    low, high = run(0), run(len(ordered) - 1)
    for end in (low, high):
        if end.bug is None:
            raise BisectError(f"deepspeed {end.version} could not be tested ({end.detail}); choose another end")
    if low.bug == high.bug:
        state = "shows" if low.bug else "does not show"
        raise BisectError(
            f"the bug {state} on both deepspeed {low.version} and {high.version}: no flip to find between them"
        )
    lo, hi = 0, len(ordered) - 1
    outcome = {lo: low, hi: high}
    pending = set(range(1, len(ordered) - 1))
    while between := [i for i in range(lo + 1, hi) if i in pending]:
        index = _nearest(between, lo, hi)
        pending.discard(index)
        probe = run(index)
        if probe.bug is None:
            estimate += 1
            continue
        outcome[index] = probe
        if probe.bug == low.bug:
            lo = index
        else:
            hi = index
    return Result(outcome[lo], outcome[hi], tuple(ordered[lo + 1 : hi]), tuple(probes))


# --- reading one probe's results ----------------------------------------------------------------------------------


def _record_bug(record: TestRecord) -> bool | None:
    """Does this record show the bug? None when it says nothing about it."""
    if record.reason is not None:
        # The gates judged the body: it failed (as declared, differently, or outside the range: the code misbehaves
        # either way) or it passed (where the bug was expected too: "did not reproduce"); None: no world ran.
        return record.reason.body_failed
    if record.verdict is Verdict.SKIPPED or record.outcome in ("skipped", "error"):
        return None  # a gate or the test skipped, or setup failed: the release says nothing about the bug
    return record.outcome in ("failed", "xfailed")  # a plain test: its outcome is the answer


def _stock(records: Iterable[TestRecord]) -> list[TestRecord]:
    """``[fixed]`` variants say whether the fix holds, not whether the release has the bug: left out."""
    return [r for r in records if r.variant != FIXED]


def bug_present(records: Iterable[TestRecord]) -> bool | None:
    """Does the bug show in this run? True if any stock test shows it; None if no stock test gave an answer."""
    known = [a for a in map(_record_bug, _stock(records)) if a is not None]
    return any(known) if known else None


def describe(records: Iterable[TestRecord]) -> str:
    """One line for the progress output: verdict (or outcome) and first error of each stock test."""
    parts = []
    for r in _stock(records):
        label = r.verdict.value if r.verdict else r.outcome.upper()
        if not r.error:
            parts.append(label)
        elif r.error.startswith(label):  # "REPRODUCED on deepspeed ...": the verdict is already said
            parts.append(r.error)
        else:
            parts.append(f"{label}: {r.error}")
    return "; ".join(parts)


# --- real releases -----------------------------------------------------------------------------------------------


#: The index asked for the release list: uv's setting, else pip's, else PyPI.
INDEX_SETTINGS = ("UV_DEFAULT_INDEX", "UV_INDEX_URL", "PIP_INDEX_URL")
DEFAULT_INDEX = "https://pypi.org/simple"
#: The simple repository API, JSON (PEP 691) preferred, HTML (PEP 503) where a proxy or mirror serves only that.
SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"
SIMPLE_ACCEPT = f"{SIMPLE_JSON}, application/vnd.pypi.simple.v1+html;q=0.2, text/html;q=0.01"


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
    """DeepSpeed's releases on the configured package index (its simple repository API, never pip's output)."""
    url = f"{index_url(os.environ if environ is None else environ)}/{PACKAGE}/"
    request = urllib.request.Request(url, headers={"Accept": SIMPLE_ACCEPT})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            kind = response.headers.get_content_type()
            body = response.read().decode(response.headers.get_content_charset() or "utf-8")
    except OSError as exc:
        raise BisectError(f"cannot read the release list from {url}: {exc}") from None
    if kind == SIMPLE_JSON:
        return parse_project_page(json.loads(body))
    anchors = _Anchors()
    anchors.feed(body)
    return parse_project_page({"files": anchors.files})


def _tail(text: str, lines: int = 3) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:] if line.strip())


@dataclass(frozen=True)
class ReleaseEnv:
    """An environment that holds one release: its interpreter, and the variables to run it with."""

    python: str
    environ: Mapping[str, str]


@dataclass(frozen=True)
class Prober:
    """Runs one test on one release: the real oracle of ``search``."""

    nodeid: str
    prepare: Callable[[Version], ReleaseEnv]  # installs a release; returns the environment that runs it
    pytest_args: tuple[str, ...] = ()
    log_dir: Path | None = None  # each probe's full pytest output, one file per release
    timeout: float = 3600.0

    def __call__(self, version: Version) -> Probe:
        start = time.monotonic()
        installed = start

        def done(bug: bool | None, detail: str) -> Probe:
            return Probe(version, bug, detail, time.monotonic() - start, installed - start)

        try:
            env = self.prepare(version)
        except Exception as exc:  # noqa: BLE001 - any install failure skips the release, with its reason
            installed = time.monotonic()
            return done(None, f"cannot install or import: {' '.join(str(exc).split())[:400]}")
        installed = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=f"dsrepro-bisect-{version}-") as tmp:
            args = [env.python, "-m", "pytest", self.nodeid, "-p", "no:cacheprovider", "--ds-results", tmp]
            proc = subprocess.run(
                [*args, *self.pytest_args], capture_output=True, text=True, env=dict(env.environ), timeout=self.timeout
            )
            if self.log_dir is not None:
                self.log_dir.mkdir(parents=True, exist_ok=True)
                (self.log_dir / f"deepspeed-{version}.log").write_text(proc.stdout + proc.stderr)
            files, unreadable = results.read_all([Path(tmp)])
        if unreadable:
            return done(None, f"unreadable results: {unreadable[0]}")
        records = [t for f in files for t in f.run.tests]
        ran = {str(f.run.environment.deepspeed) for f in files}
        if files and ran != {str(version)}:
            return done(None, f"ran deepspeed {', '.join(sorted(ran))} instead of {version}")
        if not records:
            return done(None, f"no test ran (pytest exit code {proc.returncode}): {_tail(proc.stdout + proc.stderr)}")
        return done(bug_present(records), describe(records))


# --- one environment per release ----------------------------------------------------------------------------------


def environment_dir(cache_dir: Path, version: Version) -> Path:
    """Where one release's environment lives: per DeepSpeed release, Python and torch (a build depends on all)."""
    torch = versions.installed_text("torch") or "none"
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    return cache_dir / "envs" / f"deepspeed-{version}-{py}-torch-{torch}"


def _torch_pin(cache_dir: Path) -> Path:
    """A constraints file pinning the torch installed here: bisect must never move torch."""
    torch = versions.installed_text("torch")
    if torch is None:
        raise BisectError("torch is not installed in this environment; install the torch to test with first")
    path = cache_dir / "envs" / f"constraints-torch-{torch}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"torch=={torch}\n")
    return path


def release_environment(
    cache_dir: Path | None = None,
    constraints: Path | None = None,
    python: str = sys.executable,
    log_dir: Path | None = None,
) -> Callable[[Version], ReleaseEnv]:
    """The ``prepare`` step of a ``Prober``: one uv environment per release, kept in the cache and reused, holding
    torch (pinned), that release (``install.install_deepspeed``) and this plugin as installed here
    (``install.add_this_plugin``). A ``filelock`` per environment: two bisects (or a bisect and a benchmark) never
    fill one at once. ``constraints`` defaults to ``$DSREPRO_CONSTRAINTS`` or ``constraints.txt`` here or above,
    else to a pin of the torch installed here.
    """
    from filelock import FileLock

    from ..core.options import default_cache_dir
    from . import install

    root = cache_dir or default_cache_dir()
    pins = constraints or install.find_constraints() or _torch_pin(root)

    def prepare(version: Version) -> ReleaseEnv:
        directory = environment_dir(root, version)
        directory.parent.mkdir(parents=True, exist_ok=True)
        log = log_dir / f"install-deepspeed-{version}.log" if log_dir else None
        with FileLock(str(directory) + ".lock", timeout=install.INSTALL_TIMEOUT):
            try:
                env_python = install.environment_python(directory, python)
                install.add_this_plugin(env_python, pins, log)
            except install.InstallError as exc:
                raise BisectError(exc.reason) from None
            result = install.install_deepspeed(
                str(version), python=env_python, constraints=pins, cache_dir=root, log=log
            )
        if not result.ok:
            raise BisectError(result.reason or "unavailable")
        environ = {**os.environ, "VIRTUAL_ENV": str(directory)}
        environ.setdefault("DS_ACCELERATOR", "cpu")
        return ReleaseEnv(env_python, environ)

    return prepare


def summary(result: Result, good: str, bad: str, seconds: float) -> str:
    """The final words of a bisect: the flip, the specifier to paste, and what was skipped."""
    before, after = result.last_before, result.first_after
    change = "stops showing (fixed)" if result.fixed else "starts showing (regression)"
    lines = []
    if result.exact:
        lines.append(f"first release where the outcome flips: deepspeed {after.version}")
    else:
        maybe = ", ".join(str(v) for v in (*result.untested, after.version))
        lines.append(f"the outcome flips at one of deepspeed {maybe} (the releases between could not be tested)")
    lines.append(f"  {before.version}: {before.word}  ({before.detail})")
    lines.append(f"  {after.version}: {after.word}  ({after.detail})")
    lines.append(f"the bug {change} in deepspeed {after.version}; paste:")
    lines.append(f'  @pytest.mark.ds_version(affected="{result.specifier}", ...)')
    good_probe = next((p for p in result.probes if str(p.version) == str(Version(good))), None)
    if good_probe is not None and good_probe.bug:
        lines.append(f"note: the bug shows on --good {good} and not on --bad {bad}; the flip is the same either way")
    for p in result.skipped:
        lines.append(f"skipped deepspeed {p.version}: {p.detail}")
    tested = sum(1 for p in result.probes if p.bug is not None)
    lines.append(
        f"{len(result.probes)} releases probed ({tested} tested, {len(result.skipped)} skipped) in "
        f"{seconds / 60:.1f} min"
    )
    return "\n".join(lines)
