"""The fix ledger (issue 52): the packaged rows read and validated, the rule on a small git repository written here (and
on a real DeepSpeed clone where ``DSREPRO_DEEPSPEED_CLONE`` names one), ``dsrepro ledger``'s list, filters and
``--check``, and triage naming a known fix of the ledger by what users see."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from packaging.version import Version

from conftest import commit_files, git_in
from pytest_dsrepro.core.text import strip_ansi
from pytest_dsrepro.tools import catalogue, cli, ledger_command, triage_command
from pytest_dsrepro.triage import evidence, ledger, logread
from pytest_dsrepro.triage import ranking as triage
from pytest_dsrepro.triage.ledger import FixRow, LedgerError

REPROS = Path(__file__).resolve().parents[1] / "repros"
CLONE_ENV = "DSREPRO_DEEPSPEED_CLONE"

ROW = """\
[[fix]]
commit = "{commit}"
pr = {pr}
title = "{title}"
first = "{first}"
issues = [15]
area = "zero3"
disposition = "known"
cpu = true
reason = "The frobnicator loses its widgets after a step."
workaround = "Set frob_widgets to false."

[[fix.face]]
where = "https://github.com/deepspeedai/DeepSpeed/issues/15"
raises = "RuntimeError"
match = 'the frobnicator lost its widgets'
seen = "RuntimeError: the frobnicator lost its widgets on rank 1"
frames = ["frob.py:step"]
"""


def row(commit: str = "a" * 40, pr: int = 16, title: str = "Fix the frobnicator", first: str = "0.2.0") -> str:
    return ROW.format(commit=commit, pr=pr, title=title, first=first)


def problems(text: str, name: str = "v0.2.toml") -> str:
    with pytest.raises(LedgerError) as raised:
        ledger.parse([(name, text)])
    return str(raised.value)


@pytest.fixture(scope="module")
def packaged() -> tuple[FixRow, ...]:
    return ledger.load()


@pytest.fixture(scope="module")
def repros() -> dict[str, int | None]:
    return {e.id: e.fix_pr for e in catalogue.collect([str(REPROS)], ["--rootdir", str(REPROS)])}


# --- the packaged ledger -------------------------------------------------------------------------------------------


def test_the_packaged_ledger_is_whole_and_valid(packaged: tuple[FixRow, ...], repros: dict[str, int | None]) -> None:
    """Every row filled in (a disposition, an area, a reason; a known row's faces and ``cpu``; a repro row's id, one
    the catalogue's markers name), each in the file of its releases, no commit twice."""
    assert len(packaged) >= 274
    ledger.check_catalogue(packaged, repros)
    assert {f.disposition for f in packaged} == set(ledger.DISPOSITIONS)
    for fix in packaged:
        name = Path(fix.place.split(":")[0]).stem  # v0.14-v0.15, v0.16, v0.19.3-v0.19.6
        low, _, high = name.partition("-")
        first = Version(fix.first)
        assert Version(low[1:]) <= first, fix.place
        assert first.release[: len(Version((high or low)[1:]).release)] <= Version((high or low)[1:]).release
        if fix.disposition == ledger.KNOWN:
            assert fix.seen, fix.place
            assert fix.cpu is not None, fix.place
    assert {f.repro for f in packaged if f.repro} <= set(repros)


def test_every_catalogued_fix_in_the_ledgers_range_is_its_repro_row(
    packaged: tuple[FixRow, ...], repros: dict[str, int | None]
) -> None:
    rows = {f.pr: f for f in packaged}
    for bug, pr in repros.items():
        if pr in rows:
            assert rows[pr].disposition == ledger.REPRO, (bug, pr)


# --- validation ----------------------------------------------------------------------------------------------------


def test_a_valid_row_reads_as_typed_data() -> None:
    (fix,) = ledger.parse([("v0.2.toml", row())])
    assert (fix.label, fix.first, fix.issues, fix.cpu, fix.affected) == (
        f"#16 {'a' * 9}",
        "0.2.0",
        (15,),
        True,
        "<0.2.0",
    )
    assert fix.link == "https://github.com/deepspeedai/DeepSpeed/pull/16"
    assert fix.faces[0].raises == "RuntimeError"
    assert fix.seen[0].seen == "RuntimeError: the frobnicator lost its widgets on rank 1"
    assert fix.place == "v0.2.toml:1"


@pytest.mark.parametrize(
    ("old", "new", "said"),
    [
        ('disposition = "known"', 'disposition = "fixed"', "disposition 'fixed' must be one of 'repro', 'known'"),
        ('disposition = "known"', 'disposition = ""', "not filled in: no disposition"),
        ('area = "zero3"', 'area = "zero4"', "area 'zero4' must be one of zero12, zero3"),
        ("cpu = true\n", "", "a known row says whether a CPU world could show it"),
        ('disposition = "known"', 'disposition = "repro"', "a repro row (and only one) names its catalogued bug"),
        ("match = 'the frobnicator lost its widgets'", "match = 'the frobnicator lost its gadgets'",
         "face 1: match 'the frobnicator lost its gadgets' does not match its seen"),
        ('frames = ["frob.py:step"]', 'frames = ["Frob.step"]', "face 1: frames='Frob.step' must name a function"),
        ("match = 'the frobnicator lost its widgets'", "match = 'RuntimeError: \\d+'",
         "face 1: match 'RuntimeError: \\\\d+' is too broad"),
        ('first = "0.2.0"', 'first = "0.2.0"\nsince = "0.3.0"', "since '0.3.0' must be a release before first"),
        ('first = "0.2.0"', 'first = "soon"', "first 'soon' must be the first release with the fix"),
        ('title = "Fix the frobnicator"', 'title = "Fix the frobnicator"\nowner = "me"', "unknown key 'owner'"),
    ],
)  # fmt: skip
def test_a_wrong_row_is_named_by_file_line_and_row(old: str, new: str, said: str) -> None:
    text = "# the rows of 0.2\n\n" + row().replace(old, new)
    message = problems(text)
    assert f"v0.2.toml:3: row 1 (#16 {'a' * 9})" in message
    assert said in message


def test_a_known_row_without_a_face_and_a_commit_twice_are_problems() -> None:
    faceless = row().split("[[fix.face]]")[0]
    assert "a known row needs a face" in problems(faceless)
    twice = problems(row() + "\n" + row(pr=17))
    assert f"v0.2.toml:20: commit {'a' * 9} is already a row at v0.2.toml:1" in twice


def test_repro_rows_are_checked_against_the_catalogues_markers() -> None:
    repro = row().replace('disposition = "known"', 'disposition = "repro"\nrepro = "zero3-frob"')
    fixes = ledger.parse([("v0.2.toml", repro)])
    ledger.check_catalogue(fixes, {"zero3-frob": 16})
    with pytest.raises(LedgerError, match="repro 'zero3-frob' is not a catalogued bug"):
        ledger.check_catalogue(fixes, {"zero3-other": None})
    with pytest.raises(LedgerError, match="the catalogued bug 'zero3-frob' names #16 as its fix"):
        ledger.check_catalogue(ledger.parse([("v0.2.toml", row())]), {"zero3-frob": 16})


# --- the rule ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("subject", "body", "files", "pr", "why"),
    [
        ("Fix the frobnicator (#16)", "", ["deepspeed/runtime/frob.py"], 16, "its subject says 'Fix'"),
        ("Avoid a deadlock in all_gather", "", ["deepspeed/comm/comm.py"], None, "its subject says 'deadlock'"),
        ("Handle empty groups (#17)", "Fixes #15", ["deepspeed/x.py", "tests/t.py"], 17, "it closes #15"),
        ("Handle empty groups", "closes https://github.com/deepspeedai/DeepSpeed/issues/9", ["deepspeed/x.py"], None,
         "it closes #9"),
        ("Use the right dtype (#18)", "", ["deepspeed/x.py"], 18, "a repro or a known fix names #18"),
        ("Fix a typo in the docs (#19)", "", ["docs/index.md", "deepspeed/README.md"], 19, None),
        ("Fix the op builder (#20)", "", ["op_builder/builder.py", "csrc/adam.cpp"], 20, None),
        ("Refactor the launcher (#21)", "Prefixes the logs", ["deepspeed/launcher/runner.py"], 21, None),
    ],
)  # fmt: skip
def test_the_rule(subject: str, body: str, files: list[str], pr: int | None, why: str | None) -> None:
    assert ledger.selects(subject, body, files, pr, named={18}) == why


@pytest.fixture
def clone(tmp_path: Path) -> dict[str, str]:
    """A repository in DeepSpeed's layout: v0.14.0, a fix, a docs-only fix, a refactor that closes an issue, a
    refactor, v0.2.0. Its commits by name."""
    root = tmp_path / "DeepSpeed"
    root.mkdir()
    git_in(root, "init", "-q")
    return {
        "root": str(root),
        "start": commit_files(root, "Initial", {"deepspeed/__init__.py": "", "version.txt": "0.14.0\n"}, tag="v0.14.0"),
        "fix": commit_files(root, "Fix the frobnicator (#16)", {"deepspeed/runtime/frob.py": "widgets = 1\n"}),
        "docs": commit_files(root, "Fix a typo in the docs (#17)", {"docs/index.md": "typo fixed\n"}),
        "closes": commit_files(root, "Keep the widgets (#18)\n\nFixes #15", {"deepspeed/runtime/frob.py": "widgets = 2\n"}),
        "refactor": commit_files(root, "Refactor the frobnicator (#19)", {"deepspeed/runtime/frob.py": "widgets = 3\n"},
                            tag="v0.14.1"),
    }  # fmt: skip


def check(clone: dict[str, str], rows: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    folder = tmp_path / "fixes"
    folder.mkdir(exist_ok=True)
    (folder / "v0.14.toml").write_text(rows)
    code = cli.main(["ledger", "--check", "--repo", clone["root"], "--ledger", str(folder), "--catalogue", str(REPROS)])
    return code, capsys.readouterr().out


def test_check_names_a_fix_without_a_row(
    clone: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The fix and the refactor that closes an issue are selected; the docs-only fix and the plain refactor are not.
    A selected commit without a row fails the check, naming it; with its row the check passes; a row for a commit
    the rule does not select fails it too."""
    closes = row(clone["closes"], 18, "Keep the widgets", "0.14.1")
    code, out = check(clone, closes, tmp_path, capsys)
    assert code == ledger_command.UNACCOUNTED
    assert f"no row: {clone['fix'][:9]} #16 Fix the frobnicator (its subject says 'Fix')" in out
    assert "v0.14.0" in out
    assert "4 commits, 2 selected by the rule, 1 rows" in out
    assert clone["docs"][:9] not in out
    assert "1 selected commit(s) without a row, 0 row(s) the rule does not select" in out

    both = closes + "\n" + row(clone["fix"], 16, "Fix the frobnicator", "0.14.1")
    code, out = check(clone, both, tmp_path, capsys)
    assert (code, out.splitlines()[-1]) == (ledger_command.OK, "every commit the rule selects has a row")

    code, out = check(clone, both + "\n" + row(clone["refactor"], 19, "Refactor the frobnicator", "0.14.1"),
                      tmp_path, capsys)  # fmt: skip
    assert code == ledger_command.UNACCOUNTED
    assert (
        f"the rule no longer selects: #19 {clone['refactor'][:9]} Refactor the frobnicator (its row: v0.14.toml:" in out
    )


@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        (["--release", "soon"], "--release 'soon' is not a version such as 0.18.3"),
        (["--area", "zero4"], "--area 'zero4': one of zero12, zero3"),
        (["--disposition", "fixed"], "--disposition 'fixed': one of repro, known"),
        (["--repo", "."], "--repo, --range and --catalogue are for --check"),
        (["--check"], "--check needs --repo CLONE"),
        (["--check", "--repo", "/nonexistent"], "--repo /nonexistent: no such directory"),
        (["--ledger", "/nonexistent"], "/nonexistent: no such directory of ledger files"),
    ],
)
def test_bad_input_is_one_line(arguments: list[str], said: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["ledger", *arguments]) == ledger_command.USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"dsrepro ledger: {said}"), err
    assert err.count("\n") == 1, err


def test_a_range_the_clone_does_not_have(clone: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["ledger", "--check", "--repo", clone["root"], "--range", "v0.9.0..HEAD"])
    assert code == ledger_command.USAGE
    assert "deepspeed 0.9.0 has no tag v0.9.0" in capsys.readouterr().err


@pytest.mark.skipif(
    not os.environ.get(CLONE_ENV),
    reason=f"set {CLONE_ENV}=/path/to/DeepSpeed (a clone with its tags) to check every fix since v0.14.0 has a row",
)
def test_every_fix_of_a_real_deepspeed_clone_has_a_row(capsys: pytest.CaptureFixture[str]) -> None:
    """The rule on a DeepSpeed clone, from v0.14.0 to its HEAD (``DSREPRO_DEEPSPEED_RANGE`` for another range): a
    clone with releases newer than the ledger's names the fixes without a row, and fails here."""
    arguments = ["--range", os.environ["DSREPRO_DEEPSPEED_RANGE"]] if os.environ.get("DSREPRO_DEEPSPEED_RANGE") else []
    code = cli.main(["ledger", "--check", "--repo", os.environ[CLONE_ENV], "--catalogue", str(REPROS), *arguments])
    out = capsys.readouterr().out
    assert code == ledger_command.OK, out


# --- the list ------------------------------------------------------------------------------------------------------


def test_the_list_groups_filters_and_counts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "fixes"
    folder.mkdir()
    not_for_users = row("b" * 40, 17, "Fix the frobnicator's test", "0.3.0").split("[[fix.face]]")[0]
    not_for_users = not_for_users.replace('disposition = "known"\ncpu = true', 'disposition = "not for users"')
    gpu = row("c" * 40, 18, "Fix the NCCL frobnicator", "0.3.0").replace("cpu = true", "cpu = false")
    (folder / "v0.2-v0.3.toml").write_text("\n".join([row(), not_for_users, gpu]))
    assert cli.main(["ledger", "--ledger", str(folder)]) == ledger_command.OK
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "release 0.2.0: 1"
    assert out[1].split() == ["aaaaaaaaa", "#16", "0.2.0", "known", "(CPU)", "zero3", "Fix", "the", "frobnicator"]
    assert out[2] == "release 0.3.0: 2"
    assert out[-4:] == [
        "release  repro  known  not for users  not a fix  known on CPU  total",
        "0.2.0        0      1              0          0             1      1",
        "0.3.0        0      1              1          0             0      2",
        "total        0      2              1          0             1      3",
    ]
    assert cli.main(["ledger", "--ledger", str(folder), "--by", "disposition", "--release", "0.3.0"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if not line.startswith(" ")][:2] == [
        "disposition known: 1",
        "disposition not for users: 1",
    ]
    assert cli.main(["ledger", "--ledger", str(folder), "--cpu", "--area", "zero3"]) == 0
    out = capsys.readouterr().out
    assert "#16" in out
    assert "#18" not in out
    assert "#17" not in out
    assert cli.main(["ledger", "--ledger", str(folder), "--area", "moe"]) == 0
    assert capsys.readouterr().out.startswith("no row of the ledger is chosen\n")


def test_the_packaged_ledger_is_listed(capsys: pytest.CaptureFixture[str]) -> None:
    """The repro queue: the known fixes a CPU world could show, by area, counted."""
    assert cli.main(["ledger", "--disposition", "known", "--cpu", "--by", "area"]) == ledger_command.OK
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("area zero12: ")
    total = out[-1].split()  # total, repro, known, not for users, not a fix, known on CPU, total
    assert total[:2] == ["total", "0"]
    assert total[2] == total[5] == total[6] != "0"


# --- triage names a known fix --------------------------------------------------------------------------------------


def _known(packaged: tuple[FixRow, ...], pr: int) -> FixRow:
    return next(f for f in packaged if f.pr == pr and f.disposition == ledger.KNOWN)


@pytest.fixture(scope="module")
def bugs() -> list[triage.KnownBug]:
    return triage_command.known_bugs(REPROS)


def test_triage_names_a_known_fix_by_its_face_with_its_advice(
    packaged: tuple[FixRow, ...], bugs: list[triage.KnownBug]
) -> None:
    """A known row (#6517: the flops profiler on a torch without scaled_dot_product_attention): its face's line as a
    user pasted it names the fix with confidence, in its range (from ``since``), with the release that fixes it and
    the row's workaround; the release with the fix rules it out, and so does one before ``since``."""
    fix = _known(packaged, 6517)
    ids = [b.id for b in bugs]
    assert ids.count("fix-6517") == 1
    assert len(ids) == len(set(ids))
    text = f"{fix.seen[0].seen}\n"
    before = Version(fix.first).release
    inside = f"{before[0]}.{before[1]}.{before[2] - 1}"
    t = triage.rank(bugs, logread.read(text), triage.Judged((Version(inside),), triage.GIVEN))
    assert t.known is not None, triage.terminal(t)
    assert t.known.bug.id == "fix-6517", triage.terminal(t)
    assert t.known.bug.affected == (f">={fix.since},<{fix.first}",)
    assert fix.workaround
    assert (
        t.known.bug.workaround
        == f"upgrade to deepspeed {fix.first} or later; before that: {fix.workaround.rstrip('.')}"
    )
    assert t.known.bug.upstream == fix.issue_links[0]
    for outside in (fix.first, "0.13.0"):
        ruled = triage.rank(bugs, logread.read(text), triage.Judged((Version(outside),), triage.GIVEN))
        assert [r.bug.id for r in ruled.ruled_out][:1] == ["fix-6517"]
        assert f"outside its affected range >={fix.since},<{fix.first}" in ruled.ruled_out[0].reason


def test_a_gpu_face_names_a_known_fix(packaged: tuple[FixRow, ...], bugs: list[triage.KnownBug]) -> None:
    fix = _known(packaged, 6614)
    (gpu,) = [s for s in fix.seen if s.face.gpu]
    t = triage.rank(bugs, logread.read(gpu.seen + "\n"))
    assert t.known is not None
    assert t.known.bug.id == "fix-6614"
    assert "(on GPUs)" in t.known.reason


def test_the_atlas_test_of_a_known_row_is_one_more_face_of_one_candidate(
    packaged: tuple[FixRow, ...], bugs: list[triage.KnownBug]
) -> None:
    """#8042 is a known row and a fix of the atlas: one candidate, with the row's faces and the test's failure, and
    ``--confirm --repo`` can run its test."""
    (bug,) = [b for b in bugs if b.id == "fix-8042"]
    assert bug.ledger is not None
    assert bug.fixed_by is not None
    assert set(bug.faces) > set(triage.test_faces(bug.fixed_by))
    assert set(bug.faces) > set(bug.ledger.faces)
    catalogued = {b.id for b in bugs if b.catalogued}
    assert not any(b.id == f"fix-{f.pr}" for b in bugs for f in packaged if f.repro in catalogued)


def test_the_terminal_and_the_comment_say_what_to_do(
    packaged: tuple[FixRow, ...], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fix = _known(packaged, 6517)
    assert fix.workaround
    log = tmp_path / "crash.log"
    log.write_text(f"[rank0]: {fix.seen[0].seen}\n")
    comment = tmp_path / "comment.md"
    arguments = ["triage", str(log), "--release", "0.15.1", "--catalogue", str(REPROS), "--markdown", str(comment)]
    assert cli.main(arguments) == triage_command.KNOWN
    out = strip_ansi(capsys.readouterr().out)
    assert f"KNOWN BUG  fix-6517: {fix.title}" in out
    assert (
        f"fixed in {fix.first} by pull request #6517; workaround: upgrade to deepspeed {fix.first} or later; "
        f"before that: {fix.workaround.rstrip('.')}; upstream: {fix.issue_links[0]}"
    ) in out
    assert f"a known bug: fix-6517 (fixed in {fix.first} by pull request #6517)" in out
    said = comment.read_text()
    assert said.startswith("### This looks like a known DeepSpeed bug: `fix-6517`\n")
    assert f"- Root cause: {fix.reason}\n" in said
    assert f"- Fixed by: {fix.link} ({fix.title})\n" in said
    assert "a CPU world could show it: `dsrepro new NAME --issue" in said
    assert "pytest repros/" not in said


@pytest.mark.parametrize(
    ("pattern", "own"),
    [
        ("list index out of range", False),
        ("IndexError: tuple index out of range", False),
        ("'NoneType' object has no attribute 'to'", False),
        ("No backend type associated with device type cpu", False),
        ("unsupported operand type\\(s\\) for /: 'NoneType' and 'int'", False),
        ("'BF16_Optimizer' object has no attribute 'state'", True),
        ("'NoneType' object has no attribute 'next_functions'", True),
        ("KeyError: 'max_mem'", True),
        ("Number of heads \\(\\d+\\) must be larger than sequence parallel size \\(\\d+\\)", True),
        ("Device type with index is not supported but got cuda:\\d", True),
    ],
)
def test_a_message_is_a_bugs_own_when_it_names_something_or_is_deepspeeds_wording(pattern: str, own: bool) -> None:
    assert evidence.specific(pattern) is own


def test_a_stock_message_names_a_known_fix_only_where_it_raises(
    packaged: tuple[FixRow, ...], bugs: list[triage.KnownBug]
) -> None:
    """#7599's face is Python's own ``list index out of range``, raised where a checkpoint's file names are listed: the
    line alone (a title, a bare error: a launcher's failure has it too) makes the fix possible, never known; a
    traceback through its frames names it, before the catalogued bugs that raise the same message elsewhere."""
    fix = _known(packaged, 7599)
    assert not evidence.specific(fix.seen[0].face.match or "")
    alone = triage.rank(bugs, logread.read(f"{fix.seen[0].seen}\n"))
    assert alone.known is None, triage.terminal(alone)
    assert "fix-7599" in [c.bug.id for c in alone.candidates]
    assert "a message many causes raise" in next(c for c in alone.candidates if c.bug.id == "fix-7599").reason
    traced = """Traceback (most recent call last):
  File "/opt/venv/lib/python3.10/site-packages/deepspeed/runtime/engine.py", line 3017, in load_checkpoint
    load_path, client_states = self._load_checkpoint(load_dir,
  File "/opt/venv/lib/python3.10/site-packages/deepspeed/runtime/engine.py", line 3064, in _load_checkpoint
    ckpt_list = self._get_all_ckpt_names(load_dir, tag)
  File "/opt/venv/lib/python3.10/site-packages/deepspeed/runtime/engine.py", line 3370, in _get_all_ckpt_names
    ckpt_files = [ckpt_file_pattern.format(rank) for rank in ranks[:mp_world_size]][0]
IndexError: list index out of range
"""
    t = triage.rank(bugs, logread.read(traced))
    assert t.known is not None, triage.terminal(t)
    assert t.known.bug.id == "fix-7599"


def test_a_fix_is_not_corroborated_by_the_frames_of_every_step(bugs: list[triage.KnownBug]) -> None:
    """A known fix's face through ``engine.py:backward`` (#7725) gains nothing from a traceback of any backward: that
    frame is every training step's."""
    text = """Traceback (most recent call last):
  File "/w/train.py", line 9, in <module>
    engine.backward(loss)
  File "/w/venv/lib/python3.11/site-packages/deepspeed/runtime/engine.py", line 2298, in backward
    loss.backward()
RuntimeError: element 0 of tensors does not require grad and does not have a grad_fn
"""
    t = triage.rank(bugs, logread.read(text))
    assert "fix-7725" not in [c.bug.id for c in t.candidates if "engine.py:backward" in c.reason]
