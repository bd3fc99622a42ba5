"""The catalogue's shared fixes and premises, public: for a repro written outside the catalogue, which needs one of
its bugs fixed first (``ds_prerequisite``) or shares a premise::

    from pytest_dsrepro.catalogue.prerequisites import ZERO12_CPU_FLAT_BUFFER

    pytestmark = [pytest.mark.ds_repro(...), ZERO12_CPU_FLAT_BUFFER]

The catalogue's own repros import ``_prerequisites`` beside them (``repros/`` is on their ``sys.path``); this module
names the same objects under the installed package, which every rank can import wherever the repro lives. What each
one does and on which releases: ``_prerequisites``' docstrings, and docs/writing-repros.md.
"""

from pytest_dsrepro.catalogue._prerequisites import (
    COMM_DTYPE_BUCKET,
    PERSISTENT_ALLGATHER_RACE,
    PIPELINE_GRADIENTS_SCALED_TWICE,
    PIPELINE_GRADIENTS_SUMMED,
    PIPELINE_NESTED_BACKWARD,
    TORCH_LOAD_WEIGHTS_ONLY,
    ZERO3_PARTITIONED,
    ZERO12_CPU_FLAT_BUFFER,
    detach_flat_buffer,
    flag_pipeline_backward,
    load_without_weights_only,
    report_every_bucket,
    scale_on_last_stage_only,
    scale_pipeline_loss,
    wait_on_every_handle,
    zero3_partitioned_premise,
)

__all__ = [
    "COMM_DTYPE_BUCKET", "PERSISTENT_ALLGATHER_RACE", "PIPELINE_GRADIENTS_SCALED_TWICE", "PIPELINE_GRADIENTS_SUMMED",
    "PIPELINE_NESTED_BACKWARD", "TORCH_LOAD_WEIGHTS_ONLY", "ZERO3_PARTITIONED", "ZERO12_CPU_FLAT_BUFFER",
    "detach_flat_buffer", "flag_pipeline_backward", "load_without_weights_only", "report_every_bucket",
    "scale_on_last_stage_only", "scale_pipeline_loss", "wait_on_every_handle", "zero3_partitioned_premise",
]  # fmt: skip
