"""Every bad input is one line: on each command and option that takes a path or a number, a FIFO, a directory, a
symbolic link loop, JSON nested thousands deep, a number of 5000 digits, ``Infinity`` and ``NaN``, an old or foreign
results file are refused naming the file and what is wrong (the ``dsrepro`` commands exit 2, pytest's usage errors 4;
the matrix lists a results file it cannot read and exits 4, as for any damaged file), never a traceback or a wait."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_dsrepro.core import ds_defaults, failures, json_input, paths
from pytest_dsrepro.core.ds_defaults import ReleaseReading
from pytest_dsrepro.core.results import read_all
from pytest_dsrepro.scan import defaults as config_defaults
from pytest_dsrepro.triage import known_fixes, ledger

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


DIGITS = "9" * 5000

#: Every argument of a dsrepro command that takes a path or a number, with a bad value, and what its one line says
#: (the parser's: ``dsrepro CMD: argument OPT: VALUE: what is wrong (see dsrepro CMD --help)``), refused before any
#: work starts. Node ids and releases that exist nowhere: nothing gets as far as to need them.
ARGUMENTS = [
    (("scan", "c.json", "--world-size", DIGITS), "argument --world-size: '99999"),
    (("scan", "c.json", "--world-size", "0"), "argument --world-size: '0': must be a whole number >= 1"),
    (("scan", "c.json", "--releases", "fifo"), "argument --releases: fifo: a FIFO (a named pipe), not a file"),
    (("scan", "c.json", "--markdown", "fifo"), "argument --markdown: fifo: cannot be written (it is a FIFO"),
    (("scan", "c.json", "--catalogue", "loop"), "argument --catalogue: loop: a symbolic link loop"),
    (("scan", "c.json", "--constraints", "directory"), "argument --constraints: directory: a directory"),
    (("scan", "c.json", "--cache-dir", "fifo"), "argument --cache-dir: fifo: a FIFO (a named pipe), not a directory"),
    (("triage", "log", "--top", "nan"), "argument --top: 'nan': must be a whole number >= 1"),
    (("triage", "log", "--world-size", DIGITS), "argument --world-size: '99999"),
    (("triage", "log", "--markdown", "directory"), "argument --markdown: directory: cannot be written (it is a dir"),
    (("triage", "log", "--known-fixes", "fifo"), "argument --known-fixes: fifo: a FIFO (a named pipe), not a file"),
    (("triage", "log", "--catalogue", "c.json"), "argument --catalogue: c.json: a file, not a directory"),
    (("bisect", "x::y", "--good", "1", "--bad", "2", "--timeout", "nan"), "argument --timeout: 'nan': must be a nu"),
    (("bisect", "x::y", "--good", "1", "--bad", "2", "--timeout", "1e999"), "argument --timeout: '1e999': must be"),
    (("bisect", "x::y", "--good", "1", "--bad", "2", "--runs", DIGITS), "argument --runs: '99999"),
    (("bisect", "x::y", "--good", "1", "--bad", "2", "--env-cache", "9" * 400), "argument --env-cache: '99999"),
    (("bisect", "x::y", "--good", "1", "--bad", "2", "--chdir", "fifo"), "argument --chdir: fifo: a FIFO (a named"),
    (("bisect", "x::y", "--good", "1", "--bad", "2", "--chdir", "loop"), "argument --chdir: loop: a symbolic link l"),
    (("bisect", "x::y", "--good", "1", "--bad", "2", "--constraints", "fifo"), "argument --constraints: fifo: a FIFO"),
    (("bisect", "x::y", "--good", "1", "--bad", "2", "--log-dir", "fifo"), "argument --log-dir: fifo: a FIFO (a name"),
    (("bisect", "x::y", "--good", "1", "--bad", "2", "--repo", "loop"), "--repo loop: a symbolic link loop (too many"),
    (("bisect", "x::y", "--good", "9" * 300, "--bad", "2"), "argument --good: '99999"),
    (("install", DIGITS), "argument version: not a release version: '99999"),
    (("install", "0.16.3", "--constraints", "fifo"), "argument --constraints: fifo: a FIFO (a named pipe), not a f"),
    (("install", "0.16.3", "--log", "fifo"), "argument --log: fifo: cannot be written (it is a FIFO"),
    (("install", "0.16.3", "--results", "c.json"), "argument --results: c.json: a file, not a directory"),
    (("atlas", "--repo", "loop", "--range", "a..b"), "--repo loop: a symbolic link loop (too many levels of symbolic"),
    (("atlas", "--repo", "fifo", "--range", "a..b"), "--repo fifo: a FIFO (a named pipe), not a directory"),
    (("atlas", "--repo", ".", "--range", "a..b", "--limit", "-1"), "argument --limit: '-1': must be a whole number"),
    (("atlas", "--repo", ".", "--range", "a..b", "--known-fixes", "fifo"), "argument --known-fixes: fifo: cannot be"),
    (("atlas", "--repo", ".", "--range", "a..b", "--results", "fifo"), "argument --results: fifo: a FIFO (a named"),
    (("upstream", "--checkout", "loop"), "argument --checkout: loop: a symbolic link loop"),
    (("upstream", "--failures", "fifo"), "argument --failures: fifo: a FIFO (a named pipe), not a file"),
    (("upstream", "--releases", "loop"), "argument --releases: loop: a symbolic link loop"),
    (("upstream", "--merge", "r", "--shards", "0"), "argument --shards: '0': must be a whole number >= 1"),
    (("upstream", "--shard", "1/" + DIGITS), "argument --shard: --shard '1/99999"),
    (("ledger", "--ledger", "fifo"), "fifo: a FIFO (a named pipe), not a directory"),
    (("ledger", "--ledger", "loop"), "loop: a symbolic link loop (too many levels of symbolic links)"),
    (("ledger", "--check", "--repo", "loop"), "--repo loop: a symbolic link loop (too many levels of symbolic links)"),
    (("ledger", "--release", DIGITS), "--release '99999"),
    (("scan", "c.json", "--release", DIGITS), "argument --release: '99999"),
    (("triage", "log", "--release", DIGITS), "argument --release: '99999"),
    (("upstream", "--release", DIGITS), "argument --release: '99999"),
    (("list", "fifo"), "argument PATH: fifo: a FIFO (a named pipe), not a file"),
    (("list", "loop"), "argument PATH: loop: a symbolic link loop"),
    (("new", "x", "--dir", "fifo"), "argument --dir: fifo: a FIFO (a named pipe), not a directory"),
    (("new", "x", "--dir", "loop"), "argument --dir: loop: a symbolic link loop"),
    (("export", "x.py::t", "-o", "fifo"), "argument -o/--output: fifo: cannot be written (it is a FIFO"),
    (("export", "x.py::t", "-o", "directory"), "argument -o/--output: directory: cannot be written (it is a dir"),
]


@pytest.mark.parametrize(("args", "said"), ARGUMENTS, ids=lambda v: " ".join(v)[:40]
                         if isinstance(v, tuple) else None)  # fmt: skip
def test_every_argument_given_a_bad_path_or_number_is_one_line(bad: Path, args: tuple[str, ...], said: str) -> None:
    (bad / "c.json").write_text("{}")
    done = dsrepro(*args, cwd=bad)
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    (line,) = done.stderr.splitlines()
    parsed = said.startswith("argument ")  # refused by the parser, as argparse says it
    assert line.startswith(f"dsrepro {args[0]}: {'error: ' if parsed else ''}{said}"), line
    assert line.endswith(f"(see dsrepro {args[0]} --help)") or not parsed
    assert len(line) < 300


@pytest.mark.parametrize("name", ["fifo", "loop", "directory", "binary"])
def test_a_log_to_prefill_a_repro_from_that_is_no_log_is_one_line(bad: Path, name: str) -> None:
    (bad / "binary").write_bytes(b"\x00\xff" * 100)
    done = dsrepro("new", "x", "--dir", bad / "out", "--from-log", name, cwd=bad)
    assert (done.returncode, done.stdout) == (2, "")
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"dsrepro new: {name}: ")
    assert not (bad / "out").exists() or not any((bad / "out").iterdir())


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
    assert {name: paths.not_collectable(bad / name) for name in ("fifo", "loop", "directory", "nan", "missing")} == {
        "fifo": "a FIFO (a named pipe), not a file",
        "loop": "a symbolic link loop (too many levels of symbolic links)",
        "directory": None,
        "nan": None,
        "missing": "no such file or directory",
    }
    assert {name: paths.not_a_directory(bad / name) for name in ("fifo", "nan", "missing")} == {
        "fifo": "a FIFO (a named pipe), not a directory",
        "nan": "a file, not a directory",
        "missing": "no such directory",
    }
    assert paths.not_a_directory(bad / "missing", missing_ok=True) is None
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


@pytest.mark.parametrize("name", ["deep", "digits", "infinity", "nan", "overflow"])
def test_results_given_to_since_that_cannot_be_read_are_one_line(bad: Path, name: str) -> None:
    """``--since``'s damaged file is refused, not read as no results (every run would show as changed)."""
    from matrix_records import rec, write

    write(bad / "new", "0.16.3", [rec("repros/test_x.py::test_x[zero3-stock]", "REPRODUCED")])
    done = dsrepro("matrix", "--no-write", "new", "--since", name, cwd=bad)
    assert (done.returncode, done.stdout) == (2, "")
    assert (
        done.stderr == f"dsrepro matrix: --since: {name}: not a results file this pytest-dsrepro reads: {SAID[name]}\n"
    )


def test_a_link_loop_among_results_is_named_among_the_unreadable(bad: Path) -> None:
    results = bad / "results"
    results.mkdir()
    (results / "a.json").symlink_to(results / "b.json")
    (results / "b.json").symlink_to(results / "a.json")
    files, unreadable = read_all([results])
    assert files == []
    assert [(u.path.name, u.problem) for u in unreadable] == [
        (n, "cannot be read: a symbolic link loop (too many levels of symbolic links)") for n in ("a.json", "b.json")
    ]


@pytest.mark.parametrize("name", ["deep", "digits", "infinity", "nan", "overflow"])
def test_known_fixes_of_bad_json_are_one_line(bad: Path, name: str) -> None:
    with pytest.raises(ValueError, match=rf"^{bad / name}: not a known-fixes file: {re.escape(SAID[name])}$"):
        known_fixes.load(bad / name)
    with pytest.raises(paths.NotAFile, match=r"^a FIFO"):
        known_fixes.load(bad / "fifo")


TOML = {"deep": "x = " + "[" * 5000 + "]" * 5000, "digits": "x = " + DIGITS}
TOML_SAID = {"deep": "nested too deep", "digits": "Exceeds the limit (4300 digits) for integer string conversion"}


@pytest.mark.parametrize("name", sorted(TOML))
def test_toml_from_outside_is_one_line(tmp_path: Path, name: str) -> None:
    """The fix ledger's files and a failures file: a ``TOMLDecodeError`` the readers name the file in."""
    (tmp_path / "ledger").mkdir()
    (tmp_path / "ledger" / "a.toml").write_text(TOML[name])
    with pytest.raises(ledger.LedgerError, match=rf"a\.toml: not valid TOML: {re.escape(TOML_SAID[name])}"):
        ledger.load(tmp_path / "ledger")
    with pytest.raises(failures.FailuresFileError, match=rf"^f\.toml:1: not valid TOML: {re.escape(TOML_SAID[name])}"):
        failures.parse(TOML[name], "f.toml")


def test_a_fifo_among_ledger_files_or_as_failures_is_refused_unopened(bad: Path) -> None:
    (bad / "directory" / "a.toml").symlink_to(bad / "fifo")
    with pytest.raises(ledger.LedgerError, match=r"a ledger file cannot be read \(a FIFO \(a named pipe\), not a"):
        ledger.load(bad / "directory")
    with pytest.raises(failures.FailuresFileError, match=r"fifo:1: cannot be read: a FIFO \(a named pipe\), not a"):
        failures.read(bad / "fifo")


def test_a_marker_of_5000_digits_is_refused_in_one_line(pytester: pytest.Pytester) -> None:
    """A ``ds_version`` range no release can have is refused as every bad specifier is, naming the marker and the
    test (its module's collection fails), not when the release is compared with it."""
    pytester.makepyfile(f"""
        import pytest

        @pytest.mark.ds_version(affected="<{DIGITS}", raises=ValueError)
        def test_big():
            raise ValueError("x")

        def test_other():
            pass
    """)  # fmt: skip
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=120)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["@pytest.mark.ds_version on *::test_big: affected='<99999*... is not a valid PEP 440 "
                                 "specifier (Exceeds the*"])  # fmt: skip
    assert "INTERNALERROR" not in result.stdout.str()


@pytest.mark.parametrize(
    ("variable", "value"), [("RANK", "x"), ("WORLD_SIZE", DIGITS), ("LOCAL_RANK", "-1"), ("LOCAL_WORLD_SIZE", "nan")]
)
def test_a_launchers_variable_that_is_no_number_is_one_line(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    """torchrun's variables set by hand or by a broken launcher: a usage error naming the variable (was an
    INTERNALERROR)."""
    pytester.makepyfile("def test_a():\n    pass\n")
    for name, set_to in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, set_to)
    monkeypatch.setenv(variable, value)
    result = pytester.runpytest_subprocess(timeout=120)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    errors = [line for line in result.errlines if line.strip()]
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"ERROR: pytest-dsrepro: environment variable {variable}: invalid value '{value[:5]}")
    assert len(errors[0]) < 300
