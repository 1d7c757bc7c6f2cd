"""An adapter's torch module: built on meta, given storage on its device, and a seeded random init."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def materialize(build: Callable[[], nn.Module], dtype: torch.dtype, device: torch.device) -> nn.Module:
    """build() run on meta (no allocation), cast to `dtype`, given uninitialised storage on
    `device` (a meta device keeps shapes only, for parameter counts of real sizes), in eval
    mode with gradients off."""
    with torch.device("meta"):
        module = build()
    module = module.to(dtype=dtype)
    if device.type != "meta":
        module = module.to_empty(device=device)
    return module.eval().requires_grad_(False)


def seeded_normal(shape, generator: torch.Generator, std: float = 1.0) -> torch.Tensor:
    """N(0, std) float32 draws from `generator` on the CPU, drawn in float64: torch's float32
    normal fill is vectorised per CPU kernel set (Sleef log / cos under AVX2 and AVX-512),
    so float32 draws differ between ATEN_CPU_CAPABILITY settings; the float64 fill does not."""
    return torch.empty(tuple(shape), dtype=torch.float64).normal_(0.0, std, generator=generator).to(torch.float32)


@torch.no_grad()
def seeded_normal_init(module: nn.Module, seed: int, std: float, *, weights: tuple[type, ...],
                       norms: tuple[type, ...]) -> None:
    """Deterministic from the seed alone: in module order, every `weights` module's weight is
    drawn N(0, std) on the CPU (seeded_normal) and then cast (so every dtype and device gets the
    same numbers) and its bias zeroed; `norms` get weight 1 and bias 0."""
    gen = torch.Generator().manual_seed(seed)
    for m in module.modules():
        if isinstance(m, norms):
            m.weight.fill_(1.0)
            if getattr(m, "bias", None) is not None:
                m.bias.zero_()
        elif isinstance(m, weights):
            m.weight.copy_(seeded_normal(m.weight.shape, gen, std))
            if getattr(m, "bias", None) is not None:
                m.bias.zero_()
