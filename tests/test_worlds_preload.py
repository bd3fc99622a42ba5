"""The fork server's preloading: found by a throwaway engine step, cached per install, and never a thread."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import RunPytest, first_run_without_a_preload_list


def _pythonpath() -> list[str]:
    return [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


def _python(code: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """A fresh interpreter (imports and threads must not touch the test process) with ``cwd`` importable."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": os.pathsep.join([str(cwd), *_pythonpath()])}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env
    )


def test_preloading_stops_before_a_module_that_starts_a_thread(tmp_path: Path) -> None:
    (tmp_path / "plain_a.py").write_text("VALUE = 1\n")
    (tmp_path / "starts_thread.py").write_text(
        "import threading\nstop = threading.Event()\nthreading.Thread(target=stop.wait, daemon=True).start()\n"
    )
    (tmp_path / "plain_c.py").write_text("VALUE = 3\n")
    proc = _python(
        """
        import json, sys
        from pytest_dsrepro.worlds.server.preload import import_ahead
        result = import_ahead(["plain_a", "no_such_module", "starts_thread", "plain_c"])
        print(json.dumps([result, "plain_c" in sys.modules]))
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    (imported, stopped, left), c_imported = json.loads(proc.stdout.splitlines()[-1])
    assert (imported, stopped, left) == (1, "starts_thread", "a thread")  # a missing module is skipped, not fatal
    assert not c_imported


def test_a_module_that_left_a_thread_in_the_server_is_left_to_the_ranks_next_time(tmp_path: Path) -> None:
    """A cached list can hold a module that starts a thread in the server although the throwaway children found it
    safe (a GPU machine's Triton did): the server stops there, says so, and takes it out of the list, so that the
    next server of this install imports the rest and forks with no thread."""
    (tmp_path / "plain_a.py").write_text("VALUE = 1\n")
    (tmp_path / "starts_thread.py").write_text(
        "import threading\nstop = threading.Event()\nthreading.Thread(target=stop.wait, daemon=True).start()\n"
    )
    (tmp_path / "plain_c.py").write_text("VALUE = 3\n")
    script = """
        import json, sys
        from pathlib import Path
        from pytest_dsrepro.worlds.server import preload
        here = Path.cwd()
        install = preload.Install(here, "0.0", "0.0", here, "cpu")
        listing = preload.list_file(install)
        if not listing.exists():
            preload._keep(listing, ["plain_a", "starts_thread", "plain_c"], [], 1.0)
        warmed = preload.warm(install)
        print(json.dumps([warmed.note, warmed.stopped, preload.threads(), json.loads(listing.read_text())]))
        """
    first = _python(script, tmp_path)
    assert first.returncode == 0, first.stderr
    note, stopped, threads, kept = json.loads(first.stdout.splitlines()[-1])
    assert stopped
    assert threads == 2
    assert note == "stopped at starts_thread, which left a thread; the next server leaves it to the ranks"
    assert kept["modules"] == ["plain_a", "plain_c"]
    assert kept["unsafe"] == ["starts_thread"]
    second = _python(script, tmp_path)
    assert second.returncode == 0, second.stderr
    note, stopped, threads, _ = json.loads(second.stdout.splitlines()[-1])
    assert not stopped, note
    assert threads == 1


@pytest.mark.usefixtures("process_tag")
def test_discovery_finds_what_an_engine_step_imports_and_is_cached(tmp_path: Path) -> None:
    """The real thing: a throwaway child runs ZeRO-1/2/3 steps (what a scout does: ``find``), the list is kept, and the
    server side imports it without a thread."""
    code = f"""
        import json
        import torch, deepspeed
        from pathlib import Path
        from pytest_dsrepro.worlds.server import comm_op, preload
        comm_op.warm_up()  # as the fork server does first: the op in its keyed cache, not rebuilt in the default one
        cache = Path({str(tmp_path / "cache")!r})
        where = Path(deepspeed.__file__).parent
        install = preload.Install(cache, deepspeed.__version__, torch.__version__, where, "cpu")
        ready_before = preload.ready(install, None)
        found = preload.find(install)
        listing = json.loads(preload.list_file(install).read_text())
        warmed = preload.warm(install)
        print(json.dumps([ready_before, found["kept"], warmed.modules, warmed.note, listing, preload.threads()]))
        """
    proc = _python(code, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ready_before, kept, modules, note, listing, threads = json.loads(proc.stdout.splitlines()[-1])
    assert (ready_before, kept, note) == (False, "now cached", "list cached")
    assert modules > 100
    assert {"torch._dynamo", "sympy"} <= set(listing["modules"])  # what a first ZeRO step pulls in
    assert threads == 1, "preloading left a thread (numpy's OpenBLAS pool ends its threads before a fork)"


def test_vetting_leaves_out_modules_that_start_threads_and_those_that_import_them(tmp_path: Path) -> None:
    """What the fork server will import is tried in throwaway children first: a module whose import starts a thread
    is left to the ranks, and so is one that brings it in; the rest is kept, in order."""
    (tmp_path / "plain_a.py").write_text("VALUE = 1\n")
    (tmp_path / "starts_thread.py").write_text(
        "import threading\nstop = threading.Event()\nthreading.Thread(target=stop.wait, daemon=True).start()\n"
    )
    (tmp_path / "uses_it.py").write_text("import starts_thread\n")
    (tmp_path / "plain_c.py").write_text("VALUE = 3\n")
    proc = _python(
        """
        import json, sys
        from pytest_dsrepro.worlds.server.preload import threads, vet
        safe, unsafe = vet(["plain_a", "starts_thread", "uses_it", "plain_c"])
        print(json.dumps([safe, unsafe, [m for m in ("plain_a", "starts_thread") if m in sys.modules], threads()]))
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    safe, unsafe, imported_here, threads = json.loads(proc.stdout.splitlines()[-1])
    assert (safe, unsafe) == (["plain_a", "plain_c"], ["starts_thread", "uses_it"])
    assert (imported_here, threads) == ([], 1), "vetting imported or started something in the process it vets for"


def test_a_list_found_beside_the_worlds_is_imported_once_it_is_ready(tmp_path: Path) -> None:
    """No world waits for the list: ``ready`` says no while the scout still works (the server forks its worlds
    unpreloaded meanwhile), yes once it has found it; ``warm`` then imports what it found."""
    (tmp_path / "slow_found.py").write_text("VALUE = 1\n")
    proc = _python(
        f"""
        import json, time
        from pathlib import Path
        from pytest_dsrepro.worlds.server import preload
        def search():
            time.sleep(1.5)
            return {{"names": ["slow_found"], "unsafe": [], "seconds": 1.5, "kept": "now cached"}}
        install = preload.Install(Path({str(tmp_path / "cache")!r}), "0.0", "0.0", Path("."), "cpu")
        scouted = preload.Child.start(search)
        started = time.monotonic()
        at_once = preload.ready(install, scouted)
        asked = time.monotonic() - started
        while not preload.ready(install, scouted):
            time.sleep(0.05)
        warmed = preload.warm(install, scouted)
        print(json.dumps([at_once, asked, warmed.modules, warmed.note]))
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    at_once, asked, modules, note = json.loads(proc.stdout.splitlines()[-1])
    assert (at_once, modules, note) == (False, 1, "list found beside the worlds in 2s, now cached")
    assert asked < 0.5


def test_engine_worlds_start_with_their_imports_done_and_trivial_worlds_never_pay(
    pytester: pytest.Pytester, run: RunPytest
) -> None:
    """The first world whose test builds engines makes the server preload; a trivial world before it does not."""
    pytester.makepyfile(
        """
        import sys
        import pytest

        @pytest.mark.ds_world
        def test_1_trivial(ds_rank):
            assert "torch._dynamo" not in sys.modules

        @pytest.mark.ds_world
        @pytest.mark.ds_config("zero1", "zero3")
        def test_2_engine(ds_engine, ds_rank):
            assert "torch._dynamo" in sys.modules  # an engine step needs it; nothing here imported it yet
        """
    )
    result = run("-v")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(
        ["worlds ran on: DeepSpeed *, accelerator cpu (communication backend gloo)*preloaded * modules in *"]
    )


TRIVIAL_DEEPSPEED_TESTS = """
import deepspeed  # the ranks use DeepSpeed: the fork server warms up for them
import pytest


@pytest.mark.ds_world(size=2)
@pytest.mark.parametrize("n", range(4))
def test_trivial(ds_rank, n):
    pass
"""


def test_a_first_run_with_a_short_timeout_passes_every_test(
    pytester: pytest.Pytester, run: RunPytest, monkeypatch: pytest.MonkeyPatch, private_tmp: Path
) -> None:
    """Issue 49 item 5: on a fresh cache with --ds-timeout 5, 3 of 4 trivial tests failed with "did not start the
    ranks" while the fork server found what a first engine step imports, and the server then crashed forking a world
    whose directory pytest had discarded. The search runs beside the worlds (the first worlds run without its list),
    goes on apart when the run ends before it, and the next run preloads what it found."""
    result = first_run_without_a_preload_list(pytester, run, monkeypatch, TRIVIAL_DEEPSPEED_TESTS, passed=4)
    result.stdout.fnmatch_lines(["worlds ran on: *; preloaded *"])
    assert [p.name for p in private_tmp.iterdir() if p.name.startswith("dsrepro-")] == []
    again = run("-v", "--ds-timeout", "5")
    again.assert_outcomes(passed=4)
    again.stdout.fnmatch_lines(["worlds ran on: *; preloaded * modules in *s (list cached)*"])


def test_a_run_of_one_deepspeed_world_is_not_warmed_ahead(pytester: pytest.Pytester, run: RunPytest) -> None:
    """One world uses DeepSpeed (one repro, one upstream test): its ranks import what they need themselves, beside
    each other, rather than after the server did it alone; the header says why nothing was preloaded."""
    pytester.makepyfile(
        test_trivial="""
        import pytest

        @pytest.mark.ds_world
        def test_trivial(ds_rank):
            pass
        """,
        test_deepspeed="""
        import sys
        import deepspeed
        import pytest

        @pytest.mark.ds_world
        def test_body(ds_rank):
            assert "torch._dynamo" not in sys.modules
        """,
    )
    result = run("-v")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["worlds ran on: *preloaded nothing: one world of this run uses DeepSpeed, *"])


def test_a_test_written_the_deepspeed_way_starts_warm(pytester: pytest.Pytester, run: RunPytest) -> None:
    """No fixture of the plugin's, DeepSpeed imported at the top of the module: the ranks still find what a first
    engine step imports already there, and DeepSpeed's first-use probes (py-cpuinfo, the op-compatibility probe, an
    op builder's CPU flags) run no subprocess in them: the fork server did that once."""
    pytester.makepyfile(
        """
        import subprocess, sys
        import deepspeed
        import pytest

        @pytest.mark.ds_world(size=2)
        @pytest.mark.parametrize("again", [False, True])  # two worlds: warming ahead pays
        def test_body(ds_rank, again):
            from deepspeed.accelerator import get_accelerator

            assert "torch._dynamo" in sys.modules
            started = []
            real = subprocess.Popen.__init__

            def spy(self, *args, **kwargs):
                started.append(args[0] if args else kwargs.get("args"))
                real(self, *args, **kwargs)

            subprocess.Popen.__init__ = spy
            try:
                assert deepspeed.ops.__compatible_ops__
                assert "-march" in " ".join(get_accelerator().create_op_builder("CPUAdamBuilder").cxx_args())
            finally:
                subprocess.Popen.__init__ = real
            assert started == []
        """
    )
    result = run("-v")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["worlds ran on: *preloaded *; first use done ahead: cpuinfo, op probe (*"])


def test_a_list_is_kept_per_accelerator(tmp_path: Path) -> None:
    """A CUDA server's list holds what a CPU server of the same install must not import (Triton's ops started a
    thread in one on an H100): each accelerator finds and keeps its own."""
    from pytest_dsrepro.worlds.server.preload import Install, list_file

    cpu, cuda = (list_file(Install(tmp_path, "0.19.8", "2.13.0", tmp_path, a)) for a in ("cpu", "cuda"))
    assert cpu != cuda
    assert cpu.parent == cuda.parent == tmp_path / "preload"
