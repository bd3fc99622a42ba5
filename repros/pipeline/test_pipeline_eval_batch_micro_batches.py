"""Pipeline ``eval_batch(num_micro_batches=n)`` runs the configured number of micro-batches, not ``n``.

``PipelineEngine.eval_batch`` takes ``num_micro_batches`` and uses it to average the losses, but builds its
``InferenceSchedule`` with ``self.micro_batches`` (the config's ``gradient_accumulation_steps``). So an evaluation of
fewer micro-batches than the accumulation steps pulls ``gradient_accumulation_steps`` batches from the iterator (a
``StopIteration`` where the data runs out; with a ``RepeatingLoader``, batches the next evaluation should have read),
and returns their summed loss divided by ``n``: with 2 accumulation steps and ``num_micro_batches=1``, about twice
the loss of the batch the user asked about. PR #6484 (first in 0.15.2) builds the schedule with ``micro_batches``.
"""

import pytest
from _pipeline import PIPELINE_ACCUMULATION, PIPELINE_WORLD, batches, layers, pipeline_engine, pipeline_premise

pytestmark = [
    PIPELINE_WORLD,
    pytest.mark.ds_repro(
        id="pipeline-eval-batch-micro-batches",
        title="Pipeline eval_batch ignores num_micro_batches: runs the configured micro-batches, loss divided by n",
        upstream="https://github.com/deepspeedai/DeepSpeed/pull/6484",
        fix_ref="https://github.com/deepspeedai/DeepSpeed/pull/6484",
        fixed_in="0.15.2",
        root_cause="eval_batch builds its InferenceSchedule with self.micro_batches instead of the micro_batches it "
        "derived from num_micro_batches, which it still uses to average the losses.",
    ),
    pipeline_premise(stage=(0, 1), gradient_accumulation=">=2"),
]

#: How users meet this bug besides the gate's message: evidence for `dsrepro triage`, never a gate.
pytestmark += [
    pytest.mark.ds_seen(
        "https://github.com/deepspeedai/DeepSpeed/pull/6484",
        words=("eval_batch", "num_micro_batches"),
    ),
]


def schedule_the_requested_micro_batches(monkeypatch):
    """PR #6484: the inference schedule runs the micro-batches eval_batch was asked for."""
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from pytest_dsrepro.inrank.backport import backport, release_has

    if not release_has(PipelineEngine.eval_batch, "micro_batches=self.micro_batches,"):
        return
    backport(
        monkeypatch,
        "deepspeed.runtime.pipe.engine",
        [(r"InferenceSchedule\(micro_batches=self\.micro_batches,", "InferenceSchedule(micro_batches=micro_batches,")],
    )


@pytest.mark.ds_config(pytest.param(PIPELINE_ACCUMULATION, id="pipe2_ga2"))
@pytest.mark.ds_version(
    affected="<0.15.2",
    raises=AssertionError,
    match="eval_batch evaluated other micro-batches than it was asked for",
    fix=schedule_the_requested_micro_batches,
)
def test_eval_batch_of_one_micro_batch(ds_config, ds_world_size):
    import torch
    from deepspeed.utils import RepeatingLoader

    engine = pipeline_engine(ds_config, ds_world_size, seed=6, lr=0.1)
    data = batches({**ds_config, "gradient_accumulation_steps": 2 * ds_config["gradient_accumulation_steps"]})
    # The user's evaluation loop: a loader that repeats, one micro-batch per evaluation.
    loader = iter(RepeatingLoader(data))
    losses = [engine.eval_batch(loader, num_micro_batches=1).item() for _ in range(2)]

    reference = torch.nn.Sequential(*layers(6)).to(data[0][0].device)
    with torch.no_grad():
        expected = [torch.nn.functional.mse_loss(reference(x), y).item() for x, y in data[:2]]
    assert losses == pytest.approx(expected, rel=1e-5), (
        "eval_batch evaluated other micro-batches than it was asked for: the losses of two evaluations of one "
        f"micro-batch each are {losses}, those of the first two micro-batches {expected}"
    )
