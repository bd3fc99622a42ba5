"""The catalogue run by pytest in a child process: where the installed catalogue is, its pytest run from its own
directory, and one scan of it with a user's config (``pytest --ds-scan``), read back from the results file it wrote.

What ``dsrepro scan`` runs on each release, and ``dsrepro triage --confirm`` on the best candidates' repros. The
catalogue is the one installed with the package (``pytest_dsrepro/catalogue``, from ``repros/``), else, in a checkout,
``repros/``.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

from ..core import results
from ..core.results import RunRecord
from . import processes


class ScanError(Exception):
    """The scan cannot run (no catalogue, no results written); said in one line, exit code 2."""


def installed() -> Path:
    """The catalogue this package carries: installed beside the code, or ``repros/`` of the checkout it runs from."""
    package = Path(__file__).resolve().parents[1]
    for place in (package / "catalogue", package.parent / "repros"):
        if (place / "conftest.py").is_file():
            return place
    raise ScanError(f"no catalogue found beside {package} (pytest_dsrepro/catalogue, or repros/ of a checkout); "
                    "reinstall pytest-dsrepro, or give --catalogue DIR")  # fmt: skip


def run_catalogue(
    python: str, environ: dict[str, str], where: Path, world_size: int | None, arguments: Sequence[str]
) -> tuple[int, list[results.ResultsFile], list[results.Unreadable]]:
    """The catalogue's pytest in a child, rooted at the catalogue and given its paths whole (so that no
    ``pytest.ini`` of the directory you are in applies), its output the user's to watch; ``arguments`` say what it
    runs (a scan, or some repros). Its exit code, and the results it wrote into a directory of this run's.

    The tests' ``tmp_path`` lives there too (``--basetemp``): under pytest's shared default, other pytest sessions of
    the same user prune a long run's directories while its repros still write checkpoints there. So does its working
    directory: what a scanned config names by a relative path (a flops profiler's ``output_file``, a monitor's output)
    is written there and removed with it, never into the catalogue (an installed package's directory).
    """
    with tempfile.TemporaryDirectory(prefix="dsrepro-catalogue-") as tmp:
        written = Path(tmp) / "results"
        command = [python, "-m", "pytest", "--rootdir", str(where), "-p", "no:cacheprovider", "-q", "--tb=no", "-rN",
                   "--ds-results", str(written), "--basetemp", str(Path(tmp) / "tmp")]  # fmt: skip
        if world_size is not None:
            command += ["--ds-world-size", str(world_size)]
        returncode = processes.to_terminal([*command, *arguments], cwd=Path(tmp), env=environ)
        files, unreadable = results.read_all([written]) if written.is_dir() else ([], [])
    return returncode, files, unreadable


def scan_once(
    python: str,
    environ: dict[str, str],
    config: Path,
    *,
    catalogue: Path | None,
    world_size: int | None,
    pytest_args: Sequence[str],
    markdown: Path | None = None,
) -> RunRecord:
    """One scan of ``catalogue`` (None: the installed one) with ``config``, by ``python``'s pytest and DeepSpeed; its
    record, read back from its results file (``markdown``: its report written there too)."""
    where = catalogue.resolve() if catalogue else installed()
    arguments = [str(where), "--ds-scan", str(config.resolve()), *pytest_args]
    arguments += ["--ds-report", str(markdown.resolve())] if markdown is not None else []
    returncode, files, unreadable = run_catalogue(python, environ, where, world_size, arguments)
    if returncode not in (0, 1) or not files:
        raise ScanError(f"pytest ended with exit code {returncode} and wrote no scan (its output is above)")
    if unreadable:
        raise ScanError(f"unreadable results of the scan: {unreadable[0]}")
    return files[0].run
