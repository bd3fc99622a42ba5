"""DeepSpeed's own tests run by pytest with this plugin's worlds: the command for an interpreter, and a run on each of
several releases, in its own environment, each run's results file checked before it is kept.

What ``dsrepro upstream --release`` does, and what ``dsrepro atlas`` does with each fix's tests: the runs stand in
``dsrepro matrix`` beside the catalogue, named by node id and the checkout's revision.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

from packaging.version import Version

from ..core import results
from ..core.checkout import Checkout
from ..core.gates import Verdict
from . import environments, install, processes
from .environments import EnvironmentUnavailable, ReleaseEnv

#: The pytest plugin that runs DeepSpeed's tests in this plugin's worlds.
PLUGIN = "pytest_dsrepro.upstream"


class UpstreamError(Exception):
    """A usage problem or a check that failed: ``dsrepro upstream`` says it in one line and exits 2."""


def pytest_command(python: str, targets: Sequence[str], results_dir: Path | None, extra: Sequence[str]) -> list[str]:
    command = [python, "-m", "pytest", "-p", PLUGIN, *targets]
    if results_dir is not None:
        command += ["--ds-results", str(results_dir)]
    return [*command, *extra]


def check_run(files: Sequence[results.ResultsFile], release: str, tests: Checkout) -> None:
    """A release's run is what it says: the DeepSpeed it ran is the release asked for, and every record's tests
    came from the checkout's revision (read before the run; also when git showed changes since)."""
    if not files:
        raise UpstreamError(f"the run on deepspeed {release} wrote no results file")
    for f in files:
        ran = f.run.environment.deepspeed
        if ran != release:
            raise UpstreamError(f"{f.path}: the run on deepspeed {release} ran deepspeed {ran}")
        wrong = {t.origin.revision if t.origin else "none" for t in f.run.tests} - {tests.revision}
        if wrong:
            raise UpstreamError(
                f"{f.path}: tests from revision {', '.join(sorted(map(str, wrong)))}, not the checkout's "
                f"{tests.revision}"
            )


def tally(files: Sequence[results.ResultsFile]) -> str:
    """``12 passed, 3 failed, 1 not-applicable``: the outcomes of a run's records (NOT-APPLICABLE by its verdict)."""
    counts: Counter[str] = Counter()
    for f in files:
        for t in f.run.tests:
            counts["not-applicable" if t.verdict is Verdict.NOT_APPLICABLE else t.outcome] += 1
    return ", ".join(f"{n} {word}" for word, n in sorted(counts.items())) or "no tests"


def _unavailable(results_dir: Path, release: str, reason: str) -> Path:
    failed = install.InstallResult(release, "", ok=False, action="failed", reason=reason, probe=None, seconds=0.0)
    return install.write_unavailable(results_dir, failed)


def run_releases(
    args: argparse.Namespace,
    found: Checkout,
    targets: list[str],
    releases: list[str],
    prepare: Callable[[Version], ReleaseEnv] | None = None,
) -> int:
    """Each release: its environment (``prepare``: ``environments.release_environment`` unless given), one pytest run
    of the targets, its results file checked (``check_run``) and kept in ``--results``; a release that cannot be
    installed is recorded as unavailable, as ``dsrepro install --results`` records it."""
    results_dir = (args.results or Path("results")).resolve()
    prepare = prepare or environments.release_environment(args.cache_dir, args.constraints, log_dir=args.log_dir)
    for release in releases:
        try:
            env = environments.prepared(prepare, release, "upstream")
        except EnvironmentUnavailable as exc:
            path = _unavailable(results_dir, release, str(exc))
            print(f"dsrepro upstream: deepspeed {release} cannot run here: {exc} (recorded in {path})", file=sys.stderr)
            continue
        with tempfile.TemporaryDirectory(prefix=f"dsrepro-upstream-{release}-") as tmp:
            command = pytest_command(env.python, targets, Path(tmp), args.pytest_args)
            returncode = processes.to_terminal(command, cwd=found.tests, env=env.environ)
            files, unreadable = results.read_all([Path(tmp)])
            if unreadable:
                raise UpstreamError(f"unreadable results of the run on deepspeed {release}: {unreadable[0]}")
            if returncode not in (0, 1, 5):  # 1: tests failed, as regression tests do where affected
                raise UpstreamError(f"pytest on deepspeed {release} ended with exit code {returncode}")
            check_run(files, release, found)
            results_dir.mkdir(parents=True, exist_ok=True)
            for f in files:
                shutil.move(str(f.path), results_dir / f.path.name)
        print(f"dsrepro upstream: deepspeed {release}: {tally(files)}", file=sys.stderr, flush=True)
    print(f"dsrepro upstream: results in {results_dir}; `dsrepro matrix {results_dir}` shows them", file=sys.stderr)
    return 0
