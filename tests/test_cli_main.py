"""The dsrepro command itself: help, subcommands, exit codes, and the partners' subcommands."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pytest_dsrepro import cli


def test_help_lists_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for command in ("list", "new", "bisect"):
        assert f"    {command} " in out
    assert "docs/contributing.md" in out


def test_no_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "usage: dsrepro" in capsys.readouterr().err


def test_partner_subcommands_when_present(capsys: pytest.CaptureFixture[str]) -> None:
    """``matrix`` and ``install`` come from their own modules (add_arguments/run), when those exist."""
    parser = cli.build_parser()
    for name in ("matrix", "install"):
        module = cli._partner(name)
        if module is None:
            continue
        help_text = parser.format_help()
        assert f"    {name} " in help_text


def test_help_is_fast_and_light() -> None:
    code = "import sys; from pytest_dsrepro import cli; cli.build_parser(); print(sorted(m for m in ('torch', 'deepspeed') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "[]", proc.stderr
