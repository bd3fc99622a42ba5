"""The one set of validators behind options and markers, called directly: the same value gets the same words."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pytest_dsrepro.core import options
from pytest_dsrepro.core.errors import MarkerError
from pytest_dsrepro.core.options import OPTIONS, Settings, SettingsError
from pytest_dsrepro.core.worlds import WorldSpec, settle_backend, world_spec

SETTINGS = Settings(2, "auto", 300.0, 1800.0, None, None, Path("/cache"))
OPTION = {opt.name: opt for opt in OPTIONS}


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("world_size", "0", "must be a whole number >= 1"),
        ("world_size", "two", "must be a whole number >= 1"),
        ("world_size", "1.5", "must be a whole number >= 1"),
        ("timeout", "inf", "must be a number of seconds > 0"),
        ("timeout", "nan", "must be a number of seconds > 0"),
        ("timeout", "-1", "must be a number of seconds > 0"),
        ("startup_timeout", "soon", "must be a number of seconds > 0"),
        ("backend", "NCCL", "must be one of auto, gloo, nccl"),
    ],
)
def test_bad_option_text(name: str, text: str, message: str) -> None:
    with pytest.raises(options.OptionError, match=f"^{message}$"):
        OPTION[name].parse(text)


def test_good_option_text() -> None:
    assert OPTION["world_size"].parse("4") == 4
    assert OPTION["timeout"].parse("2.5") == 2.5
    assert OPTION["backend"].parse("nccl") == "nccl"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"size": 0}, "size=0 must be a whole number >= 1"),
        ({"size": "two"}, "size='two' must be a whole number >= 1"),
        ({"size": True}, "size=True must be a whole number >= 1"),
        ({"backend": "mpi"}, "backend='mpi' must be one of auto, gloo, nccl"),
        ({"timeout": -1}, "timeout=-1 must be a number of seconds > 0"),
        ({"timeout": float("inf")}, "timeout=inf must be a number of seconds > 0"),
        ({"typo": 1}, "unexpected argument(s) typo; takes size=, backend=, timeout="),
    ],
)
def test_bad_world_marker_values_get_the_options_words(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(MarkerError, match="^here: " + re.escape(message) + "$"):
        world_spec((), kwargs, SETTINGS, "here")


def test_positional_world_arguments_are_refused() -> None:
    with pytest.raises(MarkerError, match=re.escape("here: unexpected argument(s) 4; takes size=")):
        world_spec((4,), {}, SETTINGS, "here")


def test_world_marker_defaults_come_from_settings() -> None:
    assert world_spec((), {}, SETTINGS, "here") == WorldSpec(2, "auto", 300.0)
    assert world_spec((), {"size": 3, "backend": None, "timeout": 5}, SETTINGS, "here") == WorldSpec(3, "auto", 5.0)


@pytest.mark.parametrize(
    ("requested", "size", "devices", "expected"),
    [
        ("auto", 2, 0, ("gloo", None)),
        ("auto", 2, 1, ("gloo", None)),
        ("auto", 2, 2, ("nccl", None)),
        ("gloo", 2, 8, ("gloo", None)),
        ("nccl", 2, 8, ("nccl", None)),
        ("nccl", 4, 1, ("nccl", "NCCL needs 4 CUDA devices for a 4-rank world; found 1")),
    ],
)
def test_backend_settles_on_the_devices(
    requested: str, size: int, devices: int, expected: tuple[str, str | None]
) -> None:
    assert settle_backend(requested, size, devices) == expected


def test_resolution_takes_the_first_source_with_a_value() -> None:
    first = {"world_size": ("3", "--ds-world-size")}
    sources: list[options.Source] = [
        lambda opt: first.get(opt.name, (None, "cli")),
        options.environment_source({"DSREPRO_WORLD_SIZE": "5", "DSREPRO_TIMEOUT": "7"}),
    ]
    s = options.resolve(sources, environ={})
    assert (s.world_size, s.timeout, s.backend) == (3, 7.0, "auto")


def test_resolution_names_the_source_of_a_bad_value() -> None:
    with pytest.raises(SettingsError, match=r"^pytest-dsrepro: environment variable DSREPRO_TIMEOUT: invalid value "):
        options.resolve([options.environment_source({"DSREPRO_TIMEOUT": "0"})], environ={})


def test_cache_dir_resolution_is_one_rule() -> None:
    assert options.default_cache_dir({"DSREPRO_CACHE_DIR": "/a"}) == Path("/a")
    assert options.default_cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/pytest-dsrepro")
    assert options.default_cache_dir({}) == Path.home() / ".cache" / "pytest-dsrepro"


def test_a_launcher_is_recognised_by_all_its_variables() -> None:
    torchrun = {"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    assert options.launched(torchrun) == options.Launched(rank=1, world_size=4, local_rank=0)
    assert options.launched({**torchrun, "MASTER_PORT": ""}) is None
