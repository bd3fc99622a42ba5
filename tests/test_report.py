"""--ds-report: the Markdown renderer on hand-built run records, then once end to end in real worlds."""

from __future__ import annotations

import dataclasses
import datetime
import re

import pytest

from conftest import RunPytest, deepspeed_version
from pytest_dsrepro.core.gates import Reason, Verdict
from pytest_dsrepro.core.outcome import rank_ranges
from pytest_dsrepro.core.report import dedupe_ranks, render_markdown
from pytest_dsrepro.core.results import Environment, RankStory, ReproMeta, RunRecord, TestRecord

replace = dataclasses.replace

ENV = Environment(
    deepspeed="0.18.3",
    torch="2.13.0",
    python="3.11.7",
    backend="gloo",
    world_size=2,
    os="Linux-6.1-x86_64",
    cpu="AMD EPYC",
    cpu_count=2,
    gpu=None,
    gpu_count=0,
)
REPRO = ReproMeta(
    id="zero3-no-optimizer-backward",
    title="ZeRO-3 backward without an optimizer raises AttributeError",
    upstream="https://github.com/deepspeedai/DeepSpeed/issues/1",
    fix_ref=None,
    fixed_in=None,
    root_cause="allreduce_gradients calls an epilogue that DeepSpeedZeRoOffload lacks.",
    affected=(">=0.18.3,<0.19.5",),
)
CONFIG = {"train_batch_size": 4, "zero_optimization": {"stage": 3}}
FAILING = TestRecord(
    nodeid="repros/test_a.py::test_backward[zero3-stock]",
    repro=REPRO,
    variant="stock",
    verdict=Verdict.UNEXPECTED,
    reason=Reason.FAILED_DIFFERENTLY,
    outcome="failed",
    error="failed differently on deepspeed 0.18.3: ...",
    duration=3.25,
    config=CONFIG,
    config_notes=("fp16 -> fp32: fp16 training needs CUDA; this is a gloo/CPU world",),
    ranks=(
        RankStory(
            ranks="rank 0",
            error="AttributeError: 'DeepSpeedZeRoOffload' object has no attribute 'x'",
            traceback='Traceback (most recent call last):\n  File "stage3.py", line 1\nAttributeError: no x',
            output="rank 0 says hello",
        ),
        RankStory(
            ranks="rank 1",
            error="RuntimeError: Connection closed by peer",
            traceback='Traceback (most recent call last):\n  File "gloo.py", line 9\nRuntimeError: closed',
            output="",
        ),
    ),
    longrepr="ranks failed",
)
PASSING = TestRecord(
    nodeid="repros/test_b.py::test_ids[zero3-fixed]",
    repro=replace(REPRO, id="zero3-module-id", fixed_in="0.16.4", fix_ref="PR #6847", affected=("<0.16.4",)),
    variant="fixed",
    verdict=Verdict.PASSES_WITH_FIX,
    reason=Reason.FIX_HOLDS,
    outcome="passed",
    error=None,
    duration=1.5,
    config=CONFIG,
    config_notes=(),
    ranks=(),
    longrepr=None,
)
RUN = RunRecord(
    created=datetime.datetime(2026, 11, 22, 10, tzinfo=datetime.timezone.utc), environment=ENV, tests=(FAILING, PASSING)
)


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
    gpu = render_markdown(replace(RUN, environment=replace(ENV, gpu="NVIDIA A100", gpu_count=8)))
    assert "| GPU | 8 x NVIDIA A100 |" in gpu


def test_summary_table_and_counts() -> None:
    text = render_markdown(RUN)
    assert "DeepSpeed 0.18.3, torch 2.13.0, 2 ranks, gloo: 1 unexpected, 1 passes-with-fix." in text
    assert "Run at 2026-11-22T10:00:00+00:00." in text
    assert "| `repros/test_a.py::test_backward[zero3-stock]` | UNEXPECTED | failed | 3.2 s |" in text
    assert "| `repros/test_b.py::test_ids[zero3-fixed]` | PASSES-WITH-FIX | passed | 1.5 s |" in text


def test_failing_repro_metadata_config_and_each_ranks_story() -> None:
    text = render_markdown(RUN)
    section = _section(text, FAILING.nodeid)
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
    section = _section(render_markdown(RUN), PASSING.nodeid)
    assert "- **Fixed in:** 0.16.4 (PR #6847)" in section
    assert "- **Affected:** `deepspeed<0.16.4`" in section
    three = replace(PASSING, repro=replace(REPRO, affected=(">=0.19.5", ">=0.18.3,<0.19.5", "<0.18.3")))
    assert "- **Affected:** `deepspeed<0.18.3` or `deepspeed>=0.18.3,<0.19.5` or `deepspeed>=0.19.5`" in (
        render_markdown(replace(RUN, tests=(three,)))
    )
    assert "- **Outcome:** passed in 1.5 s (fixed variant)" in section
    assert "Traceback" not in section
    assert "Result" not in section
    assert "Resolved DeepSpeed config" in section


def test_identical_ranks_are_folded_once() -> None:
    same = RankStory(ranks="", error="AttributeError: x", traceback="tb", output="o")
    labels = ["rank 1", "rank 0", "ranks 2-3"]
    merged = dedupe_ranks([replace(same, ranks=label) for label in labels])
    assert merged == [replace(same, ranks="ranks 0-3")]
    folded = replace(FAILING, ranks=tuple(replace(same, ranks=f"rank {r}") for r in range(4)))
    text = render_markdown(replace(RUN, tests=(folded,)))
    assert text.count("<summary>Traceback") == 1
    assert "**ranks 0-3:** `AttributeError: x`" in text
    assert "different ways" not in text


def test_rank_labels() -> None:
    """Labels are written the one way (``core.outcome.rank_ranges``); a label that is not a rank list is kept."""
    assert rank_ranges([3]) == "rank 3"
    assert rank_ranges([0, 1, 2, 5, 7, 8]) == "ranks 0-2,5,7-8"
    twice = dedupe_ranks([RankStory("ranks 0-1", "e", "", ""), RankStory("rank 1", "e", "", "")])
    assert [s.ranks for s in twice] == ["ranks 0-1"]  # a rank told twice is named once
    odd = dedupe_ranks([RankStory("launcher", "e", "", ""), RankStory("rank 1", "e", "", "")])
    assert odd[0].ranks == "launcher, rank 1"


def test_not_a_repro_plain_failure_and_awkward_text() -> None:
    plain = TestRecord(nodeid="tests/test_x.py::test_y", repro=None, variant=None, verdict=None, reason=None,
                       outcome="failed", error="assert 1 == 2 | `x`", duration=0.1, config=None,
                       longrepr="def test_y():\n>   assert 1 == 2\n```\nE   assert 1 == 2")  # fmt: skip
    text = render_markdown(replace(RUN, tests=(plain,)))
    assert "### FAILED: `tests/test_x.py::test_y`" in text
    assert "Not a catalogued repro" in text
    assert "- **Result:** `` assert 1 == 2 | `x` ``" in text
    assert "| `tests/test_x.py::test_y` | FAILED | failed | 0.1 s |" in text
    assert "<details><summary>Failure</summary>\n\n````\ndef test_y():" in text  # a fence longer than the ``` inside
    assert "Resolved DeepSpeed config" not in text


def test_long_tracebacks_keep_their_end() -> None:
    long_tb = "frame\n" * 5000 + "AttributeError: the end"
    text = render_markdown(
        replace(RUN, tests=(replace(FAILING, ranks=(replace(FAILING.ranks[0], traceback=long_tb),)),))
    )
    assert "characters cut ...]" in text
    assert "AttributeError: the end" in text
    assert len(text) < 20_000


def test_unavailable_release() -> None:
    env = replace(ENV, deepspeed="0.14.0", backend=None, world_size=None, gpu_count=None)
    why = "import failed: RuntimeError: CPU_Accelerator requires intel_extension_for_pytorch"
    text = render_markdown(RunRecord(environment=env, unavailable=why))
    assert "> **DeepSpeed was not available for this run:** import failed: RuntimeError: CPU_Accelerator" in text
    assert "no tests" in text
    assert "### Summary" not in text
    assert "DeepSpeed 0.14.0, torch 2.13.0, ? ranks, ?: no tests." in text


def test_renders_a_run_from_its_json_and_refuses_a_broken_one() -> None:
    assert render_markdown(RUN.to_json()) == render_markdown(RUN)
    with pytest.raises(ValueError, match="schema 1: this pytest-dsrepro reads results files of schema 3 only"):
        render_markdown({**RUN.to_json(), "schema": 1})


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
    assert f"| DeepSpeed | {deepspeed_version()} |" in text
    assert "| Backend | gloo |" in text
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
    assert "- **Outcome:** passed" in passing
    assert '"stage": 2' in passing
    assert "Traceback" not in passing
