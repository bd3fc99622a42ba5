"""``dsrepro triage LOG``: a log read as pasted, the catalogue ranked against it, and the command as a user meets it.

The reading and the ranking are pure and tested directly on logs in the shapes users paste them; the command runs
in a subprocess on the installed catalogue, with bad input of every kind, and once with ``--confirm`` in real worlds.
"""

from __future__ import annotations

import dataclasses
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

from pytest_dsrepro.core import premises, versions
from pytest_dsrepro.core.faces import Face, gate_face
from pytest_dsrepro.core.faces import parse as seen_face
from pytest_dsrepro.core.results import Finding, ScanVerdict
from pytest_dsrepro.core.text import strip_ansi
from pytest_dsrepro.tools import log_input, scaffold, triage_command
from pytest_dsrepro.triage import known_fixes, logread
from pytest_dsrepro.triage import ranking as triage
from pytest_dsrepro.triage.logread import Frame

EPILOGUE = "'DeepSpeedZeRoOffload' object has no attribute '{}'"
TRACEBACK = """Traceback (most recent call last):
  File "/home/u/train.py", line 40, in <module>
    engine.backward(loss)
  File "/venv/lib/python3.11/site-packages/deepspeed/runtime/engine.py", line 2300, in backward
    self.allreduce_gradients()
AttributeError: 'DeepSpeedZeRoOffload' object has no attribute 'overlapping_partition_gradients_reduce_epilogue'
"""


# --- reading a log --------------------------------------------------------------------------------------------------


def test_a_plain_traceback_gives_the_exception_and_its_deepspeed_frames() -> None:
    reading = logread.read(TRACEBACK)
    (error,) = reading.errors
    assert error.type == "AttributeError"
    assert error.message == EPILOGUE.format("overlapping_partition_gradients_reduce_epilogue")
    assert error.innermost_deepspeed == Frame("deepspeed/runtime/engine.py", 2300, "backward")
    assert [f.deepspeed for f in error.frames] == [False, True]


def test_colours_rank_prefixes_and_interleaved_ranks_come_apart() -> None:
    """Two ranks' tracebacks interleaved line by line, each line coloured and prefixed as torch prints them."""
    lines = TRACEBACK.splitlines()
    mixed = []
    for line in lines:
        for rank in (3, 1):
            coloured = line.replace("AttributeError", "\x1b[31mAttributeError\x1b[0m")
            mixed.append(f"[rank{rank}]: {coloured}")
    (error,) = logread.read("\n".join(mixed)).errors
    assert error.ranks == (1, 3)
    assert error.headline == "AttributeError: " + EPILOGUE.format("overlapping_partition_gradients_reduce_epilogue")
    assert len(error.frames) == 2


def test_colour_codes_whose_escape_was_lost_in_a_paste_are_removed() -> None:
    assert strip_ansi("[1;31mKeyError[0m: 2") == "KeyError: 2"


def test_torchrun_and_mpirun_prefixes_name_the_rank() -> None:
    found = logread.streams(["[default2]:KeyError: 2", "[1,5]<stderr>:KeyError: 3", "no prefix"])
    assert found == {2: ["KeyError: 2"], 5: ["KeyError: 3"], None: ["no prefix"]}


def test_lines_hard_wrapped_at_a_terminal_width_are_joined() -> None:
    """A terminal copy cut every line at 70 columns: the message reads whole again, the frame too."""
    text = TRACEBACK.replace("    ", "  ") + "RuntimeError: " + "x" * 150 + "\n"
    wrapped = [line[i : i + 70] for line in text.splitlines() for i in range(0, max(len(line), 1), 70)]
    assert logread.wrap_width(wrapped) == 70
    errors = logread.read("\n".join(wrapped)).errors
    assert errors[0].message == EPILOGUE.format("overlapping_partition_gradients_reduce_epilogue")
    assert errors[0].innermost_deepspeed == Frame("deepspeed/runtime/engine.py", 2300, "backward")
    assert errors[1].message == "x" * 150


def test_chained_exceptions_and_bare_error_lines_are_each_read() -> None:
    text = (TRACEBACK + "\nDuring handling of the above exception, another exception occurred:\n\n"
            "Traceback (most recent call last):\n  File \"t.py\", line 1, in <module>\nKeyError: 2\n"
            "ranks 0-1: IndexError: pop from an empty deque\nE   Slowdown: a training step took 5x\n")  # fmt: skip
    errors = logread.read(text, known={"Slowdown"}).errors
    assert [e.headline for e in errors[1:]] == ["KeyError: 2", "IndexError: pop from an empty deque",
                                                "Slowdown: a training step took 5x"]  # fmt: skip


def test_a_multi_line_message_is_kept_until_the_next_record() -> None:
    text = "RuntimeError: Direct calls to tensor.backward() are not supported.\nPlease use engine.backward(loss).\n\nok"
    (error,) = logread.read(text).errors
    assert error.message.splitlines() == ["Direct calls to tensor.backward() are not supported.",
                                          "Please use engine.backward(loss)."]  # fmt: skip


def test_the_error_to_read_is_not_one_that_only_lost_a_peer() -> None:
    text = ("rank 1: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:1234\n"
            "rank 0: KeyError: torch.bfloat16\n")  # fmt: skip
    reading = logread.read(text)
    assert reading.primary is not None
    assert reading.primary.headline == "KeyError: torch.bfloat16"


@pytest.mark.parametrize(
    ("statement", "version"),
    [
        ("pip install deepspeed==0.18.3", "0.18.3"),
        ("DeepSpeed version 0.16.3", "0.16.3"),
        ("deepspeed info ................... 0.17.5, unknown, unknown", "0.17.5"),
        ("[Rank 0] DeepSpeed info: version=0.19.2, git-hash=unknown", "0.19.2"),
        ("site-packages/deepspeed-0.15.4.dist-info", "0.15.4"),
    ],
)
def test_the_release_a_log_states(statement: str, version: str) -> None:
    assert logread.read(f"{statement}\nKeyError: 2\n").versions == (version,)


def test_a_config_pasted_in_the_log_with_comments_is_read() -> None:
    text = 'my config:\n{\n  "zero_optimization": {"stage": 3},  // ZeRO-3\n  "train_batch_size": 8\n}\n{"a": 1}\n'
    assert logread.read(text).config == {"zero_optimization": {"stage": 3}, "train_batch_size": 8}


# --- reading reports as they arrive ---------------------------------------------------------------------------------


def test_a_space_before_the_rank_prefix_hides_no_exception() -> None:
    """GitHub's rendering copies a space before ``[rank3]:``: the prefix is still the rank's, the traceback still read."""
    text = "\n".join(f" [rank3]: {line}" for line in TRACEBACK.splitlines())
    (error,) = logread.read(text).errors
    assert error.ranks == (3,)
    assert error.innermost_deepspeed == Frame("deepspeed/runtime/engine.py", 2300, "backward")


def test_a_warnings_error_before_the_traceback_is_not_the_error() -> None:
    """An import warning's ``AttributeError`` (protobuf's, printed bare) comes first; the traceback with DeepSpeed
    frames that follows is what the log shows and what the bug is found by."""
    noise = ("/usr/lib/python3/site-packages/google/protobuf/internal/builder.py:42: UserWarning: something\n"
             "AttributeError: 'MessageFactory' object has no attribute 'GetPrototype'\n"
             "AttributeError: 'MessageFactory' object has no attribute 'GetPrototype'\n")  # fmt: skip
    reading = logread.read(noise + "".join(f"[rank0]:{line}\n" for line in TRACEBACK.splitlines()))
    assert reading.primary is not None
    assert reading.primary.message == EPILOGUE.format("overlapping_partition_gradients_reduce_epilogue")
    t = triage.rank(CATALOGUE, reading)
    assert t.known is not None
    assert t.known.bug.id == "epilogue"
    assert triage.showed(reading).endswith("at deepspeed/runtime/engine.py:2300 in backward")


def test_the_plugins_own_suffixes_are_not_the_message() -> None:
    """``; collateral: ...`` and ``(with the prerequisite fix ...)`` are the plugin's words: ``dsrepro new --from-log``
    prefills a ``match=`` of the exception's message alone, which its gate then matches."""
    text = ("ranks 0: KeyError: 7; collateral: rank 1 then lost a peer (with the prerequisite fix for zero12-x: "
            "0.18.7-0.18.9); rank 2: IndexError: list index out of range\n")  # fmt: skip
    errors = logread.read(text).errors
    assert [e.headline for e in errors] == ["KeyError: 7", "IndexError: list index out of range"]
    start = scaffold.prefill(logread.read(text))
    assert start.match == "'7'"


def test_a_traceback_cut_before_its_exception_keeps_its_frames() -> None:
    text = "I get this when training:\n" + "\n".join(TRACEBACK.splitlines()[:-1]) + "\n[...]\nany idea?\n"
    reading = logread.read(text)
    assert reading.errors == ()
    assert Frame("deepspeed/runtime/engine.py", 2300, "backward") in reading.cut
    assert (
        triage.showed(reading)
        == "a traceback cut before its exception, at deepspeed/runtime/engine.py:2300 in backward"
    )


@pytest.mark.parametrize(
    ("title", "headline"),
    [
        ("[BUG]AttributeError: 'X' object has no attribute 'y'", "AttributeError: 'X' object has no attribute 'y'"),
        ("`IndexError: pop from an empty deque` after 20 s", "IndexError: pop from an empty deque` after 20 s"),
        ("训练 IndexError: slice() cannot be applied", "IndexError: slice() cannot be applied"),
    ],
)
def test_an_error_named_only_in_a_title(title: str, headline: str) -> None:
    reading = logread.read(f"{title}\n\nIt fails after a while, see the screenshot.\n")
    assert [e.headline for e in reading.errors] == [headline]


def test_a_type_named_without_a_message_is_noted() -> None:
    reading = logread.read("ZeRO-1 RuntimeError when using communication_data_type bf16\n")
    assert reading.errors == ()
    assert reading.named == ("RuntimeError",)


def test_a_message_written_out_without_its_type_still_names_the_bug() -> None:
    """The paste lost the type's first letter: the declared message, DeepSpeed's own wording, is in the text."""
    message = "ZeRO-3 partitioned parameters cannot be restored from a checkpoint saved without them"
    gated = bug("restore", gate_face(None, "<1", "ValueError", message))
    t = triage.rank([gated], logread.read(f"the error:\nalueError: {message}.\n"))
    assert t.known is not None
    assert f"the text writes out its message {message!r}" in t.known.reason


def test_a_stock_message_written_out_needs_the_bug_placed() -> None:
    """Torch's own wording, written out with nothing of where it raised: a possible bug, never a named one; the bug's
    frame named in the text places it."""
    gated = bug("slice", gate_face(None, "<1", "IndexError", r"slice\(\) cannot be applied to a 0-dim tensor"))
    framed = bug(
        "slice",
        gate_face(None, "<1", "IndexError", r"slice\(\) cannot be applied to a 0-dim tensor"),
        seen_face(
            (),
            {"where": "https://example.org/issues/1", "frames": ("stage_1_and_2.py:load_hp_checkpoint_state",)},
            "test",
        ),
    )
    text = "the error:\nndexError: slice() cannot be applied to a 0-dim tensor.\n"
    t = triage.rank([gated], logread.read(text))
    assert t.known is None
    assert "a message many causes raise" in t.candidates[0].reason
    t = triage.rank([framed], logread.read(f"{text}while load_hp_checkpoint_state ran\n"))
    assert t.known is not None


def test_a_title_that_repeats_the_tracebacks_exception_never_hides_its_frames() -> None:
    text = f"[BUG] AttributeError: {EPILOGUE.format('overlapping_partition_gradients_reduce_epilogue')}\n\n{TRACEBACK}"
    reading = logread.read(text)
    (error,) = reading.errors
    assert error.innermost_deepspeed == Frame("deepspeed/runtime/engine.py", 2300, "backward")
    assert "(no DeepSpeed frame)" not in triage.showed(reading)


def test_an_exception_chained_through_user_code_keeps_deepspeeds() -> None:
    text = (TRACEBACK + "\nThe above exception was the direct cause of the following exception:\n\n"
            'Traceback (most recent call last):\n  File "/home/u/loop.py", line 9, in run\n'
            '    raise TrainingFailed("step 12") from exc\nloop.TrainingFailed: step 12\n')  # fmt: skip
    reading = logread.read(text)
    assert [e.name for e in reading.errors] == ["AttributeError", "TrainingFailed"]
    assert reading.primary is reading.errors[0]
    assert triage.rank(CATALOGUE, reading).candidates[0].bug.id == "epilogue"


@pytest.mark.parametrize(
    "frame",
    [
        '  File "/opt/conda/lib/python3.10/site-packages/deepspeed/runtime/engine.py", line 2300, in backward',
        '  File "/home/me/src/DeepSpeed/deepspeed/runtime/engine.py", line 2300, in backward',
        '  File "/x/site-packages/deepspeed-0.9.2-py3.10.egg/deepspeed/runtime/engine.py", line 2300, in backward',
        '  File "C:\\envs\\ds\\Lib\\site-packages\\deepspeed\\runtime\\engine.py", line 2300, in backward',
        "\u2502 /usr/lib/python3/deepspeed/runtime/engine.py:2300 in backward          \u2502",
        "File /srv/venv/lib/python3.11/site-packages/deepspeed/runtime/engine.py:2300, in DeepSpeedEngine.backward(self)",
    ],
)
def test_deepspeed_frames_under_any_prefix(frame: str) -> None:
    """site-packages, a source checkout, an egg, Windows, rich's box, IPython."""
    text = f"Traceback (most recent call last):\n{frame}\n    self.allreduce_gradients()\nKeyError: 2\n"
    (error,) = logread.read(text).errors
    assert error.innermost_deepspeed == Frame("deepspeed/runtime/engine.py", 2300, "backward")


def test_a_traceback_indented_whole_is_read() -> None:
    """A paste indented as a Markdown code block: the exception line is indented like the frames."""
    (error,) = logread.read("\n".join(f"    {line}" for line in TRACEBACK.splitlines())).errors
    assert error.name == "AttributeError"
    assert error.innermost_deepspeed == Frame("deepspeed/runtime/engine.py", 2300, "backward")


def test_a_quoted_multi_node_log_is_read() -> None:
    """A Markdown quote's ``> `` and a launcher's host before every line (DeepSpeed's pdsh runner)."""
    text = "\n".join(f"> node-07: {line}" for line in TRACEBACK.splitlines())
    (error,) = logread.read(text).errors
    assert error.innermost_deepspeed == Frame("deepspeed/runtime/engine.py", 2300, "backward")


# --- ranking --------------------------------------------------------------------------------------------------------


def bug(id: str, *faces: Face, premise: premises.Premise | None = None, fixed_in: str | None = None,
        root_cause: str = "") -> triage.KnownBug:  # fmt: skip
    affected = tuple(f.affected for f in faces if f.affected)
    return triage.KnownBug(id, f"title of {id}", None, fixed_in, root_cause, f"/x/repros/test_{id}.py", faces,
                             premise, "the_fix", affected)  # fmt: skip


def on(release: str, origin: str = triage.GIVEN) -> triage.Judged:
    return triage.Judged((Version(release),), origin)


EPILOGUE_BUG = bug(
    "epilogue",
    gate_face(None, "<0.18.3", "AttributeError", EPILOGUE.format("backward")),
    gate_face(None, ">=0.18.3", "AttributeError", EPILOGUE.format("overlapping_partition_gradients_reduce_epilogue")),
    premise=premises.parse((), {"stage": 3}, "test"),
    root_cause="engine.backward calls allreduce_gradients on DeepSpeedZeRoOffload",
)
KEYERROR_BUG = bug("keyerror", gate_face(None, "<0.19.6", "KeyError", r"^2$"), fixed_in="0.19.6")
CATALOGUE = [EPILOGUE_BUG, KEYERROR_BUG]


def test_the_declared_message_makes_a_confident_candidate_and_says_why() -> None:
    t = triage.rank(CATALOGUE, logread.read(TRACEBACK), on("0.18.3"))
    assert t.known is not None
    assert t.known.bug.id == "epilogue"
    assert t.known.reason.startswith("the message is the one it declares: AttributeError matching")
    assert t.known.reason.endswith("deepspeed 0.18.3 is in that range")
    assert [c.bug.id for c in t.candidates] == ["epilogue"]


def test_another_releases_message_is_still_the_bug_and_is_said_so() -> None:
    t = triage.rank(CATALOGUE, logread.read("AttributeError: " + EPILOGUE.format("backward")), on("0.19.0"))
    assert t.known is not None
    assert "that message is the one of deepspeed<0.18.3; on 0.19.0 it raises AttributeError matching" in t.known.reason


def test_the_type_alone_is_weak_evidence() -> None:
    t = triage.rank(CATALOGUE, logread.read("KeyError: 'input_ids'\n"), on("0.18.3"))
    assert t.known is None
    assert [c.bug.id for c in t.candidates] == ["keyerror"]
    assert t.candidates[0].score < triage.CONFIDENT
    assert "no known bug with confidence; the closest is keyerror" in triage.verdict(t)


def test_a_release_outside_the_range_rules_the_bug_out_with_the_fixed_release() -> None:
    t = triage.rank(CATALOGUE, logread.read("KeyError: 2\n"), on("0.19.8"))
    assert t.candidates == ()
    (ruled,) = t.ruled_out
    assert ruled.reason == "deepspeed 0.19.8 is outside its affected range <0.19.6: fixed in 0.19.6"
    assert t.to_confirm(3) == [KEYERROR_BUG]  # confident evidence: a run says whether the rule holds
    assert triage.verdict(t).startswith("no known bug here: the log looks like keyerror, but deepspeed 0.19.8")
    assert triage.markdown(t).startswith(
        "### This looks like the known DeepSpeed bug `keyerror`, but deepspeed 0.19.8 is outside its affected range"
    )


def test_a_release_only_assumed_never_rules_a_matched_bug_out() -> None:
    """The DeepSpeed installed here is no evidence of the release that failed: the bug stays the known one, and the
    output asks."""
    t = triage.rank(CATALOGUE, logread.read("KeyError: 2\n"), on("0.19.8", triage.ASSUMED))
    assert t.ruled_out == ()
    assert t.known is not None
    assert t.known.bug.id == "keyerror"
    assert t.known.note == "fixed in 0.19.6; the DeepSpeed installed here is 0.19.8: was the log from an older release?"
    assert "judged on: deepspeed 0.19.8 (installed here, assumed); config:" in "\n".join(triage.terminal(t))
    assert triage.verdict(t).startswith("a known bug: keyerror (fixed in 0.19.6; the DeepSpeed installed here is")


def test_the_releases_a_log_states_rule_in_when_any_is_in_range() -> None:
    """A report that says it worked on one release and fails on another states both: the bug is ruled out only when
    none of them is in its range."""
    reading = logread.read("works with deepspeed==0.19.7, fails with deepspeed==0.19.5\nKeyError: 2\n")
    assert reading.versions == ("0.19.7", "0.19.5")
    judged = triage.Judged(tuple(Version(v) for v in reading.versions), triage.STATED)
    t = triage.rank(CATALOGUE, reading, judged)
    assert t.known is not None
    assert t.known.reason.endswith("deepspeed 0.19.5 is in that range")
    assert judged.describe() == "deepspeed 0.19.7 (stated in the log; it also states 0.19.5)"
    ruled = triage.rank(CATALOGUE, reading, triage.Judged((Version("0.19.7"), Version("0.19.8")), triage.STATED))
    assert (
        ruled.ruled_out[0].reason == "deepspeed 0.19.7, 0.19.8 is outside its affected range <0.19.6: fixed in 0.19.6"
    )


def test_a_config_that_cannot_meet_the_premise_rules_the_bug_out() -> None:
    t = triage.rank(CATALOGUE, logread.read(TRACEBACK), triage.Judged(), {"zero_optimization": {"stage": 2}})
    assert t.known is None
    (ruled,) = t.ruled_out
    assert ruled.reason == "the config cannot meet its premise: needs ZeRO stage 3; the config has 2"
    met = triage.rank(CATALOGUE, logread.read(TRACEBACK), triage.Judged(), {"zero_optimization": {"stage": 3}})
    assert met.known is not None
    assert "the config meets its premise (ZeRO stage 3)" in met.known.reason


def test_a_log_with_no_exception_is_compared_by_its_words_and_never_confident() -> None:
    text = "backward dies on DeepSpeedZeRoOffload with allreduce_gradients, no traceback kept"
    t = triage.rank(CATALOGUE, logread.read(text))
    assert t.reading.errors == ()
    assert t.candidates[0].bug.id == "epilogue"
    assert not t.candidates[0].confident
    assert "no exception (no traceback" in triage.showed(t.reading)


def test_the_markdown_is_a_ready_comment() -> None:
    """It names the repro's file as the repository does, in its subsystem's folder (wherever it was installed)."""
    placed = [dataclasses.replace(EPILOGUE_BUG, path="/site/pytest_dsrepro/catalogue/zero3/test_epilogue.py",
                                  folder="zero3"), KEYERROR_BUG]  # fmt: skip
    t = triage.rank(placed, logread.read(TRACEBACK), on("0.18.3"))
    said = {"epilogue": Finding(ScanVerdict.AFFECTED, "on deepspeed 0.18.3: ranks 0-1: AttributeError")}
    text = triage.markdown(t, said, log="crash.log")
    assert text.startswith("### This looks like a known DeepSpeed bug: `epilogue`")
    assert "- Workaround: the repro's fix `the_fix` in repros/zero3/test_epilogue.py" in text
    assert "- Reproduced: **REPRODUCED here**: on deepspeed 0.18.3" in text
    assert "dsrepro triage crash.log --release 0.18.3 --confirm" in text
    assert "pytest repros/zero3/test_epilogue.py -rx" in text


def test_the_catalogue_is_known_at_any_depth() -> None:
    """Every repro of the catalogue, in its subsystem's folder, is a known bug, its file named as the repository
    names it."""
    root = Path(__file__).parents[1]
    bugs = [b for b in triage_command.known_bugs(root / "repros") if b.catalogued]
    files = sorted(p.relative_to(root).as_posix() for p in (root / "repros").rglob("test_*.py"))
    assert sorted(b.file for b in bugs) == files
    assert "repros/zero3/test_zero3_module_id_clobbered.py" in files


def test_new_repro_prefilled_from_the_log() -> None:
    start = scaffold.prefill(logread.read(TRACEBACK + "see https://github.com/deepspeedai/DeepSpeed/issues/7650\n"))
    assert start.raises == "AttributeError"
    assert start.issue == "https://github.com/deepspeedai/DeepSpeed/issues/7650"
    text = scaffold.render("zero3-x", Path("repros/test_zero3_x.py"), start.issue, start=start)
    compile(text, "<scaffold>", "exec")
    assert "raises=AttributeError, match=\"'DeepSpeedZeRoOffload' object has no attribute" in text
    assert "(at deepspeed/runtime/engine.py in backward)" in text
    with pytest.raises(scaffold.ScaffoldError, match="no exception"):
        scaffold.prefill(logread.read("all fine\n"))


def test_a_users_config_is_judged_as_a_scan_judges_it(tmp_path: Path) -> None:
    """``"auto"`` resolved as Hugging Face does before the premise is judged, comments allowed."""
    path = tmp_path / "ds_config.json"
    path.write_text('{"zero_optimization": {"stage": 2}, // ZeRO-2\n "gradient_accumulation_steps": "auto"}')
    config, said = triage_command.config(path, logread.read(""), 2)
    assert said == str(path)
    assert config is not None
    assert config["gradient_accumulation_steps"] == 1
    shown, said = triage_command.config(None, logread.read('{"zero_optimization": {"stage": 3}}'), 2)
    assert said == "the config shown in the log"
    assert shown is not None
    assert shown["zero_optimization"] == {"stage": 3}


def test_a_pasted_config_deepspeed_would_refuse_is_judged_as_written() -> None:
    """A section written as a bare value (``"fp16": false``) is no crash: the config is read as any other (its batch
    keys derived for the world), the bare value kept, and the premise judged on it."""
    reading = logread.read('config: {"fp16": false, "zero_optimization": {"stage": 2}}\nKeyError: 2\n')
    config, said = triage_command.config(None, reading, 2)
    assert said == "the config shown in the log"
    assert config == {"fp16": False, "zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 2,
                      "gradient_accumulation_steps": 1, "train_batch_size": 4}  # fmt: skip


def test_standard_input_is_read_by_its_head_and_tail(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(log_input, "HEAD_BYTES", 64)
    monkeypatch.setattr(log_input, "TAIL_BYTES", 64)
    text = "deepspeed==0.18.3\n" + "noise line\n" * 1000 + "KeyError: 2\n"
    log = log_input.read_log("-", io.BytesIO(text.encode()))
    assert log.cut
    assert log.size == len(text)
    assert log.text.startswith("deepspeed==0.18.3\n")
    assert "[... dsrepro triage did not read" in log.text
    assert log.text.endswith("noise line\nKeyError: 2\n")


# --- the command ----------------------------------------------------------------------------------------------------


def dsrepro_triage(
    *args: str, cwd: Path, stdin: str | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pytest_dsrepro.tools.cli", "triage", *args]
    return subprocess.run(command, cwd=cwd, input=stdin, capture_output=True, text=True, timeout=timeout)


def test_a_known_bug_from_a_file_with_markdown(tmp_path: Path) -> None:
    log = tmp_path / "crash.log"
    log.write_text("\n".join(f"[rank0]: {line}" for line in TRACEBACK.splitlines()))
    proc = dsrepro_triage(str(log), "--release", "0.18.3", "--markdown", "comment.md", cwd=tmp_path)
    assert proc.returncode == triage_command.KNOWN, proc.stdout + proc.stderr
    assert "KNOWN BUG  zero3-backward-without-optimizer" in proc.stdout
    assert proc.stdout.rstrip().endswith("wrote comment.md")
    assert "a known bug: zero3-backward-without-optimizer (unfixed upstream)" in proc.stdout
    comment = (tmp_path / "comment.md").read_text()
    assert "https://github.com/deepspeedai/DeepSpeed/blob/v0.18.3/deepspeed/runtime/engine.py#L2300" in comment


def test_standard_input_and_an_error_no_repro_declares(tmp_path: Path) -> None:
    oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.\n"
    proc = dsrepro_triage("-", "--release", "0.18.3", cwd=tmp_path, stdin=oom)
    assert proc.returncode == triage_command.UNKNOWN, proc.stdout + proc.stderr
    assert proc.stdout.startswith("dsrepro triage: standard input: 72 bytes, 2 lines\n")
    assert "the log shows: torch.OutOfMemoryError: CUDA out of memory." in proc.stdout
    assert "KNOWN BUG" not in proc.stdout
    assert "to catalogue it: dsrepro new NAME --from-log -" in proc.stdout


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (b"", "empty; give the log, traceback or issue text that shows the error"),
        (b"  \n\n", "empty; give the log, traceback or issue text that shows the error"),
        (b"\x7fELF\x02\x01\x01\x00\x00\x00" * 100, "binary, not a log (control bytes in its first 8 KiB)"),
    ],
)
def test_bad_input_is_one_line(tmp_path: Path, content: bytes, said: str) -> None:
    log = tmp_path / "input"
    log.write_bytes(content)
    proc = dsrepro_triage(str(log), cwd=tmp_path)
    assert proc.returncode == triage_command.USAGE
    assert proc.stderr.startswith(f"dsrepro triage: {log}: {said}")
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "Traceback" not in proc.stderr


def test_a_known_fixes_file_that_is_not_one_is_one_line(tmp_path: Path) -> None:
    log = tmp_path / "crash.log"
    log.write_text("KeyError: 2\n")
    (tmp_path / "fixes.json").write_text('{"schema": 99}')
    proc = dsrepro_triage(str(log), "--known-fixes", "fixes.json", cwd=tmp_path)
    assert proc.returncode == triage_command.USAGE
    assert proc.stderr == ("dsrepro triage: --known-fixes fixes.json: fixes.json: not a known-fixes file of schema 1"
                           "\n")  # fmt: skip


def test_a_missing_log_is_one_line(tmp_path: Path) -> None:
    missing = dsrepro_triage(str(tmp_path / "nowhere.log"), cwd=tmp_path)
    assert missing.returncode == triage_command.USAGE
    assert (
        missing.stderr.strip()
        == f"dsrepro triage: {tmp_path / 'nowhere.log'}: cannot be read (No such file or directory)"
    )


def test_a_log_without_a_traceback_says_so(tmp_path: Path) -> None:
    """No exception; the release the log states is the one judged on, and said so."""
    log = tmp_path / "train.log"
    log.write_text("DeepSpeed version 0.14.4\nstep 1 loss 2.3\nstep 2 loss 2.1\ntraining finished\n")
    proc = dsrepro_triage(str(log), cwd=tmp_path)
    assert proc.returncode == triage_command.UNKNOWN
    assert proc.stdout.splitlines()[1:3] == [
        "the log shows: no exception (no traceback, no `...Error: message` line)",
        "judged on: deepspeed 0.14.4 (stated in the log); config: none given, none in the log",
    ]
    assert proc.stdout.rstrip().splitlines()[-2] == "no known bug matches this log"


def test_standard_input_closed_is_one_line(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "pytest_dsrepro.tools.cli", "triage", "-"]
    proc = subprocess.run(command, cwd=tmp_path, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
                          preexec_fn=lambda: os.close(0))  # fmt: skip
    assert proc.returncode == triage_command.USAGE
    assert proc.stderr == "dsrepro triage: standard input is closed; pipe the log into it, or give the log's file\n"


def test_a_200_mb_log_is_read_by_its_head_and_tail(tmp_path: Path) -> None:
    log = tmp_path / "big.log"
    line = b"[2025-01-09 10:12:44,101] [INFO] [logging.py:128:log_dist] [Rank 0] step=1000, skipped=0\n"
    block = line * ((1 << 20) // len(line) + 1)
    with log.open("wb") as f:
        f.write(b"DeepSpeed version 0.18.3\n")
        for _ in range(200):
            f.write(block)
        f.write(TRACEBACK.encode())
    proc = dsrepro_triage(str(log), "--release", "0.18.3", cwd=tmp_path)
    assert proc.returncode == triage_command.KNOWN, proc.stdout + proc.stderr
    assert proc.stdout.startswith(f"dsrepro triage: {log}: 200")
    assert "MiB, its first 1 MiB and last 4 MiB read, " in proc.stdout.splitlines()[0]
    assert "KNOWN BUG  zero3-backward-without-optimizer" in proc.stdout


def test_confirm_says_honestly_that_a_fixed_bug_does_not_reproduce_here(tmp_path: Path, process_tag: str) -> None:
    """The module-id bug's own failure text, with no release stated: the DeepSpeed installed here (fixed since 0.16.4)
    is only assumed, so the bug is still the known one, asked about; the run says it does not reproduce here."""
    log = tmp_path / "issue.txt"
    log.write_text("AssertionError: ZeRO-3 initialize replaced the user's expert ids: [100, 101] -> [3, 5]\n")
    proc = dsrepro_triage(str(log), "--confirm", cwd=tmp_path, timeout=600)
    assert proc.returncode == triage_command.KNOWN, proc.stdout + proc.stderr
    assert "note: the log states no release; deepspeed " in proc.stdout
    assert "KNOWN BUG  zero3-module-id-clobbered" in proc.stdout
    assert "release: fixed in 0.16.4; the DeepSpeed installed here is " in proc.stdout
    assert "confirm: not reproduced here: fixed: passes on deepspeed" in proc.stdout
    assert "FIXED  zero3/test_zero3_module_id_clobbered.py::" in proc.stdout  # the run's own words, by folder
    assert "a known bug: zero3-module-id-clobbered (fixed in 0.16.4; the DeepSpeed installed here is" in proc.stdout


# --- the fixes the atlas knows ---------------------------------------------------------------------------------------


FROB = known_fixes.KnownFix(16, "Fix the frobnicator", "0" * 40, "0.1.0", "99.0", (
    known_fixes.FixedTest("unit/test_frob.py::test_widgets_kept", "ranks 0-1: RuntimeError: the frobnicator lost its "
                          "widgets on rank 3"),
    known_fixes.FixedTest("unit/test_frob.py::test_count", "assert 3 == 0"),
))  # fmt: skip


def test_a_known_fix_is_named_by_its_tests_failure_with_its_pull_request() -> None:
    fix = triage.fix_bug(FROB)
    assert (fix.id, fix.title, fix.upstream, fix.fixed_in, fix.affected) == (
        "fix-16",
        "Fix the frobnicator",
        "https://github.com/deepspeedai/DeepSpeed/pull/16",
        "99.0",
        ("<99.0",),
    )
    (face,) = fix.faces  # a test's own ``assert`` is no face: users never see it
    assert face.raises == "RuntimeError"
    t = triage.rank([*CATALOGUE, fix], logread.read("RuntimeError: the frobnicator lost its widgets on rank 0\n"))
    assert t.known is not None
    assert t.known.bug is fix
    assert "the fix's own test failed so on 0.1.0 and passes from 99.0" in t.known.reason
    assert t.known.bug.workaround == "upgrade to deepspeed 99.0 or later"
    ruled = triage.rank([fix], logread.read("RuntimeError: the frobnicator lost its widgets\n"), on("99.1"))
    assert ruled.ruled_out[0].reason == "deepspeed 99.1 is outside its affected range <99.0: fixed in 99.0"


def test_a_catalogued_bug_outranks_a_known_fix_of_the_same_evidence() -> None:
    same = dataclasses.replace(triage.fix_bug(FROB), faces=KEYERROR_BUG.faces, affected=KEYERROR_BUG.affected)
    t = triage.rank([same, KEYERROR_BUG], logread.read("KeyError: 2\n"))
    assert [c.bug.id for c in t.candidates] == ["keyerror", "fix-16"]


def _fake_deepspeed_clone(root: Path) -> str:
    """A clone in DeepSpeed's layout whose fix commit adds a test that fails on any release before 99.0."""

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
                              check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip

    files = {"version.txt": "0.1.0\n", ".gitignore": "__pycache__/\n", "tests/conftest.py": "", "tests/pytest.ini": "[pytest]\n",
             "tests/unit/common.py": "class DistributedTest: pass\n",
             "tests/unit/test_frob.py": "def test_widgets_kept():\n    import deepspeed\n\n    assert deepspeed."
             "__version__ == '99.0', 'the frobnicator lost its widgets'\n"}  # fmt: skip
    root.mkdir()
    git("init", "-q")
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    git("add", "-A")
    git("commit", "-qm", "Fix the frobnicator (#16)")
    return git("rev-parse", "HEAD")


def test_confirm_runs_a_known_fixs_own_test_from_the_users_clone(tmp_path: Path) -> None:
    """``--confirm --repo CLONE``: the fix's own test, at the fix's commit, run on the DeepSpeed here, where it fails
    as it did before the fix: the bug is reproduced here."""
    sha = _fake_deepspeed_clone(tmp_path / "DeepSpeed")
    fixes = tmp_path / "known-fixes.json"
    known_fixes.write(fixes, [dataclasses.replace(FROB, commit=sha, tests=FROB.tests[:1])], "a test")
    log = tmp_path / "crash.log"
    log.write_text("RuntimeError: the frobnicator lost its widgets on rank 0\n")
    without = dsrepro_triage(str(log), "--known-fixes", str(fixes), "--repo", "x", cwd=tmp_path)
    assert (without.returncode, without.stderr) == (triage_command.USAGE, "dsrepro triage: --repo is for --confirm: "
                                                    "the clone a known fix's own test is run from\n")  # fmt: skip
    proc = dsrepro_triage(str(log), "--known-fixes", str(fixes), "--confirm", "--top", "1", "--repo",
                          str(tmp_path / "DeepSpeed"), cwd=tmp_path, timeout=600)  # fmt: skip
    assert proc.returncode == triage_command.KNOWN, proc.stdout + proc.stderr
    assert "KNOWN BUG  fix-16: Fix the frobnicator" in proc.stdout
    assert ("confirm: REPRODUCED here: its own test unit/test_frob.py::test_widgets_kept fails on deepspeed "
            f"{versions.installed_text('deepspeed')}, as before the fix (99.0): AssertionError: the frobnicator lost its "
            "widgets") in proc.stdout  # fmt: skip
    assert "a known bug, reproduced here: fix-16" in proc.stdout


def test_a_bug_a_log_does_not_reach_scores_as_the_whole_comparison_would() -> None:
    """``evidence.Reach`` lets triage skip a bug's faces for a log that shows none of its types, frames, messages'
    starts or phrases: the evidence is the same as the whole comparison's, for every known bug and fix, on real
    reports of every shape (a traceback, a title, prose, GPU ranks)."""
    from pytest_dsrepro.triage import evidence

    root = Path(__file__).resolve().parents[1]
    bugs = triage_command.known_bugs(root / "repros")
    documents = tuple(b.document for b in bugs)
    texts = sorted((root / "corpus" / "reports" / "texts").glob("*.txt"))[::12]
    assert len(texts) >= 10
    skipped = 0
    for path in texts:
        log = evidence.Log.of(logread.read(path.read_text()), documents)
        for bug in bugs:
            named = f"{bug.title} {bug.root_cause} {bug.upstream or ''}"
            reach = evidence.Reach.of(bug.faces, named)
            words = evidence.words(bug.document)
            whole = evidence.collect(bug.faces, named, words, log, strict=not bug.catalogued)
            quick = evidence.collect(bug.faces, named, words, log, strict=not bug.catalogued, reach=reach)
            assert (quick.points, quick.matched, quick.corroborated) == (
                whole.points,
                whole.matched,
                whole.corroborated,
            ), (path.name, bug.id)
            skipped += not reach.within(log)
    assert skipped > len(texts) * len(bugs) // 2  # most bugs, for most logs


def test_triage_is_linear_on_any_line_shape() -> None:
    """One line of 64 KiB of each adversarial shape (a quadratic regex took about a minute on dotted words, and a
    nested JSON ended in RecursionError): four times the line takes about four times as long, not sixteen. No bound
    in seconds (a busy machine would break it): each time is the best of two, and the benchmark has the figures."""
    import time

    from hostile import adversarial_lines

    def took(line: str) -> float:
        times = []
        for _ in range(2):
            started = time.perf_counter()
            triage.rank(CATALOGUE, logread.read(line + "\n"))
            times.append(time.perf_counter() - started)
        return min(times)

    short, long = adversarial_lines(16 * 1024), adversarial_lines(64 * 1024)
    for name, line in long.items():
        seconds, quarter = took(line), took(short[name])
        assert seconds < 10 * quarter + 0.3, f"{name}: {seconds:.2f} s against {quarter:.2f} s for a quarter of it"
