"""``dsrepro upstream``: DeepSpeed's own ``tests/unit`` files, unchanged, in this plugin's worlds, on the DeepSpeed
installed here or on several releases (one uv environment each, the recipe of ``dsrepro install``).

In a DeepSpeed checkout, ``dsrepro upstream [PATH|NODEID ...] [-- PYTEST_ARGS]`` is ``python -m pytest -p
pytest_dsrepro.upstream ...`` run from the checkout's ``tests/`` (where DeepSpeed's pytest.ini and conftest.py are),
paths and node ids given as from the directory you are in. With ``--release`` (or ``--releases FILE``) each release
gets its environment (``environments.release_environment``: cached, torch pinned, this plugin added) and a pytest
run that writes its results file; each file is checked before it is kept: the tests' checkout at the revision its
records name, the DeepSpeed release the one asked for. ``dsrepro matrix`` then shows the tests as rows beside the
catalogue's, named by node id and the checkout's revision.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

from packaging.version import InvalidVersion, Version

from ..core import checkout, results
from ..core.checkout import Checkout, CheckoutError
from ..core.failures import FailuresFileError
from ..core.gates import Verdict
from . import known_failures, processes, shard_merge
from .environments import EnvironmentUnavailable, ReleaseEnv, release_environment

#: The pytest plugin that runs DeepSpeed's tests in this plugin's worlds.
PLUGIN = "pytest_dsrepro.upstream"
#: What runs when no path is given.
DEFAULT_TARGET = "unit"


class UpstreamError(Exception):
    """A usage problem or a check that failed: ``dsrepro upstream`` says it in one line and exits 2."""


def read_releases(path: Path) -> list[str]:
    """Releases, one per line, ``#`` comments (the format of the project's releases.txt); each a valid version."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise UpstreamError(f"cannot read the releases file {path}: {exc.strerror}") from None
    found = []
    for number, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if text:
            found.append(_release(text, f"{path}:{number}"))
    return found


def _release(text: str, where: str) -> str:
    try:
        Version(text)
    except InvalidVersion:
        raise UpstreamError(f"{where}: {text!r} is not a release version") from None
    return text


def target(given: str, cwd: Path, tests: Path) -> str:
    """A path or node id as given from ``cwd``, as pytest run from the checkout's ``tests/`` names it."""
    where, sep, names = given.partition("::")
    path = (cwd / where).resolve()
    try:
        relative = path.relative_to(tests.resolve())
    except ValueError:
        raise UpstreamError(f"{given} is not under the checkout's tests directory {tests}") from None
    if not path.exists():
        raise UpstreamError(f"{given}: no such file or directory")
    return f"{relative.as_posix() if relative.parts else '.'}{sep}{names}"


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
    from .install import InstallResult, write_unavailable

    failed = InstallResult(release, "", ok=False, action="failed", reason=reason, probe=None, seconds=0.0)
    return write_unavailable(results_dir, failed)


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
    prepare = prepare or release_environment(args.cache_dir, args.constraints, log_dir=args.log_dir)
    for release in releases:
        print(f"dsrepro upstream: deepspeed {release}: preparing its environment ...", file=sys.stderr, flush=True)
        try:
            env = prepare(Version(release))
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Run DeepSpeed's own tests/unit files, unchanged, in pytest-dsrepro's worlds, from a DeepSpeed checkout: "
        "on the DeepSpeed installed here (what `pytest -p pytest_dsrepro.upstream` does from tests/), or with "
        "--release on each release's own environment, writing one results file per release for `dsrepro matrix`. "
        "Arguments after `--` go to pytest (-k, -x, --ds-shard I/N, ...)."
    )
    parser.add_argument(
        "targets",
        nargs="*",
        metavar="PATH|NODEID",
        help=f"test files, directories, node ids (default: tests/{DEFAULT_TARGET})",
    )
    parser.add_argument(
        "--checkout", type=Path, default=None, help="the DeepSpeed checkout (default: the one holding this directory)"
    )
    parser.add_argument(
        "--release", action="append", default=[], metavar="VERSION", help="run on this release (repeatable)"
    )
    parser.add_argument("--releases", type=Path, metavar="FILE", help="releases to run on, one per line (# comments)")
    parser.add_argument(
        "--results", type=Path, metavar="DIR", help="where results files go (default with --release: results/)"
    )
    parser.add_argument(
        "--cache-dir", type=Path, default=None, help="release environments (default: $DSREPRO_CACHE_DIR)"
    )
    parser.add_argument("--constraints", type=Path, default=None, help="constraints pinning torch (as dsrepro bisect)")
    parser.add_argument("--log-dir", type=Path, default=None, help="keep each release's install log here")
    shard_merge.add_arguments(parser)
    known_failures.add_arguments(parser)
    parser.set_defaults(pytest_args=[])


def run(args: argparse.Namespace) -> int:
    """Ctrl-C (or SIGTERM) stops pytest as Ctrl-C stops it: its summary and results file written, then ``dsrepro``
    ends as interrupted."""
    try:
        with processes.interrupting(signal.SIGTERM):
            return _run(args)
    except (UpstreamError, CheckoutError, FailuresFileError, shard_merge.ShardError, EnvironmentUnavailable) as exc:
        print(f"dsrepro upstream: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.merge:
        return shard_merge.merge(args)
    cwd = Path.cwd()
    root = args.checkout.resolve() if args.checkout else checkout.find(cwd)
    if root is None:
        raise UpstreamError(
            f"{cwd} is not inside a DeepSpeed checkout (no {', '.join(checkout.MARKS)}); use --checkout"
        )
    found = checkout.read(root)
    targets = [target(t, cwd, found.tests) for t in args.targets] or [DEFAULT_TARGET]
    releases = [_release(r, "--release") for r in args.release]
    releases += read_releases(args.releases) if args.releases else []
    print(f"dsrepro upstream: DeepSpeed's tests from {found.describe()}", file=sys.stderr, flush=True)
    known = known_failures.known(args.failures)
    if args.shard:
        args.results = (args.results or Path("results")).resolve()
        args.pytest_args = [*shard_merge.pytest_args(args.shard, args.results), *args.pytest_args]
    if releases:
        args.results = (args.results or Path("results")).resolve()
        return known_failures.after_releases(args.results, lambda: run_releases(args, found, targets, releases), known)

    def command(results_dir: Path) -> list[str]:
        return pytest_command(sys.executable, targets, results_dir, args.pytest_args)

    return known_failures.run_here(args.results, found, command, known)
