"""The sampler's confidence pass as one Triton kernel: max softmax probability of each
position's adjusted logits, reading the logits once.

Confidence = max_v softmax(adjust(logits))_v = 1 / sum_v exp(a_v - max a), with `adjust` the
sampler's relu suppression, repetition penalty on seen ids and bans
(`cde.steerling.kernels.adjust_logits`). The compiled elementwise + softmax version
materialized the adjusted fp32 logits (0.8 GB at 32 rows x 64 positions x 100K) and read them
three times: ~2 ms of a 70 ms step on an H200 (`kernels.compiled` swaps this kernel in for
`confidence_at`). Here one program per position streams its
logits row in `BLOCK_V` chunks with an online max / sum in fp32; the relu and seen rows of the
position's request are read from the per-slot tables (cached in L2 across the positions of
one request). Why 1/sum is the reference's value: the largest softmax entry is
exp(0) / sum = 1 / sum.

On CUDA in bf16/fp16 only; everything else (the CPU engine, the float64 parity tests) keeps
the elementwise function. `tests/test_confidence_kernel.py` checks it against that function
under Triton's interpreter and compiles it for sm_90.
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

BLOCK_V = 2048


def _confidence_kernel(logits_ptr, relu_ptr, seen_ptr, banned_ptr, slot_ptr, rep_ptr, out_ptr,
                       V, s_logits, s_relu, s_seen, BLOCK: tl.constexpr):
    n = tl.program_id(0)
    n64 = n.to(tl.int64)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    rep = tl.load(rep_ptr + n)
    offs = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)   # per-lane running max and sum
    s = tl.zeros([BLOCK], tl.float32)
    for v0 in range(0, V, BLOCK):
        v = v0 + offs
        ok = v < V
        x = tl.load(logits_ptr + n64 * s_logits + v, mask=ok, other=0.0).to(tl.float32)
        a = x - tl.load(relu_ptr + slot * s_relu + v, mask=ok, other=0.0)
        seen = tl.load(seen_ptr + slot * s_seen + v, mask=ok, other=0) != 0
        pen = tl.where(a > 0, tl.math.div_rn(a, rep), a * rep)
        a = tl.where(seen, pen, a)   # rep = 1 leaves a unchanged either way (a / 1 = a * 1 = a)
        banned = tl.load(banned_ptr + v, mask=ok, other=1) != 0
        a = tl.where(banned, float("-inf"), a)   # lanes past V load as banned
        m_new = tl.maximum(m, a)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # lanes with nothing unbanned yet
        s = s * tl.exp(m - m_safe) + tl.exp(a - m_safe)
        m = m_new
    top = tl.max(m, 0)
    total = tl.sum(s * tl.exp(m - top), 0)
    tl.store(out_ptr + n, 1.0 / total)


def _kernel():
    return jit(_confidence_kernel)


def supported(logits: Tensor) -> bool:
    return triton is not None and logits.is_cuda and logits.dtype in (torch.bfloat16, torch.float16)


def row_confidence(logits: Tensor, relu: Tensor, seen: Tensor, banned: Tensor, slot: Tensor, rep: Tensor) -> Tensor:
    """(N,) fp32 confidence of each logits row.

    logits (N, V) (last dim contiguous); relu (S, V) fp32 and seen (S, V) bool: per-slot tables;
    banned (V,) bool; slot (N,) long: each row's slot; rep (N,) fp32: its repetition penalty.
    """
    n, v = logits.shape
    out = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n == 0:
        return out
    assert logits.stride(1) == 1 and relu.stride(1) == 1 and seen.stride(1) == 1
    seen_u8 = seen.view(torch.uint8)
    banned_u8 = banned.contiguous().view(torch.uint8)
    _kernel()[(n,)](logits, relu, seen_u8, banned_u8, slot.contiguous(), rep.float().contiguous(), out,
                    v, logits.stride(0), relu.stride(0), seen_u8.stride(0), BLOCK=BLOCK_V, num_warps=8)
    return out


def dispatching(fallback: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """`kernels.confidence_at`'s signature: the kernel for CUDA half-precision logits, `fallback`
    (e.g. the compiled function) otherwise."""
    def run(logits: Tensor, relu_table: Tensor, seen_table: Tensor, slot: Tensor, rep: Tensor,
            banned: Tensor) -> Tensor:
        if supported(logits):
            return row_confidence(logits, relu_table, seen_table, banned, slot, rep)
        return fallback(logits, relu_table, seen_table, slot, rep, banned)
    return run
