"""--ds-report: the Markdown renderer on hand-built run records, then once end to end in real worlds."""

from __future__ import annotations

import dataclasses
import datetime
import re
import sys
from importlib import metadata
from pathlib import Path

import pytest

from conftest import RunPytest, deepspeed_version
from pytest_dsrepro.core.gates import Reason, Verdict
from pytest_dsrepro.core.outcome import rank_ranges
from pytest_dsrepro.core.report import Neutral, dedupe_ranks, install_commands, render_markdown, split_dumps
from pytest_dsrepro.core.results import Environment, RankStory, ReproMeta, RunRecord, Source, TestRecord

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
    with pytest.raises(ValueError, match="schema 1: written by an older pytest-dsrepro; this one reads results files"):
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
    # What a maintainer asks for, gathered when the report is written: ds_report, torch's summary, the accelerator.
    assert "| Accelerator | cpu (communication backend gloo) |" in text
    assert "<summary>ds_report (DeepSpeed&#x27;s own environment report)</summary>" in text
    assert "DeepSpeed general environment info:" in text
    assert f"deepspeed info ................... {deepspeed_version()}" in text
    assert "deepspeed install path ........... ['<site-packages>/deepspeed']" in text
    assert "PyTorch version: " in text
    assert "\x1b[" not in text  # ds_report's colours are gone
    assert f"| pytest-dsrepro | {metadata.version('pytest-dsrepro')} |" in text
    # No local path survives: not the run's directory, not the environment, not the home directory.
    for local in (str(pytester.path), sys.prefix, str(Path.home())):
        assert local not in text
    assert 'File "<rootdir>/test_two.py", line' in text
    # The source and the command that runs the test again.
    assert "<summary>Source: test_two.py (the test and what it uses from its file)</summary>" in text
    assert "python -m pytest --ds-world-size 2 --ds-backend gloo 'test_two.py::test_differs[zero3]'" in text
    assert text.count("<summary>Source: test_two.py") == 2  # two functions, two sources
    assert "def test_passes" not in _section(text, "test_two.py::test_differs[zero3]")
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


# --- what makes the report stand alone -----------------------------------------------------------------------------

SOURCE = Source(path="repros/test_a.py", code="import pytest\n\n\ndef keep(mp):\n    pass\n\n\ndef test_backward():\n    pass\n",
                fix="keep", world_elsewhere=True)  # fmt: skip
FULL_ENV = replace(ENV, torch="2.13.0+cpu", pytest="9.2.0", plugin="0.1.0", accelerator="cpu (communication backend gloo)",
                   ds_report="\x1b[92m[OKAY]\x1b[0m op report", torch_env="PyTorch version: 2.13.0+cpu")  # fmt: skip
SOURCED = replace(FAILING, source=SOURCE, world_size=2)
SOURCED_FIXED = replace(FAILING, nodeid="repros/test_a.py::test_backward[zero3-fixed]", variant="fixed",
                        verdict=Verdict.PASSES_WITH_FIX, reason=Reason.FIX_HOLDS, outcome="passed", error=None, ranks=(),
                        source=SOURCE, world_size=2, attempts=2)  # fmt: skip
STANDALONE = replace(RUN, environment=FULL_ENV, tests=(SOURCED, SOURCED_FIXED))


def test_environment_names_versions_accelerator_and_folds_the_reports() -> None:
    text = render_markdown(STANDALONE)
    for row in (
        "| pytest | 9.2.0 |",
        "| pytest-dsrepro | 0.1.0 |",
        "| Accelerator | cpu (communication backend gloo) |",
    ):
        assert row in text
    assert "2 ranks, gloo, DeepSpeed accelerator cpu (communication backend gloo): 1 unexpected" in text
    assert (
        "<details><summary>ds_report (DeepSpeed&#x27;s own environment report)</summary>\n\n```\n[OKAY] op report\n```"
        in text
    )
    assert "<summary>python -m torch.utils.collect_env (torch&#x27;s environment summary)</summary>" in text
    assert "PyTorch version: 2.13.0+cpu" in text
    assert "| Accelerator | not recorded |" in render_markdown(RUN)
    assert "<sub>Generated by pytest-dsrepro 0.1.0 (`pytest --ds-report`)" in text


def test_each_test_has_its_source_its_fix_and_the_commands_that_run_it_again() -> None:
    text = render_markdown(STANDALONE)
    stock = _section(text, SOURCED.nodeid)
    assert "- **Fix:** `keep` (applied in every rank of the `[fixed]` variant; in the source below)" in stock
    assert "- **Outcome:** failed in 3.2 s (stock variant), 2 ranks" in stock
    assert (
        "```bash\n# Python 3.11.7\n"
        "python -m pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu\n"
        "python -m pip install setuptools wheel pytest-dsrepro==0.1.0 pytest==9.2.0\n"
        "DS_BUILD_OPS=0 python -m pip install --no-build-isolation deepspeed==0.18.3\n"
        "# save the repro's source (below) as repros/test_a.py, then:\n"
        "python -m pytest --ds-world-size 2 --ds-backend gloo 'repros/test_a.py::test_backward[zero3-stock]'\n```"
    ) in stock
    assert (
        "<details><summary>Source: repros/test_a.py (the test and what it uses from its file)</summary>\n\n```python\nimport pytest"
        in stock
    )
    assert "add `pytest.mark.ds_world` to its `pytestmark`" in stock
    fixed = _section(text, SOURCED_FIXED.nodeid)
    assert "- **Fix:** `keep` (applied in every rank of this `[fixed]` variant; in the source below)" in fixed
    assert "attempt 2 of 2 (the earlier ones were run again)" in fixed
    assert "The repro's source: as for `repros/test_a.py::test_backward[zero3-stock]` above." in fixed
    assert "```python" not in fixed  # told once
    elsewhere = replace(
        SOURCE, fix="helpers.fixes.keep", fix_code="def keep(mp):\n    mp.setattr(1)\n", world_elsewhere=False
    )
    one = render_markdown(replace(STANDALONE, tests=(replace(SOURCED, source=elsewhere),)))
    assert "- **Fix:** `helpers.fixes.keep` (applied in every rank of the `[fixed]` variant; its source below)" in one
    assert "<details><summary>The fix: helpers.fixes.keep</summary>\n\n```python\ndef keep(mp):" in one
    assert "ds_world" not in one


def test_install_commands_pin_every_version() -> None:
    assert install_commands(replace(ENV, torch="2.4.1+cu121", pytest=None, plugin=None)) == [
        "python -m pip install torch==2.4.1 --index-url https://download.pytorch.org/whl/cu121",
        "python -m pip install setuptools wheel pytest-dsrepro",
        "DS_BUILD_OPS=0 python -m pip install --no-build-isolation deepspeed==0.18.3",
    ]
    assert install_commands(replace(ENV, deepspeed=None))[0] == "python -m pip install torch==2.13.0"


def test_local_paths_become_neutral() -> None:
    neutral = Neutral((("/work/me/proj", "<rootdir>"), ("/work/me/proj/.tox/py", "<venv>"), ("/tmp", "<tmp>")))
    text = (
        'File "/work/me/proj/repros/test_a.py", line 3\n'
        'File "/work/me/proj/.tox/py/lib/python3.11/site-packages/deepspeed/engine.py"\n'
        "/work/me/project and /tmpfs stay; /tmp/x goes\n"
        "/opt/conda/envs/x/lib/python3.10/site-packages/torch/nn.py in /home/alice/.cache/torch_extensions"
    )
    assert neutral.apply(text) == (
        'File "<rootdir>/repros/test_a.py", line 3\n'
        'File "<site-packages>/deepspeed/engine.py"\n'
        "/work/me/project and /tmpfs stay; <tmp>/x goes\n"
        "<site-packages>/torch/nn.py in ~/.cache/torch_extensions"
    )
    here = Neutral.here(Path("/somewhere/root"))
    assert ("/somewhere/root", "<rootdir>") in here.pairs
    assert here.apply(f"{sys.prefix}/bin/torchrun") in ("<venv>/bin/torchrun", f"{sys.prefix}/bin/torchrun")
    assert str(Path.home()) not in here.apply(f"{Path.home()}/x")
    assert render_markdown(replace(RUN, tests=(replace(FAILING, longrepr=None, ranks=(replace(FAILING.ranks[0], traceback='File "/work/me/proj/a.py"'),)),)),
                           neutral=neutral).count('File "<rootdir>/a.py"') == 1  # fmt: skip


#: DeepSpeed 0.19.8's own words, as a rank printed them (``DeepSpeedConfig.print``, ``see_memory_usage``).
DS_OUTPUT = """[2026-11-22 16:23:02,499] [INFO] [config.py:674:print] DeepSpeedEngine configuration:
[2026-11-22 16:23:02,499] [INFO] [config.py:678:print]   activation_checkpointing_config  {
    "partition_activations": false
}
[2026-11-22 16:23:02,500] [INFO] [config.py:678:print]   train_batch_size ............. 4
[2026-11-22 16:23:02,500] [INFO] [config.py:678:print]   zero_optimization_stage ...... 3
[2026-11-22 16:23:02,500] [INFO] [config.py:664:print_user_config]   json = {
    "train_micro_batch_size_per_gpu": 2,
    "zero_optimization": {
        "stage": 3
    },
    "train_batch_size": 4
}
after initialize
MA 0.32 GB         Max_MA 0.32 GB         CA 0.32 GB         Max_CA 0 GB
CPU Virtual Memory:  used = 1.69 GB, percent = 7.2%
the body's own words"""


def test_deepspeeds_dumps_are_folded_away_from_what_the_rank_said() -> None:
    kept, folded = split_dumps(DS_OUTPUT)
    assert kept == "the body's own words"
    assert folded.startswith("[2026-11-22 16:23:02,499] [INFO] [config.py:674:print] DeepSpeedEngine configuration:")
    assert folded.endswith("CPU Virtual Memory:  used = 1.69 GB, percent = 7.2%")
    assert split_dumps("just words\nand more") == ("just words\nand more", "")
    story = replace(FAILING.ranks[0], output=DS_OUTPUT)
    text = render_markdown(replace(RUN, tests=(replace(FAILING, ranks=(story,)),)))
    assert (
        "<summary>Output of rank 0 (tail, 16 lines of DeepSpeed&#x27;s config and memory dumps folded)</summary>"
        in text
    )
    shown = text.split("config and memory dumps folded)</summary>")[1]
    assert shown.index("the body's own words") < shown.index(
        "<summary>DeepSpeed&#x27;s config and memory dumps (16 lines)"
    )
    only = render_markdown(
        replace(RUN, tests=(replace(FAILING, ranks=(replace(story, output=DS_OUTPUT.rsplit("\n", 1)[0]),)),))
    )
    assert "<summary>Output of rank 0 (tail)</summary>" in only  # all there is: shown as it is
    assert "DeepSpeedEngine configuration:" in only


DUMPS = """
import pytest

pytestmark = [pytest.mark.ds_repro(id="dumps", title="DeepSpeed talks"), pytest.mark.ds_world]


@pytest.mark.ds_config("zero3")
@pytest.mark.ds_version(affected=">=0.1", raises=KeyError, match="after the dumps")
def test_dumps(ds_engine):
    import logging

    from deepspeed.runtime.utils import see_memory_usage
    from deepspeed.utils import logger

    logger.setLevel(logging.INFO)  # as DeepSpeed logs by default in older releases
    for handler in logger.handlers:
        handler.setLevel(logging.INFO)
    ds_engine()
    see_memory_usage("after initialize", force=True)
    print("the body's own words", flush=True)
    raise KeyError("after the dumps")
"""


def test_real_deepspeed_dumps_are_folded_end_to_end(pytester: pytest.Pytester, run: RunPytest) -> None:
    pytester.makepyfile(test_dumps=DUMPS)
    report = pytester.path / "report.md"
    run(f"--ds-report={report}").assert_outcomes(xfailed=1)
    text = report.read_text()
    outputs = text.split("<summary>Output of ranks 0-1 (tail, ")[1].split("\n</details>\n\n</details>")[0]
    said, dumps = outputs.split("<summary>DeepSpeed&#x27;s config and memory dumps (")
    assert "the body's own words" in said
    assert "DeepSpeedEngine configuration" not in said
    assert "Max_MA" not in said
    assert "[config.py:" in dumps
    assert "CPU Virtual Memory:" in dumps


def test_what_the_diagnostics_subprocess_said() -> None:
    from pytest_dsrepro.session import diagnostics

    said = "dsrepro-accelerator: cpu gloo\n-----\nDeepSpeed general environment info:"
    assert diagnostics.split_accelerator(said) == (
        "cpu (communication backend gloo)",
        "-----\nDeepSpeed general environment info:",
    )
    assert diagnostics.split_accelerator("Traceback ...") == (None, "Traceback ...")
    assert diagnostics.rank_environment(0, {})["DS_ACCELERATOR"] == "cpu"  # as the fork server chooses
    assert diagnostics.rank_environment(0, {"DS_ACCELERATOR": "xpu"})["DS_ACCELERATOR"] == "xpu"
    assert "DS_ACCELERATOR" not in diagnostics.rank_environment(2, {})
