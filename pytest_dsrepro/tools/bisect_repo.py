"""``dsrepro bisect --repo PATH``: from two releases (or revisions) of the user's DeepSpeed clone to the commit, and
so the pull request, where a test's outcome flips.

First the releases between the two ends (their tags' commits), then the commits between the two adjacent releases
that flip (on the newer one's first-parent line: one per pull request in DeepSpeed's squash-merged history). Every
probe is a commit (``Session``), judged by ``bisect.reproduced``: by what the stock variant did, never by the version
the commit reports. Each probe's outcome is stored as soon as it is known, so a re-run after Ctrl-C resumes where it
stopped; ``--fresh`` probes again.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import shlex
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from packaging.version import Version

from ..core.options import default_cache_dir
from ..core.text import aligned
from . import bisect, bisect_cache, install, processes
from .bisect import BisectError, Invocation, Probe, Prober, Result
from .environments import ReleaseEnv, probe_environ, torch_pin
from .history import Clone, Commit

#: The commits one release adds, for the first progress estimate (20-36 between DeepSpeed's releases).
COMMITS_PER_RELEASE = 30


@dataclass
class Session:
    """One bisect's probes: stored outcomes first (unless ``fresh``), each new one stored as soon as it is known,
    each told on ``out`` with a progress line before it runs. A probe is a commit: its tree written out of the clone
    (``history``, which never writes to the clone), installed by the ``dsrepro install`` recipe into an environment
    of its own, cached across bisects and bounded in disk use (``bisect_cache``)."""

    prober: Prober[Commit]
    outcomes: bisect_cache.Outcomes
    out: TextIO
    fresh: bool = False
    ahead: int = 0  # probes the stages still to come will take, as far as can be told
    known: dict[str, Probe[Commit]] = field(default_factory=dict)  # every probe of this run, by commit

    def oracle(self, commit: Commit) -> Probe[Commit]:
        if commit.sha in self.known:
            return self.known[commit.sha]
        stored = None if self.fresh else self.outcomes.get(commit)
        if stored is not None:
            detail = bisect.one_line(stored["detail"])
            probe = Probe(commit, stored["bug"], detail, stored["seconds"], stored["install_seconds"], stored=True)
        else:
            probe = self.prober(commit)
            self.outcomes.put(commit, {"bug": probe.bug, "detail": probe.detail, "seconds": round(probe.seconds, 2),
                                       "install_seconds": round(probe.install_seconds, 2)})  # fmt: skip
        self.known[commit.sha] = probe
        when = f"{probe.timing}, stored by an earlier run" if probe.stored else probe.timing
        self.tell(f"    {commit.short}: {probe.word} ({probe.detail}) [{when}]")
        return probe

    def progress(self, commit: Commit, step: int, estimate: int) -> None:
        if commit.sha in self.known:
            return
        total = len(self.known) + max(estimate - step, 0) + 1 + self.ahead
        stored = not self.fresh and self.outcomes.get(commit) is not None
        what = "reading its stored outcome" if stored else "installing and running"
        self.tell(f"[{len(self.known) + 1}/~{total}] {_name(commit)}: {what} ...")

    def tell(self, line: str) -> None:
        print(line, file=self.out, flush=True)


def _name(commit: Commit) -> str:
    if commit.release is not None:
        return f"deepspeed {commit.release} ({commit.short})"
    return f"commit {commit.short} {commit.subject}"


@contextlib.contextmanager
def _environment(envs: bisect_cache.CommitEnvironments, commit: Commit) -> Iterator[ReleaseEnv]:
    with envs.using(commit) as env:
        yield ReleaseEnv(env.python, probe_environ(env.directory), env.deepspeed)


def _ordered(clone: Clone, good: Commit, bad: Commit) -> tuple[Commit, Commit]:
    """The two ends, older first: by release, else by ancestry."""
    if good.sha == bad.sha:
        raise BisectError(f"--good and --bad are the same commit ({good.label}); give two different ones")
    if good.release is not None and bad.release is not None:
        return (good, bad) if good.release < bad.release else (bad, good)
    if clone.is_ancestor(good, bad):
        return good, bad
    if clone.is_ancestor(bad, good):
        return bad, good
    raise BisectError(f"{good.label} and {bad.label} are not on one line of history: neither is an ancestor")


@dataclass(frozen=True)
class Found:
    """Both stages' results (``releases`` when both ends were releases) and every point of both, oldest first."""

    releases: Result[Commit] | None
    commits: Result[Commit]
    order: tuple[str, ...]  # the commits of both stages, oldest first, by hash


def run_stages(clone: Clone, older: Commit, newer: Commit, session: Session) -> Found:
    """The releases between two release ends, then the commits between the two that flip (or between the ends)."""
    tags = clone.releases()
    tagged = {sha: version for version, sha in tags.items()}
    found_releases, points = None, []
    if older.release is not None and newer.release is not None:
        low, high = older.release, newer.release
        points = [clone.commit(tags[v], release=v) for v in sorted(v for v in tags if low <= v <= high)]
        session.ahead = math.ceil(math.log2(COMMITS_PER_RELEASE - 1))
        found_releases = bisect.search(points, session.oracle, session.progress, name=_name)
        session.ahead = 0
        older, newer = found_releases.last_before.at, found_releases.first_after.at
    commits = clone.commits(older, newer, tagged)
    found_commits = bisect.search(commits, session.oracle, session.progress, name=_name)
    tags_probed = [c.sha for c in points]  # the commit stage lies between two of them (or is all there is)
    start = tags_probed.index(older.sha) if points else 0
    end = tags_probed.index(newer.sha) + 1 if points else 0
    order = (*tags_probed[:start], *(c.sha for c in commits), *tags_probed[end:])
    return Found(found_releases, found_commits, order)


# --- what the user reads -----------------------------------------------------------------------------------------


def _as_releases(result: Result[Commit]) -> Result[Version]:
    """The release stage as a search over releases reads (each commit there is a release's)."""

    def at(probe: Probe[Commit]) -> Probe[Version]:
        assert probe.at.release is not None
        return Probe(probe.at.release, probe.bug, probe.detail, probe.seconds, probe.install_seconds, probe.stored)

    return Result(at(result.last_before), at(result.first_after),
                  tuple(c.release for c in result.untested if c.release is not None),
                  tuple(at(p) for p in result.probes))  # fmt: skip


def _pr(clone: Clone, commit: Commit, web: str) -> str:
    if commit.pr is None:
        return f"  no pull request number in its subject; the commit: {clone.link(commit, web)}"
    return f"  pull request #{commit.pr}: {clone.link(commit, web)}"


def verdict_lines(clone: Clone, result: Result[Commit], web: str) -> list[str]:
    before, after = result.last_before, result.first_after
    lines = []
    if result.exact:
        lines.append(f"first commit where the outcome flips: {after.at.short} {after.at.subject}")
        lines.append(_pr(clone, after.at, web))
    else:
        lines.append("the outcome flips at one of these commits (those before the last could not be tested):")
        for commit in (*result.untested, after.at):
            lines.append(f"  {commit.short} {commit.subject}")
            lines.append(f"  {_pr(clone, commit, web)}")
    lines.append(f"  the bug {result.change} there: {after.at.short}: {after.word} ({after.detail})")
    lines.append(f"  the newest commit before it that was tested: {before.at.label} {before.at.subject}: {before.word} "
                 f"({before.detail})")  # fmt: skip
    lines.extend(f"skipped {p.at.label} {p.at.subject}: {p.detail}" for p in result.skipped)
    return lines


def table(probes: Sequence[Probe[Commit]], numbers: dict[str, int]) -> list[str]:
    """The probes as given (oldest commit first): probe number, commit, release tag, outcome, time, what it said."""
    rows = [("#", "commit", "release", "outcome", "time", "what the run said")]
    for probe in probes:
        tag = f"v{probe.at.release}" if probe.at.release else ""
        when = f"{probe.timing} (stored)" if probe.stored else probe.timing
        rows.append((str(numbers[probe.at.sha]), probe.at.short, tag, probe.word, when, probe.detail[:110]))
    return [f"  {line}" for line in aligned(rows)]


def rerun(args: argparse.Namespace, clone: Clone, result: Result[Commit], invocation: Invocation) -> str:
    """The command that probes the two commits of the verdict again (``--fresh``: not from stored outcomes)."""
    bug, clean = (result.last_before, result.first_after) if result.fixed else (result.first_after, result.last_before)
    words = ["dsrepro", "bisect", invocation.nodeid, "--good", clean.at.short, "--bad", bug.at.short,
             "--repo", str(clone.path), "--fresh"]  # fmt: skip
    if args.runs != 1:
        words += ["--runs", str(args.runs)]
    for flag, value in (("--cache-dir", args.cache_dir), ("--constraints", args.constraints)):
        if value is not None:
            words += [flag, str(value)]
    return shlex.join([*words, *invocation.options()])


def report(args: argparse.Namespace, clone: Clone, found: Found, session: Session, seconds: float) -> str:
    """The verdict (commit, pull request, link), the release-level specifier, every probe, the command to re-run."""
    lines = verdict_lines(clone, found.commits, clone.web())
    if found.releases is not None and len(found.releases.probes) > 2:
        releases = bisect.release_lines(_as_releases(found.releases), args.good, args.bad)
        lines += ["between releases:", *(f"  {line}" for line in releases)]
    numbers = {sha: n for n, sha in enumerate(session.known, 1)}
    probes = sorted(session.known.values(), key=lambda p: found.order.index(p.at.sha))
    ran = sum(1 for p in probes if not p.stored)
    lines.append(f"probes, oldest first ({len(probes)}: {ran} run now, {len(probes) - ran} stored by an earlier "
                 f"run; {seconds / 60:.1f} min):")  # fmt: skip
    lines += table(probes, numbers)
    lines.append("re-run the verdict (its two commits, probed again):")
    lines.append(f"  {rerun(args, clone, found.commits, session.prober.invocation)}")
    return "\n".join(lines)


def run(args: argparse.Namespace, out: TextIO = sys.stderr) -> int:
    """``dsrepro bisect NODEID --good A --bad B --repo PATH``: 0 with a verdict, 1 when there is none (said why)."""
    started = time.monotonic()
    clone = Clone.open(args.repo)
    tags = clone.releases()
    older, newer = _ordered(clone, clone.end(args.good, tags), clone.end(args.bad, tags))
    cwd = (args.chdir or Path.cwd()).resolve()
    test_file = cwd / args.nodeid.split("::", 1)[0]
    if not test_file.exists():
        raise BisectError(f"{args.nodeid}: no such file {test_file} (node ids are read from --chdir, else here)")
    invocation = Invocation(args.nodeid, tuple(args.pytest_args), args.chdir)
    root = (args.cache_dir or default_cache_dir()) / "bisect"
    pins = args.constraints or install.find_constraints() or torch_pin(root)
    log_dir = Path(args.log_dir) if args.log_dir else None
    limit = bisect_cache.DEFAULT_LIMIT if args.env_cache is None else args.env_cache
    envs = bisect_cache.CommitEnvironments(root, clone, pins, limit=limit, log_dir=log_dir)
    outcomes = bisect_cache.Outcomes(root / "outcomes" / bisect_cache.repro_key(
        args.nodeid, args.pytest_args, cwd, args.runs))  # fmt: skip
    prober: Prober[Commit] = Prober(invocation, lambda commit: _environment(envs, commit), bisect.COMMITS,
                                    args.runs, log_dir, args.timeout)  # fmt: skip
    session = Session(prober, outcomes, out, fresh=args.fresh)
    what = f"releases {older.release} .. {newer.release}" if older.release and newer.release else "commits"
    session.tell(f"bisecting {args.nodeid} over the {what} of {clone.path} ({older.label} .. {newer.label}); "
                 f"probe outcomes are stored in {outcomes.directory}")  # fmt: skip
    try:
        with processes.interrupting(signal.SIGTERM):
            found = run_stages(clone, older, newer, session)
    except KeyboardInterrupt:
        session.tell(f"interrupted: {len(outcomes)} probe outcomes are stored; the same command resumes from them")
        raise
    finally:
        for note in envs.notes:
            session.tell(f"note: {note}")
    print(report(args, clone, found, session, time.monotonic() - started))
    return 0
