"""dsrepro install: the recipe's decisions as pure functions, and its failure path with a stand-in interpreter.

Real installs (uv, an sdist build, torch) are proved by tox itself (``tox -e ds0163``) and by the bisect from a
wheel install (test_bisect.py); here nothing touches the network or the environment running the tests: stand-in
``torch``/``deepspeed`` modules live in a directory put first on ``PYTHONPATH``, and a stand-in ``uv`` fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest

from pytest_dsrepro.core import results
from pytest_dsrepro.tools import install, install_command, matrix
from pytest_dsrepro.tools.install import ImportProbe, InstallResult


def test_find_constraints_env_then_nearest_parent(tmp_path: Path) -> None:
    (tmp_path / "constraints.txt").write_text("torch==2.13.0\n")
    deep = tmp_path / "a" / "b"
    deep.mkdir(parents=True)
    assert install.find_constraints({}, deep) == tmp_path / "constraints.txt"
    assert install.find_constraints({"DSREPRO_CONSTRAINTS": "/x/c.txt"}, deep) == Path("/x/c.txt")
    assert install.find_constraints({}, Path("/")) is None or Path("/constraints.txt").exists()


def test_pinned_reads_the_torch_line(tmp_path: Path) -> None:
    c = tmp_path / "c.txt"
    c.write_text("# comment\n-r other.txt\nnumpy<3  # inline\nTorch == 2.13.0\n")
    spec = install.pinned(c, "torch")
    assert spec is not None
    assert str(spec) == "==2.13.0"
    assert install.pinned(c, "deepspeed") is None
    assert install._satisfies("2.13.0+cpu", spec)  # the local CPU wheel satisfies the plain pin
    assert not install._satisfies("2.14.0", spec)
    assert not install._satisfies(None, spec)


def test_the_repository_pins_torch() -> None:
    root = Path(__file__).resolve().parents[1]
    spec = install.pinned(root / "constraints.txt", "torch")
    assert spec is not None
    assert spec.contains("2.13.0+cpu")
    assert not spec.contains("2.14.0")


@pytest.mark.parametrize(
    ("output", "reason"),
    [
        ("Collecting x\nERROR: Could not find a version that satisfies the requirement deepspeed==9.9\n"
         "ERROR: No matching distribution found for deepspeed==9.9\n",
         "Could not find a version that satisfies the requirement deepspeed==9.9"),
        ("  File setup.py\n    import torch\nModuleNotFoundError: No module named 'torch'\n"
         "error: subprocess-exited-with-error\nERROR: Failed building wheel\n",
         "ModuleNotFoundError: No module named 'torch'"),
        ("", "exit code 1"),
        ("just words\nlast words\n", "last words"),
    ],
)  # fmt: skip
def test_reason_is_the_line_that_says_what_went_wrong(output: str, reason: str) -> None:
    assert install._reason(output, "exit code 1") == reason


def stub_release(root: Path, *, deepspeed: str = "0.16.3", import_error: str | None = None) -> Path:
    """Stand-in torch and deepspeed in a target directory, with dist-info so importlib.metadata finds them."""
    (root / "torch").mkdir(parents=True)
    (root / "torch" / "__init__.py").write_text(
        "__version__ = '2.13.0+cpu'\nclass cuda:\n    @staticmethod\n    def is_available():\n        return False\n"
    )
    (root / "deepspeed" / "accelerator").mkdir(parents=True)
    body = f"raise RuntimeError({import_error!r})\n" if import_error else f"__version__ = {deepspeed!r}\n"
    (root / "deepspeed" / "__init__.py").write_text(body)
    (root / "deepspeed" / "accelerator" / "__init__.py").write_text(
        "import os\nclass _A:\n    def device_name(self):\n        return os.environ['DS_ACCELERATOR']\n"
        "def get_accelerator():\n    return _A()\n"
    )
    for name, version in (("torch", "2.13.0+cpu"), ("deepspeed", deepspeed)):
        info = root / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (info / "RECORD").write_text(f"{info.name}/METADATA,,\n{info.name}/RECORD,,\n")
    return root


def test_probe_imports_with_cpu_accelerator_when_no_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setenv("PYTHONPATH", str(stub_release(tmp_path)))
    probe = install.probe_import(sys.executable)
    assert probe == ImportProbe(ok=True, python=probe.python, torch="2.13.0+cpu", deepspeed="0.16.3", accelerator="cpu")


def test_probe_reports_the_import_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = stub_release(tmp_path, import_error="CPU_Accelerator requires intel_extension_for_pytorch")
    monkeypatch.setenv("PYTHONPATH", str(target))
    probe = install.probe_import(sys.executable)
    assert not probe.ok
    assert probe.torch == "2.13.0+cpu"
    assert probe.deepspeed is None
    assert probe.error == "RuntimeError: CPU_Accelerator requires intel_extension_for_pytorch"
    assert probe.traceback
    assert "Traceback" in probe.traceback


def test_probe_of_an_interpreter_that_dies(tmp_path: Path) -> None:
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'Fatal Python error: Segmentation fault' >&2\nkill -SEGV $$\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    probe = install.probe_import(str(fake))
    assert not probe.ok
    assert probe.error is not None
    assert probe.error.startswith("import probe died (killed by signal 11)")


def test_already_installed_release_needs_no_install_and_is_remembered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    constraints = tmp_path / "c.txt"
    constraints.write_text("torch==2.13.0\n")
    target = stub_release(tmp_path / "site")
    monkeypatch.setenv("PYTHONPATH", str(target))
    first = install.install_deepspeed(
        "0.16.3", python=sys.executable, constraints=constraints, cache_dir=tmp_path / "cache"
    )
    assert (first.ok, first.action, first.steps, first.torch) == (True, "already installed", (), "2.13.0+cpu")
    assert len(list((tmp_path / "cache" / "probes").iterdir())) == 1
    # the same files again: the remembered probe answers; a reinstall (new METADATA time) would probe afresh
    (target / "deepspeed" / "__init__.py").write_text("raise SystemExit('would have been imported')\n")
    again = install.install_deepspeed(
        "0.16.3", python=sys.executable, constraints=constraints, cache_dir=tmp_path / "cache"
    )
    assert again.ok
    assert again.probe == first.probe


def _fake_uv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str) -> Path:
    fake = tmp_path / "uv"
    fake.write_text("#!/bin/sh\n" + script)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(install, "uv_binary", lambda: str(fake))
    return fake


@pytest.fixture
def failing_uv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A uv that finds the release on the index (a dry run) but fails to install anything, as uv says it."""
    return _fake_uv(
        tmp_path,
        monkeypatch,
        'case "$*" in *--dry-run*) exit 0;; esac\n'
        "echo 'error: Failed to build `deepspeed==0.0.1`' >&2\n"
        "echo '  cause: Build backend failed to build wheel through `build_wheel` (exit status: 1)' >&2\n"
        "exit 1\n",
    )


def test_failed_install_is_a_result_not_an_exception(tmp_path: Path, failing_uv: Path) -> None:
    constraints = tmp_path / "c.txt"
    constraints.write_text("torch==2.13.0\n")
    result = install.install_deepspeed(
        "0.0.1", python=sys.executable, constraints=constraints, cache_dir=tmp_path / "cache", log=tmp_path / "log.txt"
    )
    assert not result.ok
    assert result.action == "failed"
    assert result.reason == (
        "installing torch and build tools failed: Build backend failed to build wheel through `build_wheel` "
        "(exit status: 1)"
    )
    assert result.steps[0] == f"{failing_uv} pip install --python {sys.executable} --dry-run --no-deps deepspeed==0.0.1"
    assert result.steps[1].startswith(f"{failing_uv} pip install --python {sys.executable} -c {constraints} torch")
    assert "Failed to build" in (tmp_path / "log.txt").read_text()


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    install_command.add_arguments(parser)
    return parser.parse_args(argv)


def test_run_records_an_unavailable_release_that_the_matrix_shows(
    tmp_path: Path, failing_uv: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    constraints = tmp_path / "c.txt"
    constraints.write_text("torch==2.13.0\n")
    results_dir = tmp_path / "results"
    code = install_command.run(
        _args("0.0.1", "--constraints", str(constraints), "--results", str(results_dir),
              "--cache-dir", str(tmp_path / "cache"))
    )  # fmt: skip
    assert code == 1
    err = capsys.readouterr().err
    assert "deepspeed 0.0.1 cannot run with torch" in err
    assert "recorded as unavailable" in err
    (path,) = results_dir.glob("*.json")
    data = json.loads(path.read_text())
    assert data["schema"] == results.SCHEMA
    assert data["tests"] == []
    assert data["environment"]["deepspeed"] == "0.0.1"
    m = matrix.merge(*matrix.load([results_dir]))
    (col,) = m.columns
    assert col.version == "0.0.1"
    assert col.unavailable_line is not None
    assert col.unavailable_line.startswith("cannot run with torch ")
    assert "Build backend failed to build wheel" in col.unavailable_line


def test_a_release_the_index_does_not_have_installs_nothing_and_is_not_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 27: ``dsrepro install 9.9.9`` installed torch first, dropped uv's "no version" line, and with --results
    recorded the typo as a release that cannot run, which became a matrix column."""
    calls = tmp_path / "calls"
    _fake_uv(
        tmp_path,
        monkeypatch,
        f'echo "$*" >> {calls}\n'
        "echo 'error: No solution found when resolving dependencies' >&2\n"
        "echo '  cause: Because there is no version of deepspeed==9.9.9 and you require deepspeed==9.9.9, we can "
        "conclude that your requirements are unsatisfiable.' >&2\n"
        "exit 1\n",
    )
    constraints = tmp_path / "c.txt"
    constraints.write_text("torch==2.13.0\n")
    results_dir = tmp_path / "results"
    argv = ("9.9.9", "--constraints", str(constraints), "--results", str(results_dir), "--python", sys.executable)
    assert install_command.run(_args(*argv)) == 2
    assert (
        "dsrepro install: the package index has no deepspeed 9.9.9 (looking up deepspeed 9.9.9 failed: Because there "
        "is no version of deepspeed==9.9.9 and you require deepspeed==9.9.9, we can conclude that your requirements "
        "are unsatisfiable.); nothing was installed or recorded"
    ) in capsys.readouterr().err
    assert calls.read_text().splitlines() == [
        f"pip install --python {sys.executable} --dry-run --no-deps deepspeed==9.9.9"
    ]
    assert not results_dir.exists()


def test_unavailable_file_names_the_pinned_torch_when_torch_never_arrived(tmp_path: Path) -> None:
    constraints = tmp_path / "c.txt"
    constraints.write_text("torch==2.13.0\n")
    result = InstallResult("0.14.1", sys.executable, False, "failed", "pip failed", None, 1.0)
    path = install.write_unavailable(tmp_path, result, constraints)
    data = json.loads(path.read_text())
    assert data["environment"]["torch"] == "2.13.0"
    assert data["unavailable"] == "pip failed"
    assert path.name.startswith("results-deepspeed-0.14.1-unavailable-")
    # the schema's environment, as every results file has it: "os" (this used to say "platform", which nobody read)
    env = results.read(path).environment
    assert env.os is not None
    assert "platform" not in data["environment"]
    assert (env.deepspeed, env.backend, env.world_size, env.gpu_count) == ("0.14.1", None, None, None)


def test_run_refuses_without_constraints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("DSREPRO_CONSTRAINTS", raising=False)
    monkeypatch.chdir(tmp_path)
    if install.find_constraints() is not None:
        pytest.skip("a constraints.txt above the temporary directory")
    assert install_command.run(_args("0.16.3")) == 2
    assert "refusing to install with torch unpinned" in capsys.readouterr().err


def test_version_argument_is_checked() -> None:
    with pytest.raises(SystemExit) as exc:
        _args("latest")
    assert exc.value.code == 2


def test_recipe_environment_builds_no_ops_and_gives_uv_pips_find_links(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every install and probe runs with DS_BUILD_OPS=0 whatever the caller set; uv, which reads no pip
    configuration, looks where pip would for a local torch build, unless it was told otherwise."""
    monkeypatch.setenv("DS_BUILD_OPS", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", "/opt/wheels /more/wheels")
    monkeypatch.delenv("UV_FIND_LINKS", raising=False)
    assert install._env()["DS_BUILD_OPS"] == "0"
    assert install._env()["UV_FIND_LINKS"] == "/opt/wheels,/more/wheels"
    monkeypatch.setenv("UV_FIND_LINKS", "/uv/own")
    assert install._env()["UV_FIND_LINKS"] == "/uv/own"
    assert install._env({"DS_ACCELERATOR": "cpu"})["DS_ACCELERATOR"] == "cpu"


def test_ctrl_c_while_installing_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    """Issue 27: Ctrl-C during ``dsrepro install`` printed a traceback. uv gets the interrupt too (one process group)
    and stops; dsrepro says so in one line and exits 130, as a shell does."""
    started = tmp_path / "started"
    uv = tmp_path / "uv"
    uv.write_text(f"#!/bin/sh\ntouch {started}\nexec sleep 60\n")
    uv.chmod(uv.stat().st_mode | stat.S_IEXEC)
    constraints = tmp_path / "c.txt"
    constraints.write_text("torch==2.13.0\n")
    code = (
        "import sys; from pytest_dsrepro.tools import cli, install; "
        f"install.uv_binary = lambda: {str(uv)!r}; "
        f"sys.exit(cli.main(['install', '0.16.3', '--constraints', {str(constraints)!r}, '--python', sys.executable]))"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 60
        while not started.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "uv never started"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal does: to dsrepro and uv alike
        _, err = proc.communicate(timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130
    assert err.strip().splitlines()[-1] == "dsrepro install: interrupted"
    assert "Traceback" not in err


def test_the_extras_installed_here_go_into_the_environments_made_for_other_releases() -> None:
    """A scan, bisect or upstream run on another release runs what runs here: the hf repros too where the hf extra
    is installed (the tests environment has it), at the versions here; extras that are not installed stay out."""
    requires = ["pytest>=8", "transformers>=5.0; extra == 'hf'", "no-such-package-here>=1; extra == 'other'"]
    assert install.extras_installed_here(requires) == [f"transformers=={metadata.version('transformers')}"]


# ---- extra packages: requirements, never uv's options (issue 49, item 7) ----------------------------------------


def test_extra_packages_that_are_not_requirements_are_refused_naming_where_they_came_from() -> None:
    from pytest_dsrepro.tools import environments

    env = {environments.EXTRA_PACKAGES_ENV: "einops==0.8.0, huggingface_hub[cli]>=0.20"}
    assert environments.extra_packages(env) == ["einops==0.8.0", "huggingface_hub[cli]>=0.20"]
    for given in ("--index-url=http://example.invalid/simple", "-e", "--editable=/tmp/x", "-r/etc/requirements.txt"):
        with pytest.raises(environments.EnvironmentUnavailable, match=r"^\$DSREPRO_EXTRA_PACKAGES: ") as caught:
            environments.extra_packages({environments.EXTRA_PACKAGES_ENV: f"einops {given}"})
        assert f"{given!r} is not a package requirement" in str(caught.value)
        assert str(caught.value).endswith("never uv's options")


@pytest.mark.parametrize(
    ("command", "said"),
    [
        (["scan", "ds_config.json", "--release", "0.16.4", "--with=--index-url=http://example.invalid/simple"],
         "dsrepro scan: error: argument --with: '--index-url=http://example.invalid/simple' is not a package requirement"),
        (["scan", "ds_config.json", "--release", "0.16.4"],
         "dsrepro scan: $DSREPRO_EXTRA_PACKAGES: '-e' is not a package requirement"),
        (["bisect", "t.py::test_x", "--good", "0.16.3", "--bad", "0.16.4"],
         "dsrepro bisect: $DSREPRO_EXTRA_PACKAGES: '-e' is not a package requirement"),
    ],
    ids=["scan --with", "scan", "bisect"],
)  # fmt: skip
def test_an_option_given_as_a_package_stops_the_command_before_any_environment(
    tmp_path: Path, command: list[str], said: str
) -> None:
    """What a user sees: one line naming the value and where it came from, exit 2, no environment made (the cache
    stays empty) and no package index asked (the bisect stops before it lists releases)."""
    (tmp_path / "ds_config.json").write_text('{"train_micro_batch_size_per_gpu": 1}')
    cache = tmp_path / "cache"
    env = {**os.environ, "DSREPRO_EXTRA_PACKAGES": "-e /tmp/elsewhere", "UV_OFFLINE": "1",
           "UV_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_INDEX_URL": "http://127.0.0.1:9/simple"}  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "pytest_dsrepro.tools.cli", *command, "--cache-dir", str(cache)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert said in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (cache / "envs").exists() or not any((cache / "envs").iterdir())
