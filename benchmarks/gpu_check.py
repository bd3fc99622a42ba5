"""The GPU check: what a machine with a GPU says of the plugin, in one table, within one lease (10 minutes).

Two steps, because the GPU machine has no network:

    python benchmarks/gpu_check.py prepare --into .gpu            # here, on a CPU machine that reaches PyPI
    python benchmarks/gpu_check.py run --input .gpu --out OUT     # there, on the machine with the GPU

``prepare`` puts into ``--into``: this plugin's wheel, the wheels of what the GPU image lacks for DeepSpeed (built
``DS_BUILD_OPS=0`` from its sdist with the torch of this interpreter, a pure-Python wheel), and the CPU reference:
the catalogue's verdicts in 1-rank and 2-rank gloo worlds on the same release (``--ds-results`` files).

``run`` installs those wheels into a directory of its own (``pip --no-index --target``: nothing is fetched), then,
each check with its own time limit, and prints one table (check, result, seconds, what was seen):

- the catalogue in 1-rank NCCL worlds, every verdict compared with the CPU reference;
- the catalogue in 2-rank worlds on the GPU machine with the gloo backend (that it finishes: a machine with CUDA
  and Triton once stalled there), compared with the CPU reference;
- on two GPUs or more, the catalogue in 2-rank NCCL worlds, compared likewise;
- GPU leases across two sessions: one holds the GPU, a second with ``--ds-gpu-wait 1`` is skipped naming the
  holder, a third with the default wait runs after it;
- a real hang (a collective queued behind a long CUDA kernel): the failure must name, per rank, the collective NCCL's
  flight recorder saw unfinished, and the dump must be kept;
- the cost of an NCCL world per test (pytest's call phase, a session's first test left out), fresh and in a
  ``reuse=True`` class, against a bare floor measured in the same run (a forked process's NCCL init, one
  all_reduce, destroy).

Without a CUDA device the GPU checks say SKIPPED, with why, and the rest runs: the script's own dry run.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil
from packaging.tags import sys_tags
from packaging.utils import parse_wheel_filename

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pytest_dsrepro.core import results  # noqa: E402 - the results schema's one reader

#: What the GPU image lacks for DeepSpeed and this plugin (it has torch, pytest, psutil, numpy, ninja, py-cpuinfo,
#: einops, msgpack, nvidia-ml-py and the HF stack): fetched here as wheels for its Python.
MISSING_THERE = ("hjson", "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "filelock")
#: Not for DeepSpeed: what a stalled check's ``snapshot`` takes each process's Python stacks with.
DIAGNOSTICS = ("py-spy",)
PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_28_x86_64")

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIPPED"

#: pip, for downloads: this interpreter's, else the system's (a uv-made environment has none).
PIP = (
    [sys.executable, "-m", "pip"]
    if importlib.util.find_spec("pip")
    else [shutil.which("python3") or "python3", "-m", "pip"]
)


@dataclass(frozen=True)
class Check:
    name: str
    result: str
    seconds: float
    seen: str


@dataclass(frozen=True)
class Ran:
    returncode: int | None  # None: stopped at its limit
    output: str
    seconds: float


#: After a check's time limit: how long pytest has, once interrupted, to write its results and end its worlds.
INTERRUPT_GRACE = 30.0


def run(command: Sequence[str], *, timeout: float, cwd: Path, env: dict[str, str], log: Path) -> Ran:
    """A child in a session of its own; its output kept in ``log``. At ``timeout`` what its processes were doing
    goes into ``log`` (``snapshot``), then it is interrupted as Ctrl-C would (pytest then writes the results of
    the tests that ended), and killed with its whole group ``INTERRUPT_GRACE`` later."""
    started = time.monotonic()
    with log.open("w") as out:
        child = subprocess.Popen(
            command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code: int | None = child.wait(timeout)
        except subprocess.TimeoutExpired:
            out.write(f"\n==== gpu_check: stopped at its limit ({timeout:g}s); what its processes were doing:\n")
            out.write(snapshot(child.pid, env.get("PATH")))
            out.flush()
            os.kill(child.pid, signal.SIGINT)
            try:
                child.wait(INTERRUPT_GRACE)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)  # only the group this script started
                child.wait()
            code = None
    return Ran(code, log.read_text(errors="replace"), time.monotonic() - started)


def snapshot(pid: int, path: str | None = None) -> str:
    """The process tree under ``pid`` (the pytest run, its fork servers, their ranks and throwaway children): each
    process's state, age and command, and its Python stacks where ``py-spy`` is on ``path`` (the children's). What
    a stall leaves to explain it: the GPU machine is gone by the time anyone reads the log."""
    try:
        tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error as exc:
        return f"(no process tree: {exc})\n"
    spy, lines = shutil.which("py-spy", path=path), []
    for p in tree:
        try:
            with p.oneshot():
                age, command = time.time() - p.create_time(), " ".join(p.cmdline())[:200]
                lines.append(f"pid {p.pid} (parent {p.ppid()}) {p.status()} for {age:.0f}s: {command}")
        except psutil.Error:
            continue
        if spy and "python" in p.name():
            dumped = subprocess.run([spy, "dump", "--pid", str(p.pid)], capture_output=True, text=True, timeout=20)
            lines += ["    " + line for line in (dumped.stdout + dumped.stderr).strip().splitlines()]
    if not spy:
        lines.append("(py-spy is not on PATH: no Python stacks)")
    return "\n".join(lines) + "\n"


def records(directory: Path) -> list[results.TestRecord]:
    files, _ = results.read_all([directory]) if directory.is_dir() else ([], [])
    return [t for f in files for t in f.run.tests]


def verdicts(directory: Path) -> dict[str, str]:
    """``nodeid -> verdict`` (or pytest's outcome where the test has no verdict) from a results directory."""
    return {t.nodeid: t.verdict.value if t.verdict is not None else t.outcome for t in records(directory)}


def wanting_gpus(directory: Path) -> set[str]:
    """The tests skipped here because their world has more ranks than the machine has GPUs (a repro that pins its
    size): nothing to compare."""
    return {t.nodeid for t in records(directory) if t.outcome == "skipped" and "CUDA devices for a" in (t.error or "")}


def compare(found: dict[str, str], reference: dict[str, str]) -> tuple[str, str]:
    """PASS when every test the reference judged got the same verdict; else what differs, test by test."""
    if not reference:
        return SKIP, "no CPU reference given (prepare writes it)"
    if not found:
        return FAIL, "no test was recorded"
    differ = [
        f"{n}: {reference[n]} on CPU, {found.get(n, 'not run')} here"
        for n in sorted(reference)
        if found.get(n) != reference[n]
    ]
    same = len(reference) - len(differ)
    if not differ:
        return PASS, f"{same} verdicts, all as on CPU"
    listed = "; ".join(differ[:8]) + (" ..." if len(differ) > 8 else "")
    return FAIL, f"{same} as on CPU, {len(differ)} differ: {listed}"


def summary_line(output: str) -> str:
    lines = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|xfailed|skipped|error)", line)]
    return lines[-1].strip("= ") if lines else "(no pytest summary)"


class GpuCheck:
    """The checks of ``run``, each a method that returns a ``Check``."""

    def __init__(
        self, input_dir: Path, out: Path, env: dict[str, str], gpus: int, scale: float, select: str | None, work: Path
    ) -> None:
        self.input = input_dir
        self.select = ["-k", select] if select else []  # a slice of the catalogue, to rerun what failed
        self.out = out
        self.env = env
        self.gpus = gpus
        self.scale = scale  # every time limit, times this
        self.work = work  # the check's own test files
        self.pytest = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA"]

    def limit(self, seconds: float) -> float:
        return seconds * self.scale

    def _catalogue(self, title: str, name: str, size: int, backend: str, limit: float, reference: str) -> Check:
        results_dir = self.out / name
        ran = run([*self.pytest, "repros", "--ds-world-size", str(size), "--ds-backend", backend,
                   "--ds-results", str(results_dir), *self.select],
                  timeout=self.limit(limit), cwd=ROOT, env=self.env, log=self.out / f"{name}.log")  # fmt: skip
        if ran.returncode is None:
            done = len(verdicts(results_dir))
            return Check(title, FAIL, ran.seconds, f"stopped at {self.limit(limit):g}s; {summary_line(ran.output)}; "
                         f"{done} tests recorded")  # fmt: skip
        found, wanting = verdicts(results_dir), wanting_gpus(results_dir)
        expected = {
            n: v
            for n, v in verdicts(self.input / reference).items()
            if n not in wanting and (not self.select or n in found)
        }
        result, seen = compare(found, expected)
        more = f"; {len(wanting)} skipped for want of GPUs" if wanting else ""
        return Check(title, result, ran.seconds, f"{summary_line(ran.output)}; {seen}{more}")

    def catalogue_nccl(self) -> Check:
        if self.gpus < 1:
            return Check("catalogue, 1-rank NCCL", SKIP, 0.0, "no CUDA device")
        return self._catalogue("catalogue, 1-rank NCCL", "catalogue-nccl-1", 1, "nccl", 240, "cpu-1")

    def catalogue_gloo(self) -> Check:
        return self._catalogue("catalogue, 2-rank gloo", "catalogue-gloo-2", 2, "gloo", 180, "cpu-2")

    def catalogue_nccl_two(self) -> Check:
        if self.gpus < 2:
            return Check("catalogue, 2-rank NCCL", SKIP, 0.0, f"{self.gpus} CUDA device(s): two are needed")
        return self._catalogue("catalogue, 2-rank NCCL", "catalogue-nccl-2", 2, "nccl", 240, "cpu-2")

    def _write(self, name: str, text: str) -> Path:
        path = self.work / name
        path.write_text(textwrap.dedent(text))
        return path

    def leases(self) -> Check:
        if self.gpus < 1:
            return Check("GPU leases, two sessions", SKIP, 0.0, "no CUDA device")
        started = self.work / "holding"
        self._write(
            "test_hold.py",
            f"""
            import pathlib, time
            import pytest

            @pytest.mark.ds_world(size=1, backend="nccl")
            def test_holds_the_gpu(ds_rank):
                import torch
                torch.ones(1, device="cuda")
                pathlib.Path({str(started)!r}).touch()
                time.sleep(10)
            """,
        )
        began = time.monotonic()
        log = (self.out / "lease-holder.log").open("w")
        holder = subprocess.Popen([*self.pytest, "test_hold.py"], cwd=self.work, env=self.env, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            while not started.exists() and holder.poll() is None and time.monotonic() - began < self.limit(90):
                time.sleep(0.2)
            if not started.exists():
                return Check("GPU leases, two sessions", FAIL, time.monotonic() - began, "the holder never ran")
            busy = run([*self.pytest, "test_hold.py", "--ds-gpu-wait", "1"], timeout=self.limit(60), cwd=self.work,
                       env=self.env, log=self.out / "lease-busy.log")  # fmt: skip
            after = run([*self.pytest, "test_hold.py"], timeout=self.limit(90), cwd=self.work, env=self.env,
                        log=self.out / "lease-after.log")  # fmt: skip
        finally:
            holder.wait(self.limit(60))
            log.close()
        named = re.search(r"busy: .*pid \d+", busy.output) is not None
        skipped = "1 skipped" in busy.output
        waited = after.returncode == 0
        result = PASS if named and skipped and waited else FAIL
        return Check("GPU leases, two sessions", result, time.monotonic() - began,
                     f"second session skipped: {skipped}, naming the holder's pid: {named}; third ran after the "
                     f"holder: {waited} ({after.seconds:.1f}s)")  # fmt: skip

    def hang(self) -> Check:
        if self.gpus < 1:
            return Check("a hang, explained", SKIP, 0.0, "no CUDA device")
        self._write(
            "test_hang.py",
            """
            import pytest

            @pytest.mark.ds_world(size=1, backend="nccl", timeout=30)  # torch's timeout at 15 s, its dump before 30
            def test_collective_behind_a_long_kernel(ds_rank):
                import torch
                import torch.distributed as dist
                t = torch.ones(4, device="cuda")
                dist.all_reduce(t)
                torch.cuda.synchronize()
                torch.cuda._sleep(int(2e12))  # minutes of GPU time: the next collective waits behind it
                dist.all_reduce(t)
                torch.cuda.synchronize()
            """,
        )
        ran = run([*self.pytest, "test_hang.py"], timeout=self.limit(120), cwd=self.work, env=self.env,
                  log=self.out / "hang.log")  # fmt: skip
        recorder = re.findall(r"NCCL flight recorder: (.*)", ran.output)
        told = [line for line in recorder if "no dump" not in line and "dump " in line]
        kept = [Path(p) for line in told for p in re.findall(r"dump (\S+)", line)]
        named = any(re.search(r"all_?reduce", line, re.IGNORECASE) for line in told)
        ok = ran.returncode == 1 and bool(told) and named and all(p.exists() for p in kept)
        return Check("a hang, explained", PASS if ok else FAIL, ran.seconds,
                     "; ".join(recorder) or f"no flight-recorder line ({summary_line(ran.output)})")  # fmt: skip

    def world_cost(self) -> Check:
        if self.gpus < 1:
            return Check("an NCCL world per test", SKIP, 0.0, "no CUDA device")
        self._write(
            "test_cost.py",
            """
            import pytest

            @pytest.mark.ds_world(size=1, backend="nccl")
            @pytest.mark.parametrize("n", range(11))
            def test_fresh(ds_rank, n):
                import torch, torch.distributed as dist
                t = torch.ones(4, device="cuda")
                dist.all_reduce(t)

            @pytest.mark.ds_world(size=1, backend="nccl", reuse=True)
            class TestKept:
                @pytest.mark.parametrize("n", range(11))
                def test_kept(self, ds_rank, n):
                    import torch, torch.distributed as dist
                    t = torch.ones(4, device="cuda")
                    dist.all_reduce(t)
            """,
        )
        ran = run([*self.pytest, "test_cost.py", "--durations=0", "--durations-min=0"], timeout=self.limit(180),
                  cwd=self.work, env=self.env, log=self.out / "cost.log")  # fmt: skip
        calls = call_seconds(ran.output)
        fresh = sorted(s for name, n, s in calls if name == "test_fresh" and n != 0)
        kept = sorted(s for name, n, s in calls if name == "TestKept::test_kept" and n != 0)
        floor = run([sys.executable, __file__, "floor", "10"], timeout=self.limit(120), cwd=self.work, env=self.env,
                    log=self.out / "floor.log")  # fmt: skip
        bare = re.search(r"FLOOR median=([\d.]+)", floor.output)
        if not fresh or bare is None:
            return Check("an NCCL world per test", FAIL, ran.seconds + floor.seconds,
                         f"{summary_line(ran.output)}; floor: {floor.output.strip()[-200:]}")  # fmt: skip
        base = float(bare.group(1))
        f, k = statistics.median(fresh), statistics.median(kept) if kept else float("nan")
        return Check("an NCCL world per test", PASS, ran.seconds + floor.seconds,
                     f"fresh {f:.3f}s ({f / base:.2f}x the floor), reuse=True {k:.3f}s ({k / base:.2f}x), bare floor "
                     f"{base:.3f}s; medians of {len(fresh)} and {len(kept)}")  # fmt: skip


def call_seconds(durations: str) -> list[tuple[str, int, float]]:
    """``(test, parameter, seconds)`` of each call phase in pytest's ``--durations`` lines for ``test_cost.py``
    (``test_fresh[3]``, ``TestKept::test_kept[3]``)."""
    found = re.findall(r"([\d.]+)s call\s+test_cost\.py::([\w:]+)\[(\d+)\]", durations)
    return [(name, int(n), float(s)) for s, name, n in found]


def floor(count: int) -> None:
    """The bare floor: this process imports torch (no CUDA), then forks 1-rank NCCL worlds one after the other."""
    import socket

    import torch
    import torch.distributed as dist

    seconds = []
    for _ in range(count):
        with socket.socket() as s:  # the floor's own port; the plugin's worlds bind theirs before they fork
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        began = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                    device_id=torch.device("cuda:0"))  # fmt: skip
            t = torch.ones(4, device="cuda")
            dist.all_reduce(t)
            torch.cuda.synchronize()
            dist.destroy_process_group()
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        if status != 0:
            raise SystemExit(f"a floor world failed (status {status})")
        seconds.append(time.perf_counter() - began)
    print(f"FLOOR median={statistics.median(seconds):.3f} min={min(seconds):.3f} n={count}")


def cuda_devices(env: dict[str, str]) -> int:
    """Counted in a child (this process forks nothing with CUDA, but its children's children may)."""
    code = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    return int(done.stdout.strip() or 0) if done.returncode == 0 else 0


def install(input_dir: Path, env: dict[str, str], site: Path) -> str:
    """The prepared wheels into a directory of their own, on ``PYTHONPATH``: nothing fetched, nothing else moved."""
    wheels = sorted((input_dir / "wheels").glob("*.whl"))
    if not wheels:
        return "no prepared wheels: the installed packages are used"
    here = set(sys_tags())
    foreign = [w.name for w in wheels if here.isdisjoint(parse_wheel_filename(w.name)[3])]
    if foreign:  # the dry run on a CPU machine, whose Python is not the GPU image's
        return f"the prepared wheels are not for this interpreter ({foreign[0]}): the installed packages are used"
    subprocess.run([*PIP, "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--target", str(site), *map(str, wheels)], check=True, env=env)  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p)
    env["PATH"] = os.pathsep.join((str(site / "bin"), env.get("PATH", "")))  # py-spy
    return f"{len(wheels)} wheels installed into {site}"


def table(checks: Sequence[Check]) -> str:
    rows = ["| check | result | seconds | seen |", "|---|---|---|---|"]
    rows += [f"| {c.name} | {c.result} | {c.seconds:.0f} | {c.seen.replace('|', '/')} |" for c in checks]
    return "\n".join(rows)


def run_checks(args: argparse.Namespace) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
    env.pop("DS_ACCELERATOR", None)  # each world's backend picks DeepSpeed's accelerator
    work = Path(tempfile.mkdtemp(prefix="dsrepro-gpu-check-"))
    try:
        return _checks(args, env, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _checks(args: argparse.Namespace, env: dict[str, str], work: Path) -> int:
    installed = install(args.input, env, work / "site")
    versions = subprocess.run([sys.executable, "-c", "import torch, deepspeed, pytest_dsrepro; print("
                               "'torch', torch.__version__, 'deepspeed', deepspeed.__version__)"],
                              env=env, capture_output=True, text=True)  # fmt: skip
    gpus = cuda_devices(env)
    print(f"gpu_check: {installed}; {versions.stdout.strip() or versions.stderr.strip()[-300:]}; {gpus} CUDA devices",
          flush=True)  # fmt: skip
    check = GpuCheck(args.input, args.out, env, gpus, args.scale, args.k, work)
    steps = {"nccl-1": check.catalogue_nccl, "gloo-2": check.catalogue_gloo, "nccl-2": check.catalogue_nccl_two,
             "leases": check.leases, "hang": check.hang, "cost": check.world_cost}  # fmt: skip
    done: list[Check] = []
    for name in args.only or steps:  # in the order asked: the lease may end before the last one
        done.append(steps[name]())
        print(f"gpu_check: {done[-1].name}: {done[-1].result} in {done[-1].seconds:.0f}s: {done[-1].seen}", flush=True)
    text = table(done)
    (args.out / "gpu-check.md").write_text(text + "\n")
    print(text)
    return 1 if any(c.result == FAIL for c in done) else 0


def prepare(args: argparse.Namespace) -> int:
    """The inputs of ``run``: wheels for the GPU image's Python, and the CPU reference verdicts."""
    wheels = args.into / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    subprocess.run(["uv", "build", "--wheel", "--out-dir", str(wheels), str(ROOT)], check=True)
    platforms = [flag for p in PLATFORMS for flag in ("--platform", p)]
    subprocess.run([*PIP, "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
                    args.python_version, "--implementation", "cp", *platforms, "-d", str(wheels), *MISSING_THERE,
                    *DIAGNOSTICS], check=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as sdists:
        subprocess.run([*PIP, "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", sdists,
                        f"deepspeed=={args.release}"], check=True)  # fmt: skip
        sdist = next(Path(sdists).glob("deepspeed-*.tar.gz"))
        subprocess.run(["uv", "build", "--wheel", "--no-build-isolation", "--python", py, "--out-dir", str(wheels),
                        str(sdist)], check=True, env={**os.environ, "DS_BUILD_OPS": "0"})  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    for size in (1, 2):
        reference = args.into / f"cpu-{size}"
        shutil.rmtree(reference, ignore_errors=True)
        select = ["-k", args.k] if args.k else []
        subprocess.run([py, "-m", "pytest", "-p", "no:cacheprovider", "-q", "repros", "--ds-world-size", str(size),
                        "--ds-results", str(reference), *select], cwd=ROOT, env=env)  # fmt: skip
        print(f"gpu_check prepare: {len(verdicts(reference))} CPU verdicts at {size} rank(s) in {reference}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="on a CPU machine with PyPI: wheels and the CPU reference")
    p.add_argument("--into", type=Path, required=True)
    p.add_argument("--release", default="0.19.8", help="the DeepSpeed release to check (its sdist, built here)")
    p.add_argument("--python-version", default="3.12", help="the GPU image's Python")
    p.add_argument("-k", help="the CPU reference of only the tests pytest's -k selects")
    r = sub.add_parser("run", help="on the GPU machine: every check, one table")
    r.add_argument("--input", type=Path, required=True, help="what prepare wrote")
    r.add_argument("--out", type=Path, required=True, help="logs, results and gpu-check.md")
    r.add_argument("--scale", type=float, default=1.0, help="every check's time limit, times this")
    r.add_argument(
        "--only",
        nargs="+",
        choices=("nccl-1", "gloo-2", "nccl-2", "leases", "hang", "cost"),
        help="run these checks only, in this order (a rerun of what failed, or the most wanted first)",
    )
    r.add_argument("-k", help="the catalogue checks run only the tests pytest's -k selects")
    f = sub.add_parser("floor", help=argparse.SUPPRESS)
    f.add_argument("count", type=int)
    args = parser.parse_args(argv)
    if args.command == "floor":
        floor(args.count)
        return 0
    return prepare(args) if args.command == "prepare" else run_checks(args)


if __name__ == "__main__":
    sys.exit(main())
