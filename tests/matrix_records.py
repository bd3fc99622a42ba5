"""Results files for the matrix's tests, written as the plugin writes them: through ``core.results``' typed records."""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from pathlib import Path

from pytest_dsrepro.core.gates import Rate, Reason, Verdict
from pytest_dsrepro.core.outcome import Measurement
from pytest_dsrepro.core.results import Environment, Origin, RankStory, ReproMeta, RunRecord, TestRecord

EPILOGUE = "zero3-backward-without-optimizer"
MODULE_ID = "zero3-module-id-clobbered"
STOCK = "repros/test_module_id.py::test_user_id_survives[zero3-stock]"
FIXED = "repros/test_module_id.py::test_user_id_survives[zero3-fixed]"
EPI = "repros/test_epilogue.py::test_backward[zero3-stock]"

#: The reason a record of each verdict gives (any reason of that verdict would do for the matrix).
REASONS = {
    Verdict.REPRODUCED: Reason.REPRODUCED,
    Verdict.FIXED: Reason.NOT_AFFECTED,
    Verdict.NOT_YET_AFFECTED: Reason.NOT_YET_AFFECTED,
    Verdict.PASSES_WITH_FIX: Reason.FIX_HOLDS,
    Verdict.UNEXPECTED: Reason.FAILED_DIFFERENTLY,
    Verdict.NOT_APPLICABLE: Reason.NOT_APPLICABLE,
}
#: The affected ranges each repro declares (its ds_version markers).
DECLARED = {MODULE_ID: ("<0.16.4",), EPILOGUE: ("<0.18.3",)}


def rec(
    nodeid: str,
    verdict: str | None,
    *,
    repro: str | None = MODULE_ID,
    variant: str | None = "stock",
    outcome: str = "passed",
    error: str | None = None,
    reason: Reason | None = None,
    affected: tuple[str, ...] | None = None,
    raised: str | None = None,
    world_size: int | None = 2,
    prerequisites: tuple[str, ...] = (),
    rate: Rate | None = None,
    measurements: tuple[Measurement, ...] = (),
    origin: Origin | None = None,
) -> TestRecord:
    """A test record as the plugin writes it (``raised``: the one rank story's error line)."""
    declared = DECLARED.get(repro or "", ()) if affected is None else affected
    meta = None if repro is None else ReproMeta(repro, f"title of {repro}", f"https://x.invalid/{repro}",
                                                affected=declared)  # fmt: skip
    judged = Verdict(verdict) if verdict else None
    reason = reason or (REASONS.get(judged) if judged else None)
    ranks = (RankStory("ranks 0-1", raised, "Traceback ...", ""),) if raised else ()
    return TestRecord(nodeid=nodeid, repro=meta, variant=variant, verdict=judged, reason=reason, outcome=outcome,
                      error=error, duration=1.0, config=None, ranks=ranks, world_size=world_size,
                      prerequisites=prerequisites, rate=rate, measurements=measurements, origin=origin)  # fmt: skip


def write(
    directory: Path,
    version: str,
    tests: Sequence[TestRecord],
    *,
    created: str = "2026-11-22T10:00:00+00:00",
    unavailable: str | None = None,
    name: str | None = None,
    torch: str = "2.13.0+cpu",
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / (name or f"results-deepspeed-{version}-{len(list(directory.iterdir())):08x}.json")
    env = Environment(deepspeed=version, torch=torch, python="3.11.7", backend=None if unavailable else "gloo",
                      world_size=None if unavailable else 2, os="Linux", cpu=None, cpu_count=None, gpu=None,
                      gpu_count=None)  # fmt: skip
    run = RunRecord(created=datetime.datetime.fromisoformat(created), environment=env, unavailable=unavailable,
                    tests=tuple(tests))  # fmt: skip
    path.write_text(json.dumps(run.to_json()))
    return path


#: 24 releases, as releases.txt has them.
RELEASES = ["0.14.4", "0.15.4", "0.16.3", "0.16.4", "0.16.5", "0.17.5", "0.17.6", "0.18.0", "0.18.1", "0.18.2",
            "0.18.3", "0.18.4", "0.18.5", "0.18.6", "0.18.7", "0.18.9", "0.19.0", "0.19.1", "0.19.2", "0.19.4",
            "0.19.5", "0.19.6", "0.19.7", "0.19.8"]  # fmt: skip


def big_catalogue(directory: Path, bugs: int = 30, releases: Sequence[str] = RELEASES) -> None:
    """``bugs`` bugs with long ids and configs (two configs each, stock and fixed), their ranges spread over
    ``releases``: the catalogue at twice today's size."""
    for i, version in enumerate(releases):
        tests = []
        for b in range(bugs):
            repro = f"zero{b % 4}-{'very-long-' * 2}bug-number-{b:02d}-loses-its-optimizer-state"
            first = b % (len(releases) - 5)
            start, end = releases[first], releases[first + 5]
            for config in (f"bf16_zero{b % 4}_offload_optimizer_and_params_to_cpu", "zero3"):
                base = f"repros/test_bug_{b:02d}.py::test_bug_{b:02d}[{config}"
                inside, before = first <= i < first + 5, i < first
                verdict = "REPRODUCED" if inside else "NOT-YET-AFFECTED" if before else "FIXED"
                tests.append(rec(f"{base}-stock]", verdict, repro=repro, affected=(f">={start},<{end}",),
                                 outcome="xfailed" if inside else "passed",
                                 raised="AssertionError: state lost" if inside else None))  # fmt: skip
                tests.append(rec(f"{base}-fixed]", "PASSES-WITH-FIX", repro=repro, variant="fixed",
                                 affected=(f">={start},<{end}",)))  # fmt: skip
        write(directory, version, tests)
