"""DeepSpeed's own test files through ``dsrepro upstream`` and through DeepSpeed's own harness, side by side
(issue 21), and upstream regression tests of fix PRs across releases.

Part 1, the files: every test file of a DeepSpeed checkout's ``tests/unit/{runtime/zero, v1/zero, checkpoint, comm,
v1/moe, runtime/half_precision}`` and ``tests/unit/runtime/test_*.py`` with at most ``--max-tests`` tests (or the
``--files`` given), each run twice, one after the other, in alternating order: ``pytest -p pytest_dsrepro.upstream
FILE`` from the checkout's ``tests/`` in one environment, plain ``pytest FILE`` (DeepSpeed's harness) in another from
a copy of ``tests/`` outside the checkout, with the same ``LOCAL_SIZE`` (DeepSpeed's CPU accelerator counts devices by
it: without it, it counts CPU sockets and skips every multi-rank test; it also sizes device-count-dependent class
bodies alike in both runs). The copy, because DeepSpeed's ``tests/conftest.py`` puts the directory above it first on
``sys.path``: from the checkout, its harness would test the checkout's sources, not the release. Each side says which
DeepSpeed its tests imported, and a side that ran another one than ``--release`` stops the run.
Per file: passed/failed/errors/skipped and wall time for each, and every test whose outcome differs.

Environments (uv, the recipe of ``dsrepro install``, kept under ``--cache-dir``): DeepSpeed ``--release`` with this
plugin and pytest as installed here; DeepSpeed's harness gets the same release with the pytest DeepSpeed pins for its
tests (``--deepspeed-pytest``, default ``<8.4``: its ``DistributedFixture`` relies on what pytest >= 8.4 dropped).

Part 2, ``--regressions``: the tests of fix PRs (``REGRESSIONS``) on several releases
(``--regression-releases``) through ``dsrepro upstream --release``, shown as ``dsrepro matrix`` shows them.

    python benchmarks/upstream.py --checkout ~/DeepSpeed --out upstream-bench          # part 1, every file
    python benchmarks/upstream.py --checkout ~/DeepSpeed --out upstream-suite --all    # the whole tests/unit
    python benchmarks/upstream.py --checkout ~/DeepSpeed --out b --files unit/runtime/zero/test_zero_leaf_module.py
    python benchmarks/upstream.py --checkout ~/DeepSpeed --out b --only plugin         # one side only
    python benchmarks/upstream.py --checkout ~/DeepSpeed --out b --regressions         # part 2
    python benchmarks/upstream.py --checkout ~/DeepSpeed --out b --report              # the table so far

Each file's figures are kept in ``OUT/files/*.json`` as they are measured: a run that is stopped resumes where it
was (``--fresh`` measures again). Run it niced on a shared machine; the load average at each file is recorded. Each
side keeps DeepSpeed's JIT-built ops in a directory of its own under OUT, built before anything is timed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

from pytest_dsrepro.core import checkout, failures, results
from pytest_dsrepro.core.options import CACHE_ENV, default_cache_dir
from pytest_dsrepro.tools import install, matrix, processes, upstream_runs
from pytest_dsrepro.tools.environments import activated, release_environment
from pytest_dsrepro.worlds import shm

ROOT = Path(__file__).resolve().parents[1]
DIRECTORIES = ("unit/runtime/zero", "unit/v1/zero", "unit/checkpoint", "unit/comm", "unit/v1/moe",
               "unit/runtime/half_precision")  # fmt: skip
TOP_LEVEL = "unit/runtime"  # its test_*.py files, not its subdirectories
SIDES = ("plugin", "deepspeed")
#: A JUnit testcase's child elements and the outcome each says, first found first.
OUTCOME_TAGS = (("failure", "failed"), ("error", "error"), ("skipped", "skipped"))
#: The tests of fix PRs whose history says where they were affected (docs/upstream-run.md): PR -> file.
REGRESSIONS = {
    "#7302": "unit/runtime/zero/test_zero_grad_clip.py",
    "#7967": "unit/v1/zero/test_zero_cpu_offload_grad_accum.py",
    "#8137": "unit/comm/test_comms_logger.py::test_stop_profiling_comms_disables_prof_all",
    "#8144": "unit/runtime/zero/test_zero_hook_attribute_delegation.py",
    "#8158": "unit/runtime/zero/test_zero_allreduce_fetch_params.py",
    "#8009": "unit/runtime/zero/test_zero_late_module_attach.py",
    "#8113": "unit/runtime/zero/test_zero_autocast_mixed_dtype.py",
}
REGRESSION_RELEASES = ("0.16.4", "0.17.6", "0.18.3", "0.19.2", "0.19.3", "0.19.4", "0.19.8")
#: DeepSpeed's harness gives a test 600 s (``DS_UNITTEST_TIMEOUT``); the plugin's side gets the same, not its own
#: 300 s default: on a loaded machine a slow test would otherwise end differently for the limit alone.
UPSTREAM_TIMEOUT = "600"
#: A release's first regression run JIT-builds DeepSpeed's CPU ops in its ranks: minutes on a loaded machine.
REGRESSION_TIMEOUT = "1800"


@dataclass
class Side:
    """One harness's run of one file."""

    seconds: float
    exit_code: int
    outcomes: dict[str, str]  # test -> passed, failed, error, skipped
    load: float  # the 1-minute load average when it started
    deepspeed: str = ""  # the DeepSpeed its tests imported: "VERSION at DIRECTORY" ("" in runs before it was kept)
    errors: dict[str, str] = field(default_factory=dict)  # failed or errored test -> its message, on one line
    timed_out: bool = False  # stopped at --timeout: its time is a lower bound, its outcomes those it had then

    def count(self, outcome: str) -> int:
        return sum(1 for o in self.outcomes.values() if o == outcome)


@dataclass
class FileRun:
    path: str
    sides: dict[str, Side] = field(default_factory=dict)

    @property
    def both(self) -> bool:
        """Measured under both harnesses: only such a file is compared."""
        return all(s in self.sides for s in SIDES)


def junit_outcomes(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """Each test of a JUnit XML report and how it ended (a collection error is a test named after its file), and
    each failed or errored test's message on one line (what sorts it against the failures file)."""
    if not path.exists():
        return {}, {}
    outcomes, errors = {}, {}
    for case in ET.parse(path).getroot().iter("testcase"):
        if not case.get("name"):  # what a run stopped by Ctrl-C (the timeout) reports of the test it was in
            continue
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        found = [(word, child) for tag, word in OUTCOME_TAGS for child in case if child.tag == tag]
        outcomes[name] = found[0][0] if found else "passed"  # a failed call that then errored at teardown: failed
        if found and found[0][0] != "skipped":
            child = found[0][1]
            text = child.get("message") or child.text or ""
            errors[name] = " ".join(text.split())[:600]
    return outcomes, errors


def nodeid(path: str, junit_name: str) -> str:
    """A JUnit ``classname::name`` as pytest's node id from ``tests/`` (``unit/x/test_y.py::Class::test[p]``), the
    form the failures file names tests in."""
    classname, _, name = junit_name.partition("::")
    module = path.removesuffix(".py").replace("/", ".")
    if classname == module:
        return f"{path}::{name}"
    if classname.startswith(module + "."):
        return f"{path}::{classname[len(module) + 1 :].replace('.', '::')}::{name}"
    return path if not classname else f"{path}::{name}"  # a collection error is named after its file


#: What a side says when its tests imported no DeepSpeed at all (a file of transformers' configs, under DeepSpeed's
#: harness): it cannot have run another DeepSpeed than the release.
NO_DEEPSPEED = "none imported"

#: ``pytest`` as ``python -m pytest`` runs it, then the DeepSpeed its tests imported (sys.path as they left it).
_PYTEST_THEN_SAY_DEEPSPEED = (
    "import os, sys, pytest\n"
    "code = pytest.main(sys.argv[1:])\n"
    "ds = sys.modules.get('deepspeed')\n"
    f"print('DEEPSPEED-SEEN', ds and f'{{ds.__version__}} at {{os.path.dirname(ds.__file__)}}' or {NO_DEEPSPEED!r})\n"
    "sys.exit(code)\n"
)


def run_file(python: str, tests: Path, path: str, side: str, environ: dict[str, str], timeout: float) -> Side:
    with tempfile.TemporaryDirectory(prefix="dsrepro-upstream-bench-") as tmp:
        report = Path(tmp) / "junit.xml"
        command = [python, "-c", _PYTEST_THEN_SAY_DEEPSPEED, path, "-p", "no:cacheprovider", f"--junitxml={report}"]
        if side == "plugin":
            command += ["-p", upstream_runs.PLUGIN]
        load = os.getloadavg()[0]
        before = set(shm.SHM_DIR.glob(f"{shm.PREFIX}*"))
        # At the timeout the file's pytest is stopped as Ctrl-C stops it, with every process it started (a harness's
        # ranks): it still writes the outcomes it has, and the next file starts on a machine left as found.
        try:
            done = processes.run(command, cwd=tests, env=environ, timeout=timeout)
        finally:  # Ctrl-C included: DeepSpeed's harness leaves its ranks' buffers, named after its fixed ports
            for left in set(shm.SHM_DIR.glob(f"{shm.PREFIX}*")) - before:  # (the next file's ranks would map them)
                left.unlink(missing_ok=True)
        seen = next((x.split(" ", 1)[1] for x in done.output.splitlines() if x.startswith("DEEPSPEED-SEEN ")), "")
        outcomes, errors = junit_outcomes(report)
        return Side(round(done.seconds, 1), done.returncode, outcomes, round(load, 2), seen, errors, done.timed_out)


def harness_tests(found: checkout.Checkout, out: Path) -> Path:
    """A copy of the checkout's ``tests/`` with no DeepSpeed beside it, for DeepSpeed's harness: its conftest puts
    the directory above ``tests/`` first on ``sys.path``: from the checkout it would import the checkout's sources."""
    copy = out / f"deepspeed-tests-{found.revision[:12]}" / "tests"
    if not copy.exists():
        shutil.copytree(found.tests, copy.with_suffix(".partial"), ignore=shutil.ignore_patterns("__pycache__"))
        copy.with_suffix(".partial").rename(copy)
    # Tests that read the checkout's kernel sources by path (evoformer's builder test reads a csrc/ header) read them
    # as from the checkout. Not op_builder/: beside tests/ DeepSpeed would import it by name and build its ops from it.
    csrc = copy.parent / "csrc"
    if not csrc.exists() and (found.root / "csrc").is_dir():
        csrc.symlink_to(found.root / "csrc", target_is_directory=True)
    return copy


def check_release(side: str, path: str, got: Side, release: str, found: checkout.Checkout) -> None:
    """Stop the run if a side's tests ran another DeepSpeed than the release under test (or the checkout's). A side
    stopped at the timeout before it could say is kept as stopped: its file is named, the run goes on."""
    if (got.timed_out and not got.deepspeed) or got.deepspeed == NO_DEEPSPEED:
        return
    version, _, where = got.deepspeed.partition(" at ")
    if version != release or Path(where).resolve().is_relative_to(found.root.resolve()):
        raise SystemExit(f"{path} ({side}): its tests ran DeepSpeed {got.deepspeed or 'unknown'}, not the installed "
                         f"{release}: its figures are not kept")  # fmt: skip


def collected(python: str, tests: Path, paths: list[str], environ: dict[str, str]) -> dict[str, int]:
    """How many tests pytest (with the plugin) collects in each file."""
    lister = (
        "import collections, json, sys, pytest\n"
        "class L:\n"
        "    def pytest_collection_finish(self, session):\n"
        "        c = collections.Counter(i.nodeid.split('::')[0] for i in session.items)\n"
        "        print('COUNTS ' + json.dumps(c))\n"
        "pytest.main(['-p', 'pytest_dsrepro.upstream', '-p', 'no:cacheprovider', '--co', '-q',\n"
        "             '--continue-on-collection-errors', *sys.argv[1:]], plugins=[L()])\n"
    )
    proc = subprocess.run([python, "-c", lister, *paths], cwd=tests, env=environ, capture_output=True, text=True)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("COUNTS ")), "COUNTS {}")
    return dict(json.loads(line.removeprefix("COUNTS ")))


def default_files(tests: Path, everything: bool = False) -> list[str]:
    """Part 1's directories; with ``everything``, every test file of ``tests/unit`` (the whole suite, issue 37)."""
    if everything:
        found = sorted(
            p for p in (tests / "unit").rglob("*.py") if p.name.startswith("test_") or p.stem.endswith("_test")
        )
    else:
        found = [p for d in DIRECTORIES for p in sorted((tests / d).rglob("test_*.py"))]
        found += sorted((tests / TOP_LEVEL).glob("test_*.py"))
    return [p.relative_to(tests).as_posix() for p in found]


def environments(args: argparse.Namespace) -> dict[str, str]:
    """The interpreter of each side: the release with this plugin; the release with DeepSpeed's pinned pytest."""
    cache = args.cache_dir or default_cache_dir()
    constraints = install.find_constraints(cwd=ROOT)
    if constraints is None:
        raise SystemExit("no constraints.txt pinning torch (run it from a pytest-dsrepro checkout)")
    plugin = release_environment(cache, constraints)(Version(args.release)).python
    directory = cache / "envs" / f"deepspeed-harness-{args.release}-pytest{args.deepspeed_pytest.replace('<', 'lt')}"
    python = install.environment_python(directory)
    result = install.install_deepspeed(args.release, python=python, constraints=constraints, cache_dir=cache)
    if not result.ok:
        raise SystemExit(f"deepspeed {args.release} for DeepSpeed's harness: {result.reason}")
    uv = [install.uv_binary(), "pip", "install", "-q", "--python", python, "-c", str(constraints)]
    subprocess.run([*uv, f"pytest{args.deepspeed_pytest}", *hf_extra()], check=True, env=install._env())
    return {"plugin": plugin, "deepspeed": python}


def hf_extra() -> list[str]:
    """The plugin's ``hf`` extra as the plugin's side has it (``install.extras_installed_here``): a test that needs one
    of its packages (``huggingface_hub``, say) must not fail under one harness only for lack of it."""
    requires = [r for r in metadata.distribution(install.PLUGIN).requires or [] if _in_extra(r, "hf")]
    return install.extras_installed_here(requires)


def _in_extra(requirement: str, extra: str) -> bool:
    marker = Requirement(requirement).marker
    return marker is not None and marker.evaluate({"extra": extra})


#: DeepSpeed's CPU ops that the tests' engines JIT-build in their ranks on first use (Adam, offloaded optimizers);
#: no file of the directories measured uses Adagrad or Lion, whose ops each cost minutes more to build.
OPS = ("FusedAdamBuilder", "CPUAdamBuilder")
_BUILD = "import deepspeed.ops.op_builder as b\nfor name in {ops!r}:\n    getattr(b, name)().load(verbose=False)\n"
#: Each side's comm op first, where its ranks load it: the plugin's fork server keeps it (and sets
#: TORCH_EXTENSIONS_DIR to it, where the ranks then build the other ops); DeepSpeed's ranks build it themselves.
_COMM_OP = {
    "plugin": "from pytest_dsrepro.worlds.server.comm_op import warm_up\nwarm_up()\n",
    "deepspeed": "from deepspeed.comm.torch import build_shm_op\nbuild_shm_op()\n",
}


def side_environ(side: str, base: dict[str, str], out: Path, python: str) -> dict[str, str]:
    """Each side's own place for DeepSpeed's JIT-built ops, apart from every other process on the machine: a build
    by another environment (other include paths) makes torch rebuild an op where it is loaded. One directory per
    side, for its pytest process too (a plain test class runs there, not in a world), which the plugin's fork server
    then takes as the user's own (``comm_op``). Each environment activated (``environments.activated``), as
    ``dsrepro upstream --release`` runs one: DeepSpeed's launcher tests run its ``deepspeed`` script."""
    environ = activated(Path(python).parents[1], base)
    environ["TORCH_EXTENSIONS_DIR"] = str(out / f"torch-extensions-{side}")
    if side == "plugin":
        environ[CACHE_ENV] = str(out / "cache-plugin")
    return environ


def warm_ops(pythons: dict[str, str], environs: dict[str, dict[str, str]]) -> None:
    """Build the ops each side's ranks would build on first use, before anything is timed: a first build takes
    minutes, and it would land on whichever file happens to come first, in one harness and not the other."""
    for side, python in pythons.items():
        started = time.monotonic()
        code = _COMM_OP[side] + _BUILD.format(ops=OPS)
        subprocess.run([python, "-c", code], env=environs[side], check=True, capture_output=True)
        print(f"{side}: DeepSpeed's CPU ops ready in {time.monotonic() - started:.0f}s", flush=True)


def ran_a_world(run: FileRun, tests: Path) -> bool:
    """Whether the file started a world under the plugin: it has ``DistributedTest`` classes and a test of it passed
    or failed (a file whose tests all skip, or that cannot be imported, starts none: the criterion sets it aside)."""
    side, source = run.sides.get("plugin"), tests / run.path
    ran = side is not None and any(o in ("passed", "failed") for o in side.outcomes.values())
    return ran and source.is_file() and "DistributedTest" in source.read_text()


def table(runs: list[FileRun], tests: Path) -> str:
    """The per-file table (Markdown), the totals of the files measured on both sides, and how the per-file ratios
    fall, files that ran a world apart from the others (``tests``: the checkout's, to tell them)."""
    head = "| file | plugin p/f/e/s | plugin s | DeepSpeed p/f/e/s | DeepSpeed s | ratio |"
    lines = [head, "|---|---|---|---|---|---|"]
    both = [r for r in runs if r.both]
    totals = {s: [0, 0, 0, 0, 0.0] for s in SIDES}
    for run in runs:
        cells = []
        for s in SIDES:
            side = run.sides.get(s)
            if side is None:
                cells += ["-", "-"]
                continue
            counts = [side.count(o) for o in ("passed", "failed", "error", "skipped")]
            if run.both:
                totals[s] = [*(a + b for a, b in zip(totals[s][:4], counts, strict=True)), totals[s][4] + side.seconds]
            cells += ["/".join(map(str, counts)), f"{side.seconds:.0f}{'+ (stopped)' if side.timed_out else ''}"]
        ratio = f"{run.sides['plugin'].seconds / run.sides['deepspeed'].seconds:.2f}" if run.both else "-"
        lines.append(f"| {run.path} | {' | '.join(cells)} | {ratio} |")
    t = [f"{'/'.join(str(int(x)) for x in totals[s][:4])} | {totals[s][4]:.0f}" for s in SIDES]
    ratio = totals["plugin"][4] / totals["deepspeed"][4] if totals["deepspeed"][4] else 0
    lines.append(f"| **{len(both)} files with both sides** | {t[0]} | {t[1]} | {ratio:.2f} |")
    for worlds, what in ((True, "ran a world under the plugin"), (False, "ran none (no world: set aside)")):
        group = [r for r in both if ran_a_world(r, tests) is worlds]
        ratios = {r.path: r.sides["plugin"].seconds / r.sides["deepspeed"].seconds for r in group}
        faster, slower = sum(x < 0.9 for x in ratios.values()), [p for p, x in ratios.items() if x > 1.1]
        named = f": {', '.join(f'{p} ({ratios[p]:.2f})' for p in slower)}" if worlds and slower else ""
        within = len(group) - faster - len(slower)
        lines.append(f"\n{len(group)} files {what}: the plugin faster by more than 10% on {faster}, within 10% on "
                     f"{within}, slower by more than 10% on {len(slower)}{named}.")  # fmt: skip
    return "\n".join(lines)


#: The plugin's test of one world size of a ``world_size = [1, 2, 4]`` class: ``test[2ranks-3]`` (``test[2ranks]``).
_ONE_SIZE = re.compile(r"\[\d+ranks?(?:-(?P<rest>[^\]]*))?\]$")
#: How DeepSpeed's harness ends a test that runs its sizes in turn: the first failure ends it, a skip skips it.
_WORST = ("failed", "error", "skipped", "passed")


def per_harness_test(outcomes: dict[str, str]) -> dict[str, str]:
    """The plugin's outcomes as DeepSpeed's harness names its tests: the plugin runs each size of a class's
    ``world_size`` list as a test of its own, where DeepSpeed's harness runs them all in one."""
    sizes: dict[str, list[str]] = {}
    for test, outcome in outcomes.items():
        one = _ONE_SIZE.search(test)
        rest = one and one["rest"]
        name = test if one is None else test[: one.start()] + (f"[{rest}]" if rest else "")
        sizes.setdefault(name, []).append(outcome)
    return {name: min(ends, key=_WORST.index) for name, ends in sizes.items()}


def differences(runs: list[FileRun]) -> list[str]:
    """Every test whose outcome differs between the two harnesses (or that only one of them ran)."""
    found = []
    for run in runs:
        if not run.both:
            continue
        plugin, deepspeed = per_harness_test(run.sides["plugin"].outcomes), run.sides["deepspeed"].outcomes
        for test in sorted(set(plugin) | set(deepspeed)):
            a, b = plugin.get(test, "not run"), deepspeed.get(test, "not run")
            if a != b:
                found.append(f"{test}: plugin {a}, DeepSpeed {b}")
    return found


def measure(args: argparse.Namespace, found: checkout.Checkout) -> None:
    pythons = environments(args)
    timeout = os.environ.get("DS_UNITTEST_TIMEOUT", UPSTREAM_TIMEOUT)
    base = {**os.environ, "LOCAL_SIZE": str(args.local_size), "DS_ACCELERATOR": "cpu", "DSREPRO_TIMEOUT": timeout}
    environs = {side: side_environ(side, base, args.out.resolve(), pythons[side]) for side in SIDES}
    warm_ops(pythons, environs)
    files = args.files or default_files(found.tests, args.all)
    if not args.files:
        counts = collected(pythons["plugin"], found.tests, files, environs["plugin"])
        most = float("inf") if args.all else args.max_tests
        files = [f for f in files if 0 < counts.get(f, 0) <= most]
        print(
            f"{len(files)} files of at most {args.max_tests} tests ({sum(counts[f] for f in files)} tests)", flush=True
        )
    tests = {"plugin": found.tests, "deepspeed": harness_tests(found, args.out)}
    store = args.out / "files"
    store.mkdir(parents=True, exist_ok=True)
    sides = [args.only] if args.only else list(SIDES)
    runs = []
    for index, path in enumerate(files):
        kept = store / (path.replace("/", "__") + ".json")
        run = FileRun(path) if args.fresh else kept_run(kept, path)
        order = sides if index % 2 == 0 else sides[::-1]
        for side in order:
            if side in run.sides:
                continue
            got = run_file(pythons[side], tests[side], path, side, environs[side], args.timeout)
            check_release(side, path, got, args.release, found)
            run.sides[side] = got
            kept.write_text(json.dumps(asdict(run), indent=1))
            print(f"[{index + 1}/{len(files)}] {path} {side}: {got.count('passed')} passed, "
                  f"{got.count('failed')} failed, {got.count('error')} errors, {got.count('skipped')} skipped "
                  f"in {got.seconds:.0f}s (load {got.load})", flush=True)  # fmt: skip
        runs.append(run)
    write_report(args.out, runs, found.tests)


def kept_run(kept: Path, path: str) -> FileRun:
    """What OUT holds of a file: both sides, one, or none yet."""
    run = FileRun(path)
    if kept.exists():
        run.sides = {s: Side(**v) for s, v in json.loads(kept.read_text())["sides"].items()}
    return run


def plugin_outcomes(runs: list[FileRun]) -> list[failures.Outcome]:
    """How each test ended on the plugin's side, by node id, as ``dsrepro upstream`` sorts a run's failures."""
    found = []
    for run in runs:
        side = run.sides.get("plugin")
        if side is not None:
            release = side.deepspeed.partition(" ")[0] or None
            found += [failures.Outcome(nodeid(run.path, test), release, outcome, side.errors.get(test))
                      for test, outcome in side.outcomes.items()]  # fmt: skip
    return found


def write_report(out: Path, runs: list[FileRun], tests: Path) -> None:
    report = table(runs, tests) + "\n\nDiffering outcomes:\n" + "\n".join(f"- {d}" for d in differences(runs))
    sorted_ = failures.sort_outcomes(plugin_outcomes(runs), failures.read(failures.PACKAGED))
    report += "\n\nThe plugin's failures against the failures file:\n" + "\n".join(failures.summary(sorted_))
    (out / "files.md").write_text(report + "\n")
    print(report)


def regressions(args: argparse.Namespace, found: checkout.Checkout) -> None:
    """The fix PRs' tests on each release (``dsrepro upstream --release``), then the matrix of what they said."""
    out = (args.out / "regressions").resolve()
    pytest_args = ["-p", "no:cacheprovider", "--ds-timeout", REGRESSION_TIMEOUT]
    options = argparse.Namespace(results=out, cache_dir=args.cache_dir, constraints=None, log_dir=None,
                                 pytest_args=pytest_args)  # fmt: skip
    targets = list(REGRESSIONS.values())
    upstream_runs.run_releases(options, found, targets, list(args.regression_releases))
    files, warnings = results.read_all([out])
    merged = matrix.merge(files, warnings)
    print(matrix.render_terminal(merged, width=200))
    (args.out / "regressions.md").write_text(matrix.render_markdown(merged))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkout", type=Path, required=True, help="a DeepSpeed git checkout")
    parser.add_argument("--out", type=Path, required=True, help="where figures are kept (resumable)")
    parser.add_argument("--files", nargs="+", help="test files, relative to the checkout's tests/")
    parser.add_argument("--max-tests", type=int, default=30, help="without --files: files of at most this many tests")
    parser.add_argument("--all", action="store_true", help="every test file of tests/unit, whatever its size")
    parser.add_argument("--only", choices=SIDES, help="measure one harness only")
    parser.add_argument("--release", default="0.19.8", help="the DeepSpeed release both harnesses run")
    parser.add_argument("--deepspeed-pytest", default="<8.4", help="pytest for DeepSpeed's harness (its pin)")
    parser.add_argument("--local-size", type=int, default=8, help="LOCAL_SIZE for both runs")
    parser.add_argument("--timeout", type=float, default=5400.0, help="seconds one file may take")
    parser.add_argument("--cache-dir", type=Path, help="release environments (default: the plugin's cache)")
    parser.add_argument("--fresh", action="store_true", help="measure again what OUT already holds")
    parser.add_argument("--report", action="store_true", help="only the table of what OUT holds so far (a run goes on)")
    parser.add_argument("--regressions", action="store_true", help="part 2: fix PRs' tests across releases")
    parser.add_argument("--regression-releases", nargs="+", default=list(REGRESSION_RELEASES))
    args = parser.parse_args()
    found = checkout.read(args.checkout)
    print(f"DeepSpeed's tests from {found.describe()}; load average {os.getloadavg()[0]:.1f}", flush=True)
    if args.report:
        kept = sorted((args.out / "files").glob("*.json"))
        write_report(args.out, [kept_run(k, json.loads(k.read_text())["path"]) for k in kept], found.tests)
    elif args.regressions:
        regressions(args, found)
    else:
        measure(args, found)


if __name__ == "__main__":
    sys.exit(main())
