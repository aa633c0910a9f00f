"""Steerling's qkv prep (`cde.steerling.kernels.qkv_prep`) as one Triton launch.

The fused projection (B, T, (H + 2KV) * hd) is clamped to +-clip; its q and k heads get the
per-head RMSNorm (fp32, times q_norm / k_norm weight, rounded to the activation dtype) and
rotate-half RoPE (fp32, rounded); v is only clamped. Compiled by Inductor with dynamic shapes
this was 3 kernels a layer (96 launches a step at 32 layers): at batch 1 on an H200 (one row
of 64 tokens) those small launches are part of what keeps a step above its floor.

One program per (token, block of SLOTS head slots): the slots are the H + 2KV heads of the
projection in order (q, then k, then v), so a block may mix kinds and each row picks its
weights and whether it is normed. A head is loaded as its two halves, which is what
rotate-half pairs. Arithmetic follows the eager function op by op (clamp at the bound rounded
to the activation dtype, as `clamp` does; x * rsqrt(mean x^2 + eps), then times the weight;
x * cos + rotated * sin with no FMA contraction), so results differ from eager only where
reduction order or rsqrt's last fp32 bit flips a rounding.

The output is one (B, T, H + 2KV, hd) tensor, the projection's layout; q, k, v are transposed
views of it, the same strides the eager function returns (every consumer reads strided heads
with a contiguous last dim). On CUDA in bf16/fp16 with a power-of-two half head dim only;
everything else keeps the fallback. `tests/test_qkv_prep_kernel.py` checks it against the
eager function under Triton's interpreter, compiles it for sm_90 and runs it on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from cde.lazy_jit import jit

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU installs without Triton
    triton = None

SLOTS = 16   # head slots per program: at 8B dims (48 slots) three programs a token


def _qkv_prep_kernel(qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, out_ptr, s_qkv, s_cos_b, s_cos_t, s_sin_b,
                     s_sin_t, T, N_HEAD, N_KV, clip, eps, HALF: tl.constexpr, SLOTS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)          # token b * T + t
    slot = tl.program_id(1) * SLOTS + tl.arange(0, SLOTS)
    d = tl.arange(0, HALF)
    hd = 2 * HALF
    n_slots = N_HEAD + 2 * N_KV
    ok = (slot < n_slots)[:, None]
    is_q = (slot < N_HEAD)[:, None]
    is_v = (slot >= N_HEAD + N_KV)[:, None]

    src = qkv_ptr + row * s_qkv + slot[:, None] * hd + d[None, :]
    x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
    x1 = tl.minimum(tl.maximum(x1, -clip), clip)
    x2 = tl.minimum(tl.maximum(x2, -clip), clip)

    # RMSNorm over the whole head, times q_norm's or k_norm's weight, rounded like `rms_norm`
    r = tl.math.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / hd + eps)[:, None]
    w1 = tl.where(is_q, tl.load(qw_ptr + d)[None, :].to(tl.float32), tl.load(kw_ptr + d)[None, :].to(tl.float32))
    w2 = tl.where(is_q, tl.load(qw_ptr + HALF + d)[None, :].to(tl.float32),
                  tl.load(kw_ptr + HALF + d)[None, :].to(tl.float32))
    dtype = out_ptr.dtype.element_ty
    n1 = (w1 * (x1 * r)).to(dtype).to(tl.float32)
    n2 = (w2 * (x2 * r)).to(dtype).to(tl.float32)

    # RoPE, rotate-half: (n1, n2) * cos + (-n2, n1) * sin, the token's position's tables
    b, t = row // T, row % T
    c1 = tl.load(cos_ptr + b * s_cos_b + t * s_cos_t + d)[None, :]
    c2 = tl.load(cos_ptr + b * s_cos_b + t * s_cos_t + HALF + d)[None, :]
    s1 = tl.load(sin_ptr + b * s_sin_b + t * s_sin_t + d)[None, :]
    s2 = tl.load(sin_ptr + b * s_sin_b + t * s_sin_t + HALF + d)[None, :]
    o1 = n1 * c1 - n2 * s1
    o2 = n2 * c2 + n1 * s2

    dst = out_ptr + row * (n_slots * hd) + slot[:, None] * hd + d[None, :]
    tl.store(dst, tl.where(is_v, x1, o1).to(dtype), mask=ok)
    tl.store(dst + HALF, tl.where(is_v, x2, o2).to(dtype), mask=ok)


def supported(qkv: Tensor, head_dim: int) -> bool:
    half = head_dim // 2
    return (triton is not None and qkv.is_cuda and qkv.dtype in (torch.bfloat16, torch.float16)
            and head_dim % 2 == 0 and half >= 1 and half & (half - 1) == 0)


def _rope_table(table: Tensor, b: int, t: int, hd: int) -> Tensor:
    """(B, 1, T, hd) fp32 with a contiguous last dim; broadcast views keep their zero strides."""
    table = table.float().expand(b, 1, t, hd)
    return table if table.stride(3) == 1 else table.contiguous()


def qkv_prep(qkv: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float, cos: Tensor, sin: Tensor,
             n_head: int, n_kv: int, head_dim: int, clip: float) -> tuple[Tensor, Tensor, Tensor]:
    """`cde.steerling.kernels.qkv_prep` in one launch: qkv (B, T, (H + 2KV) * hd) -> q (B, H, T,
    hd), k, v (B, KV, T, hd), transposed views of one (B, T, H + 2KV, hd) tensor."""
    b, t, width = qkv.shape
    n_slots = n_head + 2 * n_kv
    assert width == n_slots * head_dim, (qkv.shape, n_head, n_kv, head_dim)
    flat = qkv.reshape(b * t, width)
    if flat.stride(1) != 1:
        flat = flat.contiguous()
    cos, sin = _rope_table(cos, b, t, head_dim), _rope_table(sin, b, t, head_dim)
    out = torch.empty(b, t, n_slots, head_dim, dtype=qkv.dtype, device=qkv.device)
    # clamp compares in the tensor's dtype: the bound as the activation dtype rounds it
    bound = float(torch.tensor(clip, dtype=qkv.dtype))
    if b * t:
        jit(_qkv_prep_kernel)[(b * t, triton.cdiv(n_slots, SLOTS))](
            flat, q_weight.contiguous(), k_weight.contiguous(), cos, sin, out, flat.stride(0),
            cos.stride(0), cos.stride(2), sin.stride(0), sin.stride(2), t, n_head, n_kv, bound, float(eps),
            HALF=head_dim // 2, SLOTS=SLOTS, num_warps=4, enable_fp_fusion=False)
    heads = out.transpose(1, 2)
    return heads[:, :n_head], heads[:, n_head:n_head + n_kv], heads[:, n_head + n_kv:]


def dispatching(fallback: Callable[..., tuple[Tensor, Tensor, Tensor]]) -> Callable[..., tuple[Tensor, Tensor, Tensor]]:
    """The kernel for CUDA half-precision inputs, `fallback` (e.g. the compiled function) otherwise."""
    def run(qkv: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float, cos: Tensor, sin: Tensor,
            n_head: int, n_kv: int, head_dim: int, clip: float) -> tuple[Tensor, Tensor, Tensor]:
        impl = qkv_prep if supported(qkv, head_dim) else fallback
        return impl(qkv, q_weight, k_weight, eps, cos, sin, n_head, n_kv, head_dim, clip)
    return run
