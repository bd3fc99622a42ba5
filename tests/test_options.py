"""The one set of validators behind options and markers, called directly: the same value gets the same words."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pytest_dsrepro.core import options
from pytest_dsrepro.core.errors import MarkerError
from pytest_dsrepro.core.options import OPTIONS, Settings, SettingsError
from pytest_dsrepro.core.world_spec import WorldSpec, ds_accelerator, settle_backend, size_id, world_sizes, world_spec

SETTINGS = Settings(2, "auto", 300.0, 1800.0, None, None, Path("/cache"), max_world_size=16)
LIMIT_WORDS = (
    "must be at most 16, the largest world pytest-dsrepro forks on this machine (--ds-max-world-size; default 8 "
    "ranks per CPU core, one per 256 MiB of memory); raise it with --ds-max-world-size=N, DSREPRO_MAX_WORLD_SIZE=N "
    "or the ini option ds_max_world_size"
)
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
        (
            {"typo": 1},
            "unexpected argument(s) typo; takes size=, backend=, timeout=, reuse=, process_group=, launcher_env=",
        ),
        ({"reuse": "yes"}, "reuse='yes' must be True or False"),
        ({"size": 100000}, "size=100000 " + LIMIT_WORDS),
        ({"process_group": "no"}, "process_group='no' must be True or False"),
        ({"launcher_env": 0}, "launcher_env=0 must be True or False"),
        ({"reuse": 1}, "reuse=1 must be True or False"),
        (
            {"size": [1, 2]},
            "size=[1, 2] makes one test per size when pytest collects the test; this marker was added after collection, so give it one size",
        ),
    ],
)
def test_bad_world_marker_values_get_the_options_words(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(MarkerError, match="^here: " + re.escape(message) + "$"):
        world_spec((), kwargs, SETTINGS, "here")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([], "size=[] names no world size; give one size or a list of them"),
        ([1, 0], "size=[1, 0]: each size must be a whole number >= 1"),
        ([2, 2], "size=[2, 2] names a size twice"),
        ([1, 100000], "size=[1, 100000]: each size " + LIMIT_WORDS),
    ],
)
def test_bad_lists_of_world_sizes_name_the_marker(value: list[int], message: str) -> None:
    with pytest.raises(MarkerError, match="^here: " + re.escape(message) + "$"):
        world_sizes(value, SETTINGS.max_world_size, "here")


def test_a_list_of_world_sizes_and_their_ids() -> None:
    assert world_sizes((1, 2, 4), None, "here") == (1, 2, 4)
    assert world_sizes(2, None, "here") is None
    assert [size_id(n) for n in (1, 2)] == ["1rank", "2ranks"]


def test_world_flags_default_to_a_world_as_torchrun_makes_it() -> None:
    spec = world_spec((), {}, SETTINGS, "here")
    assert (spec.process_group, spec.launcher_env, spec.reuse) == (True, True, False)
    spec = world_spec((), {"process_group": False, "launcher_env": False, "reuse": True}, SETTINGS, "here")
    assert (spec.process_group, spec.launcher_env, spec.reuse) == (False, False, True)


def test_positional_world_arguments_are_refused() -> None:
    with pytest.raises(MarkerError, match=re.escape("here: unexpected argument(s) 4; takes size=")):
        world_spec((4,), {}, SETTINGS, "here")


def test_world_marker_defaults_come_from_settings() -> None:
    assert world_spec((), {}, SETTINGS, "here") == WorldSpec(2, "auto", 300.0)
    assert world_spec((), {"size": 3, "backend": None, "timeout": 5}, SETTINGS, "here") == WorldSpec(3, "auto", 5.0)
    assert world_spec((), {"reuse": True}, SETTINGS, "here") == WorldSpec(2, "auto", 300.0, reuse=True)


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


def test_the_machine_limit_counts_cores_and_memory() -> None:
    assert options.machine_world_limit(cores=2, memory=24 * 2**30) == 16  # 8 per core
    assert options.machine_world_limit(cores=128, memory=64 * 2**30) == 256  # one per 256 MiB
    assert options.machine_world_limit(cores=1, memory=2**20) == 2  # never below a 2-rank world
    assert options.machine_world_limit(cores=4, memory=0) == 32  # memory unknown: the cores alone


def test_a_world_above_the_limit_is_refused_naming_option_limit_and_how_to_raise_it() -> None:
    """Issue 11, item 7: refused at start-up, before anything forks; the same words for the option and the marker."""
    too_big = [options.environment_source({"DSREPRO_WORLD_SIZE": "100000", "DSREPRO_MAX_WORLD_SIZE": "16"})]
    with pytest.raises(SettingsError) as refused:
        options.resolve(too_big, environ={})
    assert str(refused.value) == (
        f"pytest-dsrepro: environment variable DSREPRO_WORLD_SIZE: invalid value '100000': {LIMIT_WORDS}"
    )
    raised = options.resolve(
        [options.environment_source({"DSREPRO_WORLD_SIZE": "100", "DSREPRO_MAX_WORLD_SIZE": "128"})], environ={}
    )
    assert (raised.world_size, raised.max_world_size) == (100, 128)
    assert options.resolve([], environ={}).max_world_size == options.machine_world_limit()


def test_under_a_launcher_no_limit_applies() -> None:
    """Nothing is forked: the launcher's world, however big, is the world."""
    torchrun = {"RANK": "0", "WORLD_SIZE": "4096", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    s = options.resolve([], environ=torchrun)
    assert (s.world_size, s.max_world_size) == (4096, None)
    assert world_spec((), {"size": 4096}, s, "here").size == 4096


def test_deepspeed_gets_the_cpu_accelerator_only_where_nobody_chose_and_no_gpu_is_there() -> None:
    assert ds_accelerator({}, cuda_devices=0) == "cpu"
    assert ds_accelerator({}, cuda_devices=2) is None  # DeepSpeed detects CUDA itself
    assert ds_accelerator({"DS_ACCELERATOR": "xpu"}, cuda_devices=0) == "xpu"
