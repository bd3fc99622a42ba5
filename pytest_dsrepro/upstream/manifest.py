"""``-p pytest_dsrepro.upstream.manifest --ds-shard-manifest DIR``: this pytest run writes its shard's manifest
(``core.shard_manifests``) into DIR once its tests are collected, and again with pytest's exit status when it ends, so
that the merge of K shards names one that died. The results files DIR already holds then are named in it as an
earlier run's: a shard re-run into its directory and killed is dead, not complete with the outcomes of the run
before. ``dsrepro upstream --shard I/N`` loads it; the shard is ``--ds-shard``'s
(1/1 without it)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ..core import shard_manifests, versions
from ..core.options import shard

MANIFEST_KEY = pytest.StashKey[shard_manifests.Manifest]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("dsrepro").addoption(
        "--ds-shard-manifest",
        dest="ds_shard_manifest",
        metavar="DIR",
        type=Path,
        default=None,
        help="write this shard's manifest (which shard of how many, its planned tests, pytest's exit status) into "
        "DIR, for the merge of a sharded run (dsrepro upstream --merge)",
    )


def pytest_collection_finish(session: pytest.Session) -> None:
    directory: Path | None = session.config.getoption("ds_shard_manifest")
    if directory is None or session.config.option.collectonly:
        return
    given = session.config.getoption("ds_shard", None)
    index, count = shard(given) if given else (1, 1)
    planned = tuple(item.nodeid for item in session.items)
    earlier = shard_manifests.results_in(directory)
    manifest = shard_manifests.Manifest(index, count, versions.installed_text("deepspeed"), planned, earlier=earlier)
    session.config.stash[MANIFEST_KEY] = manifest
    shard_manifests.write(manifest, directory)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    manifest = session.config.stash.get(MANIFEST_KEY, None)
    directory: Path | None = session.config.getoption("ds_shard_manifest")
    if manifest is not None and directory is not None:
        ended = dataclasses.replace(manifest, exitstatus=int(exitstatus))
        shard_manifests.write(ended, directory)
