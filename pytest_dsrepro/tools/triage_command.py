"""``dsrepro triage LOG``: is the error in this log a catalogued DeepSpeed bug, which release fixes it, what to do.

The log is read within limits (``log_input``: its head and tail only, so a 200 MB log answers as fast as a short
one); an empty or binary file is a usage error in one line. The catalogue is read from its markers by pytest's
collection (``known_bugs``); ``triage.ranking`` ranks it against ``triage.logread``'s reading of the log.

``--confirm`` runs the best candidates' repros in worlds, as ``dsrepro scan`` runs them (``confirm``), and reads the
verdicts from the results file.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any

from packaging.version import Version

from ..core import configs, faces, premises, results, userconfig, versions
from ..core.checkout import CheckoutError
from ..core.errors import MarkerError
from ..core.gates import VersionGate, common_fix, parse_gates
from ..core.git import GitError
from ..core.results import Finding, RunRecord, ScanVerdict, repro_meta
from ..triage import known_fixes, ledger, logread
from ..triage import ranking as triage
from ..triage.known_fixes import KnownFix
from . import arguments, atlas, catalogue, catalogue_run, environments, history, processes, upstream_runs
from .log_input import LogError, LogText, read_log

if TYPE_CHECKING:
    import pytest

#: Exit codes: 0 a known bug matched with confidence (or reproduced here); 1 no known bug; 2 a usage error.
KNOWN, UNKNOWN, USAGE = 0, 1, 2
#: Candidates ``--confirm`` runs by default.
CONFIRM_TOP = 3


class TriageError(Exception):
    """The triage cannot run (bad input, no catalogue, a release that cannot run): one line, exit code 2."""


# --- the catalogue -------------------------------------------------------------------------------------------------


@dataclass(eq=False)  # pluggy keeps plugins in sets: identity hashing
class _Gates:
    """A pytest plugin object: each catalogued item's ``ds_version`` gates and ``ds_premise``, by repro id."""

    gates: dict[str, list[VersionGate]] = field(default_factory=dict)
    premises: dict[str, premises.Premise] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            mark = item.get_closest_marker("ds_repro")
            if mark is None:
                continue
            bug = repro_meta(mark.args, mark.kwargs, item.path, ()).id
            premise = item.get_closest_marker("ds_premise")
            try:
                gates = parse_gates([(m.args, dict(m.kwargs)) for m in item.iter_markers("ds_version")], item.nodeid)
                if premise is not None:
                    self.premises[bug] = premises.parse(premise.args, premise.kwargs, item.nodeid)
            except MarkerError as exc:
                self.errors.append(str(exc))
                continue
            self.gates.setdefault(bug, []).extend(gates)


def known_bugs(where: Path, fixes_file: Path | None = None, ledger_dir: Path | None = None) -> list[triage.KnownBug]:
    """The catalogue at ``where``, from its markers, as triage compares it (``catalogue.collect``, with ``_Gates``
    reading the ``ds_version`` gates and ``ds_premise`` of the same items); then the fix ledger's known fixes
    (``ledger_dir``, else the package's own; checked against the catalogue), each with the atlas's tests of the same
    pull request (``fixes_file``, else the package's own), and the atlas's fixes the ledger has no row for."""
    reader = _Gates()
    try:
        entries = catalogue.collect([str(where)], ["--rootdir", str(where)], plugins=[reader])
    except catalogue.CollectionFailed as exc:
        raise TriageError(str(exc).splitlines()[0]) from None
    if reader.errors:
        raise TriageError(f"the catalogue's markers are wrong: {reader.errors[0]}")
    bugs = []
    for e in entries:
        gates = reader.gates.get(e.id, [])
        fix = common_fix(gates)
        own = (faces.gate_face(e.upstream, g.range, g.raises.__name__, g.match) for g in gates)
        bugs.append(triage.KnownBug(e.id, e.title, e.upstream, e.fixed_in, e.root_cause, e.path,
                                      tuple(dict.fromkeys([*own, *e.faces])), reader.premises.get(e.id),
                                      getattr(fix, "__name__", None), e.affected, folder=e.folder))  # fmt: skip
    if not bugs:
        raise TriageError(f"no repros (tests with a ds_repro marker) under {where}")
    try:
        fixes = known_fixes.load(fixes_file)
    except (OSError, ValueError) as exc:
        raise TriageError(f"--known-fixes {fixes_file}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        rows = ledger.load(ledger_dir)
        ledger.check_catalogue(rows, {e.id: e.fix_pr for e in entries})
    except ledger.LedgerError as exc:
        raise TriageError(f"the fix ledger cannot be read: {exc}") from None
    return bugs + triage.fix_bugs(rows, fixes, {e.fix_pr for e in entries if e.fix_pr is not None})


def _catalogue(args: argparse.Namespace) -> Path:
    if args.catalogue is not None:
        return Path(args.catalogue).resolve()
    try:
        return catalogue_run.installed()
    except catalogue_run.ScanError as exc:
        raise TriageError(str(exc)) from None


# --- what the triage is judged on ----------------------------------------------------------------------------------


def release(given: str | None, reading: logread.Reading) -> triage.Judged:
    """``--release`` (a version: ``arguments.release`` checked it), else the releases the log states, else the
    DeepSpeed installed here (only assumed: it rules no bug out); and where they came from."""
    if given is not None:
        return triage.Judged((Version(given),), triage.GIVEN)
    if reading.versions:
        return triage.Judged(tuple(Version(v) for v in reading.versions), triage.STATED)
    installed = versions.installed("deepspeed")
    if installed is not None:
        return triage.Judged((installed,), triage.ASSUMED)
    return triage.Judged()


def config(path: Path | None, reading: logread.Reading, world_size: int) -> tuple[dict[str, Any] | None, str | None]:
    """``--config`` (read as ``dsrepro scan`` reads it), else the config the log shows; and where it came from. As a
    scan judges premises: ``"auto"`` resolved as Hugging Face does, before any CPU adaptation."""
    if path is not None:
        try:
            given, said = userconfig.load(path).config, str(path)
        except userconfig.UserConfigError as exc:
            raise TriageError(str(exc)) from None
    elif reading.config is not None:
        given, said = reading.config, "the config shown in the log"
    else:
        return None, None
    try:
        return configs.resolve(given, "triage", world_size, "gloo").written, said
    except (configs.ConfigError, AttributeError, TypeError, ValueError):  # a pasted config DeepSpeed would refuse
        # (a section written as a bare value: ``"fp16": false``) is judged as written
        return given, said


def triage_log(log: LogText, bugs: Sequence[triage.KnownBug], args: argparse.Namespace) -> triage.Triage:
    reading = logread.read(log.text, known=triage.declared_types(bugs))
    given, config_from = config(args.config, reading, args.world_size or 2)
    return triage.rank(bugs, reading, release(args.release, reading), given, config_from=config_from)


# --- --confirm -----------------------------------------------------------------------------------------------------


def _environment(args: argparse.Namespace, judged_on: str | None) -> tuple[str, dict[str, str]]:
    """The interpreter and variables that run the release judged on: this one's where it is installed here, else
    the release's environment (``environments.release_environment``, built once and cached)."""
    if judged_on is None or judged_on == versions.installed_text("deepspeed"):
        return sys.executable, dict(os.environ)
    try:
        prepare = environments.release_environment(args.cache_dir, args.constraints)
        env = environments.prepared(prepare, judged_on, "triage")
    except environments.EnvironmentUnavailable as exc:
        raise TriageError(f"deepspeed {judged_on} cannot run here: {exc}") from None
    return env.python, dict(env.environ)


def _stock_run(python: str, environ: dict[str, str], args: argparse.Namespace, bugs: Sequence[triage.KnownBug],
               where: Path) -> RunRecord:  # fmt: skip
    """The bugs' own tests, stock variants only, in a child pytest from the catalogue's directory (as a scan runs)."""
    files = list(dict.fromkeys(str(Path(b.path).resolve()) for b in bugs))
    arguments = [*files, "-k", "not fixed"]
    returncode, read, unreadable = catalogue_run.run_catalogue(python, environ, where, args.world_size, arguments)
    if returncode not in (0, 1) or not read or unreadable:
        raise TriageError(f"the repros' pytest ended with exit code {returncode} and wrote no results (its output is "
                          "above)")  # fmt: skip
    return read[0].run


def confirm(args: argparse.Namespace, t: triage.Triage, where: Path) -> dict[str, Finding]:
    """The best candidates (``Triage.to_confirm``) run here: a catalogued bug's repro (with ``--config`` as a scan,
    ``--ds-scan``, else on its own configs; ``catalogue_run``), a known fix's own upstream tests (from ``--repo``); on
    the release judged on, its environment built as ``dsrepro bisect`` builds one where it is not the release
    installed here."""
    chosen = t.to_confirm(args.top)
    if not chosen:
        return {}
    names = ", ".join(b.id for b in chosen)
    print(f"dsrepro triage: confirming {names} on deepspeed {t.release or 'installed here'} ...", file=sys.stderr,
          flush=True)  # fmt: skip
    repros = [b for b in chosen if b.catalogued]
    found = {b.id: confirm_fix(args, b.fixed_by, t.release) for b in chosen if b.fixed_by is not None}
    found.update({b.id: _untested(b) for b in chosen if not b.catalogued and b.fixed_by is None})
    return {**found, **(_confirm_repros(args, t, repros, where) if repros else {})}


def _untested(bug: triage.KnownBug) -> Finding:
    """A known fix with no test of its own in the atlas: nothing here can run it."""
    return Finding(ScanVerdict.CANNOT_TELL, f"no repro and no test of its own to run: known from the ledger (fixed by "
                   f"{bug.fix_link})")  # fmt: skip


def _confirm_repros(args: argparse.Namespace, t: triage.Triage, chosen: list[triage.KnownBug],
                    where: Path) -> dict[str, Finding]:  # fmt: skip
    python, environ = _environment(args, t.release)
    if args.config is not None:
        select = ["-k", " or ".join(PurePath(b.path).stem for b in chosen)]
        try:
            run = catalogue_run.scan_once(python, environ, args.config, catalogue=where, world_size=args.world_size,
                                          pytest_args=select)  # fmt: skip
        except catalogue_run.ScanError as exc:
            raise TriageError(str(exc)) from None
    else:
        run = _stock_run(python, environ, args, chosen, where)
    return triage.confirmations(run, {b.id: b.fixed_in for b in chosen})


def confirm_fix(args: argparse.Namespace, fix: KnownFix, release: str | None) -> Finding:
    """A known fix's own tests, at its commit (a sparse checkout of ``--repo``, as the atlas runs them), on the
    release judged on (the installed one, else its environment): failing as before the fix is REPRODUCED here."""
    on = release or versions.installed_text("deepspeed")
    if args.repo is None or on is None:
        why = "give --repo CLONE (a DeepSpeed clone) to run its test" if args.repo is None else "no DeepSpeed here"
        return Finding(ScanVerdict.CANNOT_TELL, f"its own test {fix.tests[0].nodeid} was not run: {why}")
    try:
        clone = history.Clone.open(args.repo)
        with tempfile.TemporaryDirectory(prefix=f"dsrepro-triage-{fix.pr}-") as tmp:
            tests = atlas.sparse_checkout(clone, clone.commit(fix.commit), Path(tmp) / "DeepSpeed")
            out = Path(tmp) / "results"
            atlas.run_fix_tests(tests, [t.nodeid for t in fix.tests], [on], out, _release_env(args, on))
            records = [t for f in results.read_all([out])[0] if f.run.unavailable is None for t in f.run.tests]
    except (history.HistoryError, GitError, CheckoutError, upstream_runs.UpstreamError) as exc:
        raise TriageError(f"--repo {args.repo}: {exc}") from None
    return triage.fix_confirmation(fix, on, records)


def _release_env(args: argparse.Namespace, release: str) -> Callable[[Version], environments.ReleaseEnv]:
    """The release's environment: this interpreter where it is the release installed here, else its own."""
    if release == versions.installed_text("deepspeed"):
        return lambda _: environments.ReleaseEnv(sys.executable, dict(os.environ))
    return environments.release_environment(args.cache_dir, args.constraints)


# --- the command ---------------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Rank the catalogue's DeepSpeed bugs by how well an error log matches each (the exception and message each "
        "repro declares, the DeepSpeed frames, the config, the release), say why for each candidate, and rule out "
        "what cannot be it. --confirm runs the best candidates' repros here. Exit code 0: a known bug matched with "
        "confidence (or reproduced here); 1: no known bug; 2: the input or an option is wrong."
    )
    add = parser.add_argument
    add("log", metavar="LOG", help="the log, traceback or issue text (- for standard input)")
    add("--config", type=Path, metavar="PATH", help="your ds_config.json (else the log's, if any)")
    add(
        "--release",
        type=arguments.release,
        metavar="VERSION",
        help="the DeepSpeed release the error happened on "
        "(default: the ones the log states, else the one installed here, only assumed: it rules no bug out)",
    )
    add("--markdown", type=arguments.output_file, metavar="PATH", help="write a ready GitHub comment to PATH")
    add("--confirm", action="store_true", help="run the best candidates' repros in worlds here")
    add("--top", type=arguments.count, default=CONFIRM_TOP, metavar="N",
        help=f"candidates --confirm runs (default {CONFIRM_TOP})")  # fmt: skip
    add("--world-size", type=arguments.count, metavar="N", help="ranks per world (default 2)")
    add("--catalogue", type=arguments.directory, metavar="DIR", help="repros to triage against")
    add("--cache-dir", type=arguments.output_directory, help="release environments (as dsrepro scan)")
    add("--constraints", type=arguments.input_file, help="constraints pinning torch (as dsrepro bisect)")
    add("--repo", type=Path, metavar="CLONE", help="with --confirm: your DeepSpeed clone, where a known fix's own "
        "test is taken from (at the fix's commit) to run on the release judged on")  # fmt: skip
    add("--ledger", type=Path, metavar="DIR", help="the fix ledger's files (default: the package's own; dsrepro "
        "ledger lists them)")  # fmt: skip
    add("--known-fixes", type=arguments.input_file, metavar="PATH", help="the fixes triage knows besides the "
        "catalogue (default: the package's own, from the regression atlas; `dsrepro atlas --known-fixes` writes "
        "one)")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    try:
        with processes.interrupting(signal.SIGTERM):
            return _run(args)
    except (TriageError, LogError) as exc:
        print(f"dsrepro triage: {exc}", file=sys.stderr)
        return USAGE


def _run(args: argparse.Namespace) -> int:
    if args.repo is not None and not args.confirm:
        raise TriageError("--repo is for --confirm: the clone a known fix's own test is run from")
    log = read_log(args.log)
    where = _catalogue(args)
    t = triage_log(log, known_bugs(where, args.known_fixes, args.ledger), args)
    print(f"dsrepro triage: {log.described}, {t.reading.lines} lines")
    if t.release_from == triage.ASSUMED:
        print(f"note: the log states no release; deepspeed {t.release} is the one installed here, assumed: it rules "
              "no bug out (--release VERSION judges on the release that failed)")  # fmt: skip
    confirmed = confirm(args, t, where) if args.confirm else {}
    for line in triage.terminal(t, confirmed):
        print(line)
    if t.known is None:
        print(triage.new_repro_hint(args.log))
    if args.markdown is not None:
        try:
            args.markdown.parent.mkdir(parents=True, exist_ok=True)
            args.markdown.write_text(triage.markdown(t, confirmed, log=args.log))
        except OSError as exc:
            raise TriageError(f"--markdown {args.markdown}: cannot be written ({exc.strerror or exc})") from None
        print(f"wrote {args.markdown}")
    return (
        KNOWN if t.known is not None or any(f.verdict is ScanVerdict.AFFECTED for f in confirmed.values()) else UNKNOWN
    )
