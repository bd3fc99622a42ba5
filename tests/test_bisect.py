"""dsrepro bisect: the pure search over releases with fake oracles, reading probe results, the command's output, a
real bisect across the module.id fix from a wheel install, and (slow, opt-in) a wider one over PyPI releases.

The wide bisect installs and JIT-builds several DeepSpeed releases (minutes each the first time on 2 cores), so it
does not run by default. Run it with:

    DSREPRO_SLOW=1 python -m pytest tests/test_bisect.py -k wide -v
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from packaging.version import Version

from conftest import REAL_CACHE, ROOT, deepspeed_version, wait_for_no_processes
from pytest_dsrepro.core import results
from pytest_dsrepro.core.gates import Reason, Verdict
from pytest_dsrepro.core.options import CACHE_ENV
from pytest_dsrepro.core.results import RankStory, TestRecord
from pytest_dsrepro.tools import bisect, cli, environments, releases
from pytest_dsrepro.tools.bisect import (
    BisectError,
    Invocation,
    NoVerdict,
    Probe,
    Prober,
    Result,
    bug_present,
    entered,
    estimated_steps,
    releases_between,
    search,
    specifier,
)
from pytest_dsrepro.tools.environments import ReleaseEnv
from pytest_dsrepro.tools.releases import _Anchors, index_url, parse_project_page

INDEXED = [
    Version(v) for v in ["0.14.4", "0.15.3", "0.15.4", "0.16.0", "0.16.3", "0.16.4", "0.17.0", "0.18.3", "0.19.8"]
]
RELEASES = [Version(v) for v in ["0.15.4", *(f"0.16.{i}" for i in range(10)), *(f"0.17.{i}" for i in range(7)),
                                 "0.18.0", "0.18.1", "0.18.2", "0.18.3"]]  # fmt: skip


def fake(
    flip: str, *, bug_below: bool = True, skip: Iterable[str] = ()
) -> tuple[list[Version], bisect.Oracle[Version]]:
    """An oracle for a bug that stops (``bug_below``) or starts at release ``flip``; ``skip`` cannot install."""
    asked: list[Version] = []
    skipped = {Version(s) for s in skip}

    def oracle(version: Version) -> Probe[Version]:
        asked.append(version)
        if version in skipped:
            return Probe(version, None, "cannot install: no wheel")
        return Probe(version, (version < Version(flip)) == bug_below, "fake")

    return asked, oracle


# --- pure functions ----------------------------------------------------------------------------------------------


def test_the_release_list_is_read_from_the_simple_api_json_or_html() -> None:
    """PEP 691 JSON, or PEP 503 HTML where a mirror serves only that; yanked files and non-installables left out."""
    files = [
        {"filename": "deepspeed-0.16.3.tar.gz"},
        {"filename": "deepspeed-0.16.4.tar.gz", "yanked": False},
        {"filename": "deepspeed-0.16.5.tar.gz", "yanked": "broken metadata"},
        {"filename": "deepspeed-0.17.0rc1-py3-none-any.whl"},
        {"filename": "deepspeed-0.3.0-py3.6.egg"},
    ]
    releases = [Version("0.16.3"), Version("0.16.4"), Version("0.17.0rc1")]
    assert parse_project_page({"meta": {"api-version": "1.1"}, "name": "deepspeed", "files": files}) == releases
    anchors = _Anchors()
    anchors.feed(
        "<html><body><h1>Links for deepspeed</h1>"
        '<a href="https://files/deepspeed-0.16.3.tar.gz#sha256=00">deepspeed-0.16.3.tar.gz</a><br/>'
        '<a href="https://files/deepspeed-0.16.5.tar.gz" data-yanked="">deepspeed-0.16.5.tar.gz</a><br/>'
        '<a href="https://files/deepspeed-0.16.4.tar.gz">deepspeed-0.16.4.tar.gz</a></body></html>'
    )
    assert parse_project_page({"files": anchors.files}) == releases[:2]
    assert index_url({"PIP_INDEX_URL": "https://mirror/simple/"}) == "https://mirror/simple"
    assert index_url({"UV_DEFAULT_INDEX": "https://uv/simple", "PIP_INDEX_URL": "https://pip"}) == "https://uv/simple"
    assert index_url({}) == "https://pypi.org/simple"


def test_releases_between_either_order_and_inclusive() -> None:
    available = [*INDEXED, Version("0.17.0rc1")]
    expected = [Version(v) for v in ["0.15.4", "0.16.0", "0.16.3", "0.16.4", "0.17.0", "0.18.3"]]
    assert releases_between(available, "0.15.4", "0.18.3") == expected
    assert releases_between(available, "0.18.3", "0.15.4") == expected  # pre-releases are left out
    with pytest.raises(
        BisectError, match=r"deepspeed 0.16.5 is not a release on the index \(nearest: 0.16.4, 0.17.0\)"
    ):
        releases_between(available, "0.16.5", "0.18.3")
    with pytest.raises(BisectError, match="the same release"):
        releases_between(available, "0.16.4", "0.16.4.0")


def test_finds_a_fix_in_logarithmic_probes() -> None:
    asked, oracle = fake("0.16.4")
    result = search(RELEASES, oracle)
    assert result.first_after.at == Version("0.16.4")
    assert result.last_before.at == Version("0.16.3")
    assert result.exact
    assert result.fixed
    assert bisect.release_specifier(result) == "<0.16.4"
    assert asked[:2] == [Version("0.15.4"), Version("0.18.3")]  # both ends first
    assert len(asked) == len(set(asked)) <= estimated_steps(len(RELEASES)) == 7


def test_finds_a_regression() -> None:
    _, oracle = fake("0.18.3", bug_below=False)
    result = search(RELEASES, oracle)
    assert result.first_after.at == Version("0.18.3")
    assert not result.fixed
    assert bisect.release_specifier(result) == ">=0.18.3"


@pytest.mark.parametrize("flip", [str(v) for v in RELEASES[1:]])
def test_every_flip_point_is_found(flip: str) -> None:
    for bug_below in (True, False):
        _, oracle = fake(flip, bug_below=bug_below)
        assert search(RELEASES, oracle).first_after.at == Version(flip)


def test_skipped_releases_are_neither_good_nor_bad() -> None:
    # The middle release cannot be installed: its neighbour is probed instead, and the answer is still exact.
    asked, oracle = fake("0.16.4", skip=["0.16.9", "0.18.1"])
    result = search(RELEASES, oracle)
    assert result.first_after.at == Version("0.16.4")
    assert result.exact
    assert asked[2:4] == [Version("0.16.9"), Version("0.17.0")]  # 0.16.9 skipped: its neighbour goes instead
    assert [p.at for p in result.skipped] == [Version("0.16.9")]
    assert all(p.bug is None for p in result.skipped)


def test_skips_next_to_the_flip_make_the_answer_a_range() -> None:
    _, oracle = fake("0.16.4", skip=["0.16.3", "0.16.4"])
    result = search(RELEASES, oracle)
    assert not result.exact
    assert result.last_before.at == Version("0.16.2")
    assert result.first_after.at == Version("0.16.5")
    assert result.untested == (Version("0.16.3"), Version("0.16.4"))
    text = bisect.summary(result, "0.18.3", "0.15.4", 60.0)
    assert "the outcome flips at one of deepspeed 0.16.3, 0.16.4, 0.16.5" in text
    assert "skipped deepspeed 0.16.3: cannot install: no wheel" in text


def test_ends_must_be_testable_and_differ() -> None:
    """Ends that agree, or one that cannot be tested, are no verdict (exit 1); too few points cannot start (2)."""
    _, same = fake("9.0")
    with pytest.raises(NoVerdict, match=r"the bug shows on both deepspeed 0\.15\.4 and deepspeed 0\.18\.3: no flip"):
        search(RELEASES, same)
    _, broken_end = fake("0.16.4", skip=["0.15.4"])
    with pytest.raises(NoVerdict, match=r"deepspeed 0.15.4 could not be tested \(cannot install: no wheel\)"):
        search(RELEASES, broken_end)
    with pytest.raises(BisectError, match="at least two") as refused:
        search(RELEASES[:1], broken_end)
    assert not isinstance(refused.value, NoVerdict)


def test_progress_is_told_before_each_probe() -> None:
    seen: list[tuple[str, int, int]] = []
    _, oracle = fake("0.16.4", skip=["0.16.9"])
    result = search(RELEASES, oracle, progress=lambda v, step, total: seen.append((str(v), step, total)))
    assert [s[1] for s in seen] == list(range(1, len(result.probes) + 1))
    assert seen[0] == ("0.15.4", 1, 7)
    assert seen[1][0] == "0.18.3"


def test_describe_says_each_verdict_once() -> None:
    records = [
        _record(Reason.REPRODUCED, "xfailed", error="REPRODUCED on deepspeed 0.16.1: ranks 0-1: AssertionError: ids"),
        _record(None, "failed", None, error="AssertionError: x"),
        _record(Reason.NOT_AFFECTED, "passed"),
        _record(Reason.FIX_HOLDS, "passed", "fixed"),
    ]
    assert bisect.describe(records) == (
        "REPRODUCED on deepspeed 0.16.1: ranks 0-1: AssertionError: ids; FAILED: AssertionError: x; FIXED"
    )


def test_specifier() -> None:
    assert specifier(Version("0.16.4"), fixed=True) == "<0.16.4"
    assert specifier(Version("0.18.3"), fixed=False) == ">=0.18.3"


def _record(
    reason: Reason | Verdict | None, outcome: str, variant: str | None = "stock", error: str | None = None,
    ranks: int = 0,
) -> TestRecord:  # fmt: skip
    """A record as the plugin writes it: a reason (and so its verdict), SKIPPED (no reason), or neither."""
    verdict = reason if isinstance(reason, Verdict) else reason.verdict if reason else None
    stories = tuple(RankStory(f"rank {r}", "AssertionError", "tb", "") for r in range(ranks))
    return TestRecord(nodeid="t.py::t", repro=None, variant=variant, verdict=verdict,
                      reason=reason if isinstance(reason, Reason) else None, outcome=outcome, error=error,
                      duration=1.0, config=None, ranks=stories)  # fmt: skip


@pytest.mark.parametrize(
    ("records", "expected"),
    [
        ([_record(Reason.REPRODUCED, "xfailed")], True),
        ([_record(Reason.NOT_AFFECTED, "passed")], False),
        ([_record(Reason.DID_NOT_REPRODUCE, "failed", error="did not reproduce on deepspeed 0.16.3: ...")], False),
        ([_record(Reason.REGRESSION, "failed", error="regression: ...", ranks=2)], True),
        ([_record(Reason.FAILED_DIFFERENTLY, "failed", error="failed differently on ...", ranks=1)], True),
        ([_record(Reason.HARNESS_ERROR, "failed", error="no world ran: the fork server died")], None),
        ([_record(None, "failed", None)], True),  # a plain test: its outcome is the answer
        ([_record(None, "passed", None)], False),
        ([_record(Verdict.SKIPPED, "skipped")], None),
        ([_record(None, "error", None)], None),  # setup failed: says nothing about the bug
        ([_record(Reason.FIX_HOLDS, "passed", "fixed")], None),  # fix variants are not asked
        ([_record(Reason.FIX_DOES_NOT_HOLD, "failed", "fixed")], None),
        ([_record(Reason.NOT_AFFECTED, "passed"), _record(Reason.REPRODUCED, "xfailed")], True),  # any stock config
        ([], None),
    ],
)
def test_bug_present(records: list[TestRecord], expected: bool | None) -> None:
    assert bug_present(records) is expected


@pytest.mark.parametrize("reason", [r for r in Reason if r.body_failed is not None])
def test_bug_present_reads_the_reason_never_the_wording(reason: Reason) -> None:
    """Messages are for people: reworded, translated or cut, the answer stays the reason's."""
    for error in ("did not reproduce on deepspeed 0.16.3: expected ..., but it passed", "regression: ...", None):
        assert bug_present([_record(reason, "failed", error=error)]) is reason.body_failed
    assert (
        bug_present([_record(Reason.DID_NOT_REPRODUCE, "failed", error="passed, although the gate expected ...")])
        is False
    )


def test_a_probe_with_unreadable_results_is_skipped(tmp_path: Path) -> None:
    """A results file of another schema (another pytest-dsrepro on the path) is no answer, and says so."""
    fake = tmp_path / "python"
    old = '{"schema": 1, "environment": {}, "tests": []}'
    fake.write_text(f'#!/bin/sh\nfor a; do [ "$prev" = --ds-results ] && echo \'{old}\' > "$a/r.json"; prev=$a; done\n')
    fake.chmod(0o755)
    probe = Prober(Invocation("t.py::t"), entered(lambda v: ReleaseEnv(str(fake), dict(os.environ))))(Version("0.16.3"))
    assert probe.bug is None
    assert probe.detail.startswith("unreadable results: ")
    said = f"schema 1: written by an older pytest-dsrepro; this one reads results files of schema 5 to {results.SCHEMA}"
    assert said in probe.detail


# --- one probe, with the installed release --------------------------------------------------------------------------

PLAIN = """
import os

def test_flag():
    assert os.environ.get("BUG") != "1", "the bug"
"""


def test_prober_runs_pytest_with_the_prepared_environment(pytester: pytest.Pytester, tmp_path: Path) -> None:
    pytester.makepyfile(test_flag=PLAIN)
    pytester.chdir()
    here = Version(deepspeed_version())

    def prepare(bug: str) -> Any:
        def environment(version: Version) -> ReleaseEnv:
            time.sleep(0.01)  # an install, however quick, is timed
            return ReleaseEnv(sys.executable, {**os.environ, "BUG": bug})

        return environment

    bad = Prober(Invocation("test_flag.py::test_flag"), entered(prepare("1")), log_dir=tmp_path)(here)
    assert bad.bug is True
    assert bad.detail.startswith("FAILED: ")
    assert bad.seconds > 0
    assert 0 < bad.install_seconds < bad.seconds
    assert bad.timing.endswith(" s")
    assert ", install " in bad.timing
    assert "test_flag.py F" in (tmp_path / f"deepspeed-{here}.log").read_text()
    assert Prober(Invocation("test_flag.py::test_flag"), entered(prepare("0")))(here).bug is False
    # A release other than the one imported is never taken for the one asked.
    other = Prober(Invocation("test_flag.py::test_flag"), entered(prepare("0")))(Version("0.1.0"))
    assert other.bug is None
    assert other.detail == f"ran deepspeed {here} instead of 0.1.0"

    def cannot(version: Version) -> ReleaseEnv:
        raise BisectError("import failed: RuntimeError: CPU_Accelerator requires intel_extension_for_pytorch")

    skipped = Prober(Invocation("test_flag.py::test_flag"), entered(cannot))(here)
    assert skipped.bug is None
    assert skipped.detail.startswith("cannot install or import: import failed: RuntimeError")
    missing = Prober(Invocation("test_flag.py::test_nope"), entered(prepare("0")))(here)
    assert missing.bug is None
    assert missing.detail.startswith("no test ran (pytest exit code 4)")


FLAKY = """
import os
from pathlib import Path

def test_race():
    runs = Path(os.environ["RUNS_FILE"])
    runs.write_text(runs.read_text() + "x" if runs.exists() else "x")
    assert len(runs.read_text()) < int(os.environ["FAILS_AT"]), "lost the race"
"""


def test_a_probe_runs_the_test_up_to_runs_times_and_stops_at_the_first_bug(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """``--runs N``: a race shows in some runs only. The bug shows if any run shows it; runs stop there."""
    pytester.makepyfile(test_race=FLAKY)
    pytester.chdir()
    here = Version(deepspeed_version())

    def probe(fails_at: int, runs: int) -> tuple[Probe[Version], int]:
        counter = tmp_path / f"runs-{fails_at}-{runs}"
        env = {**os.environ, "RUNS_FILE": str(counter), "FAILS_AT": str(fails_at)}
        prober = Prober(Invocation("test_race.py::test_race"), entered(lambda v: ReleaseEnv(sys.executable, env)),
                        runs=runs, log_dir=tmp_path / "logs")  # fmt: skip
        return prober(here), len(counter.read_text())

    shown, ran = probe(fails_at=2, runs=5)
    assert (shown.bug, ran) == (True, 2)
    assert shown.detail.startswith("run 2 of up to 5 shows it: FAILED: ")
    clean, ran = probe(fails_at=9, runs=3)
    assert (clean.bug, ran) == (False, 3)
    assert clean.detail == "none of 3 runs shows it: PASSED"
    assert sorted(p.name for p in (tmp_path / "logs").iterdir())[:2] == [f"deepspeed-{here}-run1.log",
                                                                         f"deepspeed-{here}-run2.log"]  # fmt: skip


def test_a_probe_runs_any_node_id_from_its_directory_with_its_pytest_arguments(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """An upstream test is a node id relative to a checkout's ``tests/``, run with a plugin of its own
    (``-p pytest_dsrepro.upstream``): the invocation takes any directory and any pytest arguments."""
    tests = pytester.mkdir("checkout") / "tests"
    (tests / "unit").mkdir(parents=True)
    (tests / "unit" / "test_op.py").write_text("import os\n\ndef test_op(flag):\n    assert flag == 'on', flag\n")
    (tests / "their_plugin.py").write_text("import pytest\n\n@pytest.fixture\ndef flag():\n    return 'on'\n")
    invocation = Invocation("unit/test_op.py::test_op", ("-p", "their_plugin"), tests)
    env = {**os.environ, "PYTHONPATH": str(tests)}
    here = Version(deepspeed_version())
    probe = Prober(invocation, entered(lambda v: ReleaseEnv(sys.executable, env)))(here)
    assert (probe.bug, probe.detail) == (False, "PASSED")
    assert invocation.options() == ["--chdir", str(tests), "--", "-p", "their_plugin"]
    assert Invocation("t.py::t").options() == []
    alone = Prober(
        Invocation("unit/test_op.py::test_op", (), tests), entered(lambda v: ReleaseEnv(sys.executable, env))
    )
    without = alone(here)  # its fixture is the plugin's: the test errors, which says nothing about the bug
    assert (without.bug, without.detail[:6]) == (None, "ERROR:")


def test_a_probe_that_outlives_its_timeout_is_stopped_with_what_it_started(
    pytester: pytest.Pytester, process_tag: str
) -> None:
    """The last resort behind the world timeout: the probe's pytest and every process it started are stopped."""
    pytester.makepyfile(test_sleep="import subprocess, time\n\ndef test_sleep():\n"
                                   "    subprocess.Popen(['sleep', '300'])\n    time.sleep(300)\n")  # fmt: skip
    pytester.chdir()
    here = Version(deepspeed_version())
    prober = Prober(Invocation("test_sleep.py::test_sleep"), entered(lambda v: ReleaseEnv(sys.executable, dict(os.environ))),
                    timeout=5)  # fmt: skip
    started = time.monotonic()
    probe = prober(here)
    assert probe.bug is None
    assert probe.detail.startswith("did not finish within 5 s (stopped)")
    assert time.monotonic() - started < 60
    assert not wait_for_no_processes(process_tag, timeout=10)


def test_two_bisects_never_install_one_release_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each release's environment is guarded by a file lock: same release, one at a time; others in parallel."""
    from pytest_dsrepro.tools import install

    spans: dict[str, list[tuple[float, float]]] = {}

    def slow_install(version: str, **kwargs: Any) -> Any:
        start = time.monotonic()
        time.sleep(0.3)
        spans.setdefault(version, []).append((start, time.monotonic()))
        return SimpleNamespace(ok=True, reason=None)

    monkeypatch.setattr(install, "install_deepspeed", slow_install)
    monkeypatch.setattr(install, "environment_python", lambda directory, python: str(directory / "bin" / "python"))
    monkeypatch.setattr(install, "add_this_plugin", lambda python, constraints, log, extra: None)
    prepares = [environments.release_environment(tmp_path, tmp_path / "constraints.txt") for _ in range(2)]
    jobs = [(prepare, Version(v)) for prepare in prepares for v in ("0.16.3", "0.16.4")]
    with ThreadPoolExecutor(len(jobs)) as pool:
        envs = list(pool.map(lambda job: job[0](job[1]), jobs))
    (first, second), (other, _) = sorted(spans["0.16.3"]), sorted(spans["0.16.4"])
    assert first[1] <= second[0]  # the same release: strictly one after the other
    assert other[0] < first[1]
    assert first[0] < other[1]
    assert envs[0].python == str(environments.environment_dir(tmp_path, Version("0.16.3")) / "bin" / "python")
    assert envs[0].environ["VIRTUAL_ENV"] == str(environments.environment_dir(tmp_path, Version("0.16.3")))
    assert envs[0].environ["PATH"].split(os.pathsep)[0] == envs[0].environ["VIRTUAL_ENV"] + "/bin"


# --- the command ---------------------------------------------------------------------------------------------------


def test_command_prints_progress_and_the_specifier(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _, oracle = fake("0.16.4", skip=["0.16.9"])
    made: dict[str, Any] = {}

    class FakeProber:
        def __init__(self, invocation: Invocation, **kwargs: Any) -> None:
            made.update(invocation=invocation, **kwargs)

        def __call__(self, version: Version) -> Probe:
            return oracle(version)

    monkeypatch.setattr(releases, "available_releases", lambda: RELEASES)
    monkeypatch.setattr(environments, "release_environment", lambda *a, **k: "prepare")
    monkeypatch.setattr(bisect, "Prober", FakeProber)
    code = cli.main(["bisect", "r/test_x.py::test_y", "--good", "0.18.3", "--bad", "0.15.4", "--", "-x", "-v"])
    assert code == 0
    out, err = capsys.readouterr()
    assert made["invocation"] == Invocation("r/test_x.py::test_y", ("-x", "-v"))
    assert made["runs"] == 1
    assert err.startswith("bisecting r/test_x.py::test_y over 22 deepspeed releases 0.15.4 .. 0.18.3 (about 7 probes)")
    assert "[1/~7] deepspeed 0.15.4: installing and running ...\n    deepspeed 0.15.4: bug (fake) in 0.0 s" in err
    assert "    deepspeed 0.16.9: skipped (cannot install: no wheel) in 0.0 s" in err
    assert "[4/~8] deepspeed 0.17.0: installing and running ..." in err  # a skip adds a probe to the estimate
    assert out.splitlines()[0] == "first release where the outcome flips: deepspeed 0.16.4"
    assert '  @pytest.mark.ds_version(affected="<0.16.4", ...)' in out
    assert "skipped deepspeed 0.16.9: cannot install: no wheel" in out
    assert "note: the bug shows on --good" not in out  # 0.18.3, the --good end, is the one without the bug

    monkeypatch.setattr(releases, "available_releases", lambda: RELEASES[:3])
    assert cli.main(["bisect", "t.py::t", "--good", "0.16.9", "--bad", "0.15.4"]) == 2  # a usage error
    assert "dsrepro bisect: deepspeed 0.16.9 is not a release on the index" in capsys.readouterr().err
    monkeypatch.setattr(releases, "available_releases", lambda: RELEASES)
    monkeypatch.setattr(bisect, "Prober", lambda invocation, **kwargs: fake("9.0")[1])  # the bug on both ends
    assert cli.main(["bisect", "t.py::t", "--good", "0.18.3", "--bad", "0.15.4"]) == 1  # no verdict
    assert "dsrepro bisect: the bug shows on both deepspeed 0.15.4 and deepspeed 0.18.3" in capsys.readouterr().err


def test_result_summary_notes_swapped_labels() -> None:
    _, oracle = fake("0.16.4")
    result: Result = search(RELEASES, oracle)
    text = bisect.summary(result, "0.15.4", "0.18.3", 600.0)
    assert "note: the bug shows on --good 0.15.4 and not on --bad 0.18.3" in text
    assert text.endswith("releases probed (" + f"{len(result.probes)} tested, 0 skipped) in 10.0 min")


# --- real releases (slow, opt-in) ----------------------------------------------------------------------------------

MODULE_ID = """
import pytest

pytestmark = pytest.mark.ds_world


@pytest.mark.ds_config("zero3")
def test_user_ids_survive(ds_engine):
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    for i, layer in enumerate(model):
        layer.id = f"expert-{i}"
    ds_engine(model=model)
    assert [layer.id for layer in model] == ["expert-0", "expert-1", "expert-2"]
"""


def test_bisect_from_a_wheel_install_tests_the_release_it_names(
    plugin_dists: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 13: from an environment where the plugin is a wheel and DeepSpeed 0.19.8 is installed (as tox gives it),
    each probe runs the release it names (this once said 0.16.4 has no bug: every rank ran the environment's 0.19.8).
    Probes run in one uv environment per release, cached (``DSREPRO_CACHE_DIR``) and reused across runs."""
    from pytest_dsrepro.tools import install

    monkeypatch.setenv(CACHE_ENV, os.environ.get(CACHE_ENV, REAL_CACHE))
    constraints = ROOT / "constraints.txt"
    user = install.environment_python(tmp_path / "venv")
    _, wheel = plugin_dists
    runner = install._Runner(user, tmp_path / "install.log", echo=False)
    runner.install("installing the plugin's wheel", ["-c", str(constraints), "torch", str(wheel)])
    assert install.install_deepspeed("0.19.8", python=user, constraints=constraints).ok
    (tmp_path / "test_module_id.py").write_text(MODULE_ID)
    command = [str(tmp_path / "venv" / "bin" / "dsrepro"), "bisect", "test_module_id.py::test_user_ids_survive",
               "--good", "0.16.4", "--bad", "0.16.3", "--constraints", str(constraints)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "deepspeed 0.16.3: bug (FAILED" in proc.stderr
    assert "deepspeed 0.16.4: no bug (PASSED)" in proc.stderr
    assert "first release where the outcome flips: deepspeed 0.16.4" in proc.stdout
    assert '@pytest.mark.ds_version(affected="<0.16.4", ...)' in proc.stdout


@pytest.mark.skipif(not os.environ.get("DSREPRO_SLOW"), reason="installs DeepSpeed releases; set DSREPRO_SLOW=1")
def test_wide_bisect_finds_the_module_id_fix(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """ZeRO-3 overwrote user ``module.id`` until PR #6847, first released in 0.16.4: found among 23 releases."""
    monkeypatch.setenv("DSREPRO_CACHE_DIR", os.environ.get("DSREPRO_CACHE_DIR", REAL_CACHE))
    pytester.makepyfile(test_module_id=MODULE_ID)
    pytester.chdir()
    code = cli.main(["bisect", "test_module_id.py::test_user_ids_survive", "--good", "0.18.3", "--bad", "0.15.4"])
    out, err = capfd.readouterr()
    sys.stderr.write(err)
    assert code == 0, err
    assert "first release where the outcome flips: deepspeed 0.16.4" in out
    assert '@pytest.mark.ds_version(affected="<0.16.4", ...)' in out
