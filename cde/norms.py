"""RMSNorm, one definition for the Qwen3 and Steerling models.

Both normalise in fp32 with eps inside the square root; they differ only in where the result
returns to the input dtype, and each must keep its reference's order to stay bit-identical
to it in half precision (in fp32 the two orders give the same bits).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float, *, cast_before_weight: bool) -> Tensor:
    """x * rsqrt(mean(x^2) + eps) in fp32, times weight, in x's dtype.

    cast_before_weight: True casts back to x's dtype and then multiplies by the weight, as
    transformers' Qwen3RMSNorm does; False multiplies in fp32 and casts last, as the Steerling
    reference does.
    """
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if cast_before_weight:
        return weight * xf.to(dtype)
    return (weight * xf).to(dtype)


class RMSNorm(nn.Module):
    """A learned RMSNorm; its one parameter is ``weight`` (checkpoints load it by that name)."""

    def __init__(self, size: int, eps: float, cast_before_weight: bool):
        super().__init__()
        self.eps = eps
        self.cast_before_weight = cast_before_weight
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps, cast_before_weight=self.cast_before_weight)
