"""Settings resolve once: command line > environment > ini > default, each bad value named with its source."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_dsrepro.session.settings import SETTINGS_KEY, resolve


def test_defaults(pytester: pytest.Pytester) -> None:
    config = pytester.parseconfigure()
    s = config.stash[SETTINGS_KEY]
    assert (s.world_size, s.backend, s.timeout, s.results, s.report) == (2, "auto", 300.0, None, None)


def test_precedence(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nds_world_size = 4\nds_timeout = 60\nds_backend = gloo\n")
    config = pytester.parseconfigure("--ds-world-size", "3")
    s = resolve(config, environ={"DSREPRO_TIMEOUT": "30", "DSREPRO_WORLD_SIZE": "5"})
    assert s.world_size == 3  # command line beats environment and ini
    assert s.timeout == 30.0  # environment beats ini
    assert s.backend == "gloo"  # ini beats default


def test_paths(pytester: pytest.Pytester, tmp_path: Path) -> None:
    config = pytester.parseconfigure(f"--ds-results={tmp_path}", "--ds-cache-dir=/x/cache")
    s = config.stash[SETTINGS_KEY]
    assert s.results == tmp_path
    assert s.cache_dir == Path("/x/cache")


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        (
            {"DSREPRO_WORLD_SIZE": "0"},
            "environment variable DSREPRO_WORLD_SIZE: invalid value '0': must be a whole number >= 1",
        ),
        (
            {"DSREPRO_TIMEOUT": "inf"},
            "environment variable DSREPRO_TIMEOUT: invalid value 'inf': must be a number of seconds > 0",
        ),
        (
            {"DSREPRO_BACKEND": "NCCL"},
            "environment variable DSREPRO_BACKEND: invalid value 'NCCL': must be one of auto, gloo, nccl",
        ),
    ],
)
def test_bad_values_name_their_source(pytester: pytest.Pytester, environ: dict[str, str], message: str) -> None:
    config = pytester.parseconfig()
    with pytest.raises(pytest.UsageError, match="^pytest-dsrepro: " + message.replace("(", r"\(")):
        resolve(config, environ=environ)


def test_under_a_launcher_the_default_world_is_the_launchers(pytester: pytest.Pytester) -> None:
    config = pytester.parseconfig()
    torchrun = {"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    assert resolve(config, environ=torchrun).world_size == 4
    assert resolve(config, environ={**torchrun, "DSREPRO_WORLD_SIZE": "2"}).world_size == 2
