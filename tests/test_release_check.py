"""Issue 13: the ranks run the DeepSpeed the run is about, or the run stops saying which one they would have run.

The fork server reports the version and directory it imported DeepSpeed from; the pytest process compares them with
what it resolves itself (metadata and import spec, nothing imported). A mismatch used to go unnoticed: a bisect
from a wheel install judged every probe against the environment's own release.
"""

from __future__ import annotations

import os
import site
import textwrap

import pytest

from conftest import RunPytest
from pytest_dsrepro.core import versions
from pytest_dsrepro.core.versions import Release, same_release
from pytest_dsrepro.worlds.client.server_process import server_pythonpath


def test_an_installed_plugin_adds_nothing_to_the_servers_path() -> None:
    """A wheel's package root is a site directory: put on PYTHONPATH it would hide ``PYTHONPATH=<release dir>``."""
    site_dir = site.getsitepackages()[0]
    assert server_pythonpath(site_dir, "/releases/0.16.4", [site_dir]) == "/releases/0.16.4"
    assert server_pythonpath(site_dir, None, [site_dir]) is None


def test_a_source_checkout_comes_after_the_callers_entries() -> None:
    path = server_pythonpath("/src/checkout", os.pathsep.join(["/releases/0.16.4", "/more"]), ["/venv/site"])
    assert path == os.pathsep.join(["/releases/0.16.4", "/more", "/src/checkout"])
    assert server_pythonpath("/src/checkout", "/src/checkout", []) == "/src/checkout"  # never twice


def test_releases_compare_as_versions_at_one_real_place(tmp_path: os.PathLike[str]) -> None:
    link = os.path.join(tmp_path, "link")
    os.symlink(tmp_path, link)
    assert same_release(Release("0.16.4", str(tmp_path)), Release("0.16.4.0", link))
    assert not same_release(Release("0.16.4", str(tmp_path)), Release("0.19.8", str(tmp_path)))
    assert not same_release(Release("0.16.4", "/a/deepspeed"), Release("0.16.4", "/b/deepspeed"))
    assert not same_release(Release(None, None), Release("0.16.4", "/a/deepspeed"))


def test_this_interpreter_resolves_deepspeed_without_importing_it() -> None:
    import sys

    imported = "deepspeed" in sys.modules
    release = versions.resolved("deepspeed", "deepspeed")
    assert release.version == versions.installed_text("deepspeed")
    assert release.path is not None
    assert os.path.isfile(os.path.join(release.path, "__init__.py"))
    assert ("deepspeed" in sys.modules) == imported


def test_ranks_that_would_import_another_deepspeed_stop_the_run(pytester: pytest.Pytester, run: RunPytest) -> None:
    """A directory holding ``deepspeed/`` next to the tests (a DeepSpeed source checkout, say): pytest's default
    import mode puts it first on pytest's path, the fork server imported the installed release. The run stops
    before any verdict, once, naming both."""
    checkout = pytester.mkdir("checkout")
    (checkout / "deepspeed").mkdir()
    (checkout / "deepspeed" / "__init__.py").write_text("__version__ = '0.0.0'\n")
    (checkout / "test_repro.py").write_text(
        textwrap.dedent(
            """
        import pytest

        @pytest.mark.ds_world(size=2)
        def test_first(ds_rank):
            pass

        @pytest.mark.ds_world(size=2)
        def test_second(ds_rank):
            pass
            """
        )
    )
    result = run("checkout")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    here = os.path.realpath(checkout / "deepspeed")
    installed = versions.resolved("deepspeed", "deepspeed")
    result.stdout.fnmatch_lines(
        [
            f"*pytest-dsrepro: this pytest resolves deepspeed {installed.version} from {here}, but the ranks import "
            f"deepspeed {installed.version} from {installed.path}; every verdict would be about a release the ranks "
            "did not run*",
        ]
    )
    assert result.stdout.str().count("every verdict would be about") == 1
    result.assert_outcomes()  # nothing passed, failed or was judged
