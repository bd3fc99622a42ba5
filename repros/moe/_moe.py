"""What the MoE repros share (not a test module): a small model around DeepSpeed's own ``deepspeed.moe.layer.MoE``,
the same on every rank, and its data. Imported as ``_moe``.
"""

from __future__ import annotations

from typing import Any

HIDDEN = 8


def moe_model(num_experts: int, k: int, *, ep_size: int = 1, seed: int = 0, device: Any = None, **gate: Any) -> Any:
    """A linear layer, DeepSpeed's MoE layer (``num_experts`` linear experts over ``ep_size`` ranks, top-``k``
    gating, ``gate`` its other keywords: ``drop_tokens``, ``capacity_factor``, ...) and a linear head; its forward
    returns the head's output and the gate's auxiliary loss. The same weights on every rank (one seed)."""
    import torch
    from deepspeed.moe.layer import MoE

    class MoEModel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = torch.nn.Linear(HIDDEN, HIDDEN)
            self.moe = MoE(
                hidden_size=HIDDEN,
                expert=torch.nn.Linear(HIDDEN, HIDDEN),
                num_experts=num_experts,
                ep_size=ep_size,
                k=k,
                **gate,
            )
            self.head = torch.nn.Linear(HIDDEN, 1)
            # DeepSpeed copies the one expert it is given: experts of their own, as training makes them
            for expert in self.moe.deepspeed_moe.experts.deepspeed_experts:
                expert.reset_parameters()

        def forward(self, x: Any) -> Any:
            hidden, l_aux, _ = self.moe(torch.relu(self.inp(x)))
            return self.head(hidden), l_aux

    torch.manual_seed(seed)
    model = MoEModel()
    return model.to(device) if device is not None else model


def tokens(count: int, *, seed: int, device: Any, dtype: Any = None) -> tuple[Any, Any]:
    """``count`` tokens of ``HIDDEN`` features and their targets, drawn on the CPU (the same on every device)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(count, HIDDEN, generator=generator, device="cpu")
    y = torch.randn(count, 1, generator=generator, device="cpu")
    return x.to(device=device, dtype=dtype), y.to(device=device, dtype=dtype)


def moe_groups(model: Any) -> list[dict[str, Any]]:
    """``model``'s parameters in the groups DeepSpeed's MoE needs under ZeRO: the experts' apart from the rest."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    return split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "parameters"}
    )


def moe_engine(ds_engine: Any, ds_config: dict[str, Any], model: Any) -> Any:
    """``ds_engine`` over ``model`` with its MoE parameter groups: the config's own optimizer section built over them
    where it has one, else a ``torch.optim.Adam``."""
    import torch

    groups = moe_groups(model)
    if "optimizer" in ds_config:
        return ds_engine(model=model, optimizer=None, model_parameters=groups)
    return ds_engine(model=model, optimizer=torch.optim.Adam(groups, lr=1e-3))
