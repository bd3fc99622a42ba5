"""The ``ds_engine`` factory: ``deepspeed.initialize`` from the test's config, inside a rank.

The factory is created in the pytest process (cheap, picklable) and called in the ranks, where torch and DeepSpeed
are already imported by the fork server.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from ..core.scan_verdicts import REFUSED
from . import context


class ConfigRejected(Exception):
    """DeepSpeed's own config classes refused the test's config; the message names the config and DeepSpeed's reason."""


@dataclass(frozen=True)
class EngineFactory:
    config: dict[str, Any]
    config_name: str

    def validate(self) -> None:
        """Check the config with DeepSpeed's ``DeepSpeedConfig`` (needs the process group, so: in a rank)."""
        import deepspeed
        from deepspeed.runtime.config import DeepSpeedConfig

        # DeepSpeedConfig reads the world size from deepspeed.comm (1 when it is not set up): wrap our process group.
        deepspeed.init_distributed(dist_backend=context.current().backend)
        try:
            DeepSpeedConfig(copy.deepcopy(self.config))
            build_scheduler(self.config)
        except Exception as exc:
            raise ConfigRejected(f"{REFUSED} [{self.config_name}]: {type(exc).__name__}: {exc}") from exc

    def __call__(self, model: Any = None, optimizer: Any = "auto", **initialize_kwargs: Any) -> Any:
        """Build and return a ``DeepSpeedEngine``.

        ``model`` defaults to the plugin's tiny MLP. ``optimizer``: ``"auto"`` uses the config's ``optimizer`` section
        if it has one and a ``torch.optim.Adam`` otherwise; ``"adam"`` forces that Adam; ``None`` passes no optimizer
        (DeepSpeed then builds none unless the config asks for one); anything else is passed through.
        """
        import deepspeed
        import torch

        self.validate()
        if model is None:
            from .models import tiny_mlp

            model = tiny_mlp()
        if optimizer == "auto":
            optimizer = None if "optimizer" in self.config else "adam"
        if optimizer == "adam":
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        if optimizer is None and "optimizer" in self.config:
            initialize_kwargs.setdefault("model_parameters", model.parameters())
        # A copy each time: DeepSpeed edits the config it is given (0.18.x pops ``torch_adam`` from the optimizer's
        # parameters), so a body's second engine would otherwise get another optimizer (a CPU Adam to JIT-build).
        config = copy.deepcopy(self.config)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, **initialize_kwargs)
        return engine


def build_scheduler(config: dict[str, Any]) -> None:
    """Build the config's ``scheduler`` as ``deepspeed.initialize`` will (DeepSpeed's class of that name, with the
    config's parameters), on a throwaway optimizer: DeepSpeed checks its parameters there, not in its config classes
    (0.19.3 refuses ``warmup_num_steps`` 0, what Hugging Face's "auto" gave without warm-up). What it raises for a
    value is the config's refusal; a scheduler that needs the real optimizer (momentum, groups) is left to
    ``initialize``."""
    import torch
    from deepspeed.runtime import lr_schedules

    scheduler = config.get("scheduler") or {}
    kind = getattr(lr_schedules, str(scheduler.get("type")), None)
    if kind is None:
        return  # none, or torch's own (DeepSpeed passes the name on to torch.optim.lr_scheduler)
    params = scheduler.get("params") or {}
    # One group per value of a parameter given per group (a list), as the optimizer it is meant for has.
    groups = max((len(v) for v in params.values() if isinstance(v, (list, tuple))), default=1)
    weights = [torch.nn.Parameter(torch.zeros(1, device="cpu")) for _ in range(groups)]
    try:
        kind(torch.optim.SGD([{"params": [w]} for w in weights], lr=1e-3), **params)
    except ValueError:
        raise  # DeepSpeed's own check of a parameter's value: the config is refused whatever the optimizer
    except Exception:  # noqa: BLE001 - it needs the real optimizer (momentum, groups): initialize will tell
        return


def master_weights(engine: Any) -> list[Any]:
    """The optimizer's fp32 copy of each parameter of ``engine``'s module, whole, as float copies; a parameter that
    has none (no optimizer wrapper: fp32 without ZeRO) as it is. A bf16 weight need not move at a small learning rate
    where its fp32 master does, so "did the step train it?" is asked here. A collective under ZeRO: every rank calls
    it, at the same point."""
    from deepspeed.utils import safe_get_full_fp32_param

    found = []
    for param in engine.module.parameters():
        master = safe_get_full_fp32_param(param)
        found.append((param if master is None else master).detach().float().clone())
    return found
