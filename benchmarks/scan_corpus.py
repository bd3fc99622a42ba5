"""``dsrepro scan`` on the corpus of real configs (issue 47): every config of ``corpus/configs`` on each release, in
that release's environment (built once, before the clock starts), timed per scan; the verdicts as a table, each
AFFECTED / NOT AFFECTED checked against the bug's catalogued range, the CANNOT TELL cells listed with what they said.

    nice -n 10 python benchmarks/scan_corpus.py --out /tmp/scans [--release 0.16.4 ...] [--config ID ...]
    python benchmarks/scan_corpus.py --summary /tmp/scans [--before /tmp/scans-before] [--markdown PATH]

Each scan's record is kept in ``--out`` (``<release>/<config id>.json``, beside its output ``.log``), and a scan
already there is not run again: a run that was stopped goes on where it stopped, and ``--summary`` reads the
records again without running anything. ``--before DIR`` puts an earlier run's CANNOT TELL count beside this one's.
Run with the interpreter whose plugin is measured: the release environments get this plugin
(``environments.release_environment``), in ``--cache-dir`` (default: the plugin's cache).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import tomllib
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from pytest_dsrepro.core import scan_verdicts, userconfig
from pytest_dsrepro.core.results import RunRecord, ScanVerdict
from pytest_dsrepro.tools import catalogue_run, environments

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "corpus" / "configs"
RELEASES = ("0.16.4", "0.18.3", "0.19.8")
SHORT = {
    ScanVerdict.AFFECTED: "A",
    ScanVerdict.NOT_AFFECTED: "N",
    ScanVerdict.CANNOT_TELL: "?",
    ScanVerdict.NOT_APPLICABLE: "-",
}


@dataclass(frozen=True)
class Scan:
    """One config on one release: its record (None: no scan, ``problem`` says why) and its wall time."""

    config: str
    release: str
    record: RunRecord | None
    seconds: float
    problem: str | None = None
    cpu: float = 0.0  # CPU seconds of the scan's processes (pytest, the probe, the fork server, the ranks)


def corpus(only: list[str]) -> list[tuple[str, Path]]:
    entries = tomllib.loads((CORPUS / "index.toml").read_text())["config"]
    found = [(e["id"], CORPUS / e["file"]) for e in entries if not only or e["id"] in only]
    missing = sorted(set(only) - {name for name, _ in found})
    if missing:
        raise SystemExit(f"not in corpus/configs/index.toml: {', '.join(missing)}")
    return found


def _written(place: Path, scan: Scan) -> None:
    data = {"config": scan.config, "release": scan.release, "seconds": scan.seconds, "problem": scan.problem,
            "cpu": scan.cpu, "record": scan.record.to_json() if scan.record else None}  # fmt: skip
    place.write_text(json.dumps(data))


def _read(place: Path) -> Scan:
    data = json.loads(place.read_text())
    record = RunRecord.from_json(data["record"]) if data["record"] else None
    return Scan(data["config"], data["release"], record, data["seconds"], data["problem"], data.get("cpu", 0.0))


def scan_one(env: environments.ReleaseEnv, name: str, path: Path, release: str, log: Path,
             catalogue: Path | None = None, pytest_args: tuple[str, ...] = ()) -> Scan:  # fmt: skip
    """One timed scan (of ``catalogue``, None: the installed one), its output to ``log``; a config the scan refuses up
    front is said, with no time."""
    try:
        userconfig.load(path, "gloo")  # what the scan refuses at once in gloo worlds
    except userconfig.UserConfigError as exc:
        return Scan(name, release, None, 0.0, f"refused by dsrepro: {exc}")
    started, used = time.perf_counter(), _children_cpu()
    sys.stdout.flush()
    with log.open("w") as out:
        saved = os.dup(1)
        os.dup2(out.fileno(), 1)  # the child's pytest writes to this process's stdout: its log
        try:
            record = catalogue_run.scan_once(
                env.python, dict(env.environ), path, catalogue=catalogue, world_size=None, pytest_args=pytest_args
            )
            problem = None
        except catalogue_run.ScanError as exc:
            record, problem = None, f"scan failed: {exc}"
        finally:
            os.dup2(saved, 1)
            os.close(saved)
    return Scan(name, release, record, time.perf_counter() - started, problem, _children_cpu() - used)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(args: argparse.Namespace) -> None:
    scan_all(args, corpus(args.config))


def scan_all(args: argparse.Namespace, configs: list[tuple[str, Path]], catalogue: Path | None = None,
             pytest_args: tuple[str, ...] = ()) -> None:  # fmt: skip
    """Each config on each of ``args.release``, its record kept in ``args.out`` (one already there is not run)."""
    prepare = environments.release_environment(args.cache_dir)
    for release in args.release:
        env = environments.prepared(prepare, release, "benchmark")
        where = args.out / release
        where.mkdir(parents=True, exist_ok=True)
        for name, path in configs:
            place = where / f"{name}.json"
            if place.exists():
                continue
            scan = scan_one(env, name, path, release, where / f"{name}.log", catalogue, pytest_args)
            _written(place, scan)
            said = scan_verdicts.counts(scan_verdicts.rows(scan.record)) if scan.record else scan.problem
            print(f"{release} {name}: {scan.seconds:.1f} s: {said}", flush=True)


def load(directory: Path) -> list[Scan]:
    return [_read(p) for p in sorted(directory.glob("*/*.json"))]


def cell(scan: Scan) -> str:
    if scan.record is None:
        return "refused" if scan.problem and scan.problem.startswith("refused") else "failed"
    found = Counter(SHORT[row.verdict] for row in scan_verdicts.rows(scan.record))
    said = " ".join(f"{found[s]}{s}" for s in ("A", "N", "?") if found[s])
    return said + (" R" if scan_verdicts.refusals(scan.record) else "") or "all n/a"


def checked(scan: Scan) -> list[str]:
    """Each AFFECTED / NOT AFFECTED verdict against the bug's catalogued range on this release: what disagrees."""
    if scan.record is None:
        return []
    version = Version(scan.release)
    meta = {t.repro.id: t.repro for t in scan.record.tests if t.repro is not None}
    odd = []
    for row in scan_verdicts.rows(scan.record):
        ranges = meta[row.id].affected
        inside = any(version in SpecifierSet(r) for r in ranges)
        if row.verdict is ScanVerdict.AFFECTED and not inside:
            odd.append(f"{scan.config} on {scan.release}: {row.id} AFFECTED outside its range {ranges}")
        if row.verdict is ScanVerdict.NOT_AFFECTED and inside:
            odd.append(f"{scan.config} on {scan.release}: {row.id} NOT AFFECTED inside its range {ranges}: "
                       f"{row.detail}")  # fmt: skip
    return odd


def untold(scans: list[Scan], refused: bool | None = None) -> list[str]:
    """The CANNOT TELL cells; ``refused``: only those of a config DeepSpeed refuses (True), or only the others."""
    return [f"{s.config} on {s.release}: {row.id}: {row.detail}" for s in scans if s.record is not None
            for row in scan_verdicts.rows(s.record) if row.verdict is ScanVerdict.CANNOT_TELL
            and (refused is None or refused == (row.detail == scan_verdicts.REFUSED_ROW))]  # fmt: skip


def summary(scans: list[Scan], before: list[Scan] | None) -> list[str]:
    releases = sorted({s.release for s in scans}, key=Version)
    by = {(s.config, s.release): s for s in scans}
    names = list(dict.fromkeys(s.config for s in scans))
    lines = ["| config | " + " | ".join(releases) + " |", "| --- |" + " --- |" * len(releases)]
    lines += [f"| {n} | " + " | ".join(cell(by[n, r]) if (n, r) in by else "" for r in releases) + " |" for n in names]
    timed = [s.seconds for s in scans if s.record is not None]
    lines += ["", "A: AFFECTED, N: NOT AFFECTED, ?: CANNOT TELL (per bug; NOT APPLICABLE not counted); R: DeepSpeed "
              "refuses the config (said above the scan's table)", ""]  # fmt: skip
    for release in releases:
        these = [s for s in scans if s.record is not None and s.release == release]
        if these:
            wall, cpu = [s.seconds for s in these], [s.cpu for s in these]
            used = f"; CPU time median {statistics.median(cpu):.1f} s, worst {max(cpu):.1f} s" if max(cpu) else ""
            lines.append(f"time per scan on {release}: median {statistics.median(wall):.1f} s, worst {max(wall):.1f} s "
                         f"of wall time{used} ({len(these)} scans)")  # fmt: skip
    if timed:
        worst = max((s for s in scans if s.record is not None), key=lambda s: s.seconds)
        lines.append(f"time per scan, all: median {statistics.median(timed):.1f} s, worst {worst.seconds:.1f} s "
                     f"({worst.config} on {worst.release})")  # fmt: skip
    for refused, what in ((True, "of configs DeepSpeed refuses"), (False, "of configs it runs")):
        now = untold(scans, refused)
        counted = f"CANNOT TELL cells {what}: {len(now)}"
        if before is not None:
            counted += f" (before: {len(untold(before, refused))})"
        lines += ["", counted, *(f"- {line}" for line in now if not refused)]
    odd = [line for s in scans for line in checked(s)]
    lines += ["", f"verdicts that disagree with the bug's catalogued range: {len(odd)}", *(f"- {x}" for x in odd)]
    return lines + not_scanned(scans, "configs")


def not_scanned(scans: list[Scan], what: str) -> list[str]:
    """The scans that did not run, each with why."""
    failed = [f"{s.config} on {s.release}: {s.problem}" for s in scans if s.problem]
    return ["", f"{what} not scanned: {len(failed)}", *(f"- {x}" for x in failed)]


def arguments(description: str, releases: tuple[str, ...]) -> argparse.ArgumentParser:
    """The options every scan benchmark takes: where its records go, the releases, the cache, an earlier run."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, help="where each scan's record goes (and is found again)")
    parser.add_argument("--release", action="append", default=[], help=f"default: {' '.join(releases)}")
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--summary", type=Path, help="print the summary of an earlier --out, running nothing")
    parser.add_argument("--before", type=Path, help="an earlier --out, for the counts before")
    return parser


def main() -> None:
    parser = arguments(__doc__.splitlines()[0], RELEASES)
    parser.add_argument("--config", action="append", default=[], help="a corpus id (default: all)")
    parser.add_argument("--markdown", type=Path, help="also write the summary there")
    args = parser.parse_args()
    args.release = args.release or list(RELEASES)
    if args.summary is None:
        if args.out is None:
            parser.error("--out DIR (or --summary DIR)")
        run(args)
    lines = summary(load(args.summary or args.out), load(args.before) if args.before else None)
    print("\n".join(lines))
    if args.markdown:
        args.markdown.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
