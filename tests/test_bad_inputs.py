"""Every bad input is one line: on each command and option that takes a path or a number, a FIFO, a directory, a
symbolic link loop, JSON nested thousands deep, a number of 5000 digits, ``Infinity`` and ``NaN``, an old or foreign
results file are refused naming the file and what is wrong (the ``dsrepro`` commands exit 2, pytest's usage errors 4;
the matrix lists a results file it cannot read and exits 4, as for any damaged file), never a traceback or a wait."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_dsrepro.core import ds_defaults, json_input, paths
from pytest_dsrepro.core.ds_defaults import ReleaseReading
from pytest_dsrepro.scan import defaults as config_defaults

DEEP = "[" * 5000 + "]" * 5000


@pytest.fixture
def bad(tmp_path: Path) -> Path:
    """A directory of bad inputs, named by what is wrong with each."""
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "loop").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop")
    (tmp_path / "directory").mkdir()
    config = '{"train_batch_size": %s, "zero_optimization": {"stage": 1}}'
    (tmp_path / "deep").write_text(config % DEEP)
    (tmp_path / "digits").write_text(config % ("9" * 5000))
    (tmp_path / "infinity").write_text(config % "Infinity")
    (tmp_path / "nan").write_text(config % "NaN")
    (tmp_path / "overflow").write_text(config % "1e999")
    return tmp_path


def dsrepro(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest_dsrepro.tools.cli", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip


SAID = {
    "fifo": "a FIFO (a named pipe), not a file",
    "loop": "a symbolic link loop",
    "directory": "a directory",
    "deep": "nested 5001 deep (at most 100)",
    "digits": "a number of 5000 digits (at most 100)",
    "infinity": "Infinity (not a JSON number)",
    "nan": "NaN (not a JSON number)",
    "overflow": "a number out of range (1e999)",
}


@pytest.mark.parametrize("name", sorted(SAID))
def test_a_scanned_config_that_is_no_config_is_one_line(bad: Path, name: str) -> None:
    done = dsrepro("scan", name, cwd=bad)
    assert (done.returncode, done.stdout) == (2, "")
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"dsrepro scan: {name}: ")
    assert SAID[name] in line


@pytest.mark.parametrize("name", ["fifo", "loop", "directory"])
def test_a_log_that_is_no_file_is_one_line(bad: Path, name: str) -> None:
    done = dsrepro("triage", name, cwd=bad)
    assert (done.returncode, done.stdout) == (2, "")
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"dsrepro triage: {name}: {SAID[name]}")


@pytest.mark.parametrize("name", ["fifo", "loop"])
def test_results_that_are_no_file_are_one_line(bad: Path, name: str) -> None:
    done = dsrepro("matrix", "--no-write", name, cwd=bad)
    assert (done.returncode, done.stderr) == (2, f"dsrepro matrix: {name}: {SAID[name]}" + (
        " (too many levels of symbolic links)\n" if name == "loop" else "\n"))  # fmt: skip


@pytest.mark.parametrize("name", ["deep", "digits", "infinity", "nan", "overflow"])
def test_a_results_file_of_bad_json_is_named_among_the_unreadable(bad: Path, name: str) -> None:
    """Inside a directory of results, a FIFO named ``*.json`` is skipped as unreadable too, never opened."""
    results = bad / "results"
    results.mkdir()
    (results / f"{name}.json").write_text((bad / name).read_text())
    os.mkfifo(results / "fifo.json")
    done = dsrepro("matrix", "--no-write", results, cwd=bad)
    assert done.returncode == 4, done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert f"{name}.json: not a results file this pytest-dsrepro reads: {SAID[name]}" in " ".join(done.stdout.split())
    assert "fifo.json: cannot be read: a FIFO (a named pipe), not a file" in " ".join(done.stdout.split())


@pytest.mark.parametrize(
    ("option", "name", "said"),
    [
        ("--ds-report", "fifo", "cannot be written (it is a FIFO (a named pipe), not a file)"),
        ("--ds-report", "loop", "cannot be written (it is a symbolic link loop"),
        ("--junitxml", "fifo", "cannot be written (it is a FIFO (a named pipe), not a file)"),
        ("--ds-results", "fifo", "is not a directory"),
        ("--ds-scan", "fifo", "cannot be read (a FIFO (a named pipe), not a file)"),
        ("--ds-scan", "infinity", "Infinity (not a JSON number)"),
        ("--ds-scan", "deep", "nested 5001 deep"),
        ("--ds-timeout", "9" * 5000, "invalid value '9999"),
        ("--ds-timeout", "inf", "invalid value 'inf': must be a number of seconds > 0"),
        ("--ds-timeout", "nan", "invalid value 'nan': must be a number of seconds > 0"),
        ("--ds-world-size", "9" * 5000, "invalid value '9999"),
        ("--ds-shard", "1/" + "9" * 5000, "invalid value '1/999"),
    ],
    ids=lambda v: v[:20],
)
def test_an_option_given_a_bad_path_or_number_is_one_line(pytester: pytest.Pytester, bad: Path, option: str,
                                                           name: str, said: str) -> None:  # fmt: skip
    pytester.makepyfile("def test_a():\n    pass\n")
    value = str(bad / name) if option in ("--ds-report", "--junitxml", "--ds-results", "--ds-scan") else name
    result = pytester.runpytest_subprocess(f"{option}={value}", timeout=120)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    errors = [line for line in result.errlines if line.strip()]
    assert len(errors) == 1, errors
    assert errors[0].startswith("ERROR: pytest-dsrepro: ")
    assert said in errors[0]
    assert len(errors[0]) < 300


# --- the readers themselves -------------------------------------------------------------------------------------


def test_paths_say_what_is_no_file_without_opening_it(bad: Path) -> None:
    assert {name: paths.not_a_file(bad / name) for name in ("fifo", "loop", "directory", "nan", "missing")} == {
        "fifo": "a FIFO (a named pipe), not a file",
        "loop": "a symbolic link loop (too many levels of symbolic links)",
        "directory": "a directory",
        "nan": None,
        "missing": "no such file",
    }
    with pytest.raises(paths.NotAFile, match=r"^a FIFO"):
        paths.read_text(bad / "fifo")
    assert paths.unwritable_file(bad / "fifo") == "it is a FIFO (a named pipe), not a file"


@pytest.mark.parametrize(
    ("text", "said"),
    [
        (DEEP, "nested 5000 deep"),
        ("9" * 5000, "a number of 5000 digits"),
        ("-Infinity", r"-Infinity \(not a JSON number\)"),
        ("[1e400]", "out of range"),
    ],
)
def test_json_from_outside_is_a_bad_json_in_one_line(text: str, said: str) -> None:
    with pytest.raises(json_input.BadJSON, match=said):
        json_input.loads(text)
    with pytest.raises(json_input.BadJSON):
        json_input.raw_decode(f"x = {text}", 4)


def test_a_defaults_cache_entry_of_the_wrong_shape_heals_and_is_said_once(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Valid JSON of another shape is read again, as a damaged entry is, and the file is named; the next scan finds
    the entry healed."""
    monkeypatch.setattr(config_defaults, "install_key", lambda: "deepspeed-test")
    request = ds_defaults.request({"zero_optimization": {"stage": 1}}, 2)
    place = tmp_path / "defaults" / "deepspeed-test" / f"{ds_defaults.digest(request)}.json"
    place.parent.mkdir(parents=True)
    for shape in ([1, 2], {"keys": [1]}, {"sections": {"zero_optimization": 3}}, {"refused": 7}):
        with pytest.raises(ValueError, match="a reading"):
            ReleaseReading.from_json(shape)
        place.write_text(json.dumps(shape))
        monkeypatch.setattr(config_defaults.subprocess, "Popen", _NoProbe)
        probe = config_defaults.start([request], tmp_path, gloo=True)
        (said,) = probe.healed
        assert said.startswith(f"the cached defaults {place} could not be used (a reading")
        assert said.endswith("read again from DeepSpeed")
        probe.close()


class _NoProbe:
    """Stands in for subprocess.Popen: no probe is started."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.returncode = 0

    def poll(self) -> int:
        return 0
