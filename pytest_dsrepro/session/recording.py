"""One record per test, and one run record per pytest run: what ``--ds-results``, ``--ds-report``, the terminal
summary and ``dsrepro matrix`` all read.

Records travel inside ``report.user_properties`` (plain JSON data), so they reach the controller under xdist too.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import uuid
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from ..core.configs import ResolvedConfig
from ..core.gates import Judgement, Verdict
from ..core.outcome import Status, WorldOutcome, group_ranks

SCHEMA = 1
PROPERTY = "dsrepro"
JUDGEMENT_KEY = pytest.StashKey[Judgement]()
CONFIG_KEY = pytest.StashKey[ResolvedConfig]()


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(backend: str, world_size: int, gpus: list[str] | None = None) -> dict[str, Any]:
    return {
        "deepspeed": _version("deepspeed"),
        "torch": _version("torch"),
        "python": platform.python_version(),
        "backend": backend,
        "world_size": world_size,
        "os": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "gpu": ", ".join(sorted(set(gpus))) if gpus else None,
        "gpu_count": len(gpus or []),
    }


def repro_metadata(item: pytest.Item) -> dict[str, Any] | None:
    mark = item.get_closest_marker("ds_repro")
    if mark is None:
        return None
    module = getattr(item, "module", None)
    default_id = Path(module.__file__).stem.removeprefix("test_") if module and module.__file__ else item.name
    meta: dict[str, Any] = {
        "id": default_id,
        "title": "",
        "upstream": None,
        "fix_ref": None,
        "fixed_in": None,
        "root_cause": "",
    }
    meta.update(mark.kwargs)
    meta["affected"] = [
        str(m.kwargs.get("affected", m.args[0] if m.args else "")) for m in item.iter_markers("ds_version")
    ]
    return meta


def _ranks(outcome: WorldOutcome | None) -> list[dict[str, str]]:
    if outcome is None:
        return []
    bad = [r for r in outcome.ranks if r.status is not Status.PASSED]
    return [
        {
            "ranks": g.label,
            "error": g.headline,
            "traceback": g.ranks[0].error.traceback if g.ranks[0].error else g.ranks[0].stack,
            "output": g.ranks[0].output[-4000:],
        }
        for g in group_ranks(bad)
    ]


def _outcome_word(report: pytest.TestReport) -> str:
    if hasattr(report, "wasxfail"):
        return "xfailed" if report.skipped else "xpassed"
    if report.when != "call" and report.failed:
        return "error"
    return report.outcome


def _error_line(report: pytest.TestReport, judgement: Judgement | None) -> str | None:
    if (
        judgement is not None
        and judgement.verdict is not Verdict.FIXED
        and judgement.verdict is not Verdict.PASSES_WITH_FIX
    ):
        return judgement.message.splitlines()[0]
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)  # the exception line, as pytest's short summary shows it
        text = crash.message if crash is not None else report.longreprtext.strip()
        return text.splitlines()[0] if text.strip() else "failed"
    return None


def record(
    item: pytest.Item, report: pytest.TestReport, outcome: WorldOutcome | None, variant: str | None
) -> dict[str, Any]:
    judgement = item.stash.get(JUDGEMENT_KEY, None)
    verdict = judgement.verdict.value if judgement else None
    if report.skipped and not hasattr(report, "wasxfail") and item.get_closest_marker("ds_version"):
        verdict = Verdict.SKIPPED.value
    config = item.stash.get(CONFIG_KEY, None)
    return {
        "nodeid": item.nodeid,
        "repro": repro_metadata(item),
        "variant": variant,
        "verdict": verdict,
        "outcome": _outcome_word(report),
        "error": _error_line(report, judgement),
        "duration": round(report.duration, 3),
        "config": config.config if config else None,
        "config_notes": list(config.notes) if config else [],
        "ranks": _ranks(outcome),
        "longrepr": (report.longreprtext or None) if report.failed else None,
    }


@dataclass
class Run:
    """Collects the records of one pytest run (in the controller under xdist)."""

    records: list[dict[str, Any]] = field(default_factory=list)
    environment: dict[str, Any] = field(default_factory=dict)

    def add(self, report: pytest.TestReport) -> None:
        for name, value in report.user_properties:
            if name == PROPERTY and isinstance(value, dict):
                self.records.append(value)

    def as_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "environment": self.environment,
            "unavailable": None,
            "tests": self.records,
        }

    def write(self, directory: Path) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        env = self.environment
        path = directory / f"results-deepspeed-{env.get('deepspeed')}-{uuid.uuid4().hex[:8]}.json"
        path.write_text(json.dumps(self.as_json(), indent=2, default=str))
        return path

    def summary_lines(self) -> list[str]:
        """The terminal summary: one line per gated test, its verdict first."""
        gated = [r for r in self.records if r["verdict"] or r["repro"]]
        labels = [r["verdict"] or r["outcome"].upper() for r in gated]
        width = max(map(len, labels), default=0)
        lines = []
        for label, r in zip(labels, gated, strict=True):
            why = f"  -- {r['error']}" if label in (Verdict.UNEXPECTED.value, Verdict.SKIPPED.value) else ""
            lines.append(f"{label:<{width}}  {r['nodeid']}{why}")
        return lines


RUN_KEY = pytest.StashKey[Run]()


def is_xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")
