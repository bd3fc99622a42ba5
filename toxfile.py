"""tox's view of releases.txt: one environment per DeepSpeed release listed there, so adding one is one line.

Every release environment, and ``catalogue``, inherits ``[testenv]`` of tox.ini (the catalogue) and gets its
``DS_VERSION`` here; ``catalogue`` and the other environments get the newest listed release.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tox.config.sets import EnvConfigSet
from tox.plugin import impl
from tox.session.state import State

RELEASES = [
    line.split("#", 1)[0].strip()
    for line in (Path(__file__).parent / "releases.txt").read_text().splitlines()
    if line.split("#", 1)[0].strip()
]
ENVS = {"ds" + version.replace(".", ""): version for version in RELEASES}


@impl
def tox_extend_envs() -> list[str]:
    return ["catalogue", *ENVS]


@impl
def tox_add_env_config(env_conf: EnvConfigSet, state: State) -> None:
    env_conf["set_env"].update({"DS_VERSION": ENVS.get(env_conf.name, RELEASES[-1])})
    if env_conf.name == ".pkg":
        _stale_build_gone()


def _stale_build_gone() -> None:
    """setuptools builds the wheel through build/lib in the checkout and never empties it, so a file moved or removed
    since the last build (a repro moved into its subsystem's folder) would still be in the next wheel: an installed
    catalogue with two repros of one file name, which its conftest refuses. The package is built afresh each time."""
    shutil.rmtree(Path(__file__).parent / "build" / "lib", ignore_errors=True)
