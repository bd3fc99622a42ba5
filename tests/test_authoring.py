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
