"""What the AutoTP training repros share (not a test module): the fix that lets AutoTP training run on the CPU
accelerator before 0.18.0, declared as their prerequisite. Imported as ``_autotp``.
"""

from __future__ import annotations

from typing import Any

import pytest

#: PR #7600's edits: a device by name (``"cpu"``, ``"cuda:0"``), never the CPU accelerator's ``LOCAL_RANK`` string.
BY_NAME = "torch.device(get_accelerator().current_device_name())"


def utils_edits_by_name() -> list[tuple[str, str]]:
    """PR #7600's edit of ``compare_tensors_in_structures`` (``deepspeed.runtime.utils``) where the installed release
    needs it, else none: a fix that edits that function again carries it along (``backport`` starts from the installed
    source, and a repro's own fix is applied after its prerequisites)."""
    from deepspeed.runtime import utils

    from pytest_dsrepro.inrank.backport import release_has

    if not release_has(utils, "val1 = val1.to(get_accelerator().current_device())"):
        return []
    return [(r"\.to\(get_accelerator\(\)\.current_device\(\)\)", f".to({BY_NAME})")]


def cpu_device_by_name(monkeypatch: Any) -> None:
    """PR #7600 (first in 0.18.0): AutoTP training's check that the tensor-parallel ranks got the same inputs (the
    engine's forward pre-hook, and ``compare_tensors_in_structures``) places its tensors on
    ``torch.device(current_device_name())``. Before it they went to ``current_device()``, which the CPU accelerator
    answers with the ``LOCAL_RANK`` string: ``Invalid device string: '0'`` in the first forward of every AutoTP run
    on a CPU. A no-op where the release has the fix or no such check."""
    from deepspeed.runtime import engine, utils

    from pytest_dsrepro.inrank.backport import backport

    edits = utils_edits_by_name()
    if edits:
        backport(monkeypatch, "deepspeed.runtime.utils", edits)
        # The engine calls it by the name it imported.
        monkeypatch.setattr(engine, "compare_tensors_in_structures", utils.compare_tensors_in_structures)
    engine_by_name(monkeypatch)


def engine_by_name(monkeypatch: Any) -> None:
    """PR #7600's edit of the engine's input check, where the installed release needs it. The recompiled check reads
    ``compare_tensors_in_structures`` as the engine module held it when it was recompiled: a fix that replaces that
    function afterwards calls this again."""
    from pytest_dsrepro.inrank.backport import backport, release_has

    if release_has("deepspeed.runtime.engine", "device=get_accelerator().current_device())"):
        backport(
            monkeypatch,
            "deepspeed.runtime.engine",
            [(r"device=get_accelerator\(\)\.current_device\(\)\)", f"device={BY_NAME})")],
        )


#: For AutoTP training repros: before 0.18.0 the first forward fails on the CPU accelerator whatever the bug.
AUTOTP_CPU_DEVICE = pytest.mark.ds_prerequisite(
    fix=cpu_device_by_name,
    releases="<0.18.0",
    reason="PR #7600: before 0.18.0 AutoTP training's input check places tensors on the CPU accelerator's "
    "current_device(), the LOCAL_RANK string, and the first forward fails",
)


#: What every AutoTP training repro declares besides its own entry: the config it needs (ZeRO 0-2 and an AutoTP
#: size; the engine refuses AutoTP with ZeRO-3), the releases without AutoTP training, and the CPU prerequisite.
AUTOTP_TRAINING = [
    pytest.mark.ds_premise(stage=(0, 1, 2), config={"tensor_parallel.autotp_size": 2}),
    pytest.mark.ds_not_applicable("<0.16.4", reason="AutoTP training (tp_model_init) appeared in 0.16.4"),
    AUTOTP_CPU_DEVICE,
]
