"""Fault injection (issue 11): each fault injected for real, and what the user then sees.

Every test here runs pytest in a subprocess with real gloo worlds, injects one fault (a crash, a signal, a flood, a
typo) and checks both the words the user reads and that nothing is left: no process (``process_tag``), no world
directory or server log (``private_tmp``), no ``/dev/shm`` buffer of the worlds involved. How long each fault takes
to reach its verdict is measured by ``benchmarks/faults.py``, not asserted here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import RunPytest, leftovers


def test_a_rank_that_crashes_after_reporting_a_pass_fails(
    pytester: pytest.Pytester, run: RunPytest, private_tmp: Path
) -> None:
    """Item 4: the rank writes PASSED, then dies by SIGSEGV on its way out; the exit code outweighs the report."""
    pytester.makepyfile(
        """
        import os, signal
        import pytest

        @pytest.mark.ds_world
        def test_dies_on_exit(ds_rank):
            if ds_rank == 1:  # the harness exits the rank with os._exit once its report is written
                os._exit = lambda code: os.kill(os.getpid(), signal.SIGSEGV)
        """
    )
    result = run()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["rank 1: crashed: killed by signal SIGSEGV after its body passed"])
    assert leftovers(private_tmp) == []


def test_the_fork_servers_death_mid_world_is_told_at_once(
    pytester: pytest.Pytester, run: RunPytest, private_tmp: Path
) -> None:
    """Item 6: a rank kills the fork server. The test fails as a harness error naming the server's death (not as a
    hang at the world's timeout), and the next test gets a new server."""
    pytester.makepyfile(
        """
        import os, signal, time
        import pytest

        @pytest.mark.ds_world(timeout=600)
        def test_server_dies(ds_rank):
            if ds_rank == 0:
                os.kill(os.getppid(), signal.SIGKILL)
            time.sleep(3600)

        @pytest.mark.ds_world
        def test_next(ds_rank):
            pass
        """
    )
    result = run("-p", "no:randomly", timeout=120)
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(
        [
            "*pytest-dsrepro could not run this test's world: the pytest-dsrepro fork server died while this test's "
            "world ran (killed by signal SIGKILL), *s in; its ranks died with it. Its log:",
        ]
    )
    assert "hung" not in result.stdout.str()
    assert leftovers(private_tmp) == []
