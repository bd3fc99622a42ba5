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
