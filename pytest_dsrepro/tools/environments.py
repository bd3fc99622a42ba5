"""One uv environment per DeepSpeed release, kept in the cache and reused: what ``dsrepro bisect``, ``scan --release``,
``triage --confirm``, ``upstream --release`` (and so ``atlas``) and the benchmarks run a release in. Each holds torch
(pinned, never moved), the release as ``dsrepro install`` puts it there, and this plugin as installed here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock
from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import Version

from ..core import versions
from ..core.options import default_cache_dir
from . import install

#: Packages a release environment gets besides the plugin's (a repro's own needs, e.g. ``huggingface_hub``):
#: requirement specifiers separated by spaces or commas; ``dsrepro scan --with`` sets it.
EXTRA_PACKAGES_ENV = "DSREPRO_EXTRA_PACKAGES"


class EnvironmentUnavailable(Exception):
    """A release's environment could not be made (no such release, a failed build or import): the reason, one line."""


def requirement(text: str, given: str) -> str:
    """``text`` where it is a requirement (PEP 508: a name, extras, versions, a marker, ``name @ URL``); else
    ``EnvironmentUnavailable`` naming it and where it was ``given``, before any environment is made: it reaches uv as
    an argument, where ``--index-url ...`` or ``-e PATH`` would be an option, not a package."""
    try:
        Requirement(text)
    except InvalidRequirement as exc:
        raise EnvironmentUnavailable(
            f"{given}: {text!r} is not a package requirement ({exc}); give requirements such as huggingface_hub or "
            "einops==0.8.0, never uv's options"
        ) from None
    return text


def extra_packages(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The requirements ``$DSREPRO_EXTRA_PACKAGES`` asks every release environment to hold, each checked
    (``requirement``)."""
    given = environ.get(EXTRA_PACKAGES_ENV, "").replace(",", " ").split()
    return [requirement(text, f"${EXTRA_PACKAGES_ENV}") for text in given]


@dataclass(frozen=True)
class ReleaseEnv:
    """An environment that holds one release (or commit): its interpreter, and the variables to run it with."""

    python: str
    environ: Mapping[str, str]
    deepspeed: str | None = None  # the version its DeepSpeed reports, where not the release asked for (a commit's)


def activated(directory: Path, environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with the environment at ``directory`` activated, as ``activate`` does it: ``VIRTUAL_ENV``, and its
    ``bin`` first on ``PATH`` (DeepSpeed's launcher tests run the release's own ``deepspeed`` script)."""
    path = os.pathsep.join([str(directory / "bin"), *filter(None, [environ.get("PATH")])])
    return {**environ, "VIRTUAL_ENV": str(directory), "PATH": path}


def probe_environ(directory: Path) -> dict[str, str]:
    """The variables a probe's pytest runs with in the environment at ``directory`` (``activated``)."""
    environ = activated(directory, os.environ)
    environ.setdefault("DS_ACCELERATOR", "cpu")
    return environ


def installed_package(env: ReleaseEnv, name: str = "deepspeed") -> Path:
    """The directory of the package ``name`` in the environment, found without importing it."""
    find = f"import importlib.util as u; print(u.find_spec({name!r}).submodule_search_locations[0])"
    proc = subprocess.run([env.python, "-c", find], env=dict(env.environ), cwd="/", capture_output=True, text=True)
    if proc.returncode != 0:
        raise EnvironmentUnavailable(f"{name} is not installed in {env.python}: {proc.stderr.strip()[-200:]}")
    return Path(proc.stdout.strip())


def build_key() -> str:
    """What a DeepSpeed build depends on besides its source: ``py311-torch-2.13.0+cpu``."""
    return f"py{sys.version_info.major}{sys.version_info.minor}-torch-{versions.installed_text('torch') or 'none'}"


def environment_dir(cache_dir: Path, version: Version) -> Path:
    """Where one release's environment lives: per DeepSpeed release, Python and torch (a build depends on all)."""
    return cache_dir / "envs" / f"deepspeed-{version}-{build_key()}"


def torch_pin(cache_dir: Path) -> Path:
    """A constraints file pinning the torch installed here: bisect must never move torch."""
    torch = versions.installed_text("torch")
    if torch is None:
        raise EnvironmentUnavailable("torch is not installed in this environment; install the torch to test with first")
    path = cache_dir / "envs" / f"constraints-torch-{torch}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"torch=={torch}\n")
    return path


def release_environment(
    cache_dir: Path | None = None,
    constraints: Path | None = None,
    python: str = sys.executable,
    log_dir: Path | None = None,
    extra: Sequence[str] | None = None,
) -> Callable[[Version], ReleaseEnv]:
    """The ``prepare`` step of a ``Prober``: one uv environment per release, kept in the cache and reused, holding
    torch (pinned), that release (``install.install_deepspeed``), this plugin as installed here
    (``install.add_this_plugin``) and ``extra`` (by default ``extra_packages``) under the same pins. A ``filelock``
    per environment: two bisects (or a bisect and a benchmark) never fill one at once. ``constraints`` defaults to
    ``$DSREPRO_CONSTRAINTS`` or ``constraints.txt`` here or above, else to a pin of the torch installed here. A
    package that is not a requirement is ``EnvironmentUnavailable`` at once, before any environment is made.
    """
    wanted = extra_packages() if extra is None else [requirement(text, "extra packages") for text in extra]
    root = cache_dir or default_cache_dir()
    pins = constraints or install.find_constraints() or torch_pin(root)

    def prepare(version: Version) -> ReleaseEnv:
        directory = environment_dir(root, version)
        directory.parent.mkdir(parents=True, exist_ok=True)
        log = log_dir / f"install-deepspeed-{version}.log" if log_dir else None
        with FileLock(str(directory) + ".lock", timeout=install.INSTALL_TIMEOUT):
            try:
                env_python = install.environment_python(directory, python)
                install.add_this_plugin(env_python, pins, log, wanted)
            except install.InstallError as exc:
                raise EnvironmentUnavailable(exc.reason) from None
            result = install.install_deepspeed(
                str(version), python=env_python, constraints=pins, cache_dir=root, log=log
            )
        if not result.ok:
            raise EnvironmentUnavailable(result.reason or "unavailable")
        return ReleaseEnv(env_python, probe_environ(directory))

    return prepare


def prepared(prepare: Callable[[Version], ReleaseEnv], release: str, command: str) -> ReleaseEnv:
    """``prepare``'s environment for ``release``, said first on stderr (a release new here is built: minutes)."""
    print(f"dsrepro {command}: deepspeed {release}: preparing its environment ...", file=sys.stderr, flush=True)
    return prepare(Version(release))
