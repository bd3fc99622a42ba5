"""``dsrepro matrix`` on a synthetic catalogue: how long it takes and how big its forms are, side by side with another
checkout (``--against``), and the page as a browser draws it (``--browser``).

The catalogue: ``--bugs`` bugs with long ids, two configs each (one long), stock and fixed, on the 24 releases of
releases.txt, each bug affecting five of them: ``--bugs 21`` is 2,016 records. Each checkout writes it in its own
results schema (the same tests, verdicts and errors), then each runs ``dsrepro matrix`` on its own files, the rounds
interleaved. Printed per checkout: the median wall time of the command (a fresh interpreter each time), its
terminal's widest line and line count, the Markdown table's widest line, the page's bytes and, with a browser, the
page's width at a 1400-pixel window (``document.documentElement.scrollWidth``) with a screenshot.

    python benchmarks/matrix.py [--bugs 21] [--rounds 5] [--against CHECKOUT] [--browser chromium] [--shots DIR]
    python benchmarks/matrix.py --page docs/matrix-observed.html --browser chromium --shot docs/matrix-observed.png

The second form measures a page already written, and keeps its screenshot.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RELEASES = [ln.strip() for ln in (ROOT / "releases.txt").read_text().splitlines() if ln.strip()[:1].isdigit()]
WINDOW = "1400,900"


def write_catalogue(directory: Path, bugs: int) -> int:
    """The catalogue, through this interpreter's ``core.results`` (whichever checkout it imports); the records."""
    from pytest_dsrepro.core.gates import Reason, Verdict
    from pytest_dsrepro.core.results import Environment, ReproMeta, RunRecord, TestRecord, write

    reasons = {"REPRODUCED": Reason.REPRODUCED, "FIXED": Reason.NOT_AFFECTED, "PASSES-WITH-FIX": Reason.FIX_HOLDS}
    count = 0
    for i, version in enumerate(RELEASES):
        tests = []
        for b in range(bugs):
            first = b % (len(RELEASES) - 5)
            spec = f">={RELEASES[first]},<{RELEASES[first + 5]}"
            upstream = f"https://github.com/deepspeedai/DeepSpeed/issues/{7000 + b}"
            repro = ReproMeta(f"zero{b % 4}-a-long-bug-id-number-{b:02d}-loses-its-state", f"bug {b}", upstream,
                              affected=(spec,))  # fmt: skip
            for config in (f"bf16_zero{b % 4}_offload_optimizer_and_params", "zero3"):
                inside = first <= i < first + 5
                stock = "REPRODUCED" if inside else "FIXED"
                for variant, verdict in (("stock", stock), ("fixed", "PASSES-WITH-FIX")):
                    error = f"REPRODUCED on deepspeed {version}: ranks 0-1: AssertionError: state lost" if (
                        inside and variant == "stock") else None  # fmt: skip
                    tests.append(TestRecord(
                        nodeid=f"repros/test_bug_{b:02d}.py::test_bug[{config}-{variant}]", repro=repro,
                        variant=variant, verdict=Verdict(verdict), reason=reasons[verdict],
                        outcome="xfailed" if error else "passed", error=error, duration=2.5, config=None,
                        world_size=2))  # fmt: skip
        env = Environment(deepspeed=version, torch="2.13.0+cpu", python="3.11", backend="gloo", world_size=2,
                          os="Linux", cpu="cpu", cpu_count=2, gpu=None, gpu_count=0)  # fmt: skip
        created = datetime.datetime(2026, 11, 22, tzinfo=datetime.timezone.utc)
        write(RunRecord(created=created, environment=env, tests=tuple(tests)), directory)
        count += len(tests)
    return count


def _env(checkout: Path) -> dict[str, str]:
    """The checkout's plugin first on the path; no bytecode written into it."""
    return {**os.environ, "PYTHONPATH": str(checkout), "PYTHONDONTWRITEBYTECODE": "1", "COLUMNS": "120",
            "NO_COLOR": "1"}  # fmt: skip


def _matrix(checkout: Path, results: Path, out: Path) -> tuple[float, str]:
    """One ``dsrepro matrix`` of ``checkout``: its wall time and what it printed."""
    out.mkdir(parents=True, exist_ok=True)
    args = [str(results), "--markdown", str(out / "matrix.md"), "--html", str(out / "matrix.html")]
    start = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-m", "pytest_dsrepro.tools.cli", "matrix", *args],
        env=_env(checkout),
        cwd=out,
        capture_output=True,
        text=True,
    )  # fmt: skip  (-m puts the working directory first)
    took = time.perf_counter() - start
    if run.returncode not in (0, 1):
        raise SystemExit(f"{checkout}: dsrepro matrix exited {run.returncode}: {run.stderr[-2000:]}")
    return took, run.stdout


def _browser_width(browser: str, page: Path, shot: Path | None) -> int:
    """The page's width in ``browser`` at a 1400-pixel window: a copy that writes its scrollWidth into its title."""
    probe = page.with_name(f".{page.stem}-probe.html")
    script = "<script>document.title = 'W=' + document.documentElement.scrollWidth</script></body>"
    probe.write_text(page.read_text().replace("</body>", script))
    flags = ["--headless", "--no-sandbox", "--disable-gpu", f"--window-size={WINDOW}"]
    dom = subprocess.run([browser, *flags, "--hide-scrollbars", "--dump-dom", probe.as_uri()], capture_output=True,
                         text=True, timeout=120).stdout  # fmt: skip
    if shot is not None:
        subprocess.run(
            [browser, *flags, f"--screenshot={shot.resolve()}", page.as_uri()], capture_output=True, timeout=120
        )
    probe.unlink()
    found = re.search(r"<title>W=(\d+)</title>", dom)
    return int(found.group(1)) if found else -1


def _figures(
    checkout: Path, out: Path, printed: str, times: list[float], args: argparse.Namespace
) -> dict[str, object]:
    """What one checkout's ``dsrepro matrix`` made of the catalogue: time, and the size of each form."""
    md = (out / "matrix.md").read_text().splitlines()
    page = out / "matrix.html"
    lines = printed.splitlines()
    figures: dict[str, object] = {
        "checkout": str(checkout),
        "seconds (median)": round(statistics.median(times), 3),
        "terminal: widest line, lines": (max(map(len, lines)), len(lines)),
        "markdown: widest table line": max(len(ln) for ln in md if ln.startswith("|")),
        "html bytes": page.stat().st_size,
    }
    if args.browser:
        shot = args.shots / f"{out.name}.png" if args.shots else None
        if shot is not None:
            shot.parent.mkdir(parents=True, exist_ok=True)
        browser = shutil.which(args.browser) or args.browser
        figures["html width at a 1400 px window"] = _browser_width(browser, page, shot)
    return figures


def compare(args: argparse.Namespace) -> None:
    """Each checkout writes the catalogue in its own schema, then runs ``dsrepro matrix`` on it, rounds interleaved."""
    checkouts = [ROOT, *(p.resolve() for p in args.against)]
    with tempfile.TemporaryDirectory(prefix="dsrepro-matrix-bench-") as tmp:
        work = Path(tmp)
        for n, checkout in enumerate(checkouts):
            made = subprocess.run([sys.executable, __file__, "--write", str(work / f"r{n}"), "--bugs", str(args.bugs)],
                                  env=_env(checkout), capture_output=True, text=True, check=True)  # fmt: skip
            print(f"{checkout}: {made.stdout.strip()} records")
        times: dict[Path, list[float]] = {c: [] for c in checkouts}
        printed: dict[Path, str] = {}
        for _ in range(args.rounds):  # interleaved: a busy machine slows every checkout alike
            for n, checkout in enumerate(checkouts):
                took, printed[checkout] = _matrix(checkout, work / f"r{n}", work / f"out{n}")
                times[checkout].append(took)
        for n, checkout in enumerate(checkouts):
            print(json.dumps(_figures(checkout, work / f"out{n}", printed[checkout], times[checkout], args)))
        if len(checkouts) > 1:
            base = statistics.median(times[checkouts[1]])
            print(f"time ratio, this checkout / {checkouts[1]}: {statistics.median(times[ROOT]) / base:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bugs", type=int, default=21)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--against", type=Path, action="append", default=[], help="another checkout to compare")
    parser.add_argument("--browser", default=None, help="a headless browser to measure the page with (chromium)")
    parser.add_argument("--shots", type=Path, default=None, help="where the browser's screenshots go")
    parser.add_argument("--page", type=Path, default=None, help="measure this page only (with --browser)")
    parser.add_argument("--shot", type=Path, default=None, help="the page's screenshot (with --page)")
    parser.add_argument("--write", type=Path, default=None, help=argparse.SUPPRESS)  # a checkout's own catalogue
    args = parser.parse_args()
    if args.write is not None:
        print(write_catalogue(args.write, args.bugs))
    elif args.page is not None:
        if not args.browser:
            parser.error("--page needs --browser")
        width = _browser_width(shutil.which(args.browser) or args.browser, args.page.resolve(), args.shot)
        print(json.dumps({"page": str(args.page), "width at a 1400 px window": width}))
    else:
        compare(args)


if __name__ == "__main__":
    main()
