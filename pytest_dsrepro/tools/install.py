"""The one recipe for putting a DeepSpeed release into a Python environment (``dsrepro install``).

Used by tox (``commands_pre``) and by ``dsrepro bisect``. The rules, each learnt the hard way:

* torch is pinned through the repository's ``constraints.txt`` (``pip -c``) on every pip call: an unpinned torch
  pulls a multi-GB CUDA build, and a DeepSpeed requirement of plain ``torch`` would otherwise upgrade it.
* DeepSpeed ships sdists only; its ``setup.py`` imports torch, so it is built ``--no-build-isolation`` in an
  environment that already holds torch (and setuptools/wheel), with ``DS_BUILD_OPS=0`` (ops are JIT-built on first
  use, per release, by the plugin). The built wheel is kept in ``<cache>/wheels/torch-<torch>/``: a release is built
  once per torch, whichever environment asks for it next.
* DeepSpeed's runtime requirements (read from the wheel, extras left out) go in *before* DeepSpeed itself, under
  the same constraints, so none of them can move torch; DeepSpeed then goes in with ``--no-deps``.
* Installed is not usable: the result is proved by importing DeepSpeed in the target interpreter, with
  ``DS_ACCELERATOR=cpu`` when torch sees no GPU (releases <= 0.14.0 fail exactly there on CPU).

A release that cannot be installed or imported is not an error of this tool but a fact about the release: the
result says why (``InstallResult.reason``), and :func:`write_unavailable` records it as a results file (through
``core.results``, like every other), so ``dsrepro matrix`` shows the release as a column "cannot run with torch X:
<reason>" instead of dropping it.
"""

from __future__ import annotations

import argparse
import dataclasses
import email.parser
import hashlib
import json
import os
import re
import subprocess
import sys
import time
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from ..core import results
from ..core.options import CACHE_ENV, default_cache_dir
from ..core.results import RunRecord

__all__ = [
    "CONSTRAINTS_ENV",
    "InstallError",
    "InstallResult",
    "Probe",
    "add_arguments",
    "build_wheel",
    "find_constraints",
    "install_deepspeed",
    "pinned",
    "probe_import",
    "run",
    "runtime_requirements",
    "unavailable_results",
    "write_unavailable",
]

#: Where the constraints file comes from when none is given: this variable, else ``./constraints.txt``.
CONSTRAINTS_ENV = "DSREPRO_CONSTRAINTS"
#: What DeepSpeed's setup.py needs in the environment when built without isolation.
BUILD_PREREQUISITES = ("torch", "setuptools", "wheel")
BUILD_ENV = {"DS_BUILD_OPS": "0"}
PROBE_MARK = "DSREPRO-PROBE "
PIP_TIMEOUT = 1800.0  # building an sdist on a loaded 2-core machine takes minutes; never forever
PROBE_TIMEOUT = 600.0

# Runs in the target interpreter. DeepSpeed prints while importing, so the answer is one marked line.
_PROBE = r"""
import json, os, sys
out = {"python": sys.version.split()[0]}
try:
    import torch
    out["torch"] = torch.__version__
    out["cuda"] = bool(torch.cuda.is_available())
    if not out["cuda"]:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    out["deepspeed"] = deepspeed.__version__
    from deepspeed.accelerator import get_accelerator
    out["accelerator"] = get_accelerator().device_name()
except BaseException as exc:
    import traceback
    out["error"] = (type(exc).__name__ + ": " + str(exc)).strip().splitlines()[0]
    out["traceback"] = traceback.format_exc()
print(MARK + json.dumps(out), flush=True)
""".replace("MARK", repr(PROBE_MARK))

# Versions, and when each distribution was installed (its METADATA's mtime): a reinstall changes the fingerprint.
_VERSIONS = r"""
import json, sys
from importlib import metadata
found = {}
for name in sys.argv[1:]:
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        found[name] = [None, None]
        continue
    meta = [f for f in (dist.files or []) if f.name == "METADATA"]
    try:
        stamp = meta[0].locate().stat().st_mtime_ns if meta else None
    except OSError:
        stamp = None
    found[name] = [dist.version, stamp]
print(json.dumps(found))
"""


class InstallError(Exception):
    """One step of the recipe failed; ``reason`` is the one line a person needs, ``output`` the rest."""

    def __init__(self, reason: str, output: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.output = output


@dataclass(frozen=True)
class Probe:
    """What importing DeepSpeed in the target interpreter showed."""

    ok: bool
    python: str | None = None
    torch: str | None = None
    deepspeed: str | None = None
    accelerator: str | None = None
    cuda: bool = False
    error: str | None = None
    traceback: str | None = None


@dataclass(frozen=True)
class InstallResult:
    """The outcome of :func:`install_deepspeed`. ``ok`` False means the release is unavailable for ``reason``."""

    version: str
    python: str
    target: Path | None
    ok: bool
    action: str  # "installed", "already installed" or "failed"
    reason: str | None
    probe: Probe | None
    seconds: float
    torch: str | None = None  # the torch in the environment, when it got that far
    steps: tuple[str, ...] = field(default=())
    wheel: Path | None = None


def find_constraints(environ: Mapping[str, str] | None = None, cwd: Path | None = None) -> Path | None:
    """``$DSREPRO_CONSTRAINTS``, else ``constraints.txt`` in ``cwd`` or the nearest parent that has one."""
    environ = os.environ if environ is None else environ
    if environ.get(CONSTRAINTS_ENV):
        return Path(environ[CONSTRAINTS_ENV])
    here = (cwd or Path.cwd()).resolve()
    for directory in (here, *here.parents):
        if (directory / "constraints.txt").is_file():
            return directory / "constraints.txt"
    return None


def pinned(constraints: Path, name: str) -> SpecifierSet | None:
    """The specifier a constraints file puts on ``name`` (comments, options and other lines skipped)."""
    for line in constraints.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if canonicalize_name(req.name) == canonicalize_name(name):
            return req.specifier
    return None


def _satisfies(installed: str | None, spec: SpecifierSet | None) -> bool:
    if installed is None:
        return False
    if spec is None:
        return True
    try:
        return spec.contains(Version(installed), prereleases=True)
    except InvalidVersion:
        return False


def _same_version(a: str | None, b: str) -> bool:
    try:
        return a is not None and Version(a) == Version(b)
    except InvalidVersion:
        return a == b


def _env(target: Path | None, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(BUILD_ENV)
    if target is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(target), env.get("PYTHONPATH", "")) if p)
    env.update(extra or {})
    return env


def _reason(output: str, fallback: str) -> str:
    """The line of a failed command's output that says what went wrong."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    exception = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception|Exit)\b.*:", ln)]
    if exception:
        return exception[-1]
    errors = [ln.removeprefix("ERROR:").strip() for ln in lines if ln.startswith("ERROR:")]
    if errors:
        return errors[0]
    return lines[-1] if lines else fallback


class _Runner:
    """Runs the recipe's commands, keeps their transcript, and turns a failure into an :class:`InstallError`."""

    def __init__(self, python: str, target: Path | None, log: Path | None, echo: bool) -> None:
        self.python = python
        self.target = target
        self.log = log
        self.echo = echo
        self.steps: list[str] = []

    def __call__(self, what: str, args: Sequence[str], timeout: float = PIP_TIMEOUT) -> str:
        cmd = [self.python, *args]
        self.steps.append(" ".join(cmd))
        # never PYTHONPATH=target here: pip must see (and change) only the base environment
        if self.echo:
            print(f"dsrepro install: {what}: {' '.join(cmd)}", file=sys.stderr, flush=True)
        try:
            proc = subprocess.run(
                cmd,
                env=_env(None),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=timeout,
                check=False,
            )
            output, code = proc.stdout, proc.returncode
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            self._keep(cmd, out)
            raise InstallError(f"{what} timed out after {timeout:g}s", out) from None
        self._keep(cmd, output)
        if code != 0:
            raise InstallError(f"{what} failed: {_reason(output, f'exit code {code}')}", output)
        return output

    def pip(self, what: str, args: Sequence[str]) -> str:
        return self(what, ["-m", "pip", "--disable-pip-version-check", *args])

    def _keep(self, cmd: Sequence[str], output: str) -> None:
        if self.log is not None:
            self.log.parent.mkdir(parents=True, exist_ok=True)
            with self.log.open("a") as fh:
                fh.write(f"$ {' '.join(cmd)}\n{output}\n")


def installed_versions(python: str, names: Sequence[str], target: Path | None = None) -> dict[str, str | None]:
    """Distribution versions as the target interpreter sees them (no heavy import)."""
    return {name: version for name, (version, _) in _installed(python, names, target).items()}


def _installed(python: str, names: Sequence[str], target: Path | None) -> dict[str, tuple[str | None, int | None]]:
    proc = subprocess.run(
        [python, "-c", _VERSIONS, *names],
        env=_env(target),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if proc.returncode != 0:
        raise InstallError(f"cannot run {python}: {_reason(proc.stderr, f'exit code {proc.returncode}')}")
    found: dict[str, list[Any]] = json.loads(proc.stdout)
    return {name: (v[0], v[1]) for name, v in found.items()}


def probe_import(python: str = sys.executable, *, target: Path | None = None, timeout: float = PROBE_TIMEOUT) -> Probe:
    """Import torch, then DeepSpeed (``DS_ACCELERATOR=cpu`` when torch sees no GPU), in a fresh interpreter."""
    try:
        proc = subprocess.run(
            [python, "-c", _PROBE],
            env=_env(target),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return Probe(ok=False, error=f"importing deepspeed did not finish within {timeout:g}s")
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(PROBE_MARK):
            data: dict[str, Any] = json.loads(line[len(PROBE_MARK) :])
            return Probe(
                ok="error" not in data,
                python=data.get("python"),
                torch=data.get("torch"),
                deepspeed=data.get("deepspeed"),
                accelerator=data.get("accelerator"),
                cuda=bool(data.get("cuda")),
                error=data.get("error"),
                traceback=data.get("traceback"),
            )
    died = f"exit code {proc.returncode}" if proc.returncode >= 0 else f"killed by signal {-proc.returncode}"
    return Probe(ok=False, error=f"import probe died ({died}): {_reason(proc.stderr, 'no output')}")


def runtime_requirements(wheel: Path) -> list[str]:
    """``Requires-Dist`` of a wheel, without the ones that only an extra asks for."""
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(zf.read(name).decode())
    reqs = []
    for raw in meta.get_all("Requires-Dist") or []:
        req = Requirement(raw)
        if req.marker is not None and "extra" in str(req.marker):
            continue
        reqs.append(str(req))
    return reqs


def _install_requirements(run: _Runner, what: str, requirements: Sequence[str], constraints: Path) -> None:
    """Into the environment; with a target, never *changing* a package the environment already has.

    A target directory serves one release while the environment serves everything else (the developers' venv, other
    releases): what this release needs at another version goes into the target, which shadows it via PYTHONPATH.
    """
    if not requirements:
        return
    if run.target is None:
        run.pip(f"installing {what}", ["install", "-c", str(constraints), *requirements])
        return
    run.target.mkdir(parents=True, exist_ok=True)
    report_path = run.target / ".dsrepro-resolve.json"
    run.pip(f"resolving {what}", ["install", "--dry-run", "--report", str(report_path), "-c", str(constraints),
                                  *requirements])  # fmt: skip
    resolved = [
        (i["metadata"]["name"], i["metadata"]["version"]) for i in json.loads(report_path.read_text())["install"]
    ]
    report_path.unlink()
    present = installed_versions(run.python, [name for name, _ in resolved])
    new = [f"{n}=={v}" for n, v in resolved if present[n] is None]
    changed = [f"{n}=={v}" for n, v in resolved if present[n] is not None]
    if new:
        run.pip(f"installing {what} (new to the environment)", ["install", "--no-deps", "-c", str(constraints), *new])
    if changed:
        run.pip(f"installing {what} (other versions than the environment's) into {run.target}",
                ["install", "--no-deps", "--upgrade", "--target", str(run.target), *changed])  # fmt: skip


def _probe_stamp(
    cache_dir: Path, python: str, target: Path | None, have: Mapping[str, tuple[str | None, int | None]]
) -> Path:
    """Where a successful probe of exactly these installed files (and accelerator choice) is remembered."""
    key = json.dumps([os.path.realpath(python), str(target), sorted(have.items()), os.environ.get("DS_ACCELERATOR")])
    return cache_dir / "probes" / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".json")


def _cached_probe(stamp: Path) -> Probe | None:
    try:
        return Probe(**json.loads(stamp.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _keep_probe(stamp: Path, probe: Probe) -> None:
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.write_text(json.dumps(dataclasses.asdict(probe)))
    except OSError:
        pass  # a cache, nothing more


def _wheelhouse(cache_dir: Path, torch_version: str) -> Path:
    return cache_dir / "wheels" / f"torch-{torch_version}"


def _cached_wheel(directory: Path, version: str) -> Path | None:
    for wheel in sorted(directory.glob("deepspeed-*.whl")):
        if _same_version(wheel.name.split("-")[1], version):
            return wheel
    return None


def build_wheel(version: str, *, python: str, constraints: Path, wheelhouse: Path, run: _Runner | None = None) -> Path:
    """DeepSpeed ``version`` as a wheel built against the torch in ``python``'s environment; cached in ``wheelhouse``.

    One builder at a time per wheelhouse (``tox -p`` builds several releases at once).
    """
    from filelock import FileLock

    run = run or _Runner(python, None, None, echo=False)
    wheelhouse.mkdir(parents=True, exist_ok=True)
    with FileLock(wheelhouse / ".build.lock", timeout=PIP_TIMEOUT):
        cached = _cached_wheel(wheelhouse, version)
        if cached is not None:
            return cached
        run.pip(
            f"building deepspeed {version}",
            ["wheel", "--no-deps", "--no-build-isolation", "-c", str(constraints), "-w", str(wheelhouse),
             f"deepspeed=={version}"],
        )  # fmt: skip
        built = _cached_wheel(wheelhouse, version)
        if built is None:
            raise InstallError(f"building deepspeed {version} produced no wheel in {wheelhouse}")
        return built


def install_deepspeed(
    version: str,
    *,
    python: str = sys.executable,
    constraints: Path,
    target: Path | None = None,
    cache_dir: Path | None = None,
    log: Path | None = None,
    echo: bool = False,
) -> InstallResult:
    """Put DeepSpeed ``version`` into ``python``'s environment (or into ``target``) and prove it imports.

    With ``target``, torch and DeepSpeed's runtime requirements go into ``python``'s environment and only DeepSpeed
    into ``target`` (use it with ``PYTHONPATH=target``): one environment, one directory per release, cheap switches.
    Never raises for a release that cannot be installed: the result has ``ok=False`` and the reason.
    """
    started = time.monotonic()
    cache_dir = cache_dir or default_cache_dir()
    run = _Runner(python, target, log, echo)
    torch_pin = pinned(constraints, "torch")
    wheel: Path | None = None
    torch_version: str | None = None

    def result(ok: bool, action: str, reason: str | None, probe: Probe | None) -> InstallResult:
        return InstallResult(
            version, python, target, ok, action, reason, probe, round(time.monotonic() - started, 2),
            (probe.torch if probe else None) or torch_version, tuple(run.steps), wheel,
        )  # fmt: skip

    try:
        have = _installed(python, ["torch", "deepspeed"], target)
        torch_version = have["torch"][0]
        if _same_version(have["deepspeed"][0], version) and _satisfies(torch_version, torch_pin):
            stamp = _probe_stamp(cache_dir, python, target, have)
            probe = _cached_probe(stamp) or probe_import(python, target=target)
            if probe.ok and _same_version(probe.deepspeed, version):
                _keep_probe(stamp, probe)
                return result(True, "already installed", None, probe)
        run.pip("installing torch and build tools", ["install", "-c", str(constraints), *BUILD_PREREQUISITES])
        torch_version = installed_versions(python, ["torch"])["torch"]
        if not _satisfies(torch_version, torch_pin):
            raise InstallError(f"torch {torch_version} does not satisfy {torch_pin} from {constraints}")
        assert torch_version is not None
        wheel = build_wheel(
            version, python=python, constraints=constraints, wheelhouse=_wheelhouse(cache_dir, torch_version), run=run
        )
        _install_requirements(run, f"deepspeed {version}'s requirements", runtime_requirements(wheel), constraints)
        where = ["--target", str(target), "--upgrade"] if target is not None else ["--force-reinstall"]
        run.pip(f"installing deepspeed {version}", ["install", "--no-deps", *where, str(wheel)])
    except InstallError as exc:
        return result(False, "failed", exc.reason, None)
    probe = probe_import(python, target=target)
    if not probe.ok:
        error = re.sub(r" \((/|[A-Za-z]:\\)[^()]*\)$", "", probe.error or "")  # an ImportError's file path: noise
        return result(False, "failed", f"import failed: {error}", probe)
    if not _same_version(probe.deepspeed, version):
        return result(False, "failed", f"installed {version} but import finds deepspeed {probe.deepspeed}", probe)
    _keep_probe(_probe_stamp(cache_dir, python, target, _installed(python, ["torch", "deepspeed"], target)), probe)
    return result(True, "installed", None, probe)


def unavailable_results(result: InstallResult, constraints: Path | None = None) -> RunRecord:
    """The run record of a release that cannot run here: no tests, and why (``unavailable``)."""
    pin = pinned(constraints, "torch") if constraints is not None else None
    torch = result.torch or (str(pin).lstrip("=") if pin else None)  # not installed: the version it would have been
    here = results.environment(backend=None, world_size=None)  # no world ran: no backend, no size, GPUs unknown
    env = dataclasses.replace(
        here,
        deepspeed=result.version,
        torch=torch,
        python=(result.probe.python if result.probe else None) or here.python,
        gpu_count=None,
    )
    return RunRecord(created=results.now(), environment=env, unavailable=result.reason or "unavailable")


def write_unavailable(directory: Path, result: InstallResult, constraints: Path | None = None) -> Path:
    """Write :func:`unavailable_results` into ``directory`` (``results-deepspeed-<version>-unavailable-*.json``)."""
    return results.write(unavailable_results(result, constraints), directory)


def _version_arg(value: str) -> str:
    try:
        Version(value)
    except InvalidVersion:
        raise argparse.ArgumentTypeError(f"not a release version: {value!r}") from None
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "Install a DeepSpeed release (torch pinned, DS_BUILD_OPS=0, no build isolation) and prove "
    parser.description += "it imports. Exit 0 when usable, 1 when the release cannot run here (the reason is printed "
    parser.description += "and, with --results, written as an 'unavailable' results file), 2 on usage errors."
    parser.add_argument("version", type=_version_arg, help="DeepSpeed release, e.g. 0.16.3")
    parser.add_argument(
        "--python", default=sys.executable, help="interpreter whose environment receives it (default: this one)"
    )
    parser.add_argument(
        "--constraints",
        type=Path,
        default=None,
        help=f"pip constraints pinning torch (default: ${CONSTRAINTS_ENV}, else constraints.txt here or above)",
    )
    parser.add_argument("--target", type=Path, default=None, help="install DeepSpeed alone into DIR (PYTHONPATH use)")
    parser.add_argument("--cache-dir", type=Path, default=None, help=f"wheel cache root (default: ${CACHE_ENV})")
    parser.add_argument("--results", type=Path, default=None, help="on failure, write an 'unavailable' results file")
    parser.add_argument("--log", type=Path, default=None, help="append every command and its output to this file")


def run(args: argparse.Namespace) -> int:
    constraints: Path | None = args.constraints or find_constraints()
    if constraints is None or not constraints.is_file():
        where = constraints or f"${CONSTRAINTS_ENV} or constraints.txt in {Path.cwd()} and its parents"
        print(f"dsrepro install: no constraints file ({where}); refusing to install with torch unpinned",
              file=sys.stderr)  # fmt: skip
        return 2
    result = install_deepspeed(
        args.version,
        python=args.python,
        constraints=constraints,
        target=args.target,
        cache_dir=args.cache_dir,
        log=args.log,
        echo=True,
    )
    if result.ok:
        p = result.probe
        assert p is not None
        print(
            f"dsrepro install: deepspeed {p.deepspeed} {result.action} with torch {p.torch} "
            f"(accelerator {p.accelerator}) in {result.seconds:.1f}s"
        )
        return 0
    torch = result.torch or str(pinned(constraints, "torch") or "?")
    print(f"dsrepro install: deepspeed {args.version} cannot run with torch {torch}: {result.reason}", file=sys.stderr)
    if result.probe is not None and result.probe.traceback:
        print(result.probe.traceback, file=sys.stderr)
    if args.results is not None:
        path = write_unavailable(args.results, result, constraints)
        print(f"dsrepro install: recorded as unavailable in {path}", file=sys.stderr)
    return 1
