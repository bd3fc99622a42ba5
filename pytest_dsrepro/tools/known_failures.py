"""A run of DeepSpeed's tests against the failures file (``core.failures``): which failures are known, with their
class, and which are new; the exit code that tells them apart.

``dsrepro upstream`` (after its run) and ``dsrepro upstream --merge`` (over the shards) print the same summary.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from ..core import failures, results
from ..core.checkout import Checkout
from . import arguments, processes

#: Exit codes of a run judged against the failures file.
KNOWN_ONLY = 0  # no failure, or every failure known
NEW_FAILURES = 1  # a failure the file does not list


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--failures",
        type=arguments.input_file,
        default=None,
        metavar="FILE",
        help="the failures file that says why known tests fail on a CPU (default: the one packaged, "
        "upstream-failures.toml); failures it does not list are NEW, and make the exit code 1",
    )


def known(path: Path | None) -> tuple[failures.Known, ...]:
    """The failures file given, else the packaged one (``FailuresFileError`` names ``file:line``)."""
    return failures.read(path or failures.PACKAGED)


def sort(files: Sequence[results.ResultsFile], entries: Sequence[failures.Known]) -> failures.Sorted:
    """The failures of ``files``, each on the DeepSpeed its run imported, against ``entries``."""
    return failures.classify(((f.run.environment.deepspeed, f.run.tests) for f in files), entries)


def exit_code(found: failures.Sorted) -> int:
    return NEW_FAILURES if found.new else KNOWN_ONLY


def run_here(
    results_dir: Path | None, found: Checkout, command: Callable[[Path], list[str]], entries: Sequence[failures.Known]
) -> int:
    """``dsrepro upstream`` on the DeepSpeed installed here: pytest (``command``, given where its results go), its
    results read back, its failures sorted; pytest's own exit codes other than 0 and 1 pass through. Its results go
    straight into ``results_dir`` when one is given (a shard's: nothing of a killed shard's is left elsewhere), else
    into a directory of this run's, removed after."""
    if results_dir is not None:
        results_dir.mkdir(parents=True, exist_ok=True)
        return _sorted_run(results_dir, found, command, entries)
    with tempfile.TemporaryDirectory(prefix="dsrepro-upstream-") as tmp:
        return _sorted_run(Path(tmp), found, command, entries)


def _sorted_run(
    directory: Path, found: Checkout, command: Callable[[Path], list[str]], entries: Sequence[failures.Known]
) -> int:
    code, files = _added(directory, lambda: processes.to_terminal(command(directory), cwd=found.tests))
    if not files:  # no results to sort (the run wrote them elsewhere, with its own --ds-results): pytest's word
        return code
    return exit_code(tell(files, entries)) if code in (0, 1) else code


def after_releases(results_dir: Path, run: Callable[[], int], entries: Sequence[failures.Known]) -> int:
    """``dsrepro upstream --release``: the runs (``run``), then the failures of the results files they added to
    ``results_dir`` sorted and told; the exit code stays the runs' own (a regression test fails where affected)."""
    code, files = _added(results_dir, run)
    ran = [f for f in files if f.run.unavailable is None]
    if ran:
        tell(ran, entries)
    return code


def _added(directory: Path, run: Callable[[], int]) -> tuple[int, list[results.ResultsFile]]:
    """``run``'s exit code, and the results files it added to ``directory`` (earlier runs' may be there too)."""
    before = set(directory.glob("*.json"))
    code = run()
    files, _ = results.read_all([p for p in sorted(directory.glob("*.json")) if p not in before])
    return code, files


def tell(files: Sequence[results.ResultsFile], entries: Sequence[failures.Known]) -> failures.Sorted:
    """The failures of ``files`` sorted against ``entries``, said on stderr."""
    sorted_failures = sort(files, entries)
    print("\n".join(f"dsrepro upstream: {line}" for line in failures.summary(sorted_failures)), file=sys.stderr)
    return sorted_failures
