"""Causal attention of a few query tokens straight over the paged KV pool (Triton).

The ISD runner's decode steps have 1 (AR) to 8 (stride 4: 2N-1 = 7, bucketed) queries per
row. Gathering each row's pages into a contiguous (rows, kv_heads, pages*64, head_dim) copy
and running SDPA with an additive mask costs two gathers, the SDPA launch and its mask per
layer: at batch 1 on an H200 that was ~0.5 ms of a ~6 ms step (36 layers). This kernel reads
the pages in place, one program per (row, kv head): the GROUP query heads sharing that kv
head and the Q queries are packed into one M = Q*GROUP block (at least 16 rows for
`tl.dot`), keys/values are streamed page by page with an online softmax (fp32), and a key is
visible iff its logical position <= the query's position -- the runner's mask rule
("everything cached before the window, causal inside it").

Only used on CUDA for bf16/fp16 activations and windows of at most `MAX_QUERIES` queries;
prefill chunks and the float32/float64 paths keep the gather + SDPA code (the exact one the
CPU tests compare with the reference decoder). `tests/test_paged_attention.py` checks it
against that path under Triton's interpreter and, on a GPU, compiled.
"""

from __future__ import annotations

import torch
from torch import Tensor

MAX_QUERIES = 8

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU installs without Triton: the runner keeps gather + SDPA
    triton = None


def _paged_attention_kernel(q_ptr, k_ptr, v_ptr, pages_ptr, qpos_ptr, out_ptr,
                            sq_r, sq_h, sq_t, sk_p, sk_t, sk_h, sp_r, sqp_r, so_r, so_t, so_h,
                            scale, Q, GROUP: tl.constexpr, M: tl.constexpr, D: tl.constexpr,
                            PAGE: tl.constexpr):
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    m = tl.arange(0, M)            # packed (query t, head-in-group g) = t * GROUP + g
    t = m // GROUP
    h = kvh * GROUP + m % GROUP
    real = t < Q
    d = tl.arange(0, D)
    r64 = r.to(tl.int64)
    q = tl.load(q_ptr + r64 * sq_r + h[:, None] * sq_h + t[:, None] * sq_t + d[None, :], mask=real[:, None],
                other=0.0)
    pos = tl.load(qpos_ptr + r64 * sqp_r + t, mask=real, other=-1)
    last = tl.max(pos, 0)          # the row's furthest query: pages past it are never read
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, D], tl.float32)
    j = tl.arange(0, PAGE)
    for pi in range(0, last // PAGE + 1):
        page = tl.load(pages_ptr + r64 * sp_r + pi).to(tl.int64)
        base = page * sk_p + kvh * sk_h
        k = tl.load(k_ptr + base + j[:, None] * sk_t + d[None, :])
        v = tl.load(v_ptr + base + j[:, None] * sk_t + d[None, :])
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        s = tl.where((pi * PAGE + j)[None, :] <= pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)     # a row with nothing visible yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + r64 * so_r + t[:, None] * so_t + h[:, None] * so_h + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=real[:, None])


_JITTED: dict[bool, object] = {}


def _kernel():
    """Jitted lazily, per mode: `triton.jit` picks the CPU interpreter (TRITON_INTERPRET=1)
    or the compiler when it wraps the function."""
    mode = bool(triton.knobs.runtime.interpret)
    if mode not in _JITTED:
        _JITTED[mode] = triton.jit(_paged_attention_kernel)
    return _JITTED[mode]


def supported(q: Tensor) -> bool:
    """Whether `paged_attention` serves this step's queries (else: gather + SDPA)."""
    return (triton is not None and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
            and q.shape[2] <= MAX_QUERIES)


def paged_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, pages: Tensor, positions: Tensor) -> Tensor:
    """softmax(q K^T / sqrt(d)) V over each row's pages, keys at logical positions <= the query's.

    q (R, H, Q, D); k_pool, v_pool (pages, 64, KV, D) (one layer of the pool, last dim
    contiguous); pages (R, P) long, logical block -> physical page (padded with scratch page
    0: never read past the row's last query); positions (R, Q) long. Returns (R, H, Q, D), a
    transposed view of a (R, Q, H, D) tensor (what the output projection reads).
    """
    r, n_h, n_q, d = q.shape
    n_kv, page = k_pool.shape[2], k_pool.shape[1]
    group = n_h // n_kv
    out = torch.empty(r, n_q, n_h, d, dtype=q.dtype, device=q.device)
    m = max(16, triton.next_power_of_2(n_q * group))
    if q.stride(3) != 1:
        q = q.contiguous()
    assert k_pool.stride(3) == 1 and k_pool.stride() == v_pool.stride()
    pages, positions = pages.contiguous(), positions.contiguous()
    _kernel()[(r, n_kv)](q, k_pool, v_pool, pages, positions, out,
                         q.stride(0), q.stride(1), q.stride(2), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
                         pages.stride(0), positions.stride(0), out.stride(0), out.stride(1), out.stride(2),
                         d ** -0.5, n_q, GROUP=group, M=m, D=d, PAGE=page)
    return out.transpose(1, 2)
