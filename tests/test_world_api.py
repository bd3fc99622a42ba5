"""The public API for worlds a test does not name (issue 21): autouse rank fixtures, worlds without the plugin's
process group or launcher variables, one test per world size, and ``run_in_world`` from fixtures."""

from __future__ import annotations

import pytest

from conftest import RunPytest


def test_rank_fixtures_the_body_does_not_name_run_in_every_rank(pytester: pytest.Pytester, run: RunPytest) -> None:
    """``rank_fixture(autouse=True)`` and ``usefixtures``: set up before the body's own, torn down after, in each rank."""
    pytester.makeconftest(
        """
        from pytest_dsrepro import rank_fixture

        @rank_fixture(autouse=True)
        def seeded(ds_rank, tmp_path):
            import torch
            torch.manual_seed(1234)
            (tmp_path / f"setup-{ds_rank}").write_text("")
            yield
            (tmp_path / f"teardown-{ds_rank}").write_text("")
        """
    )
    pytester.makepyfile(
        """
        import os
        import pytest
        import torch
        from pytest_dsrepro import rank_fixture

        @rank_fixture
        def marked(ds_rank):
            os.environ["MARKED"] = str(ds_rank)

        @pytest.mark.ds_world
        def test_names_nothing(tmp_path):
            rank = torch.distributed.get_rank()
            assert (tmp_path / f"setup-{rank}").exists() and not (tmp_path / f"teardown-{rank}").exists()
            assert torch.equal(torch.rand(2), (torch.manual_seed(1234), torch.rand(2))[1])

        @pytest.mark.ds_world
        @pytest.mark.usefixtures("marked")
        def test_uses_fixtures():
            assert os.environ["MARKED"] == str(torch.distributed.get_rank())

        def test_not_a_world_test(tmp_path, seeded):
            assert seeded is None and not list(tmp_path.iterdir())  # no ranks: nothing to set up, ds_rank unasked
        """
    )
    result = run("-v")
    result.assert_outcomes(passed=3)


def test_one_test_per_world_size(pytester: pytest.Pytester, run: RunPytest) -> None:
    pytester.makepyfile(
        """
        import pytest
        import torch.distributed as dist

        @pytest.mark.ds_world(size=[1, 3])
        @pytest.mark.parametrize("n", [7])
        def test_sizes(ds_world_size, n):
            assert dist.get_world_size() == ds_world_size

        @pytest.mark.ds_world(size=[1, 2], timeout=60)
        class TestMerged:
            def test_class_size(self):
                assert dist.get_world_size() in (1, 2)

            @pytest.mark.ds_world(size=3)
            def test_own_size_keeps_the_class_timeout(self):
                assert dist.get_world_size() == 3
        """
    )
    result = run("-v", "--ds-timeout", "1")
    result.stdout.fnmatch_lines_random(
        [
            "*::test_sizes[[]1rank-7[]] PASSED*",
            "*::test_sizes[[]3ranks-7[]] PASSED*",
            "*::TestMerged::test_class_size[[]1rank[]] PASSED*",
            "*::TestMerged::test_class_size[[]2ranks[]] PASSED*",
            "*::TestMerged::test_own_size_keeps_the_class_timeout PASSED*",
        ]
    )
    result.assert_outcomes(passed=5)


def test_a_bad_list_of_sizes_fails_collection_naming_the_marker(pytester: pytest.Pytester, run: RunPytest) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.ds_world(size=[2, 2])
        def test_twice():
            pass
        """
    )
    result = run()
    result.stdout.fnmatch_lines(["*@pytest.mark.ds_world on *::test_twice: size=[[]2, 2[]] names a size twice*"])
    assert result.ret == pytest.ExitCode.INTERRUPTED


def test_worlds_without_the_plugins_process_group_or_launcher_variables(
    pytester: pytest.Pytester, run: RunPytest
) -> None:
    """``process_group=False``: no group and DeepSpeed's comm layer unbound, yet MASTER_PORT serves the body's own
    ``init_process_group()``; ``launcher_env=False``: none of torchrun's variables."""
    pytester.makepyfile(
        """
        import os
        import pytest
        import torch
        import torch.distributed as dist
        import deepspeed
        import deepspeed.comm

        @pytest.mark.ds_world(process_group=False)
        def test_own_group(ds_rank):
            assert not dist.is_initialized() and not deepspeed.comm.is_initialized()
            assert os.environ["RANK"] == str(ds_rank) and os.environ["WORLD_SIZE"] == "2"
            deepspeed.init_distributed("gloo")
            t = torch.ones(1)
            deepspeed.comm.all_reduce(t)
            assert t.item() == 2

        @pytest.mark.ds_world(launcher_env=False)
        def test_group_without_variables():
            assert dist.get_world_size() == 2 and deepspeed.comm.get_world_size() == 2
            assert not {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"} & set(os.environ)

        @pytest.mark.ds_world(process_group=False, launcher_env=False, size=1)
        def test_nothing():
            assert not dist.is_initialized() and "MASTER_PORT" not in os.environ
        """
    )
    run().assert_outcomes(passed=3)


SAVE_AND_LOAD = """
import pytest
import torch.distributed as dist
from pytest_dsrepro import rank_fixture, run_in_world

def save(directory, ds_rank, ds_world_size):
    assert dist.get_world_size() == ds_world_size == 4
    (directory / f"shard-{ds_rank}").write_text(str(ds_rank))

class Saver:
    def save(self, directory, ds_rank):
        (directory / f"method-{ds_rank}-of-{dist.get_world_size()}").write_text("")

@rank_fixture
def in_every_rank(tmp_path, ds_rank):
    (tmp_path / f"rank-fixture-{ds_rank}").write_text("")

@pytest.fixture
def saved(request, tmp_path):
    run_in_world(request, save, size=4, kwargs={"directory": tmp_path})
    run_in_world(request, Saver().save, size=3, kwargs={"directory": tmp_path}, usefixtures=["in_every_rank"])
    return tmp_path

@pytest.mark.ds_world(size=2)
def test_load_in_two(saved):
    assert dist.get_world_size() == 2
    names = sorted(p.name for p in saved.iterdir())
    assert names == [*(f"method-{r}-of-3" for r in range(3)), *(f"rank-fixture-{r}" for r in range(3)),
                     *(f"shard-{r}" for r in range(4))]
"""


def test_run_in_world_saves_in_four_ranks_for_a_test_of_two(pytester: pytest.Pytester, run: RunPytest) -> None:
    pytester.makepyfile(SAVE_AND_LOAD)
    run().assert_outcomes(passed=1)


def test_run_in_world_failures_and_refusals_as_a_user_sees_them(pytester: pytest.Pytester, run: RunPytest) -> None:
    pytester.makepyfile(
        """
        import pytest
        import torch.distributed as dist
        from pytest_dsrepro import run_in_world

        def breaks(ds_rank):
            if ds_rank == 2:
                raise ValueError("shard 2 is corrupt")

        def skips():
            pytest.skip("no checkpoint format here")

        @pytest.fixture
        def broken(request):
            run_in_world(request, breaks, size=3)

        @pytest.fixture
        def skipped(request):
            run_in_world(request, skips, size=2)

        @pytest.fixture
        def nested(request):
            def inner():
                pass
            run_in_world(request, inner, size=2)

        @pytest.fixture
        def not_a_rank_fixture(request):
            run_in_world(request, skips, size=2, usefixtures=["tmp_path"])

        def test_broken(broken):
            pass

        def test_skipped(skipped):
            pass

        def test_nested(nested):
            pass

        def test_plain_fixture(not_a_rank_fixture):
            pass
        """
    )
    result = run("-rs")
    result.assert_outcomes(errors=3, skipped=1)
    result.stdout.fnmatch_lines_random(
        [
            "*the 3-rank world of run_in_world(breaks) in *::test_broken failed:*",
            "rank 2: ValueError: shard 2 is corrupt*",
            "*no checkpoint format here*",
            "*run_in_world(nested.<locals>.inner) in *::test_nested: the ranks find the function by its module and name,"
            " so it must be defined at the top level of a module*",
            "*run_in_world(skips) in *::test_plain_fixture: usefixtures names 'tmp_path', which is not a rank fixture*",
        ]
    )
