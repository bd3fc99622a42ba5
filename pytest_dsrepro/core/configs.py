"""Named DeepSpeed configs (the one place presets live) and their resolution for a given world.

Resolution does what Hugging Face's DeepSpeed integration does with ``"auto"`` values, and adapts what a
CPU/gloo world cannot run (fp16), saying so in ``notes``. Validation is left to DeepSpeed's own config classes
inside the ranks (see ``engine``): no schema is written here.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .premises import lookup

_BASE: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "steps_per_print": 10**9,
}

PRESETS: dict[str, dict[str, Any]] = {
    "zero0": {**_BASE, "zero_optimization": {"stage": 0}},
    "zero1": {**_BASE, "zero_optimization": {"stage": 1}},
    # Seed chapter 003, section 2.1: the ZeRO-2 config recommended for most fine-tuning.
    "zero2": {
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "steps_per_print": 100,
        "gradient_clipping": 1.0,
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16},
        "zero_optimization": {
            "stage": 2,
            "allgather_partitions": True,
            "allgather_bucket_size": 2e8,
            "reduce_scatter": True,
            "reduce_bucket_size": 2e8,
            "overlap_comm": True,
            "contiguous_gradients": True,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
    },
    "zero3": {**_BASE, "zero_optimization": {"stage": 3}},
    # Seed chapter 003, section 2.2: ZeRO-3 with optimizer and parameters offloaded to CPU.
    "zero3_offload": {
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9,
            "stage3_prefetch_bucket_size": 1e7,
            "stage3_param_persistence_threshold": 1e5,
            "reduce_bucket_size": 1e7,
            "sub_group_size": 1e9,
        },
        "fp16": {"enabled": True},
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
    },
}


@dataclass(frozen=True)
class TrainingArgs:
    """The values ``"auto"`` stands for, as Hugging Face's TrainingArguments would supply them."""

    micro_batch_size: int = 2
    gradient_accumulation_steps: int = 1
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    warmup_steps: int = 0
    max_steps: int = 10
    hidden_size: int = 16  # of the plugin's tiny models; sizes the ZeRO buckets


@dataclass(frozen=True)
class ResolvedConfig:
    name: str  # preset name, or "config<N>" for a dict given in the marker
    config: dict[str, Any]  # what the world hands to DeepSpeed
    notes: tuple[str, ...] = field(default=())
    #: the config as its author wrote it, ``"auto"`` resolved, before the world's adaptations (fp16 -> fp32 on CPU):
    #: what a premise is judged on, since that is what the author runs on their own devices
    written: dict[str, Any] = field(default_factory=dict)


class ConfigError(Exception):
    pass


def _section(config: Mapping[str, Any], *path: str) -> dict[str, Any]:
    """The object at ``path`` in ``config``; a fresh empty one where it is absent or written as something else
    (``"fp16": false``, which DeepSpeed refuses: a scan refuses it first, naming it; triage reads it as written)."""
    node = lookup(config, ".".join(path))
    return node if isinstance(node, dict) else {}


def _fill(section: dict[str, Any], key: str, value: object) -> None:
    if section.get(key) == "auto":
        section[key] = value


def _given(config: Mapping[str, Any], key: str) -> int | None:
    value = config.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def resolve_batch(config: dict[str, Any], world_size: int, args: TrainingArgs) -> None:
    """Write all three batch keys (in place), so that a body can read each: an ``"auto"`` or absent one filled as
    Hugging Face's Trainer fills it, except where DeepSpeed derives it from the others (``train_batch_size`` = micro
    batch x accumulation x ranks: a config of 512 with micro-batches of 32 accumulates 8 steps on 2 ranks). What does
    not divide is left for DeepSpeed to refuse."""
    train = _given(config, "train_batch_size")
    micro = _given(config, "train_micro_batch_size_per_gpu")
    accum = _given(config, "gradient_accumulation_steps")
    if train is not None and micro is None and train % ((accum or 1) * world_size):
        return  # it does not divide over this world: DeepSpeed derives what it can and says what it refuses
    if micro is None and train is not None:
        micro = train // ((accum or 1) * world_size)
    micro = micro or args.micro_batch_size
    if accum is None and train is not None and train % (micro * world_size) == 0:
        accum = train // (micro * world_size)
    accum = accum or args.gradient_accumulation_steps
    config["train_micro_batch_size_per_gpu"] = micro
    config["gradient_accumulation_steps"] = accum
    config["train_batch_size"] = train or micro * accum * world_size


def resolve_auto(config: dict[str, Any], world_size: int, args: TrainingArgs) -> None:
    """Replace ``"auto"`` in place, the way transformers' HfTrainerDeepSpeedConfig does (the batch keys: see
    ``resolve_batch``)."""
    resolve_batch(config, world_size, args)
    _fill(config, "gradient_clipping", args.max_grad_norm)
    optimizer = _section(config, "optimizer", "params")
    for key, value in {
        "lr": args.learning_rate,
        "weight_decay": args.weight_decay,
        "betas": list(args.adam_betas),
        "eps": args.adam_epsilon,
    }.items():
        _fill(optimizer, key, value)
    scheduler = _section(config, "scheduler", "params")
    for key, value in {
        "warmup_min_lr": 0,
        "warmup_max_lr": args.learning_rate,
        "warmup_num_steps": args.warmup_steps,
        "total_num_steps": args.max_steps,
    }.items():
        _fill(scheduler, key, value)
    zero = _section(config, "zero_optimization")
    _fill(zero, "reduce_bucket_size", args.hidden_size * args.hidden_size)
    _fill(zero, "stage3_prefetch_bucket_size", int(0.9 * args.hidden_size * args.hidden_size))
    _fill(zero, "stage3_param_persistence_threshold", 10 * args.hidden_size)
    _fill(zero, "stage3_gather_16bit_weights_on_model_save", False)  # by accelerate, under the Trainer: unless asked
    for precision in ("fp16", "bf16"):
        _fill(_section(config, precision), "enabled", False)


#: Optimizers DeepSpeed runs only as CUDA kernels of its own (``optimizer.type``, lower case), and why.
CUDA_OPTIMIZERS = {
    "lamb": "DeepSpeed's Lamb is its FusedLamb CUDA kernel",
    "onebitadam": "1-bit Adam compresses its communication with CUDA kernels (and cupy)",
    "zerooneadam": "0/1 Adam compresses its communication with CUDA kernels (and cupy)",
    "onebitlamb": "1-bit Lamb compresses its communication with CUDA kernels (and cupy)",
}


def cuda_only(config: Mapping[str, Any]) -> list[str]:
    """What in ``config`` needs CUDA and has no CPU form, each naming its key and why: a gloo world cannot run it
    (what has a CPU form, ``adapt_to_backend`` adapts instead)."""
    found = []
    optimizer = _section(config, "optimizer")
    kind = str(optimizer.get("type", "")).lower()
    if kind in CUDA_OPTIMIZERS:
        found.append(f"optimizer.type {optimizer['type']!r} needs CUDA: {CUDA_OPTIMIZERS[kind]}")
    if _section(config, "amp").get("enabled") is True:
        found.append("amp.enabled needs CUDA: it is NVIDIA apex's mixed precision")
    zero = _section(config, "zero_optimization")
    for key in ("zero_quantized_weights", "zero_quantized_gradients"):
        if zero.get(key) is True:
            found.append(f"zero_optimization.{key} needs CUDA: ZeRO++'s quantizer is a CUDA kernel")
    return found


def adapt_to_backend(config: dict[str, Any], backend: str) -> list[str]:
    """Make a config runnable on the world's devices; return what was changed, in words."""
    notes = []
    if backend == "gloo":
        if _section(config, "fp16").get("enabled"):
            config["fp16"] = {"enabled": False}
            notes.append("fp16 -> fp32: fp16 training needs CUDA; this is a gloo/CPU world")
        for kind in ("offload_optimizer", "offload_param"):
            section = _section(config, "zero_optimization", kind)
            if section.get("device") == "nvme":
                section["device"] = "cpu"
                notes.append(f"{kind}.device nvme -> cpu: NVMe offload needs DeepSpeed's async I/O op (libaio), "
                             "which these worlds do not build; ZeRO's offload path, to CPU memory")  # fmt: skip
            if section.get("pin_memory"):
                section["pin_memory"] = False
                notes.append(f"{kind}.pin_memory -> false: pinned memory needs CUDA")
        optimizer = _section(config, "optimizer")
        if str(optimizer.get("type", "")).lower() in ("adam", "adamw") and "torch_adam" not in _section(
            optimizer, "params"
        ):
            optimizer.setdefault("params", {})["torch_adam"] = True
            if optimizer["type"].lower() == "adam":
                optimizer["params"].setdefault("adam_w_mode", False)
            notes.append(f"optimizer {optimizer['type']} -> torch implementation: DeepSpeed's CPU Adam is a JIT build")
        offloaded = _section(config, "zero_optimization", "offload_optimizer").get("device") == "cpu"
        if offloaded and "optimizer" not in config and "zero_force_ds_cpu_optimizer" not in config:
            config["zero_force_ds_cpu_optimizer"] = False
            notes.append(
                "zero_force_ds_cpu_optimizer -> false: offload with a torch optimizer; DeepSpeedCPUAdam is a JIT build"
            )
    return notes


def resolve(
    spec: object, name: str, world_size: int, backend: str, args: TrainingArgs = TrainingArgs()
) -> ResolvedConfig:
    """A preset name or a dict -> the config a world of this size and backend will hand to DeepSpeed."""
    if isinstance(spec, str):
        if spec not in PRESETS:
            raise ConfigError(f"unknown preset {spec!r}; presets: {', '.join(PRESETS)}")
        raw: Mapping[str, Any] = PRESETS[spec]
    elif isinstance(spec, Mapping):
        raw = spec
    else:
        raise ConfigError(f"{spec!r} is neither a preset name nor a dict")
    config = copy.deepcopy(dict(raw))
    resolve_auto(config, world_size, args)
    written = copy.deepcopy(config)
    notes = adapt_to_backend(config, backend)
    return ResolvedConfig(name, config, tuple(notes), written)
