"""A ``deepspeed.initialize`` that fails part way leaves an engine whose destructor raises a second error.

When the engine's constructor raises (an optimizer type DeepSpeed does not know is refused by its sanity check, a
config it rejects), the half-built ``DeepSpeedEngine`` is collected and its ``__del__`` (added in 0.17.1) calls
``destroy()``, which reads attributes the constructor had not set yet: from 0.18.0 ``destroy`` asks
``is_deepcompile_active()``, which reads ``self._deepcompile_active``, set only after the sanity checks. So after the
real error Python prints ``Exception ignored in: <function DeepSpeedEngine.__del__>`` and a second traceback, an
AttributeError about DeepCompile that has nothing to do with the user's mistake (issue #7812). PR #7813 (first
released in 0.18.5) reads those attributes with defaults and keeps the destructor quiet.

Observed range: from 0.18.0. In 0.17.1 the destructor tripped over ``self.optimizer`` instead (PR #7410, fixed in
0.17.2, no release of this catalogue's list between); from 0.17.2 to 0.17.6 ``destroy`` asked
``is_deepcompile_enabled()``, which reads the config, set first, so the destructor passed.
"""

import pytest

from pytest_dsrepro.inrank.models import tiny_mlp

pytestmark = [
    pytest.mark.ds_repro(
        id="engine-failed-initialize-destructor",
        title="A failed deepspeed.initialize: the half-built engine's destructor raises a misleading AttributeError",
        upstream="https://github.com/deepspeedai/DeepSpeed/issues/7812",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/7813",
        fixed_in="0.18.5",
        root_cause="DeepSpeedEngine.__del__ calls destroy(), which read attributes (_deepcompile_active) the "
        "constructor sets only after the checks that can fail.",
    ),
    pytest.mark.ds_premise(),
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/issues/7812",
        raises="AttributeError",
        match=r"'DeepSpeedEngine' object has no attribute '_deepcompile_active'",
        frames=("engine.py:__del__", "engine.py:destroy", "engine.py:is_deepcompile_active"),
        words=("Exception ignored in", "DeepSpeedEngine.__del__"),
    ),
]

CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}


def quiet_destructor(monkeypatch):
    """Backport of PR #7813: ``destroy`` reads what the constructor may not have set with defaults, and ``__del__``
    swallows what a half-built engine still raises."""
    import contextlib

    from deepspeed.runtime.engine import DeepSpeedEngine

    from pytest_dsrepro.inrank.backport import release_has

    if not hasattr(DeepSpeedEngine, "__del__") or release_has(DeepSpeedEngine.__del__, "except Exception as exc:"):
        return  # no destructor (before 0.17.1), or this release has the fix

    def __del__(self):
        with contextlib.suppress(Exception):  # what upstream's __del__ logs at debug level and drops
            self.destroy()

    monkeypatch.setattr(DeepSpeedEngine, "__del__", __del__)
    if hasattr(DeepSpeedEngine, "is_deepcompile_active"):
        monkeypatch.setattr(
            DeepSpeedEngine, "is_deepcompile_active", lambda self: getattr(self, "_deepcompile_active", False)
        )


@pytest.mark.ds_config(pytest.param(CONFIG, id="zero0_unknown_optimizer"))
@pytest.mark.ds_version(
    affected=">=0.18.0,<0.18.5",
    raises=AssertionError,
    match=r"destructor raised AttributeError: 'DeepSpeedEngine' object has no attribute '_deepcompile_active'",
    fix=quiet_destructor,
)
def test_failed_initialize_raises_once(ds_config):
    import gc
    import sys

    import deepspeed

    # The user's mistake: an optimizer type DeepSpeed does not know (a typo), refused inside the engine's constructor.
    config = {**ds_config, "optimizer": {"type": "AdamWW", "params": {"lr": 1e-3}}}
    ignored = []
    hook, sys.unraisablehook = sys.unraisablehook, ignored.append  # what Python prints as "Exception ignored in"
    try:
        with pytest.raises(Exception, match="AdamWW") as refused:
            deepspeed.initialize(model=tiny_mlp(seed=1), config=config)
        del refused  # its traceback holds the half-built engine
        gc.collect()
    finally:
        sys.unraisablehook = hook
    for event in ignored:
        assert event.exc_value is None, (
            f"the failed initialize left an engine whose destructor raised {type(event.exc_value).__name__}: "
            f"{event.exc_value} (in {event.object!r})"
        )
