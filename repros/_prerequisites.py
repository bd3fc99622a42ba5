"""Fixes of bugs that other repros need applied first, shared by import (not a test module).

Entry ``zero12-cpu-flat-buffer-view`` (``test_zero12_cpu_flat_buffer_view.py``) breaks the first ``step()`` of every
ZeRO-1/2 engine on the CPU accelerator in DeepSpeed 0.18.7-0.18.9, so any other ZeRO-1/2 repro would only see that
error there. Those repros carry ``ZERO12_CPU_FLAT_BUFFER`` (a ``ds_prerequisite`` marker): on those releases the
fix below is applied in every rank before their body, and their verdict says so. Likewise
``PERSISTENT_ALLGATHER_RACE`` (entry ``zero3-persistent-allgather-race``, before 0.19.8) for ZeRO-3 repros that read
persistent parameters after ``step()``; ``PIPELINE_NESTED_BACKWARD`` (entry ``pipeline-nested-backward``,
0.18.3-0.18.4) for pipelines of several stages; ``PIPELINE_GRADIENTS_SUMMED`` and ``PIPELINE_GRADIENTS_SCALED_TWICE``
(entries ``pipeline-gradient-accumulation-summed``, 0.16.0-0.18.2, and ``pipeline-gradient-scaled-twice``,
0.18.3-0.19.2) for pipelines with gradient accumulation, each the other's; ``COMM_DTYPE_BUCKET`` (entry
``zero2-bf16-fp32-comm-bucket``, 0.17.2-0.18.0) for ZeRO-1/2 repros reducing in another dtype. ``ZERO3_PARTITIONED``
is the premise the ZeRO-3 repros of a tiny model share. ``BF16_ZERO1_OPTIMIZER`` (entry
``bf16-zero1-fp32-accum-wrong-optimizer``, 0.17.6-0.18.4, whose fix it is) for repros of ``BF16_Optimizer`` under
ZeRO-1 with fp32 gradient accumulation. ``ZERO2_OFFLOAD_ACCUMULATION`` (entry ``zero2-offload-accumulation``,
0.15.2-0.18.9, whose fix it is) for ZeRO-1/2 repros whose weight check a scanned config with the optimizer offloaded
and 3 or more micro-steps would meet.

pytest imports ``repros/conftest.py`` (no ``__init__.py``) with ``repros/`` put first on ``sys.path`` (its default
``prepend`` import mode), and ranks get the pytest process's ``sys.path``: so ``from _prerequisites import ...``
works in both, from a repro in any folder of ``repros/``, and the fix pickles by reference (module
``_prerequisites``).
"""

from __future__ import annotations

from typing import Any

import pytest

#: The releases with PR #7828's on-device flatten and without PR #7948's ``.detach()``.
FLAT_BUFFER_VIEW_RELEASES = ">=0.18.7,<0.19.0"


def detach_flat_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """PR #7948's fix: the flat buffers ZeRO-1/2 builds are detached from autograd.

    PR #7828 (0.18.7) flattens the parameters on the device with ``torch.cat`` over ``requires_grad`` parameters, so
    the buffer and the per-parameter views cut from it carry autograd history, and the optimizer's in-place writes
    into those views raise. Upstream adds ``.detach()`` to that one call; here the method that builds every flat
    buffer detaches its result, which changes nothing for the others (they have no history) and costs nothing, where
    a source backport of ``__init__`` costs more than a second per rank. A no-op before 0.18.7 (parameters
    flattened on the CPU) and from 0.19.0 (fixed, the flag renamed with it).
    """
    import functools

    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from pytest_dsrepro.inrank.backport import release_has

    if not release_has(DeepSpeedZeroOptimizer.__init__, "flatten_on_gpu"):
        return
    flatten = DeepSpeedZeroOptimizer.flatten_dense_tensors_aligned

    @functools.wraps(flatten)
    def flatten_detached(self: Any, *args: Any, **kwargs: Any) -> Any:
        return flatten(self, *args, **kwargs).detach()

    monkeypatch.setattr(DeepSpeedZeroOptimizer, "flatten_dense_tensors_aligned", flatten_detached)


#: For ZeRO-1/2 repros: on 0.18.7-0.18.9 their body runs with ``detach_flat_buffer`` applied, and the verdict says so.
ZERO12_CPU_FLAT_BUFFER = pytest.mark.ds_prerequisite(
    fix=detach_flat_buffer,
    releases=FLAT_BUFFER_VIEW_RELEASES,
    reason="zero12-cpu-flat-buffer-view (PR #7948): every ZeRO-1/2 step on the CPU accelerator fails there first",
)


def wait_on_every_handle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Backport of PR #8539 (entry ``zero3-persistent-allgather-race``): a blocking ZeRO-3 gather of several
    parameters (the re-gather of persistent parameters after ``step()``, ``GatheredParameters`` over a list) waits on
    every launched all-gather, not only the last one (on gloo they complete in any order). A no-op from 0.19.8."""
    from deepspeed.runtime.zero import partition_parameters

    from pytest_dsrepro.inrank.backport import backport, release_has

    if not release_has(partition_parameters.Init._allgather_params_coalesced, "launch_handles[-1].wait()"):
        return  # this release has the fix
    backport(
        monkeypatch,
        "deepspeed.runtime.zero.partition_parameters",
        [(r"launch_handles\[-1\]\.wait\(\)", "for handle in launch_handles:\n            handle.wait()")],
    )


#: For ZeRO-3 repros that read or load several parameters gathered at once (persistent ones after ``step()``, a
#: ``GatheredParameters`` list): before 0.19.8 the gathers are waited for properly (the race is its own entry), and
#: the verdict says so.
PERSISTENT_ALLGATHER_RACE = pytest.mark.ds_prerequisite(
    fix=wait_on_every_handle,
    releases="<0.19.8",
    reason="zero3-persistent-allgather-race (PR #8539): parameters gathered together can be read half-gathered",
)


def load_without_weights_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """PR #6751's effect (0.16.0): DeepSpeed's ``torch.load`` calls (checkpoint engine, ``zero_to_fp32``,
    ``ds_to_universal``) load full pickles. Before it they pass no ``weights_only``, which torch >= 2.6 turns on, and
    DeepSpeed's own checkpoints (optimizer state, parameter shapes) are refused. torch's own switch for calls that
    do not choose, ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``, gives them back the old default. A no-op from 0.16.0."""
    from deepspeed.runtime.checkpoint_engine import torch_checkpoint_engine

    from pytest_dsrepro.inrank.backport import release_has

    if not release_has(torch_checkpoint_engine, "weights_only"):
        monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")


#: For repros that load DeepSpeed checkpoints: before 0.16.0 torch (2.13 here) refuses them, whatever the bug.
TORCH_LOAD_WEIGHTS_ONLY = pytest.mark.ds_prerequisite(
    fix=load_without_weights_only,
    releases="<0.16.0",
    reason="PR #6751: before 0.16.0 DeepSpeed's torch.load calls are refused by torch >= 2.6's weights_only default",
)


def zero3_partitioned_premise(**requirements: Any) -> pytest.MarkDecorator:
    """The ``ds_premise`` of a ZeRO-3 repro whose tiny model must be partitioned as the repro runs it:
    ``requirements`` of its own on top of ZeRO-3, and what a scan sets for it, and why."""
    return pytest.mark.ds_premise(
        stage=3,
        **requirements,
        sets={"zero_optimization.stage3_param_persistence_threshold": 0, "zero_force_ds_cpu_optimizer": False},
        because="every parameter partitioned, as the repro runs: under a user's threshold the tiny model's "
        "parameters would all be persistent, gathered by a path that races on gloo before 0.19.8 "
        "(zero3-persistent-allgather-race); and where the config names no optimizer the body trains with torch's "
        "Adam, which DeepSpeed refuses beside an offloaded optimizer unless told",
    )


#: The premise of ZeRO-3 repros whose tiny model must be partitioned as the repro runs it (``ds_premise``).
ZERO3_PARTITIONED = zero3_partitioned_premise()


def flag_pipeline_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """PR #7787's fix (entry ``pipeline-nested-backward``): the pipeline engine's backward on a stage before the last
    runs flagged as the engine's own, so the output hooks of PR #7665 (0.18.3) take it for ``engine.backward`` and do
    not refuse it as a direct ``tensor.backward()``. The flag is set and cleared around the method (the last stage's
    ``engine.backward`` clears it itself), which the engine's schedule finds in ``_INSTRUCTION_MAP``, not by name. A
    no-op before 0.18.3 (no such hooks) and from 0.18.5 (fixed)."""
    import functools

    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.pipe import schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from pytest_dsrepro.inrank.backport import release_has

    if not hasattr(DeepSpeedEngine, "_backward_prologue_per_tensor"):
        return  # PR #7665's hooks are not in this release
    backward_pass = PipelineEngine._exec_backward_pass
    if release_has(backward_pass, "_running_engine_backward"):
        return

    @functools.wraps(backward_pass)
    def flagged_backward_pass(self: Any, buffer_id: int) -> None:
        self._running_engine_backward = True
        try:
            backward_pass(self, buffer_id)
        finally:
            self._running_engine_backward = False

    monkeypatch.setitem(PipelineEngine._INSTRUCTION_MAP, schedule.BackwardPass, flagged_backward_pass)


#: The releases whose pipeline engine refuses its own backward on stages before the last (PR #7665 to PR #7787).
PIPELINE_BACKWARD_RELEASES = ">=0.18.3,<0.18.5"

#: For pipeline repros of several stages: on 0.18.3-0.18.4 their body runs with ``flag_pipeline_backward`` applied.
PIPELINE_NESTED_BACKWARD = pytest.mark.ds_prerequisite(
    fix=flag_pipeline_backward,
    releases=PIPELINE_BACKWARD_RELEASES,
    reason="pipeline-nested-backward (PR #7787): every stage before the last fails its first backward there",
)


#: The releases whose bucket-full path looks the bucket up by the parameter's dtype (PR #6993 to PR #7636).
COMM_BUCKET_RELEASES = ">=0.17.2,<0.18.1"


def report_every_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    """PR #7636's fix (entry ``zero2-bf16-fp32-comm-bucket``): the bucket-full path reports every bucket. Its only
    callers with a dtype are the two calls the PR changes, so ZeRO-1/2's ``report_ipg_memory_usage`` ignoring the
    argument does what the PR does."""
    import functools

    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from pytest_dsrepro.inrank.backport import release_has

    if not release_has(
        DeepSpeedZeroOptimizer.reduce_independent_p_g_buckets_and_remove_grads, "param.numel(), param.dtype)"
    ):
        return  # before 0.17.2 (one bucket, no dtype argument) or from 0.18.1 (fixed)
    report = DeepSpeedZeroOptimizer.report_ipg_memory_usage

    @functools.wraps(report)
    def report_all(self: Any, tag: str, param_elems: int, dtype: Any = None) -> None:
        report(self, tag, param_elems)

    monkeypatch.setattr(DeepSpeedZeroOptimizer, "report_ipg_memory_usage", report_all)


#: For ZeRO-1/2 repros whose gradients are reduced in another dtype than the parameters' and overflow a bucket.
COMM_DTYPE_BUCKET = pytest.mark.ds_prerequisite(
    fix=report_every_bucket,
    releases=COMM_BUCKET_RELEASES,
    reason="zero2-bf16-fp32-comm-bucket (PR #7636): a bucket-full report there raises KeyError first",
)


def scale_pipeline_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    """The effect of PR #7665 (0.18.3) on entry ``pipeline-gradient-accumulation-summed``: the pipeline engine's loss
    is divided by the accumulation steps again. PR #6675 (0.16.0) scales the loss only when the engine reduces
    gradients in ``backward`` (``enable_backward_allreduce``), which the pipeline engine turns off because it reduces
    them itself; PR #7665 moved the scaling into output hooks that no longer ask. Here the scaling condition (in
    ``backward``, from 0.17 in ``_backward_prologue``) also holds for a pipeline; the reduction's does not change. A
    no-op before 0.16.0 (no condition) and from 0.18.3 (no such line)."""
    from deepspeed.runtime import engine

    from pytest_dsrepro.inrank.backport import backport, release_has

    condition = r"if do_gradient_reduction and self\.gradient_accumulation_steps\(\) > 1 and scale_wrt_gas:"
    if not release_has(engine, "if do_gradient_reduction and self.gradient_accumulation_steps() > 1"):
        return
    backport(
        monkeypatch,
        "deepspeed.runtime.engine",
        [
            (
                condition,
                "if (do_gradient_reduction or self.pipeline_parallelism) and self.gradient_accumulation_steps() > 1 "
                "and scale_wrt_gas:",
            )
        ],
    )


#: The releases whose pipeline engine sums its micro-batches' gradients (PR #6675 to PR #7665).
PIPELINE_SUMMED_RELEASES = ">=0.16.0,<0.18.3"

#: For pipeline repros with gradient accumulation that check values on 0.16.0-0.18.2.
PIPELINE_GRADIENTS_SUMMED = pytest.mark.ds_prerequisite(
    fix=scale_pipeline_loss,
    releases=PIPELINE_SUMMED_RELEASES,
    reason="pipeline-gradient-accumulation-summed (issue #7773): every stage's gradient is a sum there, not a mean",
)


def scale_on_last_stage_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Backport of PR #8154 (entry ``pipeline-gradient-scaled-twice``): the pipeline engine's output hook scales by the
    accumulation steps on the last stage only. A no-op before 0.18.3 (the loss is scaled, no hook) and from 0.19.3
    (the pipeline engine has its own)."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.pipe.engine import PipelineEngine

    if not hasattr(DeepSpeedEngine, "_backward_prologue_per_tensor"):
        return
    if "_backward_prologue_per_tensor" in vars(PipelineEngine):
        return
    scale = DeepSpeedEngine._backward_prologue_per_tensor

    def scale_on_last_stage(self: Any, grad: Any) -> Any:
        return scale(self, grad) if self.is_last_stage() else grad

    monkeypatch.setattr(PipelineEngine, "_backward_prologue_per_tensor", scale_on_last_stage)


#: The releases whose stages before the last divide their gradients twice (PR #7665 to PR #8154).
PIPELINE_SCALED_TWICE_RELEASES = ">=0.18.3,<0.19.3"

#: For pipeline repros with gradient accumulation that check values on 0.18.3-0.19.2.
PIPELINE_GRADIENTS_SCALED_TWICE = pytest.mark.ds_prerequisite(
    fix=scale_on_last_stage_only,
    releases=PIPELINE_SCALED_TWICE_RELEASES,
    reason="pipeline-gradient-scaled-twice (PR #8154): stages before the last divide their gradients twice there",
)


def distinct_ddp_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """PR #7788's fix, as entry ``bf16-zero1-fp32-accum-wrong-optimizer`` backports it: ``DDP_BFLOAT16`` gets its own
    value (the engine compares its module globals), and ``BF16_Optimizer`` gets the loss-scaling attributes the base
    class reads, with no loss scaler to call. A no-op before 0.17.6 (no ``DDP_BFLOAT16``) and from 0.18.5."""
    from deepspeed.runtime import base_optimizer, constants, engine
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    from pytest_dsrepro.inrank.backport import backport

    if getattr(constants, "DDP_BFLOAT16", None) != constants.BFLOAT16:
        return
    monkeypatch.setattr(engine, "DDP_BFLOAT16", "ddp_bf16")
    no_loss_scaling = {"custom_loss_scaler": False, "external_loss_scale": None, "torch_autocast_gradscaler": None}
    for name, value in no_loss_scaling.items():
        monkeypatch.setattr(BF16_Optimizer, name, value, raising=False)
    if hasattr(base_optimizer.ZeROOptimizer, "scale_if_loss"):  # 0.18.3 on: engine.backward calls it for ZeRO
        backport(
            monkeypatch,
            "deepspeed.runtime.base_optimizer",
            [
                (
                    r"\n(\s+)return self\.loss_scaler\.scale_loss\(value\)",
                    r'\n\1if getattr(self, "loss_scaler", None) is not None:'
                    r"\n\1    return self.loss_scaler.scale_loss(value)",
                )
            ],
        )


#: For repros of ``BF16_Optimizer`` under ZeRO-1: on 0.17.6-0.18.4 their body runs with ``distinct_ddp_bf16``.
BF16_ZERO1_OPTIMIZER = pytest.mark.ds_prerequisite(
    fix=distinct_ddp_bf16,
    releases=">=0.17.6,<0.18.5",
    reason="bf16-zero1-fp32-accum-wrong-optimizer (PR #7788): the config gets FP16_UnfusedOptimizer there, not "
    "BF16_Optimizer",
)


#: The releases whose ZeRO-2 CPU accumulation buffer keeps micro-batch 0's gradient alone (PR #6550 to PR #7967).
OFFLOAD_ACCUMULATION_RELEASES = ">=0.15.2,<0.19.0"


def keep_the_running_sum(monkeypatch: pytest.MonkeyPatch) -> None:
    """Backport of PR #7967: the accumulated gradient goes back to the CPU buffer on every micro-step."""
    import inspect
    import re

    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from pytest_dsrepro.inrank.backport import backport

    pattern = r"\n(\s*)else:\n\s*(copy_gradients_to_cpu\(\))"  # "else:" and its call become the call alone
    if not re.search(pattern, inspect.getsource(DeepSpeedZeroOptimizer.async_accumulate_grad_in_cpu_via_gpu)):
        return  # before 0.15.2 (another condition) or from 0.19.0 (fixed)
    backport(monkeypatch, "deepspeed.runtime.zero.stage_1_and_2", [(pattern, r"\n\1\2")])


#: For ZeRO-1/2 repros that compare weights with plain training: a scanned config with the optimizer offloaded and 3
#: or more micro-steps would show that bug's dropped gradients first.
ZERO2_OFFLOAD_ACCUMULATION = pytest.mark.ds_prerequisite(
    fix=keep_the_running_sum,
    releases=OFFLOAD_ACCUMULATION_RELEASES,
    reason="zero2-offload-accumulation (PR #7967): with the optimizer offloaded and 3 or more micro-steps ZeRO-2 drops "
    "micro-batch gradients, so the weights differ from plain training first",
)
