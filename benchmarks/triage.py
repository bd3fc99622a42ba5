"""``dsrepro triage`` measured: on real reports as users pasted them (the corpus, both halves, before and after), and
on the catalogue's own failures (the old benchmark, so that nothing regresses).

**The corpus** (``corpus/reports``: each text with its answer, a catalogued bug's id, ``ledger:PR`` or none). Its
README fixes the split: a text is in the measuring half when the SHA-256 of its thread's address is odd. Each text is
triaged as ``dsrepro triage`` triages it (``triage_command.triage_log``: the releases the text states, else the
DeepSpeed installed here; no ``--release``), and counted:

- a catalogued bug's (or a ledger fix's) text: **first** when that bug is the first candidate (a possible one too),
  **known** when it is the confident one (``KNOWN BUG``, exit 0);
- another text: **claimed** when a catalogued bug is named with confidence (the user is told a wrong known bug); one
  named a known fix of the atlas instead is counted apart (it is no catalogued bug, and may be right).

Both halves, and the texts with a GPU's wording alone (``gpu`` among their faces), and the catalogued texts from
their bug's own threads (its upstream link, a face's link: the faces were written from them) apart from the
independent ones, with the median time per text.

**The sampled corpus** (``corpus/sampled``: DeepSpeed's failure reports taken without regard to the bug, each with
its class, a DeepSpeed defect, the user's setup or unclear, and its answer: a catalogued bug, ``ledger:PR``, none),
split by the same rule: the defects whose fix triage knows named with confidence (a ledger fix is the candidate
``fix-PR``: counted once the ledger's fixes are candidates), and the reports of other causes named anything.
``--before REV`` (default: the base commit of issue 46) runs the same on that revision's triage and catalogue, from a
temporary git worktree, in a child interpreter, side by side.

**The catalogue's own failures** (the old benchmark): every stock failure the matrix recorded
(``docs/matrix-observed.md``), one text per bug, config and release, triaged on that release and with none; probe
lines of real DeepSpeed issues (``--context``); errors the catalogue does not hold (``FOREIGN``); a 200 MB log.

    python benchmarks/triage.py [--half tuning|measuring|both] [--show] [--before REV] [--context DIR] [--no-big]
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
REPORTS = ROOT / "corpus" / "reports"
SAMPLED = ROOT / "corpus" / "sampled"
#: The revision triage is compared with: the base of issue 46 (before faces).
BEFORE = "c54eff2"
RELEASES = [ln.split("#")[0].strip() for ln in (ROOT / "releases.txt").read_text().splitlines() if ln[:1].isdigit()]

#: Errors users meet that no catalogued bug is: out of memory, a collective's timeout, user code, tokenizers, ...
FOREIGN = {
    "cuda-oom": """Traceback (most recent call last):
  File "/workspace/train.py", line 88, in <module>
    engine.backward(loss)
  File "/usr/local/lib/python3.10/dist-packages/deepspeed/runtime/engine.py", line 2048, in backward
    self.optimizer.backward(loss, retain_graph=retain_graph)
  File "/usr/local/lib/python3.10/dist-packages/torch/_tensor.py", line 525, in backward
    torch.autograd.backward(
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of \
which 1.02 GiB is free. Of the allocated memory 75.80 GiB is allocated by PyTorch.
""",
    "nccl-timeout": """[rank3]:[E ProcessGroupNCCL.cpp:616] [Rank 3] Watchdog caught collective operation timeout: \
WorkNCCL(SeqNum=2113, OpType=ALLREDUCE, NumelIn=262144000, NumelOut=262144000, Timeout(ms)=1800000) ran for 1800094 \
milliseconds before timing out.
[rank3]: Traceback (most recent call last):
[rank3]:   File "/home/user/deepspeed/runtime/zero/stage_1_and_2.py", line 1111, in average_tensor
[rank3]:     dist.all_reduce(tensor, group=self.dp_process_group)
[rank3]: torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, \
unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.20.5
""",
    "user-keyerror": """Traceback (most recent call last):
  File "/home/me/finetune.py", line 141, in <module>
    main()
  File "/home/me/finetune.py", line 119, in main
    batch = collate([dataset[i] for i in idx])
  File "/home/me/finetune.py", line 52, in collate
    ids = [example["input_ids"] for example in examples]
KeyError: 'input_ids'
""",
    "hf-tokenizer": """Traceback (most recent call last):
  File "/opt/conda/lib/python3.11/site-packages/transformers/tokenization_utils_base.py", line 2790, in _call_one
    raise ValueError(
ValueError: Asking to pad but the tokenizer does not have a padding token. Please select a token to use as \
`pad_token` `(tokenizer.pad_token = tokenizer.eos_token e.g.)` or add a new pad token via \
`tokenizer.add_special_tokens({'pad_token': '[PAD]'})`.
""",
    "device-mismatch": """Traceback (most recent call last):
  File "train.py", line 60, in <module>
    loss = engine(batch)
  File "/usr/lib/python3/dist-packages/deepspeed/utils/nvtx.py", line 15, in wrapped_fn
    ret_val = func(*args, **kwargs)
  File "/usr/lib/python3/dist-packages/deepspeed/runtime/engine.py", line 1899, in forward
    loss = self.module(*inputs, **kwargs)
RuntimeError: Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu! (when \
checking argument for argument mat1 in method wrapper_CUDA_addmm)
""",
    "op-build": """Using /root/.cache/torch_extensions/py310_cu121 as PyTorch extensions root...
Traceback (most recent call last):
  File "/usr/lib/python3.10/site-packages/deepspeed/ops/op_builder/builder.py", line 478, in load
    return importlib.import_module(self.absolute_name())
ModuleNotFoundError: No module named 'deepspeed.ops.adam.fused_adam_op'
""",
    "config-validation": """Traceback (most recent call last):
  File "/srv/run.py", line 30, in <module>
    engine, *_ = deepspeed.initialize(model=model, config="ds_config.json")
  File "/srv/venv/lib/python3.12/site-packages/deepspeed/runtime/config.py", line 760, in __init__
    self._initialize_params(copy.copy(self._param_dict))
pydantic_core._pydantic_core.ValidationError: 1 validation error for DeepSpeedZeroConfig
stage3_prefetch_bucket_size
  Input should be a valid integer, got a number with a fractional part [type=int_from_float, input_value=15099494.4]
""",
    "loss-scale": """[2025-01-09 10:12:44,101] [INFO] [loss_scaler.py:183:update_scale] [deepspeed] OVERFLOW! Rank 0 \
Skipping step. Attempted loss scale: 65536, reducing to 32768
Traceback (most recent call last):
  File "/home/u/pretrain.py", line 210, in <module>
    engine.step()
  File "/home/u/.local/lib/python3.10/site-packages/deepspeed/runtime/fp16/loss_scaler.py", line 175, in update_scale
    raise Exception(
Exception: Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.
""",
    "silent-description": """Training diverges after a few hundred steps with ZeRO-2 and bf16 on 8 GPUs; the loss goes \
to nan. It does not happen with plain DDP. I use the same learning rate and warmup.""",
}


# --- the corpus ----------------------------------------------------------------------------------------------------


def thread(source: str) -> str:
    """A text's thread: its source without the ``#...`` part and the trailing ``/`` (the README's rule)."""
    return source.split("#", 1)[0].rstrip("/")


def measuring(source: str) -> bool:
    """The corpus README's fixed rule: the measuring half holds the texts whose thread's SHA-256 is odd."""
    return int(hashlib.sha256(thread(source).encode()).hexdigest(), 16) % 2 == 1


def named(answer: str) -> str:
    """An answer as triage names it: a ledger fix ``ledger:PR`` is the candidate ``fix-PR`` (the ledger's and the
    atlas's fixes are named by pull request), or its catalogued bug where the ledger's row is a repro row (a fix
    catalogued since the text was answered); a catalogued bug's id as it is."""
    if not answer.startswith("ledger:"):
        return answer
    pr = int(answer.removeprefix("ledger:"))
    return _catalogued_fixes().get(pr, f"fix-{pr}")


@functools.cache
def _catalogued_fixes() -> dict[int, str]:
    """The ledger's repro rows, read once from this checkout's ledger files: pull request to catalogued bug."""
    rows = [row for f in sorted((ROOT / "pytest_dsrepro" / "triage" / "fixes").glob("*.toml"))
            for row in tomllib.loads(f.read_text())["fix"]]  # fmt: skip
    return {row["pr"]: row["repro"] for row in rows if row["disposition"] == "repro" and row.get("pr")}


def corpus(directory: Path = REPORTS) -> list[dict[str, object]]:
    """A corpus's texts (``directory``: its ``index.toml`` and ``texts/``), each with its half and its answer as
    triage names it."""
    reports: list[dict[str, object]] = tomllib.loads((directory / "index.toml").read_text())["report"]
    return [{**r, "answer": named(str(r["answer"])), "measuring": measuring(str(r["source"])),
             "text": (directory / "texts" / f"{r['id']}.txt").read_text()} for r in reports]  # fmt: skip


def triage_corpus(repros: Path, half: str, directory: Path = REPORTS) -> list[dict[str, object]]:
    """Each text of ``half`` triaged as the command does; what was first, what was named with confidence, how long it
    took; whether the text comes from one of its bug's own threads (its upstream link or a face's: the faces were
    written from it). Only ``known_bugs``, ``triage_log`` and ``LogText`` are used, which every revision compared
    has."""
    import argparse as ap

    from pytest_dsrepro.tools.log_input import LogText
    from pytest_dsrepro.tools.triage_command import known_bugs, triage_log

    bugs = known_bugs(repros)
    own = {b.id: {thread(link) for link in (b.upstream or "", *(f.where for f in b.faces)) if link} for b in bugs}
    args = ap.Namespace(release=None, config=None, world_size=None)
    found = []
    for report in corpus(directory):
        if half != "both" and report["measuring"] != (half == "measuring"):
            continue
        text = str(report["text"])
        row = {"id": report["id"], "answer": report["answer"], "measuring": report["measuring"],
               "class": report.get("class", "defect" if report["answer"] != "none" else "other"),
               "gpu": "gpu" in report.get("faces", ()),
               "own": thread(str(report["source"])) in own.get(str(report["answer"]), ())}  # fmt: skip
        started = time.perf_counter()
        try:
            t = triage_log(LogText(str(report["id"]), text, len(text.encode())), bugs, args)
        except Exception as exc:  # noqa: BLE001  # a revision that crashes on a text answers nothing for it
            found.append({**row, "first": None, "score": 0, "known": None, "release": "-",
                          "seconds": time.perf_counter() - started, "crashed": repr(exc)[:200]})  # fmt: skip
            continue
        took = time.perf_counter() - started
        first = t.candidates[0] if t.candidates else None
        looks = next((r.bug.id for r in t.ruled_out if r.score >= 50), None) if t.known is None else None
        found.append({
            **row, "first": first.bug.id if first else None, "score": first.score if first else 0,
            "known": t.known.bug.id if t.known else None, "looks": looks,
            "release": f"{t.release} ({t.release_from})" if t.release else "none", "seconds": took,
        })  # fmt: skip
    return found


def catalogued(bug: object) -> bool:
    """A catalogued bug's id, not a known fix's (``fix-PR``: the ledger's or the atlas's)."""
    return bug is not None and not str(bug).startswith("fix-")


@dataclass(frozen=True)
class Figures:
    """A set of texts' figures: catalogued texts first / known, others claimed, the median time."""

    ours: int
    first: int
    said: int  # first, or the bug a verdict says the log looks like (ruled out on the release judged on)
    known: int
    others: int
    claimed: int
    fixes: int  # others named a known fix of the atlas or the ledger with confidence
    crashed: int  # texts the triage ended with a traceback on
    median_ms: float

    @classmethod
    def of(cls, rows: list[dict[str, object]]) -> Figures:
        ours = [r for r in rows if r["answer"] != "none"]
        others = [r for r in rows if r["answer"] == "none"]
        seconds = [float(str(r["seconds"])) for r in rows] or [0.0]
        first = sum(r["first"] == r["answer"] for r in ours)
        said = sum(r["answer"] in (r["first"], r.get("looks")) for r in ours)
        known = sum(r["known"] == r["answer"] for r in ours)
        claimed = sum(catalogued(r["known"]) for r in others)
        fixes = sum(r["known"] is not None and not catalogued(r["known"]) for r in others)
        crashed = sum("crashed" in r for r in rows)
        return cls(len(ours), first, said, known, len(others), claimed, fixes, crashed,
                   statistics.median(seconds) * 1000)  # fmt: skip

    def cells(self) -> list[str]:
        unclaimed = self.others - self.claimed
        return [share(self.first, self.ours), share(self.said, self.ours), share(self.known, self.ours),
                share(unclaimed, self.others),
                str(self.fixes), str(self.crashed), f"{self.median_ms:.1f} ms"]  # fmt: skip


def share(n: int, of: int) -> str:
    return f"{n}/{of} ({100 * n / of:.0f}%)" if of else "-"


def print_table(rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)))


def halves(rows: list[dict[str, object]], half: str) -> list[dict[str, object]]:
    return [r for r in rows if half == "both" or r["measuring"] == (half == "measuring")]


def table(results: dict[str, list[dict[str, object]]], names: list[str]) -> None:
    """corpus/reports side by side: per revision, per half: all texts, the GPU-worded ones, and the catalogued texts
    from their bugs' own threads apart from the independent ones."""
    head = ["triage", "texts", "catalogued: first", "first or 'looks like'", "catalogued: KNOWN", "others: not claimed",
            "a known fix", "crashed", "median"]  # fmt: skip
    rows = [head]
    for name, rows_of in results.items():
        for half in names:
            chosen = halves(rows_of, half)
            ours = [r for r in chosen if r["answer"] != "none"]
            for label, subset in ((half, chosen), (f"{half}, gpu", [r for r in chosen if r["gpu"]]),
                                  (f"{half}, own threads", [r for r in ours if r["own"]]),
                                  (f"{half}, independent", [r for r in ours if not r["own"]])):  # fmt: skip
                rows.append([name, label, *Figures.of(subset).cells()])
    print_table(rows)


def sampled_table(results: dict[str, list[dict[str, object]]], names: list[str]) -> None:
    """corpus/sampled side by side: per revision, per half: the DeepSpeed defects whose fix triage knows (a catalogued
    bug, a ledger fix), named with confidence and first, and how many of them were named another bug with confidence;
    reports of other causes (the user's setup, unclear) and defects of no known fix named something with confidence
    (the target: none)."""
    head = ["triage", "texts", "defect, known fix: KNOWN", "first", "setup/unclear: claimed",
            "defect, no known fix: claimed", "a wrong bug named", "median"]  # fmt: skip
    rows = [head]
    for name, rows_of in results.items():
        for half in names:
            chosen = halves(rows_of, half)
            fixed = [r for r in chosen if r["class"] == "defect" and r["answer"] != "none"]
            other = [r for r in chosen if r["class"] != "defect"]
            unfixed = [r for r in chosen if r["class"] == "defect" and r["answer"] == "none"]
            seconds = [float(str(r["seconds"])) for r in chosen] or [0.0]
            rows.append([name, f"{half} ({len(chosen)})",
                         share(sum(r["known"] == r["answer"] for r in fixed), len(fixed)),
                         share(sum(r["first"] == r["answer"] for r in fixed), len(fixed)),
                         share(sum(r["known"] is not None for r in other), len(other)),
                         share(sum(r["known"] is not None for r in unfixed), len(unfixed)),
                         str(sum(r["known"] not in (None, r["answer"]) for r in fixed)),
                         f"{statistics.median(seconds) * 1000:.1f} ms"])  # fmt: skip
    print_table(rows)


def show(rows: list[dict[str, object]]) -> None:
    """Each text's answer and what triage said (to improve triage: the tuning half only)."""
    for r in rows:
        right = r["first"] == r["answer"] if r["answer"] != "none" else r["known"] is None
        print(f"{'ok ' if right else 'BAD'} {r['id']:<40} {r['answer']:<38} first={r['first']} ({r['score']}) "
              f"known={r['known']} release={r['release']}")  # fmt: skip


def both_corpora(repros: Path, half: str) -> dict[str, list[dict[str, object]]]:
    """Both corpora triaged by the catalogue at ``repros`` (and the triage this interpreter imports)."""
    return {"reports": triage_corpus(repros, half, REPORTS), "sampled": triage_corpus(repros, half, SAMPLED)}


def before(revision: str, half: str, big: bool) -> tuple[dict[str, list[dict[str, object]]], str]:
    """Both corpora triaged by ``revision``'s triage and catalogue: a temporary git worktree, this script's
    ``--corpus-json`` in a child interpreter with that worktree first on its path; and that revision's command on the
    200 MB log (``big``)."""
    with tempfile.TemporaryDirectory(prefix="triage-before-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(tree), revision],
                       check=True)  # fmt: skip
        environ = {**os.environ, "PYTHONPATH": str(tree)}
        try:
            done = subprocess.run([sys.executable, __file__, "--corpus-json", str(tree / "repros"), "--half", half],
                                  cwd=tmp, env=environ, capture_output=True, text=True, check=False)  # fmt: skip
            if done.returncode:
                last = done.stderr.strip().splitlines()[-1:] or ["no output"]
                raise SystemExit(f"--before {revision}: its triage could not read the corpus ({last[0]})")
            said = measure_big(tree, environ) if big else ""
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    return dict(json.loads(done.stdout)), said


# --- the catalogue's own failures (the old benchmark) --------------------------------------------------------------


@dataclass(frozen=True)
class Text:
    bug: str
    release: str
    text: str
    origin: str


def _expand(releases: str) -> list[str]:
    """``0.14.4-0.18.2`` or ``0.16.4, 0.18.3`` as the releases of releases.txt they cover."""
    from packaging.version import Version

    found: list[str] = []
    for part in releases.split(","):
        low, _, high = part.strip().partition("-")
        found += [r for r in RELEASES if Version(low) <= Version(r) <= Version(high or low)]
    return found


def matrix_texts(page: Path) -> list[Text]:
    """Each recorded stock failure (``read_raised``: the page's "What each test raised"), as ``ranks 0-1: Type:
    message`` lines, per release of its run."""
    from pytest_dsrepro.tools.matrix.markdown import read_raised

    found = []
    for name, text, releases in read_raised(page.read_text()):
        lines = re.split(r"; (?=ranks? \d)", text)
        if all(": skipped:" in line for line in lines):
            continue
        bug, _, config = name.partition(" [")
        if not re.fullmatch(r"[\w-]+", bug):  # an upstream test's line (an atlas run's), no catalogued bug's
            continue
        for release in _expand(releases):
            found.append(Text(bug, release, "\n".join(lines) + "\n", f"matrix [{config.rstrip(']')}]"))
    return found


def context_texts(directory: Path, ids: dict[str, str]) -> list[Text]:
    """Probe lines (``RESULT ds=X rank=0 Type: message  @ frame``) under a heading naming a catalogued bug's link
    (``ids``: each bug's id by its upstream link and root cause)."""
    found = []
    for page in sorted(directory.glob("*.md")):
        for section in re.split(r"^### ", page.read_text(), flags=re.MULTILINE)[1:]:
            numbers = re.findall(r"#(\d+)", section.split("\n", 1)[0])
            links = [bug for bug, said in ids.items() if any(f"/{n}" in said for n in numbers)]
            for m in re.finditer(r"`RESULT ds=(?P<release>[\d.]+) rank=\d+ (?P<error>\w+: .*?)`", section):
                if links and not m["error"].startswith("OK"):
                    found.append(Text(links[0], m["release"], m["error"] + "\n", f"{page.name} probe"))
    return found


def measure_own(texts: list[Text]) -> list[float]:
    from packaging.version import Version

    from pytest_dsrepro.tools.triage_command import known_bugs
    from pytest_dsrepro.triage import logread
    from pytest_dsrepro.triage import ranking as triage

    bugs = known_bugs(ROOT / "repros")
    seconds: list[float] = []
    per_bug: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
    for item in texts:
        ranks, scores = [], []
        for judged in (triage.Judged((Version(item.release),), triage.GIVEN), triage.Judged()):
            started = time.perf_counter()
            t = triage.rank(bugs, logread.read(item.text, known=triage.declared_types(bugs)), judged)
            seconds.append(time.perf_counter() - started)
            ids = [c.bug.id for c in t.candidates]
            ranks.append(ids.index(item.bug) + 1 if item.bug in ids else 99)
            scores.append(next((c.score for c in t.candidates if c.bug.id == item.bug), 0))
        per_bug[item.bug].append((ranks[0], ranks[1], scores[0]))
    print(f"{'bug':<40} texts  rank on its release (worst/best)  rank, no release (worst)  score (min)")
    firsts = 0
    for bug in sorted(per_bug):
        runs = per_bug[bug]
        on, blind = [r for r, _, _ in runs], [r for _, r, _ in runs]
        firsts += max(on) == 1
        print(f"{bug:<40} {len(runs):5d}  {max(on):>6} / {min(on):<24} {max(blind):>6}{'':<20}"
              f"{min(s for *_, s in runs):>5}")  # fmt: skip
    print(f"ranked first for every own text on its release: {firsts} of {len(per_bug)} bugs ({len(texts)} texts)")
    return seconds


def measure_foreign() -> list[float]:
    from packaging.version import Version

    from pytest_dsrepro.tools.triage_command import known_bugs
    from pytest_dsrepro.triage import logread
    from pytest_dsrepro.triage import ranking as triage

    bugs = known_bugs(ROOT / "repros")
    seconds: list[float] = []
    print(f"\n{'foreign text':<20} best candidate (score)                              confident?")
    claimed = 0
    for name, text in FOREIGN.items():
        started = time.perf_counter()
        t = triage.rank(bugs, logread.read(text), triage.Judged((Version("0.18.3"),), triage.GIVEN))
        seconds.append(time.perf_counter() - started)
        best = t.candidates[0] if t.candidates else None
        said = f"{best.bug.id} ({best.score})" if best else "none"
        claimed += t.known is not None
        print(f"{name:<20} {said:<52} {'YES' if t.known else 'no'}")
    print(f"claimed with confidence: {claimed} of {len(FOREIGN)}")
    return seconds


def measure_big(root: Path = ROOT, environ: dict[str, str] | None = None, megabytes: int = 200) -> str:
    """The command (of the tree at ``root``) on a log of ``megabytes`` (a training log's lines, the epilogue error at
    its end): its exit code, wall time and verdict."""
    with tempfile.TemporaryDirectory(prefix="triage-bench-") as tmp:
        log = Path(tmp) / "big.log"
        line = b"[2025-01-09 10:12:44,101] [INFO] [logging.py:128:log_dist] [Rank 0] step=1000, skipped=0, lr=[1e-05]\n"
        block = line * ((1 << 20) // len(line) + 1)
        with log.open("wb") as f:
            for _ in range(megabytes):
                f.write(block)
            f.write(b"AttributeError: 'DeepSpeedZeRoOffload' object has no attribute 'backward'\n")
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "pytest_dsrepro.tools.cli", "triage", str(log)], cwd=root,
                              env=environ, capture_output=True, text=True, check=False)  # fmt: skip
        took = time.perf_counter() - started
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr.strip()
    return f"{megabytes} MB log: `dsrepro triage` exit {done.returncode} in {took:.2f} s wall: {last}"


def measure_adversarial(size: int = 64 * 1024) -> list[str]:
    """Triage (read and rank against the catalogue, in process) of one line of ``size`` characters per adversarial
    shape (``tests/hostile.py``: dotted words, nested JSON, open comments, ...): each shape's seconds."""
    import importlib.util

    from pytest_dsrepro.tools.triage_command import known_bugs
    from pytest_dsrepro.triage import logread, ranking

    spec = importlib.util.spec_from_file_location("hostile", ROOT / "tests" / "hostile.py")
    assert spec is not None
    assert spec.loader is not None
    hostile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hostile)
    bugs = known_bugs(ROOT / "repros")
    out = []
    for name, line in hostile.adversarial_lines(size).items():
        started = time.perf_counter()
        ranking.rank(bugs, logread.read(line + "\n"))
        out.append(f"{name}: {time.perf_counter() - started:.2f} s")
    return out


def old_benchmark(context: Path | None, big: bool) -> None:
    from pytest_dsrepro.tools.triage_command import known_bugs

    texts = matrix_texts(ROOT / "docs" / "matrix-observed.md")
    if context is not None:
        bugs = known_bugs(ROOT / "repros")
        texts += context_texts(context, {b.id: f"{b.upstream} {b.root_cause}" for b in bugs})
    seconds = measure_own(texts) + measure_foreign()
    print(f"\nper triage (read + rank, in process): median {statistics.median(seconds) * 1000:.1f} ms, "
          f"max {max(seconds) * 1000:.1f} ms over {len(seconds)}")  # fmt: skip
    if big:
        print(f"\nnow: {measure_big()}")
    print(f"\none line of 64 KiB per adversarial shape: {'; '.join(measure_adversarial())}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--half", choices=("tuning", "measuring", "both"), default="both")
    parser.add_argument("--show", action="store_true", help="each text's answer and triage's (the tuning half)")
    parser.add_argument("--before", default=BEFORE, metavar="REV", help="the revision compared with ('' for none)")
    parser.add_argument("--context", type=Path, help="pages of real DeepSpeed issues with probe lines")
    parser.add_argument("--no-own", action="store_true", help="skip the catalogue's own failures")
    parser.add_argument("--no-big", action="store_true", help="skip the 200 MB log")
    parser.add_argument("--corpus-json", type=Path, metavar="REPROS", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.corpus_json is not None:  # the child of ``before``: another revision's triage, as JSON
        print(json.dumps(both_corpora(args.corpus_json, args.half)))
        return 0
    sys.path.insert(0, str(ROOT))  # "now" is this tree's triage, not a pytest-dsrepro installed in the environment
    from pytest_dsrepro.core import versions

    print(f"DeepSpeed installed here: {versions.installed_text('deepspeed') or 'none'} (a text stating no release is "
          "judged on it)\n")  # fmt: skip
    results = {"now": both_corpora(ROOT / "repros", args.half)}
    if args.show:
        for rows in results["now"].values():
            show([r for r in rows if not r["measuring"]])
    big_before = ""
    if args.before:
        results[args.before], big_before = before(args.before, args.half, not args.no_big and not args.no_own)
    names = ["tuning", "measuring"] if args.half == "both" else [args.half]
    print("corpus/reports (texts chosen by bug)")
    table({name: corpora["reports"] for name, corpora in results.items()}, names)
    print("\ncorpus/sampled (DeepSpeed's failure reports, taken without regard to the bug)")
    sampled_table({name: corpora["sampled"] for name, corpora in results.items()}, names)
    if not args.no_own:
        print()
        old_benchmark(args.context, not args.no_big)
    if big_before:
        print(f"{args.before}: {big_before}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
