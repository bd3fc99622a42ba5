"""``ds_seen``: a bug's faces, declared on its repro, read once (``core.faces``) and shown where the catalogue is:
the marker's errors, ``dsrepro list``, ``--ds-report``, the results file that carries them, and the catalogue's own."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from conftest import RunPytest
from pytest_dsrepro.core import faces, report, results
from pytest_dsrepro.core.errors import MarkerError
from pytest_dsrepro.tools import catalogue, cli
from pytest_dsrepro.tools.matrix.markdown import read_raised
from pytest_dsrepro.tools.triage_command import known_bugs
from pytest_dsrepro.triage import evidence, logread
from pytest_dsrepro.triage import ranking as triage

WHERE = "@pytest.mark.ds_seen on repros/test_x.py::test_x"
LINK = "https://github.com/deepspeedai/DeepSpeed/issues/8072"


def test_a_face_read_from_its_marker() -> None:
    face = faces.parse((LINK,), {"raises": "TypeError", "match": r"output tensor must have the same type",
                                 "frames": ("partition_parameters.py:_allgather_params_coalesced",), "gpu": True},
                       WHERE)  # fmt: skip
    assert face == faces.Face(LINK, "TypeError", r"output tensor must have the same type",
                              ("partition_parameters.py:_allgather_params_coalesced",), (), True)  # fmt: skip
    assert face.describe() == ("TypeError matching 'output tensor must have the same type' through "
                               "partition_parameters.py:_allgather_params_coalesced (on GPUs)")  # fmt: skip
    assert faces.parse((), {"where": LINK, "raises": KeyError}, WHERE).raises == "KeyError"  # a class: its name


@pytest.mark.parametrize(
    ("args", "kwargs", "said"),
    [
        ((), {"raises": "TypeError"}, "where=None must be the link where the face was seen (http:// or https://)"),
        (("issue 8072",), {"raises": "TypeError"}, "where='issue 8072' must be the link where the face was seen"),
        ((LINK,), {}, "a face needs at least one of raises=, match=, frames=, words="),
        ((LINK,), {"match": "output (tensor"}, "match='output (tensor' is not a regular expression: missing )"),
        ((LINK,), {"raises": "not a name!"}, "raises='not a name!' must be an exception class or its name as printed"),
        ((LINK,), {"frames": ("deepspeed/runtime/engine.py:backward",)},
         "frames='deepspeed/runtime/engine.py:backward' must name a function, or file.py:function"),
        ((LINK,), {"words": ("ok", "")}, "words=('ok', '') must be a tuple of non-empty strings"),
        ((LINK,), {"words": ("x",), "gpu": "yes"}, "gpu='yes' must be True or False"),
        ((LINK,), {"word": ("x",)}, "unexpected argument(s) word; takes where, raises, match, frames, words, gpu"),
    ],
)  # fmt: skip
def test_a_bad_face_names_marker_test_and_value(args: tuple[object, ...], kwargs: dict[str, object], said: str) -> None:
    with pytest.raises(MarkerError) as caught:
        faces.parse(args, kwargs, WHERE)
    assert str(caught.value) == f"{WHERE}: {said}" or str(caught.value).startswith(f"{WHERE}: {said}")


@pytest.mark.parametrize(
    ("pattern", "literal"),
    [
        (r"slice\(\) cannot be applied to a 0-dim tensor", "slice() cannot be applied to a 0-dim tensor"),
        (r"^2$", "2"),
        (r"start \(0\) \+ length \(\d+\) exceeds", "start (0) + length ("),
        (r"'\w+' object has no attribute 'refresh_fp32_params'", "'"),
        (r"learning rates? after", "learning rate"),
    ],
)
def test_the_literal_start_of_a_pattern(pattern: str, literal: str) -> None:
    assert faces.literal_prefix(pattern) == literal


MODULE = """
import pytest

pytestmark = [
    pytest.mark.ds_repro(id="x", title="x", upstream="https://example.invalid/1"),
    pytest.mark.ds_world,
]
pytestmark += [pytest.mark.ds_seen({seen})]

@pytest.mark.ds_version(affected="<0.0.1", raises=AttributeError)
def test_x():
    pass
"""


def test_a_bad_face_fails_the_test_and_the_listing(pytester: pytest.Pytester, run: RunPytest) -> None:
    """At setup, before any world starts, as every marker's error; and ``dsrepro list`` says it too."""
    pytester.mkdir("repros")
    pytester.makepyfile(**{"repros/test_x": MODULE.format(seen=f"{LINK!r}, match='(unclosed'")})
    result = run("-q", "repros")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*@pytest.mark.ds_seen on repros/test_x.py::test_x: match='(unclosed' is not a "
                                 "regular expression: missing ), unterminated subpattern*"])  # fmt: skip
    assert "pytest-dsrepro: building" not in result.stdout.str()
    pytester.chdir()
    with pytest.raises(catalogue.CollectionFailed, match=r"match='\(unclosed' is not a regular expression"):
        catalogue.collect(["repros"])


def test_faces_in_the_listing_and_the_record(pytester: pytest.Pytester, capsys: pytest.CaptureFixture[str]) -> None:
    pytester.mkdir("repros")
    seen = f"{LINK!r}, raises='TypeError', match='output tensor', gpu=True"
    pytester.makepyfile(**{"repros/test_x": MODULE.format(seen=seen)})
    pytester.chdir()
    assert cli.main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = lines.index("  seen: TypeError matching 'output tensor' (on GPUs)")
    assert lines[at + 1] == f"  at {LINK}"
    assert cli.main(["list", "--format", "markdown"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("| PREMISE | SEEN AS |")
    assert out[2].endswith(f"| TypeError matching 'output tensor' (on GPUs) ([seen]({LINK})) |")
    assert cli.main(["list", "--format", "json"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)
    assert entry["faces"] == [{"where": LINK, "raises": "TypeError", "match": "output tensor", "frames": [],
                               "words": [], "gpu": True, "affected": None, "gate": False}]  # fmt: skip


REPRO = results.ReproMeta("x", "x title", LINK, affected=("<1",),
                          faces=(faces.Face(LINK, "TypeError", "output tensor", gpu=True),))  # fmt: skip


def test_the_report_shows_the_faces() -> None:
    lines = report._repro(REPRO)
    assert lines[-1] == f"- **Also seen as:** TypeError matching 'output tensor' (on GPUs) ([seen]({LINK}))"


def test_a_schema_6_file_reads_as_repros_without_faces(tmp_path: Path) -> None:
    """Schema 7 only added a repro's faces: results written before it still merge with new ones."""
    record = results.TestRecord(nodeid="repros/test_x.py::test_x", repro=dataclasses.replace(REPRO, faces=()),
                                variant=None, verdict=None, reason=None, outcome="passed", error=None, duration=0.1,
                                config=None)  # fmt: skip
    run = results.RunRecord(environment=results.environment(None, None), tests=(record,))
    data = run.to_json()
    assert data["tests"][0]["repro"].pop("faces") == []
    path = tmp_path / "r.json"
    path.write_text(json.dumps({**data, "schema": 6}))
    assert results.read(path) == run


def test_every_catalogued_bug_has_a_face_with_its_link() -> None:
    """The catalogue's own: every bug declares how users meet it, each face with the address where it was seen, and
    a face whose message a bug's gate already declares adds more than that message."""
    bugs = [b for b in known_bugs(Path(__file__).parents[1] / "repros") if b.catalogued]
    assert len(bugs) >= 33
    for bug in bugs:
        seen = [f for f in bug.faces if not f.gate]
        assert seen, f"{bug.id} declares no ds_seen face"
        assert all(f.where.startswith("https://") for f in seen)
        gated = {(f.raises, f.match) for f in bug.faces if f.gate}
        assert all(f.frames or f.words or (f.raises, f.match) not in gated for f in seen), bug.id


def _shows(face: faces.Face, text: str) -> bool:
    """Whether ``text`` shows ``face``'s message: an exception of it as triage reads the text, or written out."""
    reading = logread.read(text)
    return (
        any(evidence.against(face, e).matched for e in reading.errors)
        or evidence.written_out(face, text.lower()).matched
    )


def _raised(bug: triage.KnownBug) -> list[str]:
    """What the repro itself raises, as its gates declare it (each run checks it): a face that is its message, or a
    part of it, is seen there."""
    return [f"{face.raises}: {face.literal}" for face in bug.faces if face.gate and face.raises and face.literal]


def test_every_face_pattern_matches_a_real_text() -> None:
    """A face that matches nothing is no face (a raw string's doubled backslash wants a backslash in the message):
    every ds_seen pattern finds its message in a real report (corpus/reports, corpus/sampled) or in what its own repro
    was recorded raising (docs/matrix-observed.md, the matrix's "What each test raised": the one record of it)."""
    root = Path(__file__).parents[1]
    texts = [p.read_text() for p in sorted(root.glob("corpus/*/texts/*.txt"))]
    recorded: dict[str, list[str]] = {}
    for name, text, _ in read_raised((root / "docs" / "matrix-observed.md").read_text()):
        recorded.setdefault(name.partition(" [")[0], []).append("\n".join(re.split(r"; (?=ranks? \d)", text)))
    assert len(texts) >= 190
    assert len(recorded) >= 30
    unmatched = [
        f"{bug.id}: {face.match!r} ({face.where})"
        for bug in known_bugs(root / "repros")
        if bug.catalogued  # a ledger fix's faces are checked against the lines they were seen as (test_ledger)
        for face in bug.faces
        if not face.gate
        and face.match
        and not any(_shows(face, t) for t in [*_raised(bug), *recorded.get(bug.id, []), *texts])
    ]
    assert not unmatched, "ds_seen patterns that match no real text nor the repro's recorded output:\n" + "\n".join(
        unmatched
    )


def test_a_face_of_another_traceback_rules_the_bug_out() -> None:
    """The NCCL wording of hf-lora-fp32-adapters-bf16 raised in a forward's fetch (not the step's all-gather its face
    names) is the same message from another cause: its frames rule the bug out, saying where it raised instead."""
    bugs = known_bugs(Path(__file__).parents[1] / "repros")
    text = """Traceback (most recent call last):
  File "/env/lib/python3.10/site-packages/deepspeed/runtime/zero/partitioned_param_coordinator.py", line 254, in fetch_sub_module
    self.__all_gather_params(params_to_fetch, forward)
  File "/env/lib/python3.10/site-packages/deepspeed/runtime/zero/partitioned_param_coordinator.py", line 386, in __all_gather_params
    handle = param_group[0].all_gather_coalesced(param_group, quantize=quantize)
RuntimeError: output tensor must have the same type as input tensor
"""
    t = triage.rank(bugs, logread.read(text), triage.Judged())
    assert t.known is None
    ruled = next(r for r in t.ruled_out if r.bug.id == "hf-lora-fp32-adapters-bf16")
    assert "_allgather_params_coalesced" in ruled.reason
    assert "__all_gather_params" in ruled.reason


def test_a_gpu_face_makes_the_nccl_wording_a_known_bug() -> None:
    """NCCL words the dtype mismatch of hf-lora-fp32-adapters-bf16 differently from gloo (the repro's gate): its
    GPU face names it, with confidence."""
    bugs = known_bugs(Path(__file__).parents[1] / "repros")
    text = "[rank1]: TypeError: output tensor must have the same type as input tensor\n"
    t = triage.rank(bugs, logread.read(text), triage.Judged())
    assert t.known is not None
    assert t.known.bug.id == "hf-lora-fp32-adapters-bf16"
    assert "(on GPUs)" in t.known.reason


def test_the_message_under_another_type_needs_the_bugs_frames() -> None:
    """hf-lora-fp32-adapters-bf16's NCCL face raises TypeError; the same words as a RuntimeError (an older torch, another
    raise) name it only where its frames show it raised in the step's all-gather."""
    bugs = known_bugs(Path(__file__).parents[1] / "repros")
    bare = "[rank1]: RuntimeError: output tensor must have the same type as input tensor\n"
    t = triage.rank(bugs, logread.read(bare), triage.Judged())
    assert t.known is None
    assert "another raise" in t.candidates[0].reason
    framed = """Traceback (most recent call last):
  File "/env/lib/python3.11/site-packages/deepspeed/runtime/zero/partition_parameters.py", line 1421, in _allgather_params_coalesced
    dist.all_gather_into_tensor(flat_tensor, param_ds_tensor)
RuntimeError: output tensor must have the same type as input tensor
"""
    t = triage.rank(bugs, logread.read(framed), triage.Judged())
    lora = next(c for c in t.candidates if c.bug.id == "hf-lora-fp32-adapters-bf16")
    assert lora.confident, lora.reason


def test_the_engines_entry_frames_alone_name_no_bug() -> None:
    """A traceback cut inside the engine's _configure_zero_optimizer (every failure to build a ZeRO optimizer passes
    there): a bug whose face lists that frame is possible, never named without its message."""
    bugs = known_bugs(Path(__file__).parents[1] / "repros")
    text = """Traceback (most recent call last):
  File "/work/train.py", line 40, in <module>
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
  File "/env/lib/python3.11/site-packages/deepspeed/runtime/engine.py", line 1348, in _configure_optimizer
    self.optimizer = self._configure_zero_optimizer(basic_optimizer)
  File "/env/lib/python3.11/site-packages/deepspeed/runtime/engine.py", line 1560, in _configure_zero_optimizer
    optimizer = DeepSpeedZeroOptimizer(
"""
    t = triage.rank(bugs, logread.read(text), triage.Judged())
    assert t.known is None
