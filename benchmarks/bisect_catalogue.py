"""Every catalogued boundary the matrix only brackets, pinned by ``dsrepro bisect`` over PyPI's releases (issue 53).

The matrix runs each repro on the releases of releases.txt. Where a bug's range begins or ends between two of them
with other releases on PyPI in between (0.14.4 .. 0.15.4 holds five), the matrix shows the boundary only to lie in
that gap. Here ``dsrepro bisect`` searches the gap's releases for each such boundary, on the bug's first stock test,
and the release it finds is compared with the one the ``ds_version`` gate declares. A boundary between two listed
releases that are adjacent on PyPI is observed by the matrix itself and is not bisected.

    nice -n 10 python benchmarks/bisect_catalogue.py --out /tmp/bisects [--cache-dir DIR] [--only ID ...]
    python benchmarks/bisect_catalogue.py --summary /tmp/bisects

Each bisect's output goes to ``--out`` as ``<id>.<bound>.txt`` with a JSON record beside it (one already there is not
run again); the release environments are cached in ``--cache-dir`` and shared by every bisect.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from pytest_dsrepro.tools import catalogue
from pytest_dsrepro.tools.releases import available_releases, read_releases

ROOT = Path(__file__).resolve().parents[1]
FOUND = re.compile(r"^first release where the outcome flips: deepspeed (\S+)$", re.MULTILINE)
PROBES = re.compile(r"^(\d+) releases probed", re.MULTILINE)


@dataclass(frozen=True)
class Boundary:
    """Where one bug's declared range begins (``>=``: the first affected release) or ends (``<``: the first fixed)."""

    id: str
    node: str
    declared: str  # the release the gate names
    kind: str  # "introduced" or "fixed"
    good: str  # the listed release on the side without the bug
    bad: str  # ... and on the side with it

    @property
    def name(self) -> str:
        return f"{self.id}.{self.kind}-{self.declared}"


def boundaries(entries: list[catalogue.Entry], listed: list[Version], pypi: list[Version]) -> list[Boundary]:
    """Each bound of each bug's gate that falls in a gap of releases.txt holding other PyPI releases. A bound where
    one of its ranges ends and another begins is where its message changes, not where the bug does: none."""
    found: list[Boundary] = []
    for entry in entries:
        stock = [t for t in entry.tests if t.endswith("-stock]") or t.endswith("[stock]")]
        bounds = {(s.operator, Version(s.version)) for spec in entry.affected for s in SpecifierSet(spec)}
        inner = {b for op, b in bounds if op == "<"} & {b for op, b in bounds if op == ">="}
        for operator, bound in sorted((b for b in bounds if b[1] not in inner), key=lambda b: b[1]):
            below, above = [r for r in listed if r < bound], [r for r in listed if r >= bound]
            if not stock or not below or not above or not any(below[-1] < p < above[0] for p in pypi):
                continue
            introduced = operator == ">="
            good, bad = (below[-1], above[0]) if introduced else (above[0], below[-1])
            kind = "introduced" if introduced else "fixed"
            found.append(Boundary(entry.id, stock[0], str(bound), kind, str(good), str(bad)))
    return found


def bisect(boundary: Boundary, out: Path, cache: Path) -> dict[str, object]:
    """Run ``dsrepro bisect`` for one boundary; its record (what it found, how long it took), its output kept."""
    command = [sys.executable, "-m", "pytest_dsrepro.tools.cli", "bisect", boundary.node, "--good", boundary.good,
               "--bad", boundary.bad, "--cache-dir", str(cache)]  # fmt: skip
    started = time.monotonic()
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    text = proc.stdout + proc.stderr
    (out / f"{boundary.name}.txt").write_text(text)
    found, probes = FOUND.search(text), PROBES.search(text)
    record = {**asdict(boundary), "rc": proc.returncode, "wall_s": round(time.monotonic() - started, 1),
              "found": found and found.group(1), "probes": probes and int(probes.group(1))}  # fmt: skip
    (out / f"{boundary.name}.json").write_text(json.dumps(record, indent=1))
    return record


def _no_verdict(record: dict[str, object], text: str) -> str:
    """Why a bisect gave no release: an end where the test does not apply (the gap holds the release its feature
    appeared in, which the gate's ``ds_not_applicable`` declares), or bisect's own last line."""
    if "could not be tested (NOT-APPLICABLE" in text:
        return "not applicable at the older end: the feature appears in the gap"
    said = [line for line in text.splitlines() if line.startswith("dsrepro bisect:")]
    return f"no verdict (exit {record['rc']}: {said[-1] if said else 'see its output'})"


def summary(out: Path) -> None:
    """The records as a Markdown table, and the counts: agreed, differed, no verdict."""
    records = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    print("| bug | boundary | gap searched | declared | found | probes | wall |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in records:
        gap = " .. ".join(sorted((r["good"], r["bad"]), key=Version))
        boundary = Boundary(**{name: r[name] for name in Boundary.__dataclass_fields__})
        found = r["found"] or _no_verdict(r, (out / f"{boundary.name}.txt").read_text())
        mark = "" if r["found"] in (None, r["declared"]) else " **differs**"
        print(f"| `{r['id']}` | {r['kind']} | {gap} | {r['declared']} | {found}{mark} | {r['probes'] or '-'} | "
              f"{r['wall_s'] / 60:.1f} min |")  # fmt: skip
    agreed = sum(r["found"] == r["declared"] for r in records)
    missing = sum(r["found"] is None for r in records)
    total = sum(float(r["wall_s"]) for r in records) / 60
    print(f"\n{len(records)} boundaries: {agreed} found where declared, {len(records) - agreed - missing} elsewhere, "
          f"{missing} without a release; {total:.0f} min in all")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="where each bisect's output and record go")
    parser.add_argument("--cache-dir", type=Path, default=None, help="the releases' environments (default: --out)")
    parser.add_argument("--only", nargs="*", default=(), help="these bug ids only")
    parser.add_argument("--summary", type=Path, help="print the table of the records in this directory")
    args = parser.parse_args()
    if args.summary:
        summary(args.summary)
        return
    if args.out is None:
        parser.error("--out or --summary is required")
    args.out.mkdir(parents=True, exist_ok=True)
    listed = [Version(r) for r in read_releases(ROOT / "releases.txt")]
    found = boundaries(catalogue.collect([str(ROOT / "repros")]), listed, available_releases())
    todo = [b for b in found if (not args.only or b.id in args.only) and not (args.out / f"{b.name}.json").exists()]
    print(f"{len(found)} boundaries in gaps of releases.txt; {len(todo)} to bisect", flush=True)
    for i, boundary in enumerate(todo, 1):
        record = bisect(boundary, args.out, args.cache_dir or args.out / "cache")
        print(f"[{i}/{len(todo)}] {boundary.name}: {record['found']} ({record['wall_s']} s)", flush=True)


if __name__ == "__main__":
    main()
