"""Environments for DeepSpeed releases (issue 13): uv, as ``dsrepro install`` and ``bisect`` make them, against the
pip path they replaced (``python -m venv``, pip installs under the same constraints), measured in one run.

For each release: a cold environment (new directory; package caches warm, as on any machine that built the release
once), and a warm one (the same environment again: what a second tox run or bisect probe pays). Each environment
holds torch (pinned), the release (built --no-build-isolation, DS_BUILD_OPS=0) and this plugin, and is proved by
importing DeepSpeed.

    python benchmarks/environments.py [--releases 0.16.3 0.16.4] [--no-pip] [--json PATH]

Run from a checkout with ``constraints.txt``; uv comes from this environment (a dependency of the plugin).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from pytest_dsrepro.tools import install

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "constraints.txt"


def timed(make: Callable[[Path, str], None], directory: Path, release: str) -> float:
    started = time.perf_counter()
    make(directory, release)
    return time.perf_counter() - started


def uv_environment(directory: Path, release: str) -> None:
    python = install.environment_python(directory)
    install.add_this_plugin(python, CONSTRAINTS)
    result = install.install_deepspeed(release, python=python, constraints=CONSTRAINTS, cache_dir=directory / "c")
    if not result.ok:
        raise SystemExit(f"uv: deepspeed {release}: {result.reason}")


def pip_environment(directory: Path, release: str) -> None:
    """The recipe before uv: a venv with pip, torch and build tools, then DeepSpeed without build isolation."""
    python = str(directory / "bin" / "python")
    env = install._env()
    if not Path(python).exists():
        subprocess.run([sys.executable, "-m", "venv", str(directory)], check=True)
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "-c", str(CONSTRAINTS)]
    subprocess.run([*pip, "torch", "setuptools", "wheel", "pytest", "psutil", "filelock", "packaging"], env=env,
                   check=True)  # fmt: skip
    subprocess.run([*pip, "--no-build-isolation", f"deepspeed=={release}"], env=env, check=True)
    probe = install.probe_import(python)
    if not probe.ok:
        raise SystemExit(f"pip: deepspeed {release}: {probe.error}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--releases", nargs="+", default=["0.16.3", "0.16.4"])
    parser.add_argument("--no-pip", action="store_true", help="measure uv only (pip takes minutes per release)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    figures: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="dsrepro-envbench-") as tmp:
        for release in args.releases:
            for tool, make in (("uv", uv_environment), ("pip", pip_environment)):
                if tool == "pip" and args.no_pip:
                    continue
                directory = Path(tmp) / f"{tool}-{release}"
                cold = timed(make, directory, release)
                warm = timed(make, directory, release)
                figures.setdefault(tool, {}).setdefault("cold", []).append(cold)
                figures[tool].setdefault("warm", []).append(warm)
                print(f"{tool:3} deepspeed {release}: cold {cold:6.1f} s, warm {warm:5.1f} s", flush=True)
                shutil.rmtree(directory)
    print()
    for kind in ("cold", "warm"):
        uv = statistics.median(figures["uv"][kind])
        line = f"median {kind:4}: uv {uv:6.1f} s"
        if "pip" in figures:
            pip = statistics.median(figures["pip"][kind])
            line += f", pip {pip:6.1f} s, uv/pip {uv / pip:.2f}"
        print(line)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
