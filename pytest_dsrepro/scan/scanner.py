"""``--ds-scan CONFIG``: a user's config run through the catalogue, a pytest plugin of its own (the entry point
``dsrepro-scan``; ``Scan`` registered only for a scan), so that the rest of the plugin knows nothing of scans: it
answers the plugin's hooks (``plugin.HookSpecs``) and pytest's. Each catalogued repro gets one ``[scan]`` test with
the user's config; its premise is judged at setup on the config as the installed release reads it (``ScanConfig``,
asked through ``scan.defaults`` while collection runs), NOT APPLICABLE or refused configs start no world, and the
gates' judgement becomes the scan's verdict and the test's outcome (AFFECTED and CANNOT TELL fail, NOT AFFECTED
passes, NOT APPLICABLE skips). The run's summary and ``--ds-report`` are the scan's table.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import pytest

from ..core import configs, ds_defaults, results, scan_verdicts, userconfig
from ..core.errors import MarkerError
from ..core.gates import Judgement, Reason, installed_deepspeed
from ..core.premises import Premise, lookup, put
from ..core.results import Finding, RunRecord, ScanSource, ScanVerdict, TestRecord
from ..session import markers
from ..session.backends import WORLD_BACKEND_KEY, SpawnedWorlds
from ..session.markers import MARKS_KEY
from ..session.parametrize import give_config
from ..session.recording import RecordedTests, Summary
from ..session.settings import SETTINGS_KEY
from ..session.verdicts import JUDGEMENT_KEY, fail
from ..worlds.device_nodes import gpu_device_nodes
from . import defaults

#: The test id of a repro's one scanned test (and the name its config has in messages).
SCAN_ID = "scan"
#: The name ``Scan`` registers under: not the entry point's, which pytest gives this module itself.
REGISTERED_AS = "dsrepro-scan-config"


@dataclass(frozen=True)
class Mend:
    """A bug of refusals that holds the config, and the change to the config that avoids it."""

    bug: str
    changes: tuple[tuple[str, object], ...]
    said: tuple[str, ...]  # each change in words: ``scheduler.params.warmup_num_steps 0 -> 1``


@dataclass(frozen=True)
class ConfigRead:
    """The config for one world size: as written (``"auto"`` resolved, before the CPU adaptations; mended where
    ``mend`` says; the keys the release does not know, ``unknown``, taken out), as the release reads it (``values``:
    each key left out at its default), and DeepSpeed's refusal of it, if any (``Type: message``)."""

    written: dict[str, Any]
    values: dict[str, Any]
    refused: str | None = None
    mend: Mend | None = None
    defaults_known: bool = True  # False: DeepSpeed refused the config, or the probe failed
    unknown: dict[str, str] = dataclasses.field(default_factory=dict)  # key -> DeepSpeed's message

    def premise_problems(self, premise: Premise) -> tuple[str, ...]:
        """What the config lacks for ``premise``. Without the release's reading (a config DeepSpeed refuses, a
        probe that failed) a key the config leaves out that the release would give a default is not judged (that
        default is not known), the rest is judged as written (stage, precision, offload, an optimizer section, a
        scheduler: their absence is the same on every release)."""
        if self.defaults_known:
            return premise.unmet(self.values, self.written)
        known = tuple(r for r in premise.requirements
                      if r.key is None or lookup(self.written, r.key) is not None
                      or not ds_defaults.read_by_release(r.key))  # fmt: skip
        return Premise(known).unmet(self.written)


class ScanConfig:
    """The user's config as the installed release reads it, per world size (asked once, kept)."""

    def __init__(self, user: userconfig.UserConfig, cache_dir: Path, gloo: bool, size: int | None) -> None:
        """``size``: the world size to ask the release about now (None: nothing runs here, ask when asked)."""
        self.user, self.cache_dir, self.gloo = user, cache_dir, gloo
        self.menders: list[tuple[str, Premise]] = []
        self.problems: list[str] = []
        self.healed: list[str] = []  # cached defaults that could not be used, read again: each said once
        self._read: dict[int, tuple[ConfigRead, ConfigRead]] = {}
        self._probes = {} if size is None else {size: self._ask([self.written(size)], size)}

    def written(self, size: int) -> dict[str, Any]:
        return configs.resolve(self.user.config, SCAN_ID, size, "gloo").written

    def _ask(self, written: list[dict[str, Any]], size: int) -> defaults.DefaultsProbe:
        return defaults.start([ds_defaults.request(w, size) for w in written], self.cache_dir, self.gloo)

    def _answer(self, probe: defaults.DefaultsProbe, written: dict[str, Any], mend: Mend | None) -> ConfigRead:
        reading = probe.wait()[0]
        self.healed += [healed for healed in probe.healed if healed not in self.healed]
        if reading is None:
            if probe.problem and probe.problem not in self.problems:
                self.problems.append(probe.problem)
            return ConfigRead(written, written, None, mend, defaults_known=False)
        written = ds_defaults.without(written, reading.unknown)
        if reading.refused is not None:
            return ConfigRead(written, written, reading.refused, mend, defaults_known=False, unknown=reading.unknown)
        return ConfigRead(written, ds_defaults.merged(written, reading), None, mend, unknown=reading.unknown)

    def read(self, size: int) -> tuple[ConfigRead, ConfigRead]:
        """The config for a world of ``size`` as written, and as the scan judges every bug but a mending one with
        (the same, unless DeepSpeed refuses the config as written and a bug of refusals mends it)."""
        if size not in self._read:
            written = self.written(size)
            probe = self._probes.pop(size, None) or self._ask([written], size)
            plain = self._answer(probe, written, None)
            self._read[size] = (plain, self._mended(plain, size) or plain)
        return self._read[size]

    def _mended(self, plain: ConfigRead, size: int) -> ConfigRead | None:
        if plain.refused is None:
            return None
        for bug, premise in self.menders:
            if plain.premise_problems(premise):
                continue
            mended = copy.deepcopy(plain.written)
            said = premise.mended(mended)
            return self._answer(self._ask([mended], size), mended, Mend(bug, premise.mend, tuple(said)))
        return None

    def notes(self) -> list[str]:
        """What the scan did to the config as a whole, for the notes above its table: the keys the release does not
        know, taken out; a mend, in words with why; defaults that could not be read."""
        said = []
        for plain, effective in self._read.values():
            said += [f"judged without {key}: DeepSpeed {installed_deepspeed()} does not know it ({message}); no "
                     "catalogued bug depends on it, and the rest of the config is judged" for key, message in
                     plain.unknown.items()]  # fmt: skip
            mend = effective.mend
            if mend is not None:
                said.append(f"judged with {', '.join(mend.said)}: DeepSpeed {installed_deepspeed()} refuses the config "
                            f"as written ({plain.refused}), which is the known bug {mend.bug} (its row: as written); "
                            "every other bug is judged with that bug's fix on the config's side")  # fmt: skip
        said += [f"{problem}: a key the config leaves out that DeepSpeed gives a default was not judged"
                 for problem in self.problems]  # fmt: skip
        return list(dict.fromkeys(said + self.healed))

    def close(self) -> None:
        """End a probe never read (the run ended first)."""
        for probe in self._probes.values():
            probe.close()
        self._probes.clear()


@dataclass(frozen=True)
class ScanPlan:
    """What a scanned test's world runs: the user's config with the premise's settings on top, and those settings
    in words."""

    config: dict[str, Any]
    notes: tuple[str, ...]


#: A scanned test's plan (its config), made at its setup.
PLAN_KEY = pytest.StashKey[ScanPlan]()
#: A scanned test's verdict when decided at setup (no world ran for it).
FINDING_KEY = pytest.StashKey[Finding]()


@pytest.hookimpl(trylast=True)  # after the plugin's own configure, which resolves the settings
def pytest_configure(config: pytest.Config) -> None:
    """Read the user's config once; whatever is wrong with it is a usage error now. On a machine with no GPU (or
    ``--ds-backend gloo``) the worlds are gloo, so what needs CUDA and has no CPU form is refused now too."""
    settings = config.stash.get(SETTINGS_KEY, None)
    if settings is None or settings.scan is None:  # None: the plugin itself is off (-p no:dsrepro)
        return
    gloo = settings.backend == "gloo" or (settings.backend == "auto" and not gpu_device_nodes())
    try:
        user = userconfig.load(settings.scan, "gloo" if gloo else None)
    except userconfig.UserConfigError as exc:
        raise pytest.UsageError(f"pytest-dsrepro: --ds-scan {exc}") from None
    # Where this process runs the tests (not --collect-only, not an xdist controller), the release is asked now and
    # the fork server started: their imports overlap collection instead of preceding the first verdicts.
    runs_here = not (config.option.collectonly or getattr(config.option, "numprocesses", None))
    reading = ScanConfig(user, settings.cache_dir, gloo, settings.world_size if runs_here else None)
    config.pluginmanager.register(Scan(user, reading), REGISTERED_AS)
    backend = config.stash.get(WORLD_BACKEND_KEY, None)
    if runs_here and gloo and isinstance(backend, SpawnedWorlds):
        backend.runner.launch()


def _repro(item: pytest.Item) -> results.ReproMeta:
    """The ``ds_repro`` marker of a scanned test (``_scans``), read as every report reads it (``repro_meta``): the
    bug's id is the one its rows carry."""
    mark = item.get_closest_marker("ds_repro")
    assert mark is not None
    return results.repro_meta(mark.args, mark.kwargs, item.path, ())


def _decided(item: pytest.Item, found: Finding) -> NoReturn:
    item.stash[FINDING_KEY] = found
    raise pytest.skip.Exception(f"{found.verdict.value}: {found.detail}")


def _scans(node: pytest.Item) -> bool:
    """Is ``node`` (a test or a test function's definition) a repro, which a scan runs?"""
    return node.get_closest_marker("ds_repro") is not None


def _plan(item: pytest.Item, user: dict[str, Any], reading: ScanConfig, told: dict[str, str]) -> ScanPlan:
    """A scanned test's plan, or its verdict decided now (``_decided``, no world): its premise judged on the config
    as the release reads it; a race's series skipped where a deterministic test of the same bug has told (``told``:
    which test, and what); the user's config, mended unless this repro is the bug of refusals that mends it, then
    the premise's ``removes`` and ``sets``, each said."""
    if "ds_config" not in getattr(item, "fixturenames", ()):
        _decided(item, Finding(ScanVerdict.CANNOT_TELL, "the repro builds its own config (no ds_config): a user's "
                                                        "config cannot be run through it"))  # fmt: skip
    marks = item.stash[MARKS_KEY]
    premise = marks.premise
    if premise is None:
        _decided(item, Finding(ScanVerdict.CANNOT_TELL, "the repro declares no ds_premise: what a config needs "
                                                        "for its bug is not known"))  # fmt: skip
    plain, effective = reading.read(marks.world.size if marks.world is not None else 1)
    read = plain if premise.mend else effective
    unmet = read.premise_problems(premise)  # the accelerator's premise: judged before, at the plugin's own setup
    if unmet:
        _decided(item, scan_verdicts.not_applicable(unmet))
    series = marks.nondeterministic
    if series is not None and (bug := _repro(item).id) in told:
        said = f"told by {told[bug]}: this race's series of {series.runs} worlds adds nothing"
        _decided(item, Finding(ScanVerdict.NOT_APPLICABLE, said))
    if read.refused is not None and not premise.mend:
        _decided(item, Finding(ScanVerdict.CANNOT_TELL, f"{scan_verdicts.REFUSED} [{SCAN_ID}]: {read.refused}"))
    config = ds_defaults.without(user, read.unknown)
    for key, value in () if read.mend is None else read.mend.changes:
        put(config, key, value)
    return ScanPlan(config, tuple(premise.apply(config, read.values, read.written)))


class Scan:
    """This run's scan of one user config, registered for its hooks."""

    def __init__(self, user: userconfig.UserConfig, reading: ScanConfig) -> None:
        self.user = user
        self.reading = reading
        self.told: dict[str, str] = {}  # per bug, the deterministic test that told it and what it said

    def finding(self, item: pytest.Item, judgement: Judgement | None, error: str | None) -> Finding | None:
        """A scanned test's verdict for its record: decided at setup, else from the gates' judgement; a test that was
        never judged (a skip in the body, a missing extra, a marker error) is CANNOT TELL, with what it said."""
        if not _scans(item):
            return None
        decided = item.stash.get(FINDING_KEY, None)
        if decided is not None:
            return decided
        plan = item.stash.get(PLAN_KEY, None)
        notes = plan.notes if plan is not None else ()
        if judgement is None:
            return Finding(ScanVerdict.CANNOT_TELL, error or "it did not run", notes)
        marks = item.stash.get(MARKS_KEY, None)
        mend = marks.premise.describe_mend() if marks and marks.premise and marks.premise.mend else None
        return scan_verdicts.finding(judgement.reason, judgement.message, fixed_in=_repro(item).fixed_in,
                                     rate=judgement.rate, notes=notes, mend=mend)  # fmt: skip

    # ---- pytest's hooks -----------------------------------------------------------------------------------------

    @pytest.hookimpl(tryfirst=True)  # before the plugin's own expansion, which a test given its config skips
    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        """One ``[scan]`` test id whose ``ds_config`` is the user's config, in place of the repro's own configs and
        variants."""
        if _scans(metafunc.definition):
            give_config(metafunc, SCAN_ID, self.user.config)

    @pytest.hookimpl(tryfirst=True)  # before --ds-shard picks its share
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        """A scan runs the catalogue's repros only: other tests collected beside them are deselected. The bugs of
        refusals among them (a premise with ``mend``) are noted, for a config DeepSpeed refuses."""
        other = [item for item in items if not _scans(item)]
        if other:
            config.hook.pytest_deselected(items=other)
            items[:] = [item for item in items if _scans(item)]
        for item in items:
            with contextlib.suppress(MarkerError):  # said at that test's setup
                premise = markers.premise(item)
                if premise is not None and premise.mend:
                    self.reading.menders.append((_repro(item).id, premise))

    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        """Judge the premise on the user's config; no world for a config that cannot meet it. After the plugin's
        own setup (tryfirst: the markers, the world's backend), before the fixtures (``ds_config`` reads the plan):
        this object registers after pytest's own plugins, whose hooks run after those registered later."""
        if _scans(item):
            item.stash[PLAN_KEY] = _plan(item, self.user.config, self.reading, self.told)

    def pytest_unconfigure(self) -> None:
        """A probe of DeepSpeed's defaults that was never read (the run ended first) is stopped."""
        self.reading.close()

    # ---- the plugin's own hooks ---------------------------------------------------------------------------------

    def pytest_dsrepro_config(self, item: pytest.Item) -> dict[str, Any] | None:
        """A scanned test runs its plan's config: the user's, with the premise's settings on top."""
        plan = item.stash.get(PLAN_KEY, None)
        return plan.config if plan is not None else None

    @pytest.hookimpl(tryfirst=True)
    def pytest_dsrepro_conclude(self, item: pytest.Item, judgement: Judgement, story: str) -> bool | None:
        """The pytest outcome of a scanned test from its verdict: a pass for NOT AFFECTED (the body passed)."""
        found = self.finding(item, judgement, None)
        if found is None:
            return None
        if found.verdict is ScanVerdict.NOT_AFFECTED:
            return True
        if found.verdict is ScanVerdict.NOT_APPLICABLE:
            pytest.skip(f"{found.verdict.value}: {found.detail}")
        text = f"{found.verdict.value}: {found.detail}"
        if judgement.reason is not Reason.REPRODUCED:
            text += f"\n\n{story}".rstrip()
        fail(text)

    def pytest_dsrepro_test_record(self, item: pytest.Item, record: TestRecord) -> TestRecord | None:
        """A scanned test's record carries its finding."""
        found = self.finding(item, item.stash.get(JUDGEMENT_KEY, None), record.error)
        if found is None:
            return None
        marks = item.stash.get(MARKS_KEY, None)
        if found.verdict in (ScanVerdict.AFFECTED, ScanVerdict.NOT_AFFECTED) and marks and not marks.nondeterministic:
            self.told.setdefault(_repro(item).id, f"{item.name} ({found.verdict.value})")
        return dataclasses.replace(record, scan=found)

    def pytest_dsrepro_run_record(self, record: RunRecord) -> RunRecord:
        """The run's record names the config it scanned."""
        notes = (*self.user.notes, *self.reading.notes())
        return dataclasses.replace(record, scan=ScanSource(self.user.path, self.user.config, notes))

    def pytest_dsrepro_summary(self, config: pytest.Config, recorded: RecordedTests) -> Summary:
        """The scan's table, per bug; the worlds it ran on are said with ``-v`` only."""
        settings = config.stash[SETTINGS_KEY]
        environment = results.environment(settings.backend, settings.world_size)
        run = self.pytest_dsrepro_run_record(recorded.record(environment))
        title = f"dsrepro scan of {self.user.path} (deepspeed {installed_deepspeed()})"
        return Summary(title, scan_verdicts.terminal(run), with_worlds=False)

    def pytest_dsrepro_report(self, run: RunRecord) -> str:
        """``--ds-report``: the scan as Markdown to paste into an issue."""
        return scan_verdicts.markdown(run)
