"""Small models and deterministic data for repros: built on demand, so importing this module imports no torch."""

from __future__ import annotations

import functools
from typing import Any

from pytest_dsrepro.inrank.devices import rank_device


def tiny_mlp(hidden: int = 16, seed: int = 0, *, device: Any = None) -> Any:
    """A two-layer MLP (in ``hidden`` -> out 1), identically initialised on every rank (on the CPU, whatever the
    device), placed on the rank's device unless ``device`` says otherwise: a plain-torch reference runs where the
    engine it is compared with does."""
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))
    return model.to(device if device is not None else rank_device())


def tiny_moe(num_experts: int = 4, hidden: int = 16, seed: int = 0, first_id: int = 100, *, device: Any = None) -> Any:
    """A mixture-of-experts layer whose experts carry user ids (``expert.id``), as MoE code uses them for placement;
    on the rank's device unless ``device`` says otherwise.

    ``placement()`` maps each expert id to the rank that owns it; routing sends each token to one expert.
    """
    import torch

    class Expert(torch.nn.Module):
        def __init__(self, expert_id: int) -> None:
            super().__init__()
            self.id = expert_id  # the user's id: what ZeRO-3 before 0.16.4 overwrote
            self.ffn = torch.nn.Linear(hidden, hidden)

        def forward(self, x: Any) -> Any:
            return torch.relu(self.ffn(x))

    class TinyMoE(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = torch.nn.Linear(hidden, num_experts)
            self.experts: list[Expert] = torch.nn.ModuleList(  # type: ignore[assignment]
                Expert(first_id + i) for i in range(num_experts)
            )
            self.head = torch.nn.Linear(hidden, 1)

        def placement(self, world_size: int) -> dict[int, int]:
            return {e.id: e.id % world_size for e in self.experts}

        def forward(self, x: Any) -> Any:
            choice = self.gate(x).argmax(dim=-1)
            # every expert runs on every token (ZeRO-3 needs the same modules on every rank), routing picks one
            outputs = torch.stack([e(x) for e in self.experts], dim=1)
            picked = outputs[torch.arange(x.shape[0], device=x.device), choice]
            return self.head(picked)

    torch.manual_seed(seed)
    return TinyMoE().to(device if device is not None else rank_device())


def lora_linear(features: int = 16, rank: int = 4, base_dtype: Any = None, seed: int = 0, *, device: Any = None) -> Any:
    """A ``LoraLinear``: a frozen base weight (in ``base_dtype``, e.g. bf16) and trainable fp32 low-rank adapters in
    one module, as PEFT's LoRA layers keep them. The class lives here so that configs can name it
    (``pytest_dsrepro.inrank.models.LoraLinear``, e.g. in ``torch_autocast.lower_precision_safe_modules``). On the
    rank's device unless ``device`` says otherwise."""
    import torch

    torch.manual_seed(seed)
    module = _lora_linear_class()(features, rank, base_dtype or torch.float32)
    return module.to(device if device is not None else rank_device())


def __getattr__(name: str) -> Any:
    """``LoraLinear`` is defined on first use, so that importing this module imports no torch."""
    if name == "LoraLinear":
        return _lora_linear_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _lora_linear_class() -> Any:
    import torch

    class LoraLinear(torch.nn.Module):
        def __init__(self, features: int, rank: int, base_dtype: Any) -> None:
            super().__init__()
            # drawn on the CPU, as torch.nn's layers are: the same values on every device, moved by .to()
            weight = torch.randn(features, features, device="cpu") / features**0.5
            self.weight = torch.nn.Parameter(weight.to(base_dtype), requires_grad=False)
            self.lora_a = torch.nn.Parameter(torch.randn(rank, features, device="cpu") * 0.1)
            self.lora_b = torch.nn.Parameter(torch.zeros(features, rank, device="cpu"))

        def forward(self, x: Any) -> Any:
            base = torch.nn.functional.linear(x, self.weight)
            return base + torch.nn.functional.linear(torch.nn.functional.linear(x, self.lora_a), self.lora_b)

    LoraLinear.__module__, LoraLinear.__qualname__ = __name__, "LoraLinear"  # importable by that name (pickle too)
    return LoraLinear


def make_batch(
    batch_size: int, hidden: int = 16, seed: int = 0, rank: int = 0, *, device: Any = None, dtype: Any = None
) -> tuple[Any, Any]:
    """``(x, y)`` for a regression step: different per rank, the same on every run and every device (drawn on the
    CPU, then moved). On the rank's device unless ``device`` says otherwise; in ``dtype`` (say
    ``precision_dtype(ds_config)``: what a bf16 or fp16 engine computes in), fp32 when it is not given."""
    import torch

    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(batch_size, hidden, generator=generator, device="cpu")
    y = x.sum(dim=-1, keepdim=True) * 0.1
    place = {"device": device if device is not None else rank_device(), "dtype": dtype or torch.float32}
    return x.to(**place), y.to(**place)
