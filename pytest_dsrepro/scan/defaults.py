"""Each release's own defaults on pytest's side: a config as the installed DeepSpeed reads it, asked of that release
in a subprocess of this interpreter (``scan.probe``), so the pytest process never imports DeepSpeed.

A probe is started as soon as its configs are known (a scan starts one at configure, so the import of torch and
DeepSpeed overlaps collection) and read when a premise is first judged. Its answers are kept in the cache directory
per DeepSpeed install (release, place, the time of its config module) and config: a config scanned again on a
release costs nothing. A probe that fails or runs out of time is said in one line (``DefaultsProbe.problem``); a
scan then leaves unjudged what a default would have decided.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..core import ds_defaults, json_input, paths
from ..core.ds_defaults import ReleaseReading
from ..core.files import write_atomically
from ..core.gates import installed_deepspeed
from ..core.versions import installed_text
from ..session.diagnostics import rank_environment

#: Seconds a probe may take: importing torch and DeepSpeed (2 s on a quiet machine, 10-20 s on a loaded one).
TIMEOUT = 180.0
MODULE = "pytest_dsrepro.scan.probe"


def install_key() -> str | None:
    """The DeepSpeed install this interpreter imports, found without importing it (None: no DeepSpeed)."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        return None
    where = Path(next(iter(spec.submodule_search_locations)))
    module = where / "runtime" / "config.py"
    stamp = module.stat().st_mtime_ns if module.exists() else 0
    place = hashlib.sha256(f"{where.resolve()}:{stamp}".encode()).hexdigest()[:12]
    return f"deepspeed-{installed_deepspeed()}-torch-{installed_text('torch')}-{place}-v{ds_defaults.FORMAT}"


@dataclasses.dataclass
class DefaultsProbe:
    """One batch of configs asked of the installed release: the readings, in order, once ``wait`` has them."""

    configs: list[dict[str, Any]]
    cached: dict[int, ReleaseReading]
    places: dict[int, Path]
    child: subprocess.Popen[str] | None = None
    workdir: tempfile.TemporaryDirectory[str] | None = None
    problem: str | None = None
    healed: list[str] = dataclasses.field(default_factory=list)  # cache entries that could not be used: read again
    readings: list[ReleaseReading | None] = dataclasses.field(default_factory=list)

    def wait(self) -> list[ReleaseReading | None]:
        """The readings (None for each config when the probe failed: ``problem`` says why)."""
        if self.readings or not self.configs:
            return self.readings
        answers = self._answers()
        for i, place in self.places.items():
            if answers is not None:  # whole or not at all: xdist workers and other runs share the cache
                write_atomically(place, json.dumps(answers[i].to_json()))
        found: list[ReleaseReading | None] = []
        for i in range(len(self.configs)):
            found.append(self.cached.get(i) or (answers[i] if answers is not None else None))
        self.readings = found
        return found

    def close(self) -> None:
        """Stop the probe if it is still running, and remove its files."""
        if self.child is not None and self.child.poll() is None:
            self.child.kill()
            self.child.communicate()
        if self.workdir is not None:
            self.workdir.cleanup()

    def _answers(self) -> dict[int, ReleaseReading] | None:
        if self.child is None or self.workdir is None:
            return {}
        try:
            output, _ = self.child.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            self.child.kill()
            self.child.communicate()
            self.problem = f"reading DeepSpeed's defaults took over {TIMEOUT:.0f} s"
            return None
        finally:
            answer = Path(self.workdir.name) / "answer.json"
            text = answer.read_text() if answer.exists() else None
            self.workdir.cleanup()
        if self.child.returncode != 0 or text is None:
            tail = (output or "").strip().splitlines()[-1:] or ["no output"]
            self.problem = f"reading DeepSpeed's defaults failed (exit {self.child.returncode}): {tail[0]}"
            return None
        try:
            read = [ReleaseReading.from_json(r) for r in json_input.loads(text)]
        except (ValueError, TypeError) as exc:
            self.problem = f"DeepSpeed's defaults came back unreadable: {exc}"
            return None
        return dict(zip(sorted(self.places), read, strict=True))


def start(configs: Sequence[Mapping[str, Any]], cache_dir: Path, gloo: bool) -> DefaultsProbe:
    """Ask the installed release for ``configs`` (each a ``ds_defaults.request``): from the cache where it answered
    before, the rest in one subprocess started now."""
    key = install_key()
    wanted = [dict(c) for c in configs]
    if key is None:
        return DefaultsProbe(wanted, {}, {}, problem="DeepSpeed is not installed: its defaults cannot be read")
    folder = cache_dir / "defaults" / key
    cached, places, healed = {}, {}, []
    for i, config in enumerate(wanted):
        place = folder / f"{ds_defaults.digest(config)}.json"
        try:
            cached[i] = ReleaseReading.from_json(json_input.loads(paths.read_text(place)))
        except FileNotFoundError:
            places[i] = place
        except (OSError, ValueError) as exc:  # damaged, or of another shape: read again, and said once
            places[i] = place
            healed.append(f"the cached defaults {place} could not be used ({exc}): read again from DeepSpeed")
    probe = DefaultsProbe(wanted, cached, places, healed=healed)
    if places:
        probe.workdir = tempfile.TemporaryDirectory(prefix="dsrepro-defaults-")
        request = Path(probe.workdir.name) / "request.json"
        request.write_text(json.dumps([wanted[i] for i in sorted(places)]))
        answer = Path(probe.workdir.name) / "answer.json"
        probe.child = subprocess.Popen(
            [sys.executable, "-m", MODULE, str(request), str(answer)],
            cwd=probe.workdir.name,  # no directory of the user's shadows the installed DeepSpeed
            env=rank_environment(0 if gloo else 1),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    return probe
