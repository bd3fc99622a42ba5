"""``dsrepro triage`` measured on real error texts: is each catalogued bug ranked first for its own failure, and is
no bug claimed with confidence for an error the catalogue does not hold?

The corpus, nothing downloaded:

- **the catalogue's own failures**, as the matrix recorded them: ``docs/matrix-observed.md``'s "What each test
  raised" (each repro's stock failure on each release of a run of releases, as ``ranks 0-1: Type: message``), one
  text per bug, config and release (the run expanded over ``releases.txt``), triaged on that release and again with
  no release known;
- **probe outputs of real DeepSpeed issues** (``--context DIR``, e.g. the shared ``catalogue-bugs.md``): each
  ``RESULT ds=X rank=0 Type: message  @ deepspeed/...py:N in f`` line of a section whose heading names the issue or
  pull request a catalogued bug links;
- **errors the catalogue does not hold**, written here as users meet them (``FOREIGN``).

Printed: per bug, the rank its own texts got (worst and best) and the score; per foreign text, the best candidate's
score and whether it was claimed with confidence; the time per triage (reading and ranking, in process), and the
command's wall time on a 200 MB log (a fresh interpreter, the catalogue collected, the log's head and tail read).

    python benchmarks/triage.py [--context /work/shared/context] [--no-big]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

from pytest_dsrepro.core import logread, triage
from pytest_dsrepro.tools.triage_command import known_bugs

ROOT = Path(__file__).resolve().parent.parent
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


@dataclass(frozen=True)
class Text:
    bug: str
    release: str
    text: str
    origin: str


def _expand(releases: str) -> list[str]:
    """``0.14.4-0.18.2`` or ``0.16.4, 0.18.3`` as the releases of releases.txt they cover."""
    found: list[str] = []
    for part in releases.split(","):
        low, _, high = part.strip().partition("-")
        found += [r for r in RELEASES if Version(low) <= Version(r) <= Version(high or low)]
    return found


def matrix_texts(page: Path) -> list[Text]:
    """Each recorded stock failure, as ``ranks 0-1: Type: message`` lines, per release of its run."""
    section = page.read_text().partition("## What each test raised")[2]
    found = []
    for m in re.finditer(r"^- (?P<bug>[\w-]+) \[(?P<config>.+?)\] on (?P<releases>[\d., -]+): `(?P<text>.*)`$", section,
                         re.MULTILINE):  # fmt: skip
        lines = re.split(r"; (?=ranks? \d)", m["text"])
        if all(": skipped:" in line for line in lines):
            continue
        for release in _expand(m["releases"]):
            found.append(Text(m["bug"], release, "\n".join(lines) + "\n", f"matrix [{m['config']}]"))
    return found


def context_texts(directory: Path, bugs: list[triage.KnownBug]) -> list[Text]:
    """Probe lines (``RESULT ds=X rank=0 Type: message  @ frame``) under a heading naming a catalogued bug's link."""
    found = []
    for page in sorted(directory.glob("*.md")):
        for section in re.split(r"^### ", page.read_text(), flags=re.MULTILINE)[1:]:
            numbers = re.findall(r"#(\d+)", section.split("\n", 1)[0])
            links = [b for b in bugs if any(f"/{n}" in f"{b.upstream} {b.root_cause}" for n in numbers)]
            for m in re.finditer(r"`RESULT ds=(?P<release>[\d.]+) rank=\d+ (?P<error>\w+: .*?)`", section):
                if links and not m["error"].startswith("OK"):
                    found.append(Text(links[0].id, m["release"], m["error"] + "\n", f"{page.name} probe"))
    return found


def _rank_of(bug: str, t: triage.Triage) -> int | None:
    ids = [c.bug.id for c in t.candidates]
    return ids.index(bug) + 1 if bug in ids else None


def _triage(bugs: list[triage.KnownBug], text: str, release: str | None) -> tuple[triage.Triage, float]:
    started = time.perf_counter()
    reading = logread.read(text, known={s.raises for b in bugs for s in b.signatures})
    t = triage.rank(bugs, reading, None if release is None else Version(release))
    return t, time.perf_counter() - started


def measure_own(bugs: list[triage.KnownBug], texts: list[Text]) -> list[float]:
    seconds: list[float] = []
    per_bug: dict[str, list[tuple[int | None, int | None, int]]] = defaultdict(list)
    for item in texts:
        on, took = _triage(bugs, item.text, item.release)
        blind, took_blind = _triage(bugs, item.text, None)
        seconds += [took, took_blind]
        score = next((c.score for c in on.candidates if c.bug.id == item.bug), 0)
        per_bug[item.bug].append((_rank_of(item.bug, on), _rank_of(item.bug, blind), score))
    print(f"{'bug':<40} texts  rank on its release (worst/best)  rank, no release (worst)  score (min)")
    firsts = 0
    for bug in sorted(per_bug):
        runs = per_bug[bug]
        on = [r if r is not None else 99 for r, _, _ in runs]
        blind = [r if r is not None else 99 for _, r, _ in runs]
        firsts += max(on) == 1
        least = min(score for *_, score in runs)
        print(f"{bug:<40} {len(runs):5d}  {max(on):>6} / {min(on):<24} {max(blind):>6}{'':<20}{least:>5}")
    print(f"ranked first for every own text on its release: {firsts} of {len(per_bug)} bugs ({len(texts)} texts)")
    return seconds


def measure_foreign(bugs: list[triage.KnownBug]) -> list[float]:
    seconds: list[float] = []
    print(f"\n{'foreign text':<20} best candidate (score)                              confident?")
    claimed = 0
    for name, text in FOREIGN.items():
        t, took = _triage(bugs, text, "0.18.3")
        seconds.append(took)
        best = t.candidates[0] if t.candidates else None
        said = f"{best.bug.id} ({best.score})" if best else "none"
        claimed += t.known is not None
        print(f"{name:<20} {said:<52} {'YES' if t.known else 'no'}")
    print(f"claimed with confidence: {claimed} of {len(FOREIGN)}")
    return seconds


def measure_big(megabytes: int = 200) -> None:
    """The command on a log of ``megabytes`` (a training log's lines, the epilogue error at its end)."""
    with tempfile.TemporaryDirectory(prefix="triage-bench-") as tmp:
        log = Path(tmp) / "big.log"
        line = b"[2025-01-09 10:12:44,101] [INFO] [logging.py:128:log_dist] [Rank 0] step=1000, skipped=0, lr=[1e-05]\n"
        block = line * ((1 << 20) // len(line) + 1)
        with log.open("wb") as f:
            for _ in range(megabytes):
                f.write(block)
            f.write(b"AttributeError: 'DeepSpeedZeRoOffload' object has no attribute 'backward'\n")
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "pytest_dsrepro.tools.cli", "triage", str(log)], cwd=ROOT,
                              capture_output=True, text=True, check=False)  # fmt: skip
        took = time.perf_counter() - started
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr.strip()
    print(f"\n{megabytes} MB log: `dsrepro triage` exit {done.returncode} in {took:.2f} s wall: {last}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=Path, help="pages of real DeepSpeed issues with probe lines")
    parser.add_argument("--no-big", action="store_true", help="skip the 200 MB log")
    args = parser.parse_args()
    started = time.perf_counter()
    bugs = known_bugs(ROOT / "repros")
    print(f"catalogue: {len(bugs)} bugs read from their markers in {time.perf_counter() - started:.2f} s\n")
    texts = matrix_texts(ROOT / "docs" / "matrix-observed.md")
    if args.context:
        texts += context_texts(args.context, bugs)
    seconds = measure_own(bugs, texts) + measure_foreign(bugs)
    print(f"\nper triage (read + rank, in process): median {statistics.median(seconds) * 1000:.1f} ms, "
          f"max {max(seconds) * 1000:.1f} ms over {len(seconds)}")  # fmt: skip
    if not args.no_big:
        measure_big()
    return 0


if __name__ == "__main__":
    sys.exit(main())
