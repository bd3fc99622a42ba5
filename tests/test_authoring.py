"""Writing a repro feels like writing a pytest test (issue 12): what crosses into a rank, seen as a user sees it."""

from __future__ import annotations

import pytest

from conftest import RunPytest


def test_plain_assert_in_a_rank_shows_pytest_introspection(pytester: pytest.Pytester, run: RunPytest) -> None:
    """The rank compiles the test module with pytest's rewriter: the values, not a bare AssertionError."""
    pytester.makepyfile(
        """
        import pytest

        def helper_total(xs):
            return sum(xs)

        @pytest.mark.ds_world
        def test_lists(ds_rank):
            xs = [1, 2, ds_rank]
            assert xs == [1, 2, 3]

        @pytest.mark.ds_world
        def test_call(ds_rank):
            assert helper_total([ds_rank, 1]) == 10
        """
    )
    result = run()
    result.assert_outcomes(failed=2)
    out = result.stdout.str()
    assert "rank 0: AssertionError: assert [1, 2, 0] == [1, 2, 3]" in out
    assert "rank 1: AssertionError: assert [1, 2, 1] == [1, 2, 3]" in out
    result.stdout.fnmatch_lines(["AssertionError: assert 1 == 10", " +  where 1 = helper_total([[]0, 1[]])"])


def test_assert_plain_turns_rewriting_off_in_ranks_too(pytester: pytest.Pytester, run: RunPytest) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ds_world
        def test_lists(ds_rank):
            assert [ds_rank] == [7]
        """
    )
    result = run("--assert=plain")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["ranks 0-1: AssertionError"])


def test_environment_changes_made_by_fixtures_reach_the_ranks(
    pytester: pytest.Pytester, run: RunPytest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fork server's environment is the one pytest had when it started; each world carries what changed since."""
    monkeypatch.setenv("DSREPRO_TEST_INHERITED", "from the shell")
    pytester.makepyfile(
        """
        import os
        import pytest

        @pytest.fixture
        def tuned(monkeypatch):
            monkeypatch.setenv("DSREPRO_TEST_SETTING", "on")
            monkeypatch.delenv("DSREPRO_TEST_INHERITED")

        @pytest.mark.ds_world
        def test_first_sees_the_fixture(ds_rank, tuned):
            assert os.environ.get("DSREPRO_TEST_SETTING") == "on"
            assert "DSREPRO_TEST_INHERITED" not in os.environ

        @pytest.mark.ds_world
        def test_next_sees_it_undone(ds_rank):
            assert "DSREPRO_TEST_SETTING" not in os.environ
            assert os.environ["DSREPRO_TEST_INHERITED"] == "from the shell"
        """
    )
    run().assert_outcomes(passed=2)


def test_environ_changes_between_two_environments() -> None:
    from pytest_dsrepro.worlds.protocol import EnvironChanges

    changes = EnvironChanges.between({"A": "1", "B": "2", "C": "3"}, {"A": "1", "B": "20", "D": "4"})
    assert changes == EnvironChanges(set=(("B", "20"), ("D", "4")), unset=("C",))
    environ = {"A": "1", "B": "2", "C": "3", "RANK": "0"}
    changes.apply(environ)
    assert environ == {"A": "1", "B": "20", "D": "4", "RANK": "0"}


def test_deepspeed_comm_is_bound_to_the_world_before_the_body(pytester: pytest.Pytester, run: RunPytest) -> None:
    """zero.Init with a config dict validates the batch size against the real world, with no init_distributed call."""
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ds_world
        @pytest.mark.ds_config("zero3")
        def test_zero_init(ds_config, ds_world_size):
            import deepspeed, torch
            assert deepspeed.comm.is_initialized()
            assert deepspeed.comm.get_world_size() == ds_world_size == 2
            with deepspeed.zero.Init(config_dict_or_path=ds_config):
                layer = torch.nn.Linear(4, 4)
            assert layer.weight.ds_numel == 16

        @pytest.mark.ds_world
        def test_module_imports_deepspeed(ds_rank):
            import deepspeed.comm as comm
            assert comm.get_world_size() == 2
        """
    )
    run().assert_outcomes(passed=2)


def test_worlds_of_tests_without_deepspeed_do_not_bind_it(pytester: pytest.Pytester, run: RunPytest) -> None:
    pytester.makepyfile(
        """
        import sys
        import pytest

        @pytest.mark.ds_world
        def test_plain(ds_rank):
            comm = sys.modules["deepspeed.comm.comm"]  # loaded by the fork server, never bound here
            assert comm.cdb is None
        """
    )
    run().assert_outcomes(passed=1)


def test_imports_finds_a_package_anywhere_in_a_module() -> None:
    from pytest_dsrepro.core.source import imports

    assert imports("def test_x():\n    import deepspeed.comm as c\n", "deepspeed")
    assert imports("from deepspeed.runtime import engine\n", "deepspeed")
    assert not imports("import deepspeedish\nfrom . import deepspeed\n", "deepspeed")
    assert not imports("def broken(:\n", "deepspeed")


def test_a_module_is_read_once_however_many_of_its_tests_ask(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pytest_dsrepro.core import source
    from pytest_dsrepro.session.rank_job import uses_deepspeed

    imports = source.imports
    read = []
    monkeypatch.setattr(source, "imports", lambda text, package: read.append(package) or imports(text, package))
    pytester.makepyfile(
        test_using="import pytest\n@pytest.mark.parametrize('i', range(50))\ndef test(i):\n    import deepspeed.comm",
        test_plain="def test_a(): pass\ndef test_b(): pass",
    )
    items, _ = pytester.inline_genitems()
    assert [uses_deepspeed(item) for item in items * 2] == ([False] * 2 + [True] * 50) * 2  # test_plain.py first
    assert read == ["deepspeed", "deepspeed"]


def test_xfail_skip_and_return_values_in_ranks_behave_as_in_pytest(pytester: pytest.Pytester, run: RunPytest) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ds_world
        def test_xfails(ds_rank):
            pytest.xfail("known upstream")

        @pytest.mark.ds_world
        def test_skips(ds_rank):
            if ds_rank == 1:
                pytest.skip("rank 1 has no use for it")

        @pytest.mark.ds_world
        def test_returns(ds_rank):
            return ds_rank
        """
    )
    result = run("-rsx")
    result.assert_outcomes(xfailed=1, skipped=1, passed=1, warnings=1)
    result.stdout.fnmatch_lines(["XFAIL *::test_xfails - known upstream"])
    # at the body's own line, not the plugin's
    result.stdout.fnmatch_lines(["SKIPPED [[]1[]] test_xfail_skip_*.py:10: rank 1 has no use for it"])
    result.stdout.fnmatch_lines(
        ["*PytestReturnNotNoneWarning: Test functions should return None, but *::test_returns returned <class 'int'>*"]
    )
    strict = run("-W", "error::pytest.PytestReturnNotNoneWarning", "-k", "test_returns")
    strict.assert_outcomes(failed=1)


def test_xunit_setup_in_a_world_test_is_refused_clearly(pytester: pytest.Pytester, run: RunPytest) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ds_world
        class TestState:
            def setup_method(self, method):
                self.ready = True

            def test_ready(self, ds_rank):
                assert self.ready
        """
    )
    result = run()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        [
            "*::TestState::test_ready: TestState.setup_method runs in the pytest process, not in the ranks, *use a fixture*"
        ]
    )


def test_a_fixture_computing_with_ds_rank_fails_at_setup_saying_how(pytester: pytest.Pytester, run: RunPytest) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.fixture
        def seed(ds_rank):
            return 1000 + ds_rank * 7

        @pytest.fixture
        def label(ds_rank):
            return f"rank {ds_rank}"

        @pytest.mark.ds_world
        def test_seed(seed):
            pass

        @pytest.mark.ds_world
        def test_label(label):
            pass
        """
    )
    result = run()
    result.assert_outcomes(errors=2)
    result.stdout.fnmatch_lines(
        [
            "E * TypeError: ds_rank is a placeholder outside the ranks: fixtures run once, in the pytest process, *",
            "*Make the fixture a rank fixture (`from pytest_dsrepro import rank_fixture`, `@rank_fixture` instead of*",
        ]
    )
    assert result.stdout.str().count("E       TypeError: ds_rank is a placeholder outside the ranks") == 2


def test_rank_placeholders_compare_only_with_each_other() -> None:
    from pytest_dsrepro.worlds.protocol import RankValue

    assert RankValue("rank") == RankValue("rank") != RankValue("world_size")
    assert len({RankValue("rank"), RankValue("rank")}) == 1
    with pytest.raises(TypeError, match="ds_world_size is a placeholder outside the ranks"):
        _ = RankValue("world_size") == 2


def test_a_test_file_edited_during_the_run_is_refused_not_run(pytester: pytest.Pytester, run: RunPytest) -> None:
    """Ranks import the test file anew; once it was edited mid-run they would run a body pytest never collected, so
    the test fails saying so, as a harness error (never judged as the bug, even with ``raises=Exception``)."""
    path = pytester.makepyfile(
        """
        import pathlib
        import pytest

        def test_edits_this_file():
            path = pathlib.Path(__file__)
            path.write_text(path.read_text().replace("assert True  # collected", "assert False  # edited"))

        @pytest.mark.ds_world
        @pytest.mark.ds_version(affected=">=0", raises=Exception)
        def test_world():
            assert True  # collected
        """
    )
    result = run()
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            f"*pytest-dsrepro could not run this test's world: {path} changed since pytest collected it, so its "
            "ranks would run code pytest never saw; run pytest again",
            "UNEXPECTED  *::test_world  -- no world ran: *changed since pytest collected it*",
        ]
    )


def test_rank_fixtures_run_in_every_rank_and_tear_down_there(pytester: pytest.Pytester, run: RunPytest) -> None:
    """``@rank_fixture``: set up after rendezvous with the rank's own ``ds_rank``, from other fixtures (pytest's and
    rank fixtures) and after the fixes; torn down in the rank after the body, last first; a teardown that fails
    fails its rank."""
    pytester.makeconftest(
        """
        from pytest_dsrepro import rank_fixture

        @rank_fixture
        def group_size():
            import torch.distributed as dist
            return dist.get_world_size()  # the world exists: rank fixtures run after rendezvous
        """
    )
    pytester.makepyfile(
        """
        import json
        import os
        import pytest
        from pytest_dsrepro import rank_fixture

        def patch(monkeypatch):
            monkeypatch.setattr(json, "patched", True, raising=False)

        @pytest.fixture
        def base(tmp_path):
            return tmp_path

        @rank_fixture
        def rank_dir(base, ds_rank):
            path = base / f"rank{ds_rank}"
            path.mkdir()
            yield path
            (path / "torn-down").write_text(str(getattr(json, "patched", False)))

        @rank_fixture
        def seed(rank_dir, ds_rank, group_size):
            yield 1000 + 7 * ds_rank + 100 * group_size
            assert not (rank_dir / "torn-down").exists()  # torn down before rank_dir

        @pytest.mark.ds_world
        @pytest.mark.ds_version(affected=">=0", raises=KeyError, match="unpatched", fix=patch)
        def test_in_ranks(seed, rank_dir, ds_rank, base):
            assert seed == 1200 + 7 * ds_rank
            assert rank_dir == base / f"rank{ds_rank}"
            if not getattr(json, "patched", False):
                raise KeyError("unpatched")

        def test_torn_down_in_each_rank(tmp_path_factory):
            found = sorted(p.read_text() for p in tmp_path_factory.getbasetemp().rglob("torn-down"))
            # [stock] (torn down after its body failed, as pytest's fixtures are) and [fixed], fix still on at teardown
            assert found == ["False", "False", "True", "True"]

        @rank_fixture
        def broken_teardown(ds_rank):
            yield
            if ds_rank == 1:
                raise RuntimeError("teardown failed in rank 1")

        @pytest.mark.ds_world
        def test_teardown_failure(broken_teardown):
            pass
        """
    )
    result = run("-p", "no:randomly")
    result.assert_outcomes(passed=2, xfailed=1, failed=1)
    result.stdout.fnmatch_lines(["*test_teardown_failure*", "*rank 1: RuntimeError: teardown failed in rank 1*"])
