"""Attention over the paged KV cache, for both engines: one step's rows write their K/V into
their pages, then attend over the pages they may see.

* `block_rows_attend` (Steerling): 64-token block rows, block-causal ("all earlier pages + my
  page", keys up to the row's `n_visible`); each row writes its whole page.
* `query_windows_attend` (ISD): short query windows of a causal model; each real query token
  writes its K/V at its absolute position and a key is visible iff its position <= the query's.
  On CUDA in bf16/fp16, windows of at most `MAX_QUERIES` queries go through the Triton kernel
  below, which reads the pages in place.
* Everything else: gather the row's pages and run SDPA with an additive mask (the exact path
  the CPU tests compare with the reference decoders).

The Triton kernel: the ISD runner's decode steps have 1 (AR) to 8 (stride 4: 2N-1 = 7,
bucketed) queries per row. Gathering each row's pages into a contiguous (rows, kv_heads,
pages*64, head_dim) copy and running SDPA with an additive mask costs two gathers, the SDPA
launch and its mask per layer: at batch 1 on an H200 that was ~0.5 ms of a ~6 ms step (36
layers). The kernel reads the pages in place, one program per (row, kv head): the GROUP query
heads sharing that kv head and the Q queries are packed into one M = Q*GROUP block (at least
16 rows for `tl.dot`), keys/values are streamed page by page with an online softmax (fp32),
and a key is visible iff its logical position <= the query's position -- the runner's mask
rule ("everything cached before the window, causal inside it"). `tests/test_paged_attention.py`
checks it against gather + SDPA under Triton's interpreter and, on a GPU, compiled.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from worker_svc.engine.kv_cache import KVCache

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


# ---- gather + SDPA, and the two row shapes ---------------------------------------------------

AttendFn = Callable[[int, Tensor, Tensor, Tensor], Tensor]   # (layer, q, k, v) -> attention output


def additive_mask(visible: Tensor, dtype: torch.dtype) -> Tensor:
    """0 where a key is visible, -inf elsewhere. Built once per step: given a bool mask, SDPA
    converts it again in every layer (a `where` and two fills per layer)."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


class _GatheredSdpa:
    """Attention of R rows over their gathered page tables; the additive mask is built once per
    step and activation dtype."""

    def __init__(self, kv: KVCache, pages: Tensor, visible: Tensor):
        self.kv = kv
        self.rows, self.n_pages = pages.shape
        self.flat_pages = pages.reshape(-1)
        self.visible = visible
        self.masks: dict[torch.dtype, Tensor] = {}

    def __call__(self, layer: int, q: Tensor) -> Tensor:
        mask = self.masks.get(q.dtype)
        if mask is None:
            mask = self.masks[q.dtype] = additive_mask(self.visible, q.dtype)
        kc, vc = self.kv.k[layer], self.kv.v[layer]                           # (pages, 64, KV, hd)
        n_kv, hd = kc.shape[2], kc.shape[3]
        shape = (self.rows, self.n_pages * kc.shape[1], n_kv, hd)
        keys = kc.index_select(0, self.flat_pages).view(shape).transpose(1, 2)
        vals = vc.index_select(0, self.flat_pages).view(shape).transpose(1, 2)
        return F.scaled_dot_product_attention(q, keys.to(q.dtype), vals.to(q.dtype), attn_mask=mask,
                                              enable_gqa=True)


def block_rows_attend(kv: KVCache, write_page: Tensor, pages: Tensor, n_visible: Tensor) -> AttendFn:
    """Steerling rows: each row's block K/V goes to its page `write_page`; it sees keys
    0 .. n_visible - 1 of its page table (block-causal)."""
    key_pos = torch.arange(pages.shape[1] * kv.page, device=pages.device)
    sdpa = _GatheredSdpa(kv, pages, (key_pos[None, :] < n_visible[:, None])[:, None, None, :])   # (R, 1, 1, P*64)

    def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        kc, vc = kv.k[layer], kv.v[layer]
        kc.index_copy_(0, write_page, k.transpose(1, 2).to(kc.dtype))
        vc.index_copy_(0, write_page, v.transpose(1, 2).to(vc.dtype))
        return sdpa(layer, q)

    return attend


class PagedKernelUse:
    """Whether the Triton kernel serves decode windows (switched off for good when it fails to
    build on its first call), and how often it did."""

    def __init__(self) -> None:
        self.enabled = True
        self.calls = 0

    def run(self, q: Tensor, kc: Tensor, vc: Tensor, pages: Tensor, positions: Tensor) -> Tensor | None:
        if not (self.enabled and supported(q)):
            return None
        try:
            out = paged_attention(q, kc, vc, pages, positions)
        except Exception as exc:   # a Triton build this kernel does not compile on
            if self.calls:
                raise
            self.enabled = False
            warnings.warn(f"paged attention kernel unavailable ({type(exc).__name__}: {exc}); "
                          "using gather + SDPA", stacklevel=3)
            return None
        self.calls += 1
        return out


def query_windows_attend(kv: KVCache, write_idx: Tensor, pages: Tensor, positions: Tensor,
                         kernel: PagedKernelUse) -> AttendFn:
    """ISD rows: query token (r, j) writes its K/V at flat page slot write_idx[r, j] (page * 64 +
    offset) and sees the keys at positions <= positions[r, j]."""
    n_kv, hd = kv.k.shape[3], kv.k.shape[4]
    key_pos = torch.arange(pages.shape[1] * kv.page, device=pages.device)
    sdpa = _GatheredSdpa(kv, pages, (key_pos[None, None, :] <= positions[:, :, None])[:, None])   # (R, 1, Q, P*64)
    # flat (page, offset, head) row of every (row, query, head) K/V vector
    heads = torch.arange(n_kv, device=pages.device)[None, None, :]
    widx = (write_idx[:, :, None] * n_kv + heads).reshape(-1)                                  # (R*Q*KV,)

    def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        kc, vc = kv.k[layer], kv.v[layer]
        kc.view(-1, hd).index_copy_(0, widx, k.transpose(1, 2).reshape(-1, hd).to(kc.dtype))
        vc.view(-1, hd).index_copy_(0, widx, v.transpose(1, 2).reshape(-1, hd).to(vc.dtype))
        out = kernel.run(q, kc, vc, pages, positions)   # decode windows on the GPU: pages read in place
        return out if out is not None else sdpa(layer, q)

    return attend
