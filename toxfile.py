"""tox's view of releases.txt: one environment per DeepSpeed release listed there, so adding one is one line.

Every release environment, and ``catalogue``, inherits ``[testenv]`` of tox.ini (the catalogue) and gets its
``DS_VERSION`` here; ``catalogue`` and the other environments get the newest listed release.
"""

from __future__ import annotations

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
