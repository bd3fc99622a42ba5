"""--ds-results: one JSON file per run with the environment and a record per test, under xdist too."""

from __future__ import annotations

import json

import pytest

from conftest import RunPytest, deepspeed_version

REPRO = """
import pytest

pytestmark = [
    pytest.mark.ds_repro(id="demo-bug", title="A demo bug", upstream="https://example.invalid/1", fixed_in=None,
                         root_cause="json has no epilogue."),
    pytest.mark.ds_world,
]

def patch(monkeypatch):
    import json
    monkeypatch.setattr(json, "epilogue", lambda: None, raising=False)

@pytest.mark.ds_config("zero2")
@pytest.mark.ds_version(affected=">=0.1", raises=AttributeError, match="epilogue", fix=patch)
def test_demo(ds_config, ds_rank):
    import json
    json.epilogue()

def test_plain_skip(ds_rank):
    pytest.skip("nothing to see")
"""


@pytest.mark.parametrize("xdist", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_results_file(pytester: pytest.Pytester, run: RunPytest, xdist: list[str]) -> None:
    pytester.makepyfile(test_demo=REPRO)
    result = run(f"--ds-results={pytester.path / 'out'}", *xdist)
    result.assert_outcomes(passed=1, xfailed=1, skipped=1)
    (path,) = (pytester.path / "out").glob("*.json")
    run_record = json.loads(path.read_text())
    env = run_record["environment"]
    assert run_record["schema"] == 1 and run_record["unavailable"] is None
    assert env["deepspeed"] == deepspeed_version() and env["backend"] == "gloo" and env["world_size"] == 2
    assert env["cpu_count"] >= 1 and env["gpu_count"] == 0
    tests = {t["nodeid"]: t for t in run_record["tests"]}
    stock = tests["test_demo.py::test_demo[zero2-stock]"]
    assert stock["verdict"] == "REPRODUCED" and stock["outcome"] == "xfailed" and stock["variant"] == "stock"
    assert stock["error"].startswith(f"REPRODUCED on deepspeed {deepspeed_version()}: ranks 0-1: AttributeError:")
    assert stock["repro"]["id"] == "demo-bug" and stock["repro"]["affected"] == [">=0.1"]
    assert stock["config"]["zero_optimization"]["stage"] == 2 and stock["config"]["train_batch_size"] == 4
    assert "fp16 -> fp32: fp16 training needs CUDA; this is a gloo/CPU world" in stock["config_notes"]
    assert stock["ranks"][0]["ranks"] == "ranks 0-1" and "json.epilogue()" in stock["ranks"][0]["traceback"]
    fixed = tests["test_demo.py::test_demo[zero2-fixed]"]
    assert (fixed["verdict"], fixed["outcome"], fixed["error"]) == ("PASSES-WITH-FIX", "passed", None)
    skipped = tests["test_demo.py::test_plain_skip"]
    assert (skipped["outcome"], skipped["error"]) == ("skipped", "nothing to see")
