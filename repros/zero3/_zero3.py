"""Configs and premises the ZeRO-3 repros of this folder share (a helper module, not a test module).

``ZERO3`` is ZeRO-3 with every parameter of a tiny model partitioned (``stage3_param_persistence_threshold: 0``:
persistent parameters are gathered by a path that races on gloo before 0.19.8, entry
``zero3-persistent-allgather-race``), torch's Adam allowed beside DeepSpeed's, and no clipping, so that values can be
compared across releases. ``ZERO3_HPZ`` adds ZeRO++ hierarchical partitioning over pairs of ranks (worlds of 4), and
``HPZ_PARTITIONED`` is the premise of repros that need it. Imported by module basename (``from _zero3 import ...``),
as the catalogue's own helpers are.
"""

from __future__ import annotations

from _prerequisites import zero3_partitioned_premise

ZERO3 = {
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "zero_force_ds_cpu_optimizer": False,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
}

ZERO3_HPZ = {**ZERO3, "zero_optimization": {**ZERO3["zero_optimization"], "zero_hpz_partition_size": 2}}

#: ZeRO-3 with hierarchical partitioning (a secondary group of two ranks or more), every parameter partitioned.
HPZ_PARTITIONED = zero3_partitioned_premise(config={"zero_optimization.zero_hpz_partition_size": ">=2"})
