"""The pointwise parts of a Steerling layer as pure tensor functions, compilable once for all layers.

Eager, each layer launches ~70 small kernels around its five GEMMs (fp32 norms, RoPE,
clamps, SwiGLU, residual adds, the steering add): at batch 1 on an H200 those launches,
even replayed from a CUDA graph, cost more than the weights' memory traffic. Compiling the
whole 32-layer forward fuses them but takes minutes per shape bucket. These functions are
the regional alternative: each fuses what sits between two GEMMs (or a GEMM and attention),
takes only tensors and constants, and has the same code for every layer, so one compiled
graph per function serves all 32 layers and every row/page bucket (dynamic shapes).

The arithmetic is exactly the model's eager arithmetic (same op order, same dtypes), so the
eager `Kernels()` are bit-identical to the layer code they replaced.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from cde import norms, regional
from cde.regional import Kernels
from cde.steerling.sampling import counter_uniform

# the reference multiplies by the weight in fp32 and returns to the input dtype last
CAST_BEFORE_WEIGHT = False


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm in fp32, scaled by weight, back to x's dtype (the reference's order)."""
    return norms.rms_norm(x, weight, eps, cast_before_weight=CAST_BEFORE_WEIGHT)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (B,H,T,hd); cos/sin (B,1,T,hd) fp32. Rotate-half on the full head dim, in fp32."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


def qkv_prep(qkv: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float, cos: Tensor, sin: Tensor,
             n_head: int, n_kv: int, head_dim: int, clip: float) -> tuple[Tensor, Tensor, Tensor]:
    """Fused qkv (B,T,(H+2KV)*hd) -> clamp, split, QK-norm, RoPE -> q (B,H,T,hd), k, v (B,KV,T,hd)."""
    b, t, _ = qkv.shape
    qkv = qkv.clamp(-clip, clip)
    q, k, v = qkv.split([n_head * head_dim, n_kv * head_dim, n_kv * head_dim], dim=2)
    q = q.reshape(b, t, n_head, head_dim).transpose(1, 2)
    k = k.reshape(b, t, n_kv, head_dim).transpose(1, 2)
    v = v.reshape(b, t, n_kv, head_dim).transpose(1, 2)
    q = apply_rope(rms_norm(q, q_weight, eps), cos, sin)
    k = apply_rope(rms_norm(k, k_weight, eps), cos, sin)
    return q, k, v


def add_norm(x: Tensor, y: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Post-norm residual: x + RMSNorm(y)."""
    return x + rms_norm(y, weight, eps)


def add_norm_steer(x: Tensor, y: Tensor, weight: Tensor, eps: float, coef: Tensor, vector: Tensor) -> Tensor:
    """Post-norm residual, then the steering injection: coef (B,T) fp32 times vector (B,D)."""
    x = x + rms_norm(y, weight, eps)
    return x + (coef[..., None] * vector[:, None, :]).to(x.dtype)


def swiglu(h: Tensor) -> Tensor:
    """c_fc's output is (up, gate): silu(gate) * up."""
    up, gate = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def adjust_logits(logits: Tensor, relu: Tensor, seen: Tensor, rep: Tensor, banned: Tensor) -> Tensor:
    """The sampler's adjusted logits (fp32): relu suppression, repetition penalty on seen ids,
    banned ids at -inf. logits (R, T, V); relu (R, 1, V) fp32; seen (R, 1, V) bool; rep (R,)
    fp32; banned (V,) bool. Elementwise, so any subset of positions gives the same bits."""
    out = logits.float() - relu
    rp = rep[:, None, None]
    penalized = torch.where(out > 0, out / rp, out * rp)
    out = torch.where(seen & (rp != 1.0), penalized, out)
    return out.masked_fill(banned, float("-inf"))


def confidence(logits: Tensor, relu: Tensor, seen: Tensor, rep: Tensor, banned: Tensor) -> Tensor:
    """Max softmax probability of the adjusted logits per position, (R, T). Compiled, the
    adjustment fuses into the softmax's reductions: the (R, 64, V) fp32 tensors the eager
    version writes several times (0.8 GB each at 32 rows) are never formed."""
    return torch.softmax(adjust_logits(logits, relu, seen, rep, banned), dim=-1).amax(dim=-1)


def confidence_at(logits: Tensor, relu_table: Tensor, seen_table: Tensor, slot: Tensor, rep: Tensor,
                  banned: Tensor) -> Tensor:
    """`confidence` of N scattered positions, (N,): logits (N, V), each position's request's relu
    and seen rows looked up in the tables (S, V) by slot (N,), rep (N,) fp32. Compiled, the
    lookups are indirect loads inside the softmax's reductions: no (N, V) copy of either table."""
    return confidence(logits[:, None, :], relu_table[slot][:, None, :], seen_table[slot][:, None, :], rep,
                      banned)[:, 0]


# counter_uniform: ~60 int64 elementwise ops eager (five hash rounds), one kernel compiled
_FUNCTIONS = {"qkv_prep": qkv_prep, "add_norm": add_norm, "add_norm_steer": add_norm_steer, "swiglu": swiglu,
              "confidence": confidence, "confidence_at": confidence_at, "counter_uniform": counter_uniform}
EAGER = Kernels(_FUNCTIONS)


def compiled(backend="inductor") -> Kernels:
    """The functions compiled with dynamic shapes (cde/regional.py); on CUDA in half precision,
    qkv prep, SwiGLU and the sampler's confidence pass as hand-written Triton kernels
    (cde/steerling/qkv_prep_kernel.py, cde/fused_swiglu.py, cde/steerling/confidence_kernel.py
    say why)."""
    from cde import fused_swiglu
    from cde.steerling import confidence_kernel, qkv_prep_kernel

    kn = regional.compiled(_FUNCTIONS, backend)
    kn.qkv_prep = qkv_prep_kernel.dispatching(kn.qkv_prep)
    kn.swiglu = fused_swiglu.dispatching(kn.swiglu)
    kn.confidence_at = confidence_kernel.dispatching(kn.confidence_at)
    return kn
