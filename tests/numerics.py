"""Numeric comparisons the parity tests share (a helper module: test modules never import each other)."""

from __future__ import annotations

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max |b|, in fp32 so half-precision outputs compare without rounding the
    difference (fp32 inputs are used as they are)."""
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))
