"""What a kept rank finds after a test, one leftover at a time (issue 49, item 1), at the lowest level that proves it:
the fork server's ``Baseline.take``, a forked rank's ``settled`` baseline and ``ProcessState``, one leftover made, then
what the rank does between two tests (``spawned_rank._put_back``): the leftovers it names (and then ends its world),
else what it put back.

One child process imports torch and DeepSpeed once, as the fork server does, and forks one rank per case (the suite's
own process never imports torch); each case is its own test here. ``tests/test_reuse.py`` runs the same leftovers in
real worlds, with reuse and without.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

#: Each case: what it does in a kept rank after the baseline, then what it reports once the rank put back what it
#: could (``after``, a Python expression evaluated then), as ``(make, after)``.
CASES = {
    "default-dtype": ("torch.set_default_dtype(torch.float64)", "torch.get_default_dtype() is torch.float64"),
    "grad-mode": ("torch.set_grad_enabled(False)", "torch.is_grad_enabled()"),
    "autocast": ("torch.autocast('cpu').__enter__()", "torch.is_autocast_enabled('cpu')"),
    "default-device": ("torch.set_default_device('meta')", "str(torch.get_default_device())"),
    "deterministic": ("torch.use_deterministic_algorithms(True)", "torch.are_deterministic_algorithms_enabled()"),
    "zero-init-entered": ("deepspeed.zero.Init(config_dict_or_path=Z3).__enter__(); torch.nn.Linear(4, 4)", "0"),
    "zero-init-left": (
        "with deepspeed.zero.Init(config_dict_or_path=Z3):\n    torch.nn.Linear(4, 4)",
        "(Init.param_id, torch.nn.Linear(4, 4).weight.numel())",
    ),
    "deepspeed-swaps-linear": (
        "from deepspeed.runtime.zero.linear import zero3_linear_wrap\ntorch.nn.functional.linear = zero3_linear_wrap",
        "torch.nn.functional.linear is torch._C._nn.linear",
    ),
    "replaced-function": ("torch.nn.functional.gelu = lambda x: x * 0", "0"),
    "replaced-method": ("torch.nn.Linear.forward = lambda self, x: x", "0"),
    "deleted-name": ("del torch.nn.functional.gelu", "0"),
    "mock": ("import unittest.mock\nunittest.mock.patch('torch.add').start()", "0"),
    "module-replaced": ("import types\nsys.modules['json'] = types.ModuleType('json')", "0"),
    "deepspeed-global": ("deepspeed.comm.get_rank = lambda group=None: 99", "deepspeed.comm.get_rank is GET_RANK"),
    "thread": ("threading.Thread(target=time.sleep, args=(30,), daemon=True).start()", "0"),
    "child-process": ("CHILD.append(subprocess.Popen(['sleep', '30']))", "0"),
    "file-lock": ("HELD.append(open('lock', 'w')); fcntl.flock(HELD[-1], fcntl.LOCK_EX)", "0"),
    "stdout": ("sys.stdout = io.StringIO()", "0"),
    "signal-handler": ("signal.signal(signal.SIGUSR2, lambda *a: None)", "0"),
    "random-streams": (
        "torch.rand(9); random.random(); numpy.random.rand(9)",
        "(torch.rand(1).item(), random.random(), numpy.random.rand()) == FIRST",
    ),
    "warnings-filter": ("warnings.simplefilter('error')", "list(warnings.filters) == list(baseline.filters)"),
    "logger-level": (
        "logging.getLogger('deepspeed').setLevel(logging.CRITICAL)",
        "logging.getLogger('deepspeed').level",
    ),
    "environment": ("os.environ['DSREPRO_LEAK'] = '1'", "'DSREPRO_LEAK' in os.environ"),
}

SCRIPT = """
import fcntl, io, json, logging, os, random, signal, subprocess, sys, threading, time, warnings
import deepspeed, numpy, numpy.random, torch
import torch.distributed as dist
from deepspeed.runtime.zero.partition_parameters import Init
from pytest_dsrepro.worlds.rank import namespaces, spawned_rank
from pytest_dsrepro.worlds.rank.leftovers import ProcessState
from pytest_dsrepro.worlds.rank.reuse_reset import Baseline

os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
logging.getLogger("deepspeed").setLevel(logging.WARNING)
Z3 = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
GET_RANK, HELD, CHILD = deepspeed.comm.get_rank, [], []
forked = Baseline.take()  # as the fork server does, before it forks a reusable world
cases, compare = json.loads(sys.argv[1]), sys.argv[2]
found = {}
for name, (make, after) in cases.items():
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            if compare == "objects":
                forked.namespaces.type_dict = None  # a CPython whose dict versions cannot be read
            baseline = forked.settled()
            state = ProcessState.take()
            FIRST = (torch.rand(1).item(), random.random(), numpy.random.rand())
            for set_state, saved in baseline.streams:
                set_state(saved)
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # as a rank's test does
            deepspeed.init_distributed(dist_backend="gloo")
            exec(make)
            dist.destroy_process_group()
            left = spawned_rank._put_back(baseline, state)
            for child in CHILD:
                child.kill()
            sys.stdout = sys.__stdout__
            os.write(w, json.dumps({"left": left, "after": repr(eval(after))}).encode())
        except BaseException as exc:
            os.write(w, json.dumps({"error": repr(exc)}).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        found[name] = json.loads(f.read() or "{}")
    os.waitpid(pid, 0)
print(json.dumps(found))
"""


@pytest.fixture(scope="module", params=["versions", "objects"])
def kept_rank(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    """Every case's report from its forked rank: namespaces compared by their dict versions (CPython's own), and
    object by object (the fallback where those cannot be read)."""
    workdir = tmp_path_factory.mktemp("kept")
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT), json.dumps(CASES), request.param],
        cwd=workdir, capture_output=True, text=True, timeout=600, env={**os.environ, "DS_ACCELERATOR": "cpu"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    found: dict[str, dict[str, object]] = json.loads(proc.stdout.strip().splitlines()[-1])
    return found


#: The cases that end the kept rank's world, and words its report must say.
ENDS = {
    "default-dtype": "torch's default dtype (torch.set_default_dtype) changed: torch.float64, forked with torch.float32",
    "grad-mode": "grad mode (torch.set_grad_enabled, torch.no_grad) changed: False, forked with True",
    "autocast": "autocast (torch.autocast) changed",
    "default-device": "torch's default device (torch.set_default_device) changed",
    "deterministic": "deterministic algorithms (torch.use_deterministic_algorithms) changed",
    "zero-init-entered": "deepspeed.zero.Init contexts entered and not left changed: 1, forked with 0",
    "replaced-function": "torch.nn.functional.gelu was replaced by <lambda> (<string>:1)",
    "replaced-method": "torch.nn.modules.linear.Linear.forward was replaced by <lambda> (<string>:1)",
    "deleted-name": "torch.nn.functional.gelu was deleted",
    "mock": "torch.add was replaced by a MagicMock",
    "module-replaced": "sys.modules['json'] was replaced or removed",
    "thread": "thread 'Thread-* (sleep)' still running",
    "child-process": "child process * (sleep) still running",
    "file-lock": "a FLOCK lock on * still held",
    "stdout": "sys.stdin, sys.stdout, sys.stderr changed",
    "signal-handler": "signal handlers (signal.signal) changed",
}

#: The cases a kept rank puts back, and what the case then reads.
PUT_BACK = {
    "zero-init-left": "(0, 16)",
    "deepspeed-swaps-linear": "True",
    "deepspeed-global": "True",
    "random-streams": "True",
    "warnings-filter": "True",
    "logger-level": "30",
    "environment": "False",
}


@pytest.mark.parametrize("case", sorted(ENDS))
def test_a_leftover_that_cannot_be_put_back_is_named_and_ends_the_world(
    kept_rank: dict[str, dict[str, object]], case: str
) -> None:
    left = kept_rank[case]["left"]
    assert isinstance(left, list)
    words = ".*".join(map(re.escape, ENDS[case].split("*")))  # only * is a wildcard: the words hold brackets
    assert any(re.search(words, said) for said in left), left


@pytest.mark.parametrize("case", sorted(PUT_BACK))
def test_what_can_be_put_back_is_and_the_world_is_kept(kept_rank: dict[str, dict[str, object]], case: str) -> None:
    assert kept_rank[case] == {"left": [], "after": PUT_BACK[case]}


def test_every_case_is_judged() -> None:
    assert set(CASES) == set(ENDS) | set(PUT_BACK)


def test_code_from_the_tests_files_is_told_from_the_libraries(tmp_path: Path) -> None:
    """``namespaces.by_test``: what decides between a leftover and what is put back."""
    from pytest_dsrepro.worlds.rank import namespaces

    (tmp_path / "helper.py").write_text("def patched(x):\n    return x\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import helper  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("helper", None)
    assert namespaces.by_test(helper.patched)
    assert namespaces.by_test(lambda: None)  # this file is not an installed package's
    assert not namespaces.by_test(json.dumps)
    assert not namespaces.by_test(len)  # a builtin
    assert not namespaces.by_test(3)
    import unittest.mock

    assert namespaces.by_test(unittest.mock.MagicMock())
