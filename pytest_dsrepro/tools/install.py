"""The one recipe for putting a DeepSpeed release into a Python environment (``dsrepro install``).

Used by tox (``commands_pre``), by ``dsrepro bisect`` and by the benchmarks. Every environment is made and filled
by ``uv`` (its shared cache makes a warm install a hard-link away); the recipe's rules, each learnt the hard way, are
``_Build``'s. A release that cannot be installed or imported is not an error of this tool but a fact about the
release: the result says why (``InstallResult.reason``), and ``dsrepro matrix`` shows it rather than dropping it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from ..core import results
from ..core.options import default_cache_dir
from ..core.results import RunRecord
from . import processes

__all__ = [
    "CONSTRAINTS_ENV",
    "ImportProbe",
    "InstallError",
    "InstallResult",
    "NoSuchRelease",
    "add_this_plugin",
    "environment_python",
    "extras_installed_here",
    "find_constraints",
    "install_deepspeed",
    "pinned",
    "probe_import",
    "unavailable_results",
    "uv_binary",
    "write_unavailable",
]

#: Where the constraints file comes from when none is given: this variable, else ``./constraints.txt``.
CONSTRAINTS_ENV = "DSREPRO_CONSTRAINTS"
#: What DeepSpeed's setup.py needs in the environment when built without isolation.
BUILD_PREREQUISITES = ("torch", "setuptools", "wheel")
BUILD_ENV = {"DS_BUILD_OPS": "0"}
PROBE_MARK = "DSREPRO-PROBE "
INSTALL_TIMEOUT = 1800.0  # building an sdist on a loaded 2-core machine takes minutes; never forever
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


class NoSuchRelease(InstallError):
    """The package index has no such DeepSpeed release (a typo, most likely): nothing about a release to record."""


@dataclass(frozen=True)
class ImportProbe:
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
    ok: bool
    action: str  # "installed", "already installed" or "failed"
    reason: str | None
    probe: ImportProbe | None
    seconds: float
    torch: str | None = None  # the torch in the environment, when it got that far
    steps: tuple[str, ...] = field(default=())


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
    except ValueError:  # InvalidVersion, or a part of 4300 digits or more (int())
        return False


def _same_version(a: str | None, b: str) -> bool:
    try:
        return a is not None and Version(a) == Version(b)
    except ValueError:  # InvalidVersion, or a part of 4300 digits or more (int())
        return a == b


def uv_binary() -> str:
    """uv from its PyPI package (a dependency of this one), else from ``PATH``."""
    try:
        from uv import find_uv_bin

        return str(find_uv_bin())
    except (ImportError, FileNotFoundError):
        pass
    found = shutil.which("uv")
    if found is None:
        raise InstallError("uv is not installed (pip install uv)")
    return found


def _env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of every install and probe: no ops built, and pip's find-links passed on to uv."""
    env = dict(os.environ)
    env.update(BUILD_ENV)
    if "UV_FIND_LINKS" not in env and env.get("PIP_FIND_LINKS"):
        env["UV_FIND_LINKS"] = ",".join(env["PIP_FIND_LINKS"].split())
    env.update(extra or {})
    return env


def _reason(output: str, fallback: str) -> str:
    """The line of a failed command's output that says what went wrong (uv's ``cause:`` line first)."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    causes = [ln.removeprefix("cause:").strip() for ln in lines if ln.startswith("cause:")]
    if causes:
        return causes[-1]
    exception = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception|Exit)\b.*:", ln)]
    if exception:
        return exception[-1]
    errors = [ln.removeprefix("ERROR:").removeprefix("error:").strip() for ln in lines
              if ln.startswith(("ERROR:", "error:"))]  # fmt: skip
    if errors:
        return errors[0]
    return lines[-1] if lines else fallback


class _Runner:
    """Runs the recipe's uv commands, keeps their transcript, and turns a failure into an :class:`InstallError`.
    ``extra``: variables the commands get besides the recipe's own (a source build's ``DS_BUILD_STRING``)."""

    def __init__(self, python: str, log: Path | None, echo: bool, extra: Mapping[str, str] | None = None) -> None:
        self.python = python
        self.log = log
        self.echo = echo
        self.extra = dict(extra or {})
        self.steps: list[str] = []

    def __call__(self, what: str, args: Sequence[str], timeout: float = INSTALL_TIMEOUT) -> str:
        cmd = [uv_binary(), *args]
        self.steps.append(" ".join(cmd))
        if self.echo:
            print(f"dsrepro install: {what}: {' '.join(cmd)}", file=sys.stderr, flush=True)
        done = processes.run(cmd, env=_env(self.extra), timeout=timeout)  # Ctrl-C: uv and its build stop too
        self._keep(cmd, done.output)
        if done.timed_out:
            raise InstallError(f"{what} timed out after {timeout:g}s", done.output)
        if done.returncode != 0:
            raise InstallError(f"{what} failed: {_reason(done.output, f'exit code {done.returncode}')}", done.output)
        return done.output

    def install(self, what: str, args: Sequence[str]) -> str:
        return self(what, ["pip", "install", "--python", self.python, *args])

    def _keep(self, cmd: Sequence[str], output: str) -> None:
        if self.log is not None:
            self.log.parent.mkdir(parents=True, exist_ok=True)
            with self.log.open("a") as fh:
                fh.write(f"$ {' '.join(cmd)}\n{output}\n")


def environment_python(directory: Path, python: str = sys.executable) -> str:
    """The interpreter of the virtual environment at ``directory``, made with uv (for ``python``'s version) unless
    it is there already."""
    interpreter = directory / "bin" / "python"
    if not interpreter.exists():
        _Runner(python, None, echo=False)("creating an environment", ["venv", "-q", "--python", python, str(directory)])
    return str(interpreter)


PLUGIN = "pytest-dsrepro"
_PURELIB = "import sysconfig; print(sysconfig.get_paths()['purelib'])"


def add_this_plugin(python: str, constraints: Path, log: Path | None = None, extra: Sequence[str] = ()) -> None:
    """Make this plugin, as it is installed here, run in ``python``'s environment too: pytest and every pytest plugin
    at the versions here, the plugin's own requirements, ``extra`` (what a repro needs beyond them), and a copy of the
    plugin's code and metadata (entry point included) in a directory of its own on that environment's path. Nothing
    else of this environment, DeepSpeed least of all.
    """
    try:
        dist = metadata.distribution(PLUGIN)
    except metadata.PackageNotFoundError:
        raise InstallError(f"{PLUGIN} is not installed here (pip install -e . in its checkout)") from None
    needs = [*_without_extras(dist.requires or []), *extras_installed_here(dist.requires or [])]
    plugins = {
        f"{ep.dist.name}=={ep.dist.version}" for ep in metadata.entry_points(group="pytest11")
        if ep.dist is not None and canonicalize_name(ep.dist.name) != PLUGIN
    }  # fmt: skip
    run = _Runner(python, log, echo=False)
    run.install("installing pytest and its plugins", ["-c", str(constraints), f"pytest=={metadata.version('pytest')}",
                                                       *needs, *sorted(plugins), *extra])  # fmt: skip
    site = Path(subprocess.run([python, "-c", _PURELIB], capture_output=True, text=True, check=True).stdout.strip())
    overlay = site.parent / "dsrepro-plugin"
    shutil.rmtree(overlay, ignore_errors=True)
    info = overlay / f"{dist.name.replace('-', '_')}-{dist.version}.dist-info"
    info.mkdir(parents=True)
    for name in ("METADATA", "entry_points.txt"):
        (info / name).write_text(dist.read_text(name) or "")
    shutil.copytree(Path(__file__).resolve().parents[1], overlay / "pytest_dsrepro",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    (site / "dsrepro-plugin.pth").write_text(f"{overlay}\n")


def _without_extras(requires: Sequence[str]) -> list[str]:
    """A distribution's requirements, those of its extras left out."""
    return [r for r in requires if "extra" not in str(Requirement(r).marker or "")]


def extras_installed_here(requires: Sequence[str]) -> list[str]:
    """The extras' requirements that this environment has, pinned at its versions (``transformers==5.1.0``): an
    environment made for a scan, a bisect or upstream tests runs what the plugin here runs (the ``hf`` repros
    included), not less."""
    pins = []
    for text in requires:
        requirement = Requirement(text)
        if "extra" not in str(requirement.marker or ""):
            continue
        try:
            pins.append(f"{requirement.name}=={metadata.version(requirement.name)}")
        except metadata.PackageNotFoundError:
            continue
    return sorted(set(pins))


_REQUIRES = "import json, sys; from importlib import metadata; print(json.dumps(metadata.requires(sys.argv[1]) or []))"


def requirements(python: str, name: str) -> list[str]:
    """What the distribution ``name`` installed in ``python``'s environment requires (its extras' left out)."""
    proc = subprocess.run([python, "-c", _REQUIRES, name], env=_env(), capture_output=True, text=True, timeout=120,
                          check=False)  # fmt: skip
    if proc.returncode != 0:
        raise InstallError(
            f"cannot read the requirements of {name}: {_reason(proc.stderr, f'exit code {proc.returncode}')}"
        )
    return _without_extras(json.loads(proc.stdout))


def installed_versions(python: str, names: Sequence[str]) -> dict[str, str | None]:
    """Distribution versions as the target interpreter sees them (no heavy import)."""
    return {name: version for name, (version, _) in _installed(python, names).items()}


def _installed(python: str, names: Sequence[str]) -> dict[str, tuple[str | None, int | None]]:
    proc = subprocess.run(
        [python, "-c", _VERSIONS, *names],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if proc.returncode != 0:
        raise InstallError(f"cannot run {python}: {_reason(proc.stderr, f'exit code {proc.returncode}')}")
    found: dict[str, list[Any]] = json.loads(proc.stdout)
    return {name: (v[0], v[1]) for name, v in found.items()}


def probe_import(python: str = sys.executable, *, timeout: float = PROBE_TIMEOUT) -> ImportProbe:
    """Import torch, then DeepSpeed (``DS_ACCELERATOR=cpu`` when torch sees no GPU), in a fresh interpreter."""
    try:
        proc = subprocess.run(
            [python, "-c", _PROBE],
            env=_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return ImportProbe(ok=False, error=f"importing deepspeed did not finish within {timeout:g}s")
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(PROBE_MARK):
            data: dict[str, Any] = json.loads(line[len(PROBE_MARK) :])
            return ImportProbe(
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
    return ImportProbe(ok=False, error=f"import probe died ({died}): {_reason(proc.stderr, 'no output')}")


def _probe_stamp(cache_dir: Path, python: str, have: Mapping[str, tuple[str | None, int | None]]) -> Path:
    """Where a successful probe of exactly these installed files (and accelerator choice) is remembered."""
    key = json.dumps([os.path.realpath(python), os.environ.get("PYTHONPATH"), sorted(have.items()),
                      os.environ.get("DS_ACCELERATOR")])  # fmt: skip
    return cache_dir / "probes" / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".json")


def _cached_probe(stamp: Path) -> ImportProbe | None:
    try:
        return ImportProbe(**json.loads(stamp.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _keep_probe(stamp: Path, probe: ImportProbe) -> None:
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.write_text(json.dumps(dataclasses.asdict(probe)))
    except OSError:
        pass  # a cache, nothing more


def _look_up(run: _Runner, version: str) -> None:
    """Is there such a release on the index? Asked first (a dry run: no download, no build), so that a typo installs
    nothing and is never recorded as a release that cannot run."""
    try:
        run.install(f"looking up deepspeed {version}", ["--dry-run", "--no-deps", f"deepspeed=={version}"])
    except InstallError as exc:
        if "there is no version of deepspeed" in exc.output:
            raise NoSuchRelease(f"the package index has no deepspeed {version} ({exc.reason})", exc.output) from None
        raise


def install_deepspeed(
    version: str,
    *,
    python: str = sys.executable,
    constraints: Path,
    cache_dir: Path | None = None,
    log: Path | None = None,
    echo: bool = False,
) -> InstallResult:
    """Put DeepSpeed ``version`` into ``python``'s environment and prove it imports.

    Never raises for a release that cannot be installed: the result has ``ok=False`` and the reason. Raises
    ``NoSuchRelease`` for a version the package index does not have.
    """
    cache_dir = cache_dir or default_cache_dir()
    build = _Build(version, python, constraints, _Runner(python, log, echo))
    try:
        have = _installed(python, ["torch", "deepspeed"])
        build.torch = have["torch"][0]
        if _same_version(have["deepspeed"][0], version) and _satisfies(build.torch, build.torch_pin):
            stamp = _probe_stamp(cache_dir, python, have)
            probe = _cached_probe(stamp) or probe_import(python)
            if probe.ok and _same_version(probe.deepspeed, version):
                _keep_probe(stamp, probe)
                return build.result(True, "already installed", None, probe)
        _look_up(build.run, version)
    except InstallError as exc:
        if isinstance(exc, NoSuchRelease):
            raise
        return build.result(False, "failed", exc.reason, None)

    def deepspeed() -> None:
        build.run.install(f"installing deepspeed {version}",
                          ["-c", str(constraints), "--no-build-isolation", f"deepspeed=={version}"])  # fmt: skip

    result = build.installed(deepspeed, lambda found: _same_version(found, version))
    if result.probe is not None and result.ok:
        _keep_probe(_probe_stamp(cache_dir, python, _installed(python, ["torch", "deepspeed"])), result.probe)
    return result


def install_source(
    source: Path,
    build_string: str,
    *,
    python: str = sys.executable,
    constraints: Path,
    log: Path | None = None,
    name: str | None = None,
) -> InstallResult:
    """Put DeepSpeed built from a source tree (one commit of a clone: ``dsrepro bisect --repo``) into ``python``'s
    environment by the same recipe, and prove it imports. ``build_string`` is DeepSpeed's ``DS_BUILD_STRING``,
    appended to its ``version.txt`` (``+029e0a3``): the installed version names the commit even where the tree has
    no ``.git`` to ask. ``name`` says which tree in messages. Never raises for a tree that cannot be built or
    imported: ``ok=False`` and the reason.

    The commit's own wheel is built into a uv cache of its own beside ``source``, removed right after: no later
    install can use it, so it never enters uv's shared cache, and the environment alone holds its files (removing
    the environment frees them). Its requirements come from the shared cache, under the pin.
    """
    run = _Runner(python, log, echo=False, extra={BUILD_STRING: build_string})
    build = _Build(name or str(source), python, constraints, run)

    def deepspeed() -> None:
        with tempfile.TemporaryDirectory(prefix="uv-cache-", dir=source.parent) as own:
            run.install(f"installing deepspeed {build.what}",
                        ["--cache-dir", own, "--no-build-isolation", "--no-deps", str(source)])  # fmt: skip
        needs = requirements(python, "deepspeed")
        if needs:
            run.install(f"installing the requirements of deepspeed {build.what}", ["-c", str(constraints), *needs])

    return build.installed(deepspeed, lambda found: found is not None and found.endswith(build_string))


#: DeepSpeed's setup.py appends this variable to version.txt (and skips asking git for a hash).
BUILD_STRING = "DS_BUILD_STRING"


@dataclass
class _Build:
    """One install by the recipe: torch and the build tools under the pin, DeepSpeed without build isolation, then
    the import proved. ``what`` names it in results (a release, or a source tree). The rules:

    * torch is pinned through the repository's ``constraints.txt`` (``-c``) on every install: an unpinned torch pulls
      a multi-GB CUDA build, and a DeepSpeed requirement of plain ``torch`` would otherwise upgrade it. uv does not
      read pip's configuration, so pip's ``find-links`` (where a local CPU build of torch may lie) is passed on to it.
    * DeepSpeed ships sdists only; its ``setup.py`` imports torch, so it is built ``--no-build-isolation`` in an
      environment that already holds torch (and setuptools/wheel), with ``DS_BUILD_OPS=0`` (ops are JIT-built on
      first use by the plugin, once per distinct source). uv keeps the built wheel in its cache: a release is built
      once.
    * Installed is not usable: the result is proved by importing DeepSpeed in the target interpreter, with
      ``DS_ACCELERATOR=cpu`` when torch sees no GPU (releases <= 0.14.0 fail exactly there on CPU).
    """

    what: str
    python: str
    constraints: Path
    run: _Runner
    torch: str | None = None
    started: float = field(default_factory=time.monotonic)

    @property
    def torch_pin(self) -> SpecifierSet | None:
        return pinned(self.constraints, "torch")

    def result(self, ok: bool, action: str, reason: str | None, probe: ImportProbe | None) -> InstallResult:
        return InstallResult(
            self.what, self.python, ok, action, reason, probe, round(time.monotonic() - self.started, 2),
            (probe.torch if probe else None) or self.torch, tuple(self.run.steps),
        )  # fmt: skip

    def installed(self, deepspeed: Callable[[], None], accept: Callable[[str | None], bool]) -> InstallResult:
        """Torch and the build tools, then ``deepspeed`` (the step that installs it), then the import proved;
        ``accept``: is the version the import finds the one this install made?"""
        try:
            self.run.install("installing torch and build tools", ["-c", str(self.constraints), *BUILD_PREREQUISITES])
            self.torch = installed_versions(self.python, ["torch"])["torch"]
            if not _satisfies(self.torch, self.torch_pin):
                raise InstallError(f"torch {self.torch} does not satisfy {self.torch_pin} from {self.constraints}")
            deepspeed()
        except InstallError as exc:
            return self.result(False, "failed", exc.reason, None)
        probe = probe_import(self.python)
        if not probe.ok:
            error = re.sub(r" \((/|[A-Za-z]:\\)[^()]*\)$", "", probe.error or "")  # an ImportError's file path: noise
            return self.result(False, "failed", f"import failed: {error}", probe)
        if not accept(probe.deepspeed):
            return self.result(
                False, "failed", f"installed {self.what} but import finds deepspeed {probe.deepspeed}", probe
            )
        return self.result(True, "installed", None, probe)


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
    """Write :func:`unavailable_results` into ``directory`` (``results-deepspeed-<version>-unavailable-*.json``):
    a results file like every other (through ``core.results``), so that ``dsrepro matrix`` shows the release as a
    column "cannot run with torch X: <reason>" instead of dropping it."""
    return results.write(unavailable_results(result, constraints), directory)
