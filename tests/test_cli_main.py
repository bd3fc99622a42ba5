"""The dsrepro command itself: help, subcommands, exit codes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pytest_dsrepro.tools import cli


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for command in ("list", "new", "bisect", "install", "matrix", "export"):
        assert f"    {command} " in out
    assert "docs/contributing.md" in out


@pytest.mark.parametrize("command", [c.name for c in cli.COMMANDS])
def test_every_command_has_its_own_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main([command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: dsrepro {command} ")
    assert len(out.split("\n\n")[1].strip()) > 20  # a description, not just the usage line


def test_no_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "usage: dsrepro" in capsys.readouterr().err


def test_help_is_fast_and_light() -> None:
    code = (
        "import sys; from pytest_dsrepro.tools import cli; cli.build_parser(); "
        "print(sorted(m for m in ('torch', 'deepspeed', 'pytest_dsrepro.worlds', 'pytest_dsrepro.session') "
        "if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "[]", proc.stderr


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib import metadata

    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out == (
        f"pytest-dsrepro {metadata.version('pytest-dsrepro')} "
        f"(deepspeed {metadata.version('deepspeed')}, torch {metadata.version('torch')})"
    )
