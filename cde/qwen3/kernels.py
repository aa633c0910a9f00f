"""The pointwise parts of a Qwen3 layer as pure tensor functions, compilable once for all layers.

Same reason as cde/steerling/kernels.py: eager, a layer launches ~55 kernels around its 7
GEMMs (fp32 RMSNorms, QK-norm, RoPE's rotate-half, SiLU, residual adds), which at batch 1 on
a GPU costs more than reading the weights. Each function here fuses what sits between two
GEMMs (or a GEMM and attention), takes only tensors and constants, and is the same code for
all 36 layers: one compiled graph per function serves every layer and shape bucket.

The eager arithmetic is exactly the layer's (transformers' op order: RMSNorm casts back to
the input dtype before the weight multiply; RoPE in the activation dtype), so `EAGER` is
bit-identical to the code it replaced and the transformers parity tests still hold.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from cde import norms, regional
from cde.regional import Kernels

# transformers' Qwen3RMSNorm returns to the input dtype before the weight multiply
CAST_BEFORE_WEIGHT = True


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return norms.rms_norm(x, weight, eps, cast_before_weight=CAST_BEFORE_WEIGHT)


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return x * cos + rotate_half(x) * sin


def qk_norm_rope(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float, cos: Tensor,
                 sin: Tensor) -> tuple[Tensor, Tensor]:
    """q (B,T,H,hd), k (B,T,KV,hd) projections -> QK-norm, heads first, RoPE: (B,H,T,hd), (B,KV,T,hd)."""
    q = rms_norm(q, q_weight, eps).transpose(1, 2)
    k = rms_norm(k, k_weight, eps).transpose(1, 2)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def add_rms_norm(x: Tensor, y: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Pre-norm residual step: x + y, and its RMSNorm (the next sublayer's input)."""
    x = x + y
    return x, rms_norm(x, weight, eps)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


_FUNCTIONS = {"rms_norm": rms_norm, "qk_norm_rope": qk_norm_rope, "add_rms_norm": add_rms_norm, "silu_mul": silu_mul}
EAGER = Kernels(_FUNCTIONS)


def compiled(backend="inductor") -> Kernels:
    """The functions compiled with dynamic shapes (cde/regional.py)."""
    return regional.compiled(_FUNCTIONS, backend)
