"""``--ds-scan CONFIG``: a user's DeepSpeed config run through the catalogue, on the pytest side, as a plugin object
of its own: this module is a pytest plugin of its own (the entry point ``dsrepro-scan``), which registers ``Scan`` only
for a scan. The rest of the plugin knows nothing of it: the scan answers the plugin's own hooks
(``plugin.HookSpecs``) and pytest's.

At configure the config is read and checked (``core.userconfig``: a usage error naming file:line:col or the key,
before anything starts). At collection each catalogued repro (a test with ``ds_repro``) gets one test id, ``[scan]``,
whose ``ds_config`` is the user's config; its own config ids and its ``[fixed]`` variant are not made, and tests
that are no repro are deselected. At setup the repro's ``ds_premise`` is judged on the config as written (``"auto"``
resolved for the world, before the CPU adaptations): a config that cannot meet it is NOT APPLICABLE with the
premise's words and no world; else the premise's ``sets`` go on top of the config, each said. After the body the
gates' judgement becomes the scan's verdict (``core.scan_verdicts.finding``), which decides the pytest outcome:
AFFECTED and CANNOT TELL fail, NOT AFFECTED passes, NOT APPLICABLE skips. Each test's record carries its finding; the
run's record names the config, and its terminal summary and ``--ds-report`` are the scan's table.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, NoReturn

import pytest

from ..core import configs, results, scan_verdicts, userconfig
from ..core.gates import Judgement, Reason, installed_deepspeed
from ..core.results import Finding, RunRecord, ScanSource, ScanVerdict, TestRecord
from ..worlds.device_nodes import gpu_device_nodes
from .execution import PREPARED_KEY
from .markers import MARKS_KEY
from .parametrize import give_config
from .rank_job import Prepared
from .recording import RecordedTests, Summary
from .settings import SETTINGS_KEY
from .verdicts import JUDGEMENT_KEY, fail

#: The test id of a repro's one scanned test.
SCAN_ID = "scan"
#: The name ``Scan`` registers under: not the entry point's, which pytest gives this module itself.
REGISTERED_AS = "dsrepro-scan-run"


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
    config.pluginmanager.register(Scan(user), REGISTERED_AS)


def _accelerator(prepared: Prepared) -> str:
    return "cuda" if prepared.backend == "nccl" else "cpu"


def _fixed_in(item: pytest.Item) -> str | None:
    mark = item.get_closest_marker("ds_repro")
    value = mark.kwargs.get("fixed_in") if mark is not None else None
    return None if value is None else str(value)


def _decided(item: pytest.Item, found: Finding) -> NoReturn:
    item.stash[FINDING_KEY] = found
    raise pytest.skip.Exception(f"{found.verdict.value}: {found.detail}")


class Scan:
    """This run's scan of one user config, registered for its hooks."""

    def __init__(self, user: userconfig.UserConfig) -> None:
        self.user = user

    @staticmethod
    def scans(node: pytest.Item) -> bool:
        """Is ``node`` (a test or a test function's definition) a repro, which a scan runs?"""
        return node.get_closest_marker("ds_repro") is not None

    def finding(self, item: pytest.Item, judgement: Judgement | None, error: str | None) -> Finding | None:
        """A scanned test's verdict for its record: decided at setup, else from the gates' judgement; a test that was
        never judged (a skip in the body, a missing extra, a marker error) is CANNOT TELL, with what it said."""
        if not self.scans(item):
            return None
        decided = item.stash.get(FINDING_KEY, None)
        if decided is not None:
            return decided
        plan = item.stash.get(PLAN_KEY, None)
        notes = plan.notes if plan is not None else ()
        if judgement is None:
            return Finding(ScanVerdict.CANNOT_TELL, error or "it did not run", notes)
        return scan_verdicts.finding(
            judgement.reason, judgement.message, fixed_in=_fixed_in(item), rate=judgement.rate, notes=notes
        )

    # ---- pytest's hooks -----------------------------------------------------------------------------------------

    @pytest.hookimpl(tryfirst=True)  # before the plugin's own expansion, which a test given its config skips
    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        """One ``[scan]`` test id whose ``ds_config`` is the user's config, in place of the repro's own configs and
        variants."""
        if self.scans(metafunc.definition):
            give_config(metafunc, SCAN_ID, self.user.config)

    @pytest.hookimpl(tryfirst=True)  # before --ds-shard picks its share
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        """A scan runs the catalogue's repros only: other tests collected beside them are deselected."""
        other = [item for item in items if not self.scans(item)]
        if other:
            config.hook.pytest_deselected(items=other)
            items[:] = [item for item in items if self.scans(item)]

    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        """Judge the premise on the user's config; no world for a config that cannot meet it. After the plugin's
        own setup (tryfirst: the markers, the world's backend), before the fixtures (``ds_config`` reads the plan):
        this object registers after pytest's own plugins, whose hooks run after those registered later."""
        if not self.scans(item):
            return
        if "ds_config" not in getattr(item, "fixturenames", ()):
            _decided(item, Finding(ScanVerdict.CANNOT_TELL, "the repro builds its own config (no ds_config): a user's "
                                                            "config cannot be run through it"))  # fmt: skip
        premise = item.stash[MARKS_KEY].premise
        if premise is None:
            _decided(item, Finding(ScanVerdict.CANNOT_TELL, "the repro declares no ds_premise: what a config needs "
                                                            "for its bug is not known"))  # fmt: skip
        marks, prepared = item.stash[MARKS_KEY], item.stash.get(PREPARED_KEY, None)
        size = marks.world.size if marks.world is not None else 1
        written = configs.resolve(self.user.config, SCAN_ID, size, prepared.backend if prepared else "gloo").written
        unmet = list(premise.unmet(written))
        if premise.accelerator and prepared is not None and premise.accelerator != _accelerator(prepared):
            unmet.append(f"needs the {premise.accelerator} accelerator; these worlds use {_accelerator(prepared)}")
        if unmet:
            _decided(item, scan_verdicts.not_applicable(unmet))
        config = copy.deepcopy(self.user.config)
        item.stash[PLAN_KEY] = ScanPlan(config, tuple(premise.apply(config)))

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
        return None if found is None else dataclasses.replace(record, scan=found)

    def pytest_dsrepro_run_record(self, record: RunRecord) -> RunRecord:
        """The run's record names the config it scanned."""
        return dataclasses.replace(record, scan=ScanSource(self.user.path, self.user.config, self.user.notes))

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
