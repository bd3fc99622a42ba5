"""``deepspeed.comm``'s communication logger keeps logging after ``stop_profiling_comms()``.

With ``"comms_logger": {"enabled": true}`` in the config, every collective that ``deepspeed.comm`` runs while the
logger's ``prof_all`` flag is set is timed (the op is made blocking for it) and recorded for ``log_summary()``.
``CommsLogger.start_profiling_comms()`` sets the flag, and ``stop_profiling_comms()``, meant to end the profiled
window, set it to ``True`` as well: since the logger's first version (PR #2012) global profiling could never be
turned off, so a run that profiles a few steps keeps paying for blocking, timed collectives and the summary counts
every step after the window. PR #8137 sets the flag to ``False`` (first released in 0.19.3).
"""

import pytest

from pytest_dsrepro.inrank.devices import precision_dtype
from pytest_dsrepro.inrank.models import make_batch, tiny_mlp

pytestmark = [
    pytest.mark.ds_repro(
        id="comms-logger-stop-profiling",
        title="CommsLogger.stop_profiling_comms() leaves global comm profiling on: collectives still logged",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/8137",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/8137",
        fixed_in="0.19.3",
        root_cause="stop_profiling_comms() set prof_all = True, the value start_profiling_comms() sets, so the flag "
        "that makes deepspeed.comm time and record every collective could not be cleared.",
    ),
    pytest.mark.ds_premise(config={"comms_logger.enabled": True}),
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/blob/v0.18.0/deepspeed/utils/comms_logging.py#L93",
        words=("stop_profiling_comms", "comms_logger", "prof_all", "log_summary"),
    ),
]

#: A plain data-parallel engine (its gradient all-reduce goes through ``deepspeed.comm``) with the logger on.
ZERO0_COMMS_LOGGER = {
    "zero_optimization": {"stage": 0},
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "comms_logger": {"enabled": True, "prof_all": True},
}


def clear_prof_all_on_stop(monkeypatch):
    """Backport of PR #8137: ``stop_profiling_comms`` clears ``prof_all``."""
    from deepspeed.utils.comms_logging import CommsLogger

    from pytest_dsrepro.inrank.backport import backport, release_has

    if release_has(CommsLogger.stop_profiling_comms, "self.prof_all = False"):
        return  # this release has the fix
    backport(
        monkeypatch,
        "deepspeed.utils.comms_logging",
        [(r"(def stop_profiling_comms\(self\):\n\s+self\.prof_all = )True", r"\1False")],
    )


def logged_ops(comms_logger):
    """How many collectives the logger has recorded so far, over every op and message size."""
    return sum(record[0] for sizes in comms_logger.comms_dict.values() for record in sizes.values())


@pytest.mark.ds_config(pytest.param(ZERO0_COMMS_LOGGER, id="zero0_comms_logger"))
@pytest.mark.ds_version(
    affected="<0.19.3",
    raises=AssertionError,
    match=r"kept recording collectives after stop_profiling_comms\(\)",
    fix=clear_prof_all_on_stop,
)
def test_stop_profiling_comms_stops_logging(ds_engine, ds_config, ds_rank):
    import deepspeed.comm as dist
    import torch

    engine = ds_engine(model=tiny_mlp(seed=4), optimizer="adam")

    def step(seed):
        """One optimizer step: the config's accumulation of micro-steps (ZeRO reduces at the boundary only)."""
        x, y = make_batch(
            ds_config["train_micro_batch_size_per_gpu"], seed=seed, rank=ds_rank, dtype=precision_dtype(ds_config)
        )
        for _ in range(engine.gradient_accumulation_steps()):
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            engine.step()

    step(seed=0)
    profiled = logged_ops(dist.comms_logger)
    assert profiled > 0, "the profiled step logged no collective: the logger is not in effect"

    dist.comms_logger.stop_profiling_comms()
    step(seed=1)
    after = logged_ops(dist.comms_logger) - profiled
    assert after == 0, (
        f"the logger kept recording collectives after stop_profiling_comms(): {after} in the next step "
        f"(prof_all={dist.comms_logger.prof_all}; {profiled} recorded before)"
    )
