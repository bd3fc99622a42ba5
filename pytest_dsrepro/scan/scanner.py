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
from packaging.version import Version

from ..core import configs, ds_defaults, results, scan_verdicts, userconfig
from ..core.errors import MarkerError
from ..core.gates import Judgement, Reason, affecting, installed_deepspeed
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
class Mender:
    """A bug whose premise declares a ``mend``. On a release inside its affected range a config that meets its premise
    stops every body there before the body's own check (DeepSpeed refuses it, or every step fails); on another
    (``inside`` false) DeepSpeed may refuse that config as its fix does (a ``reduce_bucket_size`` of 0 from 0.19.6).
    Either way the scan judges the other bugs with its fix on the config's side; outside the range only where the
    mend cures such a refusal."""

    bug: str
    title: str
    premise: Premise
    inside: bool = True


@dataclass(frozen=True)
class Mend:
    """A mend the scan applied to the config: the bug, its fix on the config's side, and the refusal of DeepSpeed's it
    cures, if that is how the bug shows."""

    bug: str
    title: str
    changes: tuple[tuple[str, object], ...]
    said: tuple[str, ...]  # each change in words: ``scheduler.params.warmup_num_steps 0 -> 1``
    refused: str | None = None  # DeepSpeed's refusal of the config without it, accepted with every mend
    inside: bool = True  # the release is inside the bug's range (else the refusal is the bug's fix)


@dataclass(frozen=True)
class ConfigRead:
    """The config for one world size: as written (``"auto"`` resolved, before the CPU adaptations; with ``mends``;
    the keys the release does not take, ``unknown``, taken out), as the release reads it (``values``: each key left
    out at its default), and DeepSpeed's refusal of it, if any (``Type: message``)."""

    written: dict[str, Any]
    values: dict[str, Any]
    refused: str | None = None
    mends: tuple[Mend, ...] = ()
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
    """The user's config as the installed release reads it, per world size (asked once, kept), and the mends that
    apply to it: each of a ``Mender`` (``menders``, noted at collection) whose premise the config meets."""

    def __init__(self, user: userconfig.UserConfig, cache_dir: Path, gloo: bool, size: int | None) -> None:
        """``size``: the world size to ask the release about now (None: nothing runs here, ask when asked)."""
        self.user, self.cache_dir, self.gloo = user, cache_dir, gloo
        self.menders: dict[str, Mender] = {}
        self.problems: list[str] = []
        self.healed: list[str] = []  # cached defaults that could not be used, read again: each said once
        self._read: dict[int, dict[tuple[str, ...], ConfigRead]] = {}  # per size, by the bugs whose mends it has
        self._probes = {} if size is None else {size: self._ask([self.written(size)], size)}

    def written(self, size: int) -> dict[str, Any]:
        return configs.resolve(self.user.config, SCAN_ID, size, "gloo").written

    def _ask(self, written: list[dict[str, Any]], size: int) -> defaults.DefaultsProbe:
        return defaults.start([ds_defaults.request(w, size) for w in written], self.cache_dir, self.gloo)

    def _answer(self, probe: defaults.DefaultsProbe, index: int, written: dict[str, Any]) -> ConfigRead:
        reading = probe.wait()[index]
        self.healed += [healed for healed in probe.healed if healed not in self.healed]
        if reading is None:
            if probe.problem and probe.problem not in self.problems:
                self.problems.append(probe.problem)
            return ConfigRead(written, written, None, defaults_known=False)
        written = ds_defaults.without(written, reading.unknown)
        if reading.refused is not None:
            return ConfigRead(written, written, reading.refused, defaults_known=False, unknown=reading.unknown)
        return ConfigRead(written, ds_defaults.merged(written, reading), None, unknown=reading.unknown)

    def read(self, size: int, bug: str | None = None) -> ConfigRead:
        """The config for a world of ``size`` as the scan judges ``bug`` with: with every mend that applies but the
        bug's own (its row is the bug as the config is written; several mending bugs: each with the others')."""
        readings = self._readings(size)
        return readings[tuple(m.bug for m in self.mends(size) if m.bug != bug)]

    def mends(self, size: int) -> tuple[Mend, ...]:
        """The mends the scan applies to the config for a world of ``size``, in the order the menders were noted."""
        return max(self._readings(size).values(), key=lambda read: len(read.mends)).mends

    def _readings(self, size: int) -> dict[tuple[str, ...], ConfigRead]:
        """The config as written, and mended: with every mend that applies, and, where several do, with each but
        one (that bug's row), all asked of the release in one probe."""
        if size not in self._read:
            written = self.written(size)
            probe = self._probes.pop(size, None) or self._ask([written], size)
            plain = self._answer(probe, 0, written)
            menders = [m for m in self.menders.values() if not plain.premise_problems(m.premise)
                       and (m.inside or plain.refused is not None)]  # fmt: skip
            readings, mends = self._mended(size, plain, menders)
            cured = {m.bug for m in mends if m.inside or m.refused is not None}
            if len(cured) < len(mends):  # a fix's refusal that its mend did not cure: judged without that mend
                readings, mends = self._mended(size, plain, [m for m in menders if m.bug in cured])
            self._read[size] = {bugs: dataclasses.replace(read, mends=tuple(m for m in mends if m.bug in bugs))
                                for bugs, read in readings.items()}  # fmt: skip
        return self._read[size]

    def _mended(self, size: int, plain: ConfigRead, menders: list[Mender]
                ) -> tuple[dict[tuple[str, ...], ConfigRead], list[Mend]]:  # fmt: skip
        """The config with every mend of ``menders``, and with each but one (that bug's row), asked of the release
        in one probe; each mend as applied."""
        rows = {tuple(m.bug for m in menders if m is not left) for left in menders}  # the others' mends
        wanted = sorted((rows | {tuple(m.bug for m in menders)}) - {()})
        mended = [_mended(plain.written, [self.menders[bug] for bug in bugs]) for bugs in wanted]
        probe = self._ask(mended, size)
        readings: dict[tuple[str, ...], ConfigRead] = {(): plain}
        readings.update((bugs, self._answer(probe, i, mended[i])) for i, bugs in enumerate(wanted))
        return readings, [_mend(mender, plain, readings) for mender in menders]

    def notes(self) -> list[str]:
        """What the scan did to the config as a whole, for the notes above its table: the keys the release does not
        know, taken out; each mend, in words with why; defaults that could not be read."""
        said = []
        for size, readings in self._read.items():
            said += taken_out(readings[()].unknown, str(installed_deepspeed()))
            mends = self.mends(size)
            said += [_said(mend, several=len(mends) > 1) for mend in mends]
        said += [f"{problem}: a key the config leaves out that DeepSpeed gives a default was not judged"
                 for problem in self.problems]  # fmt: skip
        return list(dict.fromkeys(said + self.healed))

    def close(self) -> None:
        """End a probe never read (the run ended first)."""
        for probe in self._probes.values():
            probe.close()
        self._probes.clear()


def taken_out(unknown: dict[str, str], release: str) -> list[str]:
    """The notes for the keys ``release`` does not take (``ReleaseReading.unknown``: key -> DeepSpeed's message), one
    per refusal: pydantic refuses every extra key of a section in one error, which names each key, so keys whose
    messages differ only by that name are said together, with the message once."""
    refusals: dict[str, list[str]] = {}
    for key, message in unknown.items():
        refusals.setdefault(message.replace(f": {key.rsplit('.', 1)[-1]}: ", ": ", 1), []).append(key)
    said = []
    for shared, keys in refusals.items():
        message, them = (unknown[keys[0]], "it") if len(keys) == 1 else (shared, "them")
        said.append(f"judged without {', '.join(keys)}: DeepSpeed {release} does not take {them} ({message}); no "
                    f"catalogued bug depends on {them}, and the rest of the config is judged")  # fmt: skip
    return said


def _mended(written: dict[str, Any], menders: list[Mender]) -> dict[str, Any]:
    """A copy of ``written`` with each of ``menders``' mends put in."""
    config = copy.deepcopy(written)
    for mender in menders:
        mender.premise.mended(config)
    return config


def _mend(mender: Mender, plain: ConfigRead, readings: dict[tuple[str, ...], ConfigRead]) -> Mend:
    """``mender``'s mend as the scan applies it (``readings``: the config with each set of mends, by their bugs): its
    changes in words, from the config as written; the refusal it cures, where DeepSpeed refuses the config of its
    row (without it) and accepts the config with every mend."""
    every = max(readings, key=len)
    row = readings[tuple(bug for bug in every if bug != mender.bug)]
    cured = row.refused if readings[every].refused is None else None
    said = mender.premise.mended(copy.deepcopy(plain.written))
    return Mend(mender.bug, mender.title, mender.premise.mend, tuple(said), cured, mender.inside)


def _said(mend: Mend, several: bool) -> str:
    """A mend, for the notes above the table: which keys, which bug, and why no other bug's body gets past it."""
    refused = scan_verdicts.refusal_line(mend.refused) if mend.refused is not None else None
    if refused is not None and not mend.inside:
        why = (f"DeepSpeed {installed_deepspeed()} refuses the config as written ({refused}), as the fix of the "
               f"known bug {mend.bug} ({mend.title}) does: on this release the config needs that change")  # fmt: skip
    elif refused is not None:
        why = (f"DeepSpeed {installed_deepspeed()} refuses the config as written ({refused}), which is the known "
               f"bug {mend.bug}")  # fmt: skip
    else:
        why = (f"on DeepSpeed {installed_deepspeed()} the config meets the known bug {mend.bug} ({mend.title}), which "
               "every other bug's body would meet before its own check")  # fmt: skip
    row = "with the other mends, not its own" if several else "as written"
    return (f"judged with {', '.join(mend.said)}: {why} (its row: {row}); every other bug is judged with that bug's "
            "fix on the config's side")  # fmt: skip


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


def _mender(item: pytest.Item, release: Version | None) -> Mender | None:
    """The repro as a ``Mender``, where its premise has a ``mend``: ``inside`` where ``release`` is in its affected
    range."""
    premise = markers.premise(item)
    if premise is None or not premise.mend or release is None:
        return None
    repro = _repro(item)
    return Mender(repro.id, repro.title, premise, inside=bool(affecting(markers.gates(item), release)))


def _plan(item: pytest.Item, user: dict[str, Any], reading: ScanConfig, told: dict[str, str]) -> ScanPlan:
    """A scanned test's plan, or its verdict decided now (``_decided``, no world): its premise judged on the config
    as the release reads it; a race's series skipped where a deterministic test of the same bug has told (``told``:
    which test, and what); the user's config with every mend that applies but the repro's own (``ScanConfig.read``),
    then the premise's ``removes`` and ``sets``, each said."""
    if "ds_config" not in getattr(item, "fixturenames", ()):
        _decided(item, Finding(ScanVerdict.CANNOT_TELL, "the repro builds its own config (no ds_config): a user's "
                                                        "config cannot be run through it"))  # fmt: skip
    marks = item.stash[MARKS_KEY]
    premise = marks.premise
    if premise is None:
        _decided(item, Finding(ScanVerdict.CANNOT_TELL, "the repro declares no ds_premise: what a config needs "
                                                        "for its bug is not known"))  # fmt: skip
    bug, size = _repro(item).id, marks.world.size if marks.world is not None else 1
    read = reading.read(size, bug)
    unmet = read.premise_problems(premise)  # the accelerator's premise: judged before, at the plugin's own setup
    if unmet:
        _decided(item, scan_verdicts.not_applicable(unmet))
    series = marks.nondeterministic
    if series is not None and bug in told:
        said = f"told by {told[bug]}: this race's series of {series.runs} worlds adds nothing"
        _decided(item, Finding(ScanVerdict.NOT_APPLICABLE, said))
    if read.refused is not None and not any(m.bug == bug and m.refused for m in reading.mends(size)):
        _decided(item, Finding(ScanVerdict.CANNOT_TELL, f"{scan_verdicts.REFUSED} [{SCAN_ID}]: {read.refused}"))
    config = ds_defaults.without(user, read.unknown)
    for key, value in (change for mend in read.mends for change in mend.changes):
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
        """A scan runs the catalogue's repros only: other tests collected beside them are deselected. The bugs
        among them that mend a config (a premise with ``mend``) are noted, for a config that meets their premise
        (outside their affected range only where DeepSpeed refuses it as their fix does)."""
        other = [item for item in items if not _scans(item)]
        if other:
            config.hook.pytest_deselected(items=other)
            items[:] = [item for item in items if _scans(item)]
        release = installed_deepspeed()
        for item in items:
            with contextlib.suppress(MarkerError):  # said at that test's setup
                mender = _mender(item, release)
                if mender is not None:
                    self.reading.menders.setdefault(mender.bug, mender)

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
