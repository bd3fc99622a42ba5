"""``dsrepro bisect``: the first DeepSpeed release (or, with ``--repo``, commit) where a test's outcome flips, by
binary search.

Three layers, the first two pure and tested directly: ``search``, which points (releases, or commits) to probe, in
which order, and what the probes prove; ``bug_present`` and ``reproduced``, what one probe's ``--ds-results`` records
say (the bug shows / does not show / no answer), read from each record's ``reason`` (the gates' own answer), never
from a message's wording; and ``Prober``, which runs the test at a point in that point's environment and reads the
records back.
"""

from __future__ import annotations

import contextlib
import math
import tempfile
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

from packaging.version import Version

from ..core import results
from ..core.gates import FIXED, Reason, Verdict
from ..core.results import TestRecord
from . import processes
from .environments import ReleaseEnv

#: What a search runs over: releases (``Version``) or commits (``history.Commit``).
P = TypeVar("P")


class BisectError(Exception):
    """The bisect cannot start (its ends, its test, its options: ``dsrepro bisect`` exits 2); the message says why."""


class NoVerdict(BisectError):
    """The search ran and can name no flip: an end could not be tested, or both ends agree (``dsrepro bisect``
    exits 1)."""


@dataclass(frozen=True)
class Probe(Generic[P]):
    """What one point did. ``bug``: True (the bug shows), False (it does not), None (could not be tested)."""

    at: P
    bug: bool | None
    detail: str = ""
    seconds: float = 0.0  # the whole probe
    install_seconds: float = 0.0  # of which installing (or finding) the point's DeepSpeed
    stored: bool = False  # found among the outcomes an earlier run stored, not run now

    @property
    def timing(self) -> str:
        install = f", install {self.install_seconds:.1f} s" if self.install_seconds else ""
        return f"{self.seconds:.1f} s{install}"

    @property
    def word(self) -> str:
        return {True: "bug", False: "no bug", None: "skipped"}[self.bug]


Oracle = Callable[[P], Probe[P]]
Progress = Callable[[P, int, int], None]  # (point about to be probed, step number, estimated steps)


@dataclass(frozen=True)
class Result(Generic[P]):
    """The flip lies between ``last_before`` and ``first_after`` (consecutive, unless ``untested`` lie between)."""

    last_before: Probe[P]  # the newest point tested with the older end's outcome
    first_after: Probe[P]  # the oldest point tested with the newer end's outcome
    untested: tuple[P, ...]  # points between the two that could not be tested: the flip may be at any
    probes: tuple[Probe[P], ...] = field(default=())  # every probe, in the order run

    @property
    def fixed(self) -> bool:
        """True when the bug shows in the older points and stops at ``first_after`` (a fix, not a regression)."""
        return bool(self.last_before.bug)

    @property
    def exact(self) -> bool:
        return not self.untested

    @property
    def skipped(self) -> tuple[Probe[P], ...]:
        return tuple(p for p in self.probes if p.bug is None)

    @property
    def change(self) -> str:
        return "stops showing (fixed)" if self.fixed else "starts showing (regression)"


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
    """Probes a search over ``candidates`` points needs when none is skipped: both ends, then halving."""
    return 2 + math.ceil(math.log2(max(candidates - 1, 1)))


def _nearest(indices: Sequence[int], lo: int, hi: int) -> int:
    middle = (lo + hi) / 2
    return min(indices, key=lambda i: (abs(i - middle), i))


def _release(point: object) -> str:
    return f"deepspeed {point}"


def search(
    points: Sequence[P], oracle: Oracle[P], progress: Progress[P] | None = None, name: Callable[[P], str] = _release
) -> Result[P]:
    """Binary search for the first point whose outcome differs from the oldest one's (``points``: oldest first).

    Both ends are probed first and must differ. A skipped point is removed from the candidates and the one nearest
    the middle is tried instead (as ``git bisect skip`` does); skipped points left between the two closest tested
    points make the result inexact, and ``Result.untested`` names them. ``name`` names a point in errors. A point
    that cannot be installed or imported, or whose run says nothing, is skipped: never counted as good or bad, and
    named.
    """
    if len(points) < 2:
        raise BisectError("need at least two points to bisect")
    ordered = list(points)
    probes: list[Probe[P]] = []
    estimate = estimated_steps(len(ordered))

    def run(index: int) -> Probe[P]:
        if progress is not None:
            progress(ordered[index], len(probes) + 1, max(estimate, len(probes) + 1))
        probe = oracle(ordered[index])
        probes.append(probe)
        return probe

    low, high = run(0), run(len(ordered) - 1)
    _check_ends(low, high, name)
    (lo, before), (hi, after) = (0, low), (len(ordered) - 1, high)
    pending = set(range(1, hi))
    while between := [i for i in range(lo + 1, hi) if i in pending]:
        index = _nearest(between, lo, hi)
        pending.discard(index)
        probe = run(index)
        if probe.bug is None:
            estimate += 1
        elif probe.bug == low.bug:
            lo, before = index, probe
        else:
            hi, after = index, probe
    return Result(before, after, tuple(ordered[lo + 1 : hi]), tuple(probes))


def _check_ends(low: Probe[P], high: Probe[P], name: Callable[[P], str]) -> None:
    """Both ends tested, and with different outcomes: else there is no flip to find (``NoVerdict``)."""
    for end in (low, high):
        if end.bug is None:
            raise NoVerdict(f"{name(end.at)} could not be tested ({end.detail}); choose another end")
    if low.bug == high.bug:
        state = "shows" if low.bug else "does not show"
        raise NoVerdict(f"the bug {state} on both {name(low.at)} and {name(high.at)}: no flip to find between them")


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


def _any(answers: Iterable[bool | None]) -> bool | None:
    """True if any answer is True; None if none is an answer."""
    known = [a for a in answers if a is not None]
    return any(known) if known else None


def bug_present(records: Iterable[TestRecord]) -> bool | None:
    """Does the bug show in this run of a release (the body failed: the release misbehaves)? True if any stock test
    shows it; None if no stock test gave an answer."""
    return _any(map(_record_bug, _stock(records)))


#: The body raised what a gate declares: inside the affected range, or outside it (a commit reports the next
#: release's version). Until the gates tell a declared error outside the range from another one (``regression``
#: from any failure there, on this branch), a failure outside the range counts as declared.
DECLARED = frozenset({Reason.REPRODUCED, Reason.REGRESSION, Reason.BEFORE_AFFECTED})


def _reproduced(record: TestRecord) -> bool | None:
    """Did this record's body raise what its gate declares (True), pass (False), or neither (None: it failed
    otherwise, crashed, hung, or no body ran)?"""
    if record.reason is None:
        return _record_bug(record)  # a plain test: its outcome is the answer
    if record.reason in DECLARED:
        return True
    return False if record.reason.body_failed is False else None


def reproduced(records: Iterable[TestRecord]) -> bool | None:
    """Does the bug show in this run of a commit? Judged by what the stock variant did (raised what its gate declares,
    inside the affected range or outside it, or passed), never by the version the commit's DeepSpeed reports (its
    ``version.txt`` names the next release right after each release)."""
    return _any(map(_reproduced, _stock(records)))


def _said(record: TestRecord) -> str:
    """What the plugin said of one test: its verdict (or outcome) and error."""
    label = record.verdict.value if record.verdict else record.outcome.upper()
    if not record.error:
        return label
    if record.error.startswith(label):  # "REPRODUCED on deepspeed ...": the verdict is already said
        return record.error
    return f"{label}: {record.error}"


def describe(records: Iterable[TestRecord]) -> str:
    """One line for the progress output: verdict (or outcome) and first error of each stock test."""
    return "; ".join(map(_said, _stock(records)))


def describe_commit(records: Iterable[TestRecord]) -> str:
    """One line for a commit's probe, in ``reproduced``'s terms: the gates' words are about releases, and a commit
    reports the next release's version."""
    parts = []
    for r in _stock(records):
        answer = _reproduced(r)
        error = r.ranks[0].error if r.ranks else r.error
        ending = f"{r.ranks[0].ranks}: {error.splitlines()[0]}" if r.ranks and error else error
        if answer is False:
            parts.append("passed")
        elif answer and ending:
            parts.append(f"failed{' as declared' if r.reason else ''} ({ending})")
        elif r.reason is not None and r.reason.body_failed and ending:
            parts.append(f"failed otherwise, not as declared ({ending})")
        else:
            parts.append(_said(r))
    return "; ".join(parts)


@dataclass(frozen=True)
class Criterion:
    """How a probe's records are judged: the answer (``judge``) and the line that says why (``describe``)."""

    judge: Callable[[Iterable[TestRecord]], bool | None]
    describe: Callable[[Iterable[TestRecord]], str]


#: A release: did the body fail. A commit: did it raise what its gate declares, or pass.
RELEASES = Criterion(bug_present, describe)
COMMITS = Criterion(reproduced, describe_commit)


# --- running one probe ------------------------------------------------------------------------------------------------


def one_line(text: str) -> str:
    """A message on one line (an assertion's comparison follows it on the next): for progress lines and tables."""
    return " ".join(text.split())


def _tail(text: str, lines: int = 3) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:] if line.strip())


@dataclass(frozen=True)
class Invocation:
    """How a probe runs the test: ``python -m pytest NODEID -p no:cacheprovider --ds-results DIR ARGS``, from
    ``cwd``. Any node id pytest takes: a catalogue repro, a repro file of one's own, an upstream test (run from the
    checkout's ``tests/`` with ``-p pytest_dsrepro.upstream`` in ``args``)."""

    nodeid: str
    args: tuple[str, ...] = ()
    cwd: Path | None = None

    def command(self, python: str, results_dir: Path) -> list[str]:
        return [python, "-m", "pytest", self.nodeid, "-p", "no:cacheprovider", "--ds-results", str(results_dir),
                *self.args]  # fmt: skip

    def options(self) -> list[str]:
        """The ``dsrepro bisect`` arguments that give this invocation (after the node id)."""
        where = ["--chdir", str(self.cwd)] if self.cwd is not None else []
        return [*where, *(["--", *self.args] if self.args else [])]


Prepare = Callable[[P], AbstractContextManager[ReleaseEnv]]


def entered(prepare: Callable[[P], ReleaseEnv]) -> Prepare[P]:
    """A ``prepare`` that returns the environment, as a ``Prober`` takes it: with nothing to hold while it runs."""
    return lambda point: contextlib.nullcontext(prepare(point))


@dataclass(frozen=True)
class Prober(Generic[P]):
    """Runs one test at one point (a release, a commit): the real oracle of ``search``.

    ``prepare`` gives the point's environment (a release's, cached per release: ``environments.release_environment``;
    a commit's: ``bisect_cache``), held while the test runs (a commit's is locked against pruning); a failure to
    prepare it skips the point, with the reason. The test runs ``runs`` times at most, each a pytest run of its own
    with ``--ds-results DIR``, its records read back, stopping at the first that shows the bug (a race shows in some
    runs only); ``timeout`` stops a run that outlives it (the world timeout, ``--ds-timeout``, normally ends a hung
    world first).
    """

    invocation: Invocation
    prepare: Prepare[P]
    criterion: Criterion = RELEASES
    runs: int = 1
    log_dir: Path | None = None  # each run's full pytest output, one file per point and run
    timeout: float = 3600.0

    def __call__(self, point: P) -> Probe[P]:
        start = time.monotonic()
        with contextlib.ExitStack() as stack:
            try:
                env = stack.enter_context(self.prepare(point))
            except Exception as exc:  # noqa: BLE001 - any install failure skips the point, with its reason
                seconds = time.monotonic() - start
                return Probe(point, None, f"cannot install or import: {' '.join(str(exc).split())[:400]}", seconds,
                             seconds)  # fmt: skip
            installed = time.monotonic()
            bug, detail = self._answer(point, env)
        return Probe(point, bug, detail, time.monotonic() - start, installed - start)

    def _answer(self, point: P, env: ReleaseEnv) -> tuple[bool | None, str]:
        answers: list[tuple[bool | None, str]] = []
        for run in range(1, self.runs + 1):
            answers.append(self._once(point, env, run))
            if answers[-1][0]:
                break
        if self.runs == 1:
            return answers[0]
        bug = _any(a for a, _ in answers)
        if bug:
            return True, f"run {len(answers)} of up to {self.runs} shows it: {answers[-1][1]}"
        clean = [d for a, d in answers if a is False]
        if clean:
            unanswered = f" ({len(answers) - len(clean)} without an answer)" if len(clean) < len(answers) else ""
            return False, f"none of {len(answers)} runs shows it{unanswered}: {clean[-1]}"
        return None, f"none of {len(answers)} runs gave an answer: {answers[-1][1]}"

    def _once(self, point: P, env: ReleaseEnv, run: int) -> tuple[bool | None, str]:
        log = None
        if self.log_dir is not None:
            log = self.log_dir / f"deepspeed-{point}{f'-run{run}' if self.runs > 1 else ''}.log"
        with tempfile.TemporaryDirectory(prefix="dsrepro-bisect-") as tmp:
            command = self.invocation.command(env.python, Path(tmp))
            done = processes.run(command, env=env.environ, cwd=self.invocation.cwd, timeout=self.timeout, output=log)
            files, unreadable = results.read_all([Path(tmp)])
        if done.timed_out:
            return None, f"did not finish within {self.timeout:g} s (stopped): {_tail(done.output)}"
        if unreadable:
            return None, f"unreadable results: {unreadable[0]}"
        records = [t for f in files for t in f.run.tests]
        ran = {str(f.run.environment.deepspeed) for f in files}
        expected = env.deepspeed or str(point)
        if files and ran != {expected}:
            return None, f"ran deepspeed {', '.join(sorted(ran))} instead of {expected}"
        if not records:
            return None, f"no test ran (pytest exit code {done.returncode}): {_tail(done.output)}"
        return self.criterion.judge(records), one_line(self.criterion.describe(records))


def release_specifier(result: Result[Version]) -> str:
    """What to paste into ``ds_version(affected=...)``."""
    return specifier(result.first_after.at, fixed=result.fixed)


def release_lines(result: Result[Version], good: str, bad: str) -> list[str]:
    """What a search over releases found: the flip, the specifier to paste, and the releases skipped."""
    before, after = result.last_before, result.first_after
    lines = []
    if result.exact:
        lines.append(f"first release where the outcome flips: deepspeed {after.at}")
    else:
        maybe = ", ".join(str(v) for v in (*result.untested, after.at))
        lines.append(f"the outcome flips at one of deepspeed {maybe} (the releases between could not be tested)")
    lines.append(f"  {before.at}: {before.word}  ({before.detail})")
    lines.append(f"  {after.at}: {after.word}  ({after.detail})")
    lines.append(f"the bug {result.change} in deepspeed {after.at}; paste:")
    lines.append(f'  @pytest.mark.ds_version(affected="{release_specifier(result)}", ...)')
    good_probe = next((p for p in result.probes if p.at == Version(good)), None)
    if good_probe is not None and good_probe.bug:
        lines.append(f"note: the bug shows on --good {good} and not on --bad {bad}; the flip is the same either way")
    lines.extend(f"skipped deepspeed {p.at}: {p.detail}" for p in result.skipped)
    return lines


def summary(result: Result[Version], good: str, bad: str, seconds: float) -> str:
    """The final words of a bisect over releases: ``release_lines``, and what it took."""
    tested = sum(1 for p in result.probes if p.bug is not None)
    return "\n".join([
        *release_lines(result, good, bad),
        f"{len(result.probes)} releases probed ({tested} tested, {len(result.skipped)} skipped) in "
        f"{seconds / 60:.1f} min",
    ])  # fmt: skip
