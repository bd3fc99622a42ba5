"""--ds-report: the Markdown renderer on hand-built run records, then once end to end in real worlds."""

from __future__ import annotations

import re
from typing import Any

import pytest

from conftest import RunPytest, deepspeed_version
from pytest_dsrepro.report import dedupe_ranks, rank_label, render_markdown

ENV: dict[str, Any] = {
    "deepspeed": "0.18.3",
    "torch": "2.13.0",
    "python": "3.11.7",
    "backend": "gloo",
    "world_size": 2,
    "os": "Linux-6.1-x86_64",
    "cpu": "AMD EPYC",
    "cpu_count": 2,
    "gpu": None,
    "gpu_count": 0,
}
REPRO: dict[str, Any] = {
    "id": "zero3-no-optimizer-backward",
    "title": "ZeRO-3 backward without an optimizer raises AttributeError",
    "upstream": "https://github.com/deepspeedai/DeepSpeed/issues/1",
    "fix_ref": None,
    "fixed_in": None,
    "root_cause": "allreduce_gradients calls an epilogue that DeepSpeedZeRoOffload lacks.",
    "affected": [">=0.18.3,<0.19.5"],
}
CONFIG: dict[str, Any] = {"train_batch_size": 4, "zero_optimization": {"stage": 3}}
FAILING: dict[str, Any] = {
    "nodeid": "repros/test_a.py::test_backward[zero3-stock]",
    "repro": REPRO,
    "variant": "stock",
    "verdict": "UNEXPECTED",
    "outcome": "failed",
    "error": "failed differently on deepspeed 0.18.3: ...",
    "duration": 3.25,
    "config": CONFIG,
    "config_notes": ["fp16 -> fp32: fp16 training needs CUDA; this is a gloo/CPU world"],
    "ranks": [
        {
            "ranks": "rank 0",
            "error": "AttributeError: 'DeepSpeedZeRoOffload' object has no attribute 'x'",
            "traceback": 'Traceback (most recent call last):\n  File "stage3.py", line 1\nAttributeError: no x',
            "output": "rank 0 says hello",
        },
        {
            "ranks": "rank 1",
            "error": "RuntimeError: Connection closed by peer",
            "traceback": 'Traceback (most recent call last):\n  File "gloo.py", line 9\nRuntimeError: closed',
            "output": "",
        },
    ],
    "longrepr": "ranks failed",
}
PASSING: dict[str, Any] = {
    "nodeid": "repros/test_b.py::test_ids[zero3-fixed]",
    "repro": {**REPRO, "id": "zero3-module-id", "fixed_in": "0.16.4", "fix_ref": "PR #6847", "affected": ["<0.16.4"]},
    "variant": "fixed",
    "verdict": "PASSES-WITH-FIX",
    "outcome": "passed",
    "error": None,
    "duration": 1.5,
    "config": CONFIG,
    "config_notes": [],
    "ranks": [],
    "longrepr": None,
}
RUN: dict[str, Any] = {"schema": 1, "created": "2026-11-22T10:00:00+00:00", "environment": ENV, "unavailable": None,
       "tests": [FAILING, PASSING]}  # fmt: skip


def _section(text: str, nodeid: str) -> str:
    """The part of the report about one test."""
    start = text.index(f"`{nodeid}`", text.index("### ", text.index("### Summary") + 1))
    end = text.find("\n### ", start)
    return text[start : end if end != -1 else len(text)]


def test_environment_is_all_there() -> None:
    text = render_markdown(RUN)
    for row in ("| DeepSpeed | 0.18.3 |", "| torch | 2.13.0 |", "| Python | 3.11.7 |", "| Backend | gloo |",
                "| World size | 2 |", "| OS | Linux-6.1-x86_64 |", "| CPU | AMD EPYC (2 cores) |", "| GPU | none |"):  # fmt: skip
        assert row in text
    gpu = render_markdown({**RUN, "environment": {**ENV, "gpu": "NVIDIA A100", "gpu_count": 8}})
    assert "| GPU | 8 x NVIDIA A100 |" in gpu


def test_summary_table_and_counts() -> None:
    text = render_markdown(RUN)
    assert "DeepSpeed 0.18.3, torch 2.13.0, 2 ranks, gloo: 1 unexpected, 1 passes-with-fix." in text
    assert "| `repros/test_a.py::test_backward[zero3-stock]` | UNEXPECTED | failed | 3.2 s |" in text
    assert "| `repros/test_b.py::test_ids[zero3-fixed]` | PASSES-WITH-FIX | passed | 1.5 s |" in text


def test_failing_repro_metadata_config_and_each_ranks_story() -> None:
    text = render_markdown(RUN)
    section = _section(text, FAILING["nodeid"])
    assert (
        "- **Repro:** `zero3-no-optimizer-backward` - ZeRO-3 backward without an optimizer raises AttributeError"
        in section
    )
    assert "- **Upstream:** https://github.com/deepspeedai/DeepSpeed/issues/1" in section
    assert "- **Affected:** `deepspeed>=0.18.3,<0.19.5`" in section
    assert "- **Fixed in:** no release yet" in section
    assert "- **Root cause:** allreduce_gradients calls an epilogue that DeepSpeedZeRoOffload lacks." in section
    assert "- **Outcome:** failed in 3.2 s (stock variant)" in section
    assert "- **Config adapted to this world:** fp16 -> fp32: fp16 training needs CUDA" in section
    assert '<details><summary>Resolved DeepSpeed config</summary>\n\n```json\n{\n  "train_batch_size": 4,' in section
    assert "The ranks ended in 2 different ways:" in section
    assert "**rank 0:** `AttributeError: 'DeepSpeedZeRoOffload' object has no attribute 'x'`" in section
    assert "**rank 1:** `RuntimeError: Connection closed by peer`" in section
    assert "<details><summary>Traceback (rank 0)</summary>\n\n```pytb\nTraceback" in section
    assert 'File "gloo.py", line 9' in section
    assert "<details><summary>Output of rank 0 (tail)</summary>" in section
    assert "Output of rank 1" not in section  # empty output: no empty block
    # Every <details> is closed, and every code fence too.
    assert text.count("<details>") == text.count("</details>")
    assert text.count("```") % 2 == 0


def test_passing_repro_has_no_failure_blocks() -> None:
    section = _section(render_markdown(RUN), PASSING["nodeid"])
    assert "- **Fixed in:** 0.16.4 (PR #6847)" in section
    assert "- **Affected:** `deepspeed<0.16.4`" in section
    three = {**PASSING, "repro": {**REPRO, "affected": [">=0.19.5", ">=0.18.3,<0.19.5", "<0.18.3"]}}
    assert "- **Affected:** `deepspeed<0.18.3` or `deepspeed>=0.18.3,<0.19.5` or `deepspeed>=0.19.5`" in (
        render_markdown({**RUN, "tests": [three]})
    )
    assert "- **Outcome:** passed in 1.5 s (fixed variant)" in section
    assert "Traceback" not in section and "Result" not in section
    assert "Resolved DeepSpeed config" in section


def test_identical_ranks_are_folded_once() -> None:
    same = {"error": "AttributeError: x", "traceback": "tb", "output": "o"}
    merged = dedupe_ranks([{**same, "ranks": "rank 1"}, {**same, "ranks": "rank 0"}, {**same, "ranks": "ranks 2-3"}])
    assert merged == [{**same, "ranks": "ranks 0-3"}]
    text = render_markdown({**RUN, "tests": [{**FAILING, "ranks": [{**same, "ranks": f"rank {r}"} for r in range(4)]}]})
    assert text.count("<summary>Traceback") == 1 and "**ranks 0-3:** `AttributeError: x`" in text
    assert "different ways" not in text


def test_rank_labels() -> None:
    assert rank_label([3]) == "rank 3"
    assert rank_label([0, 1, 2, 5, 7, 8]) == "ranks 0-2,5,7-8"
    odd = dedupe_ranks(
        [{"ranks": "launcher", "error": "e", "traceback": ""}, {"ranks": "rank 1", "error": "e", "traceback": ""}]
    )
    assert odd[0]["ranks"] == "launcher, rank 1"


def test_not_a_repro_plain_failure_and_awkward_text() -> None:
    plain: dict[str, Any] = {"nodeid": "tests/test_x.py::test_y", "repro": None, "variant": None, "verdict": None, "outcome": "failed",
             "error": "assert 1 == 2 | `x`", "duration": 0.1, "config": None, "config_notes": [], "ranks": [],
             "longrepr": "def test_y():\n>   assert 1 == 2\n```\nE   assert 1 == 2"}  # fmt: skip
    text = render_markdown({**RUN, "tests": [plain]})
    assert "### FAILED: `tests/test_x.py::test_y`" in text
    assert "Not a catalogued repro" in text
    assert "- **Result:** `` assert 1 == 2 | `x` ``" in text
    assert "| `tests/test_x.py::test_y` | FAILED | failed | 0.1 s |" in text
    assert "<details><summary>Failure</summary>\n\n````\ndef test_y():" in text  # a fence longer than the ``` inside
    assert "Resolved DeepSpeed config" not in text


def test_long_tracebacks_keep_their_end() -> None:
    long_tb = "frame\n" * 5000 + "AttributeError: the end"
    text = render_markdown({**RUN, "tests": [{**FAILING, "ranks": [{**FAILING["ranks"][0], "traceback": long_tb}]}]})
    assert "characters cut ...]" in text and "AttributeError: the end" in text
    assert len(text) < 20_000


def test_unavailable_release() -> None:
    run = {"schema": 1, "environment": {"deepspeed": "0.14.0", "torch": "2.13.0"}, "tests": [],
           "unavailable": "import failed: RuntimeError: CPU_Accelerator requires intel_extension_for_pytorch"}  # fmt: skip
    text = render_markdown(run)
    assert "> **DeepSpeed was not available for this run:** import failed: RuntimeError: CPU_Accelerator" in text
    assert "no tests" in text and "### Summary" not in text


REPROS = """
import pytest

pytestmark = [
    pytest.mark.ds_repro(id="two-ways", title="Ranks fail differently", upstream="https://example.invalid/2",
                         fixed_in="9.9.9", root_cause="rank 1 is impatient."),
    pytest.mark.ds_world,
]

@pytest.mark.ds_config("zero3")
def test_differs(ds_config, ds_rank):
    if ds_rank == 0:
        raise KeyError("rank zero lost its key")
    raise ValueError("rank one has a bad value")

@pytest.mark.ds_config("zero2")
def test_passes(ds_config, ds_rank):
    print("all good on", ds_rank)
"""


def test_ds_report_end_to_end(pytester: pytest.Pytester, run: RunPytest) -> None:
    pytester.makepyfile(test_two=REPROS)
    result = run(f"--ds-report={pytester.path / 'out' / 'report.md'}")
    result.assert_outcomes(passed=1, failed=1)
    text = (pytester.path / "out" / "report.md").read_text()
    assert f"| DeepSpeed | {deepspeed_version()} |" in text and "| Backend | gloo |" in text
    assert "| World size | 2 |" in text
    failing = _section(text, "test_two.py::test_differs[zero3]")
    assert "- **Repro:** `two-ways` - Ranks fail differently" in failing
    assert "- **Fixed in:** 9.9.9" in failing
    assert '"stage": 3' in failing
    assert "The ranks ended in 2 different ways:" in failing
    assert "**rank 0:** `KeyError: 'rank zero lost its key'`" in failing
    assert "**rank 1:** `ValueError: rank one has a bad value`" in failing
    assert re.search(r"<summary>Traceback \(rank 0\)</summary>\n\n```pytb\n(.|\n)*raise KeyError", failing)
    passing = _section(text, "test_two.py::test_passes[zero2]")
    assert "- **Outcome:** passed" in passing and '"stage": 2' in passing and "Traceback" not in passing
