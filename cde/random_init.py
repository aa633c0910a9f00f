"""Seeded random weights for the Qwen3 and Steerling models (demo, test and benchmark models
that have no checkpoint): one rule for which parameters are norm scales, one draw order."""

from __future__ import annotations

import torch
import torch.nn as nn


def is_norm_weight(name: str) -> bool:
    """A norm's scale, which starts at 1: Qwen3's ``*norm.weight``, Steerling's ``ln_*`` and QK-norms."""
    return name.endswith("norm.weight") or ".ln_" in name or name.endswith("ln_f.weight")


def init_random(model: nn.Module, seed: int, std: float = 0.02) -> nn.Module:
    """normal(0, std) weights, norm scales at 1. Drawn from a CPU generator seeded with `seed`,
    parameter by parameter in `named_parameters` order, so a seed gives the same weights on
    any device and dtype the model is later moved to."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_norm_weight(name):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model
