"""Small models and deterministic data for repros: built on demand, so importing this module imports no torch."""

from __future__ import annotations

import functools
from typing import Any


def tiny_mlp(hidden: int = 16, seed: int = 0) -> Any:
    """A two-layer MLP (in ``hidden`` -> out 1), identically initialised on every rank."""
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))


def tiny_moe(num_experts: int = 4, hidden: int = 16, seed: int = 0, first_id: int = 100) -> Any:
    """A mixture-of-experts layer whose experts carry user ids (``expert.id``), as MoE code uses them for placement.

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
            picked = outputs[torch.arange(x.shape[0]), choice]
            return self.head(picked)

    torch.manual_seed(seed)
    return TinyMoE()


def lora_linear(features: int = 16, rank: int = 4, base_dtype: Any = None, seed: int = 0) -> Any:
    """A ``LoraLinear``: a frozen base weight (in ``base_dtype``, e.g. bf16) and trainable fp32 low-rank adapters in
    one module, as PEFT's LoRA layers keep them. The class lives here so that configs can name it
    (``pytest_dsrepro.inrank.models.LoraLinear``, e.g. in ``torch_autocast.lower_precision_safe_modules``)."""
    import torch

    torch.manual_seed(seed)
    return _lora_linear_class()(features, rank, base_dtype or torch.float32)


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
            weight = torch.randn(features, features) / features**0.5
            self.weight = torch.nn.Parameter(weight.to(base_dtype), requires_grad=False)
            self.lora_a = torch.nn.Parameter(torch.randn(rank, features) * 0.1)
            self.lora_b = torch.nn.Parameter(torch.zeros(features, rank))

        def forward(self, x: Any) -> Any:
            base = torch.nn.functional.linear(x, self.weight)
            return base + torch.nn.functional.linear(torch.nn.functional.linear(x, self.lora_a), self.lora_b)

    LoraLinear.__module__, LoraLinear.__qualname__ = __name__, "LoraLinear"  # importable by that name (pickle too)
    return LoraLinear


def make_batch(batch_size: int, hidden: int = 16, seed: int = 0, rank: int = 0) -> tuple[Any, Any]:
    """``(x, y)`` for a regression step: different per rank, the same on every run."""
    import torch

    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(batch_size, hidden, generator=generator)
    return x, x.sum(dim=-1, keepdim=True) * 0.1
