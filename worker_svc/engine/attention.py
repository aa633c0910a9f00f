"""Attention over the paged KV cache, for both engines: one step's rows write their K/V into
their pages, then attend over the pages they may see.

* `block_rows_attend` (Steerling): 64-token block rows, block-causal ("all earlier pages + my
  page", keys up to the row's `n_visible`); each row writes its whole page. On CUDA in
  bf16/fp16 (with the runner's `BlockKernelUse`) the writes are one Triton launch for K and V
  (`write_block_kv`) and attention is `block_attention`, which reads the pages in place.
* `query_windows_attend` (ISD): query windows of a causal model (decode windows of 1-8
  queries, prompt chunks of up to 64 (`prefill_chunk`; at most `MAX_QUERIES`)); each real query
  token writes its K/V at its absolute position and a key is visible iff its position <= the
  query's. On CUDA in bf16/fp16 both go through `paged_attention`, which reads the pages in place.
* Everything else (CPU, fp32/fp64, no Triton, or a kernel that failed to build on its first
  call: switched off with one warning): gather the row's pages and run SDPA with an additive
  mask (the exact path the CPU tests compare with the reference decoders). On the CPU a
  Steerling row attends alone over exactly its `n_visible` keys (`_RowSdpa`), so its result is
  the same to the bit whatever else is in the step (below).

Batch invariance on the CPU (`_RowSdpa`): gathered into one SDPA call, every row's keys are
padded to the step's page bucket (the longest row's), and how the CPU SDPA kernel blocks its
sums follows the key length (torch 2.13: a row with 200 visible keys padded to 256 and to 512
differs by ~2e-7; from 512 on the results agree), so the same row rounded differently when a
longer request shared its step, or when a replayed request's prefill wrote its K/V: identical
tokens, concept records (hence attributions) off by an ulp that the following layers and blocks
spread. One SDPA call per row over its own visible keys (no mask:
a block row's queries all see keys 0 .. n_visible - 1) has no padding to depend on. The
GEMMs around attention take the step's rows at once; the CPU BLAS computes a row of a
(>= 8)-row product the same way whatever the row count or the row's place
(`tests/test_batch_invariance.py` checks the whole engine's records alone and in company).

Why in place: gathering each row's pages into a contiguous (rows, kv_heads, pages*64, head_dim)
copy costs two gathers, the SDPA launch and its mask per layer, and grows with the context
(Steerling at 4K tokens: 10.6 ms per step against a 5.6 ms floor on an H200; an ISD 4K prompt's
chunks each copied all their visible pages every layer).

`block_attention`: one program per (row, query head, split); its tile is the row's 64 block
queries (bidirectional inside the block: every query sees keys 0 .. n_visible - 1, which is
block-causal because a row's page table holds only pages 0 .. its block); query head h reads kv
head h // group; keys/values are streamed a page at a time with an online softmax in fp32, and
pages past the last visible key are never read.

`paged_attention` (ISD windows: 1 (AR) to 8 queries per decode row, up to 64 per prompt chunk):
the GROUP query heads sharing a kv head and the Q queries are packed into M = Q*GROUP rows
(row t*GROUP + g: query t, head g of the group), cut into `query_tiles` of BLOCK_M <= 64 rows
(at least 16 for `tl.dot`; the (BLOCK_M, D) fp32 accumulator stays in registers at D = 128);
one program per (row, kv head x tile, split). A decode window (M <= 64) is one tile; a 64-query
chunk on GQA 4 is 4 tiles of 16 queries each. A key is visible iff its logical position <= the
query's position -- the runner's mask rule ("everything cached before the window, causal inside
it") -- and each tile reads pages only up to its own furthest query (causal: a chunk's later
tiles read more), never past the row's page table.

Split-KV (flash-decoding), both kernels: at batch 1 there are only rows x heads (x tiles)
programs (8 for an ISD decode window at 4K context on a 132-SM GPU), so each program's visible
pages are cut into `splits` contiguous ranges, one program each, writing fp32 partials (running
max, sum, unnormalised output) that `_merge_splits_kernel` combines (one program per row, query
head and tile of <= 64 queries). `split_count` picks the splits on the host from shapes alone
(the programs launched, the page-table bucket, the SM count), so a CUDA graph per bucket
captures one choice; splits = 1 writes the output directly (no partials, no merge).
`tests/test_block_attention.py` and `tests/test_paged_attention.py` check the kernels against
gather + SDPA under Triton's interpreter, compiled for sm_90, and on a GPU.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from cde.lazy_jit import jit
from worker_svc.engine.kv_cache import KVCache

# The largest query window `paged_attention` serves: isd_engine's largest Q_BUCKETS entry (the
# largest prompt chunk it accepts); tests check the two agree.
MAX_QUERIES = 128
MAX_TILE_ROWS = 64   # packed query rows per program (paged_attention) and queries per merge program

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU installs without Triton: the runner keeps gather + SDPA
    triton = None


# ---- Triton kernels (plain functions, jitted lazily per interpreter mode by `cde.lazy_jit.jit`) -------------

def _paged_attention_kernel(q_ptr, k_ptr, v_ptr, pages_ptr, qpos_ptr, out_ptr, pm_ptr, pl_ptr, pacc_ptr,
                            sq_r, sq_h, sq_t, sk_p, sk_t, sk_h, sp_r, sqp_r, so_r, so_t, so_h,
                            scale, Q, NH, P, M_TILES, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                            D: tl.constexpr, PAGE: tl.constexpr, SPLITS: tl.constexpr):
    """One program per (row, kv head x query tile, split): BLOCK_M of the row's packed
    (query, head-in-group) rows against its keys at positions <= each query's."""
    r = tl.program_id(0)
    kvh = tl.program_id(1) // M_TILES
    tile = tl.program_id(1) % M_TILES
    split = tl.program_id(2)
    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)   # packed (query t, head-in-group g) = t * GROUP + g
    t = m // GROUP
    h = kvh * GROUP + m % GROUP
    real = t < Q
    d = tl.arange(0, D)
    r64 = r.to(tl.int64)
    q = tl.load(q_ptr + r64 * sq_r + h[:, None] * sq_h + t[:, None] * sq_t + d[None, :], mask=real[:, None],
                other=0.0)
    pos = tl.load(qpos_ptr + r64 * sqp_r + t, mask=real, other=-1)
    last = tl.max(pos, 0)          # the tile's furthest query: pages past it are never read
    # (last + PAGE) // PAGE: no negative division (a tile with no query reads nothing); capped at
    # the table, which padding queries (positions past the row's end) may run beyond
    n_pages = tl.minimum((last + PAGE) // PAGE, P)
    per_split = (n_pages + SPLITS - 1) // SPLITS     # this program's contiguous range of pages
    lo = split * per_split
    hi = tl.minimum(lo + per_split, n_pages)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    j = tl.arange(0, PAGE)
    for pi in range(lo, hi):
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
    if SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + r64 * so_r + t[:, None] * so_t + h[:, None] * so_h + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=real[:, None])
    else:   # partials (R, NH, SPLITS, Q[, D]) for `_merge_splits_kernel`
        part = ((r64 * NH + h) * SPLITS + split) * Q + t
        tl.store(pm_ptr + part, m_i, mask=real)
        tl.store(pl_ptr + part, l_i, mask=real)
        tl.store(pacc_ptr + part[:, None] * D + d[None, :], acc, mask=real[:, None])


def _block_attention_kernel(q_ptr, k_ptr, v_ptr, pages_ptr, nvis_ptr, out_ptr, pm_ptr, pl_ptr, pacc_ptr,
                            sq_r, sq_h, sq_t, sk_p, sk_t, sk_h, sp_r, so_r, so_t, so_h,
                            scale, NH, GROUP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                            SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One program per (row, query head, split): the row's 64 block queries against keys
    0 .. n_visible - 1 of its page table (the same keys for every query: bidirectional inside
    the block, block-causal because the table holds only pages 0 .. the row's block)."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    kvh = h // GROUP
    t = tl.arange(0, PAGE)         # BLOCK_M = the row's block = one page of queries
    d = tl.arange(0, D)
    r64 = r.to(tl.int64)
    q = tl.load(q_ptr + r64 * sq_r + h * sq_h + t[:, None] * sq_t + d[None, :])
    n_vis = tl.load(nvis_ptr + r64)
    n_pages = (n_vis + PAGE - 1) // PAGE              # pages past the last visible key are never read
    per_split = (n_pages + SPLITS - 1) // SPLITS
    lo = split * per_split
    hi = tl.minimum(lo + per_split, n_pages)
    m_i = tl.full([PAGE], float("-inf"), tl.float32)
    l_i = tl.zeros([PAGE], tl.float32)
    acc = tl.zeros([PAGE, D], tl.float32)
    for pi in range(lo, hi):       # every page read has >= 1 visible key, so m_i is finite after it
        page = tl.load(pages_ptr + r64 * sp_r + pi).to(tl.int64)
        base = page * sk_p + kvh * sk_h
        k = tl.load(k_ptr + base + t[:, None] * sk_t + d[None, :])
        v = tl.load(v_ptr + base + t[:, None] * sk_t + d[None, :])
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        s = tl.where((pi * PAGE + t)[None, :] < n_vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    if SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + r64 * so_r + t[:, None] * so_t + h * so_h + d[None, :], out.to(out_ptr.dtype.element_ty))
    else:   # partials (R, NH, SPLITS, 64[, D]); an empty split stores m = -inf, l = 0, acc = 0
        part = ((r64 * NH + h) * SPLITS + split) * PAGE + t
        tl.store(pm_ptr + part, m_i)
        tl.store(pl_ptr + part, l_i)
        tl.store(pacc_ptr + part[:, None] * D + d[None, :], acc)


def _merge_splits_kernel(pm_ptr, pl_ptr, pacc_ptr, out_ptr, so_r, so_t, so_h, NH, T,
                         SPLITS: tl.constexpr, BLOCK_T: tl.constexpr, D: tl.constexpr):
    """Flash-decoding merge, one program per (row, query head, tile of BLOCK_T queries):
    out = sum_s w_s acc_s / sum_s w_s l_s with w_s = exp(m_s - max_s m_s)."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    real = t < T
    d = tl.arange(0, D)
    r64 = r.to(tl.int64)
    first = (r64 * NH + h) * SPLITS * T + t
    m_max = tl.full([BLOCK_T], float("-inf"), tl.float32)
    for s in range(SPLITS):
        m_max = tl.maximum(m_max, tl.load(pm_ptr + first + s * T, mask=real, other=float("-inf")))
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)     # a query that saw no key at all
    l_sum = tl.zeros([BLOCK_T], tl.float32)
    acc = tl.zeros([BLOCK_T, D], tl.float32)
    for s in range(SPLITS):
        w = tl.exp(tl.load(pm_ptr + first + s * T, mask=real, other=float("-inf")) - m_safe)
        l_sum += w * tl.load(pl_ptr + first + s * T, mask=real, other=0.0)
        acc += w[:, None] * tl.load(pacc_ptr + (first + s * T)[:, None] * D + d[None, :], mask=real[:, None],
                                    other=0.0)
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    tl.store(out_ptr + r64 * so_r + t[:, None] * so_t + h * so_h + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=real[:, None])


def _write_block_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, page_ptr, sk_r, sk_h, sk_t, sv_r, sv_h, sv_t,
                           sc_p, sc_t, sc_h, D: tl.constexpr, PAGE: tl.constexpr):
    """K and V of row r's block (strided views of the qkv projection) into page write_page[r], one
    program per (row, kv head): one launch for both tensors, no contiguous copy of the sources."""
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    t = tl.arange(0, PAGE)
    d = tl.arange(0, D)
    r64 = r.to(tl.int64)
    dst = tl.load(page_ptr + r64).to(tl.int64) * sc_p + kvh * sc_h + t[:, None] * sc_t + d[None, :]
    k = tl.load(k_ptr + r64 * sk_r + kvh * sk_h + t[:, None] * sk_t + d[None, :])
    v = tl.load(v_ptr + r64 * sv_r + kvh * sv_h + t[:, None] * sv_t + d[None, :])
    tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty))
    tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty))


def _kernel():
    return jit(_paged_attention_kernel)


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


# ---- splits (flash-decoding) ------------------------------------------------------------------

SPLIT_WAVES = 2              # aim for ~2 programs per SM
MIN_PAGES_PER_SPLIT = 2      # a split of one page is mostly merge overhead
MAX_SPLITS = 32
# Block rows split only past this many pages: their partials are 64 queries x head_dim fp32 per
# split, so at short contexts the merge costs more than the parallelism gains (H200, one row,
# bench/results/kernels-micro-h200-67ea389.json: 4 pages 7.3 us unsplit vs 10.0 split in 2; 8 pages
# 11.4 vs 11.7; 16 pages 19.6 vs 17.2 split in 8)
BLOCK_SPLIT_MIN_PAGES = 9


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def split_count(programs: int, n_pages: int, device: torch.device) -> int:
    """Key splits for a grid of `programs` (rows x heads) over page tables of `n_pages`, from
    shapes only (a CUDA graph per bucket captures one choice): enough programs to fill ~2 waves
    of the GPU's SMs, at least MIN_PAGES_PER_SPLIT pages each. 1 off CUDA (the interpreter:
    tests force their splits)."""
    if device.type != "cuda":
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    want = -(-SPLIT_WAVES * sms // programs)
    return max(1, min(want, n_pages // MIN_PAGES_PER_SPLIT, MAX_SPLITS))


def _partials(rows: int, n_h: int, splits: int, n_q: int, d: int, device) -> tuple[Tensor, Tensor, Tensor]:
    """Per-split running max, sum and unnormalised output (fp32); unused placeholders at 1 split."""
    if splits == 1:
        empty = torch.empty(1, dtype=torch.float32, device=device)
        return empty, empty, empty
    f32 = dict(dtype=torch.float32, device=device)
    return (torch.empty(rows, n_h, splits, n_q, **f32), torch.empty(rows, n_h, splits, n_q, **f32),
            torch.empty(rows, n_h, splits, n_q, d, **f32))


def _merge(partials: tuple[Tensor, Tensor, Tensor], out: Tensor, splits: int) -> None:
    r, n_q, n_h, d = out.shape
    block_t = min(MAX_TILE_ROWS, _next_power_of_2(n_q))      # (block_t, D) fp32 accumulator per program
    jit(_merge_splits_kernel)[(r, n_h, -(-n_q // block_t))](*partials, out, out.stride(0), out.stride(1),
                                                            out.stride(2), n_h, n_q, SPLITS=splits,
                                                            BLOCK_T=block_t, D=d)


# ---- ISD query windows (decode windows and prompt chunks) ------------------------------------

def query_tiles(n_q: int, group: int) -> tuple[int, int]:
    """(BLOCK_M, tiles) of a window of n_q queries on `group` query heads per kv head: its
    n_q * group packed rows in tiles of at most MAX_TILE_ROWS (the (BLOCK_M, D) fp32
    accumulator stays in registers at D = 128) and at least 16 (`tl.dot`). Decode windows
    (n_q * group <= 64) are one tile."""
    packed = n_q * group
    block_m = max(16, min(MAX_TILE_ROWS, _next_power_of_2(packed)))
    return block_m, -(-packed // block_m)


def supported(q: Tensor) -> bool:
    """Whether `paged_attention` serves this step's queries (else: gather + SDPA)."""
    return (triton is not None and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
            and q.shape[2] <= MAX_QUERIES)


def paged_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, pages: Tensor, positions: Tensor,
                    splits: int | None = None) -> Tensor:
    """softmax(q K^T / sqrt(d)) V over each row's pages, keys at logical positions <= the query's.

    q (R, H, Q, D); k_pool, v_pool (pages, 64, KV, D) (one layer of the pool, last dim
    contiguous); pages (R, P) long, logical block -> physical page (padded with scratch page
    0: never read past a tile's last query nor past P); positions (R, Q) long. splits: key
    splits (default `split_count`; 1 = one program per (row, kv head, query tile), no merge).
    Returns (R, H, Q, D),
    a transposed view of a (R, Q, H, D) tensor (what the output projection reads).
    """
    r, n_h, n_q, d = q.shape
    n_kv, page = k_pool.shape[2], k_pool.shape[1]
    group = n_h // n_kv
    block_m, tiles = query_tiles(n_q, group)
    splits = splits or split_count(r * n_kv * tiles, pages.shape[1], q.device)
    out = torch.empty(r, n_q, n_h, d, dtype=q.dtype, device=q.device)
    if q.stride(3) != 1:
        q = q.contiguous()
    assert k_pool.stride(3) == 1 and k_pool.stride() == v_pool.stride()
    pages, positions = pages.contiguous(), positions.contiguous()
    partials = _partials(r, n_h, splits, n_q, d, q.device)
    _kernel()[(r, n_kv * tiles, splits)](q, k_pool, v_pool, pages, positions, out, *partials,
                                         q.stride(0), q.stride(1), q.stride(2), k_pool.stride(0),
                                         k_pool.stride(1), k_pool.stride(2), pages.stride(0), positions.stride(0),
                                         out.stride(0), out.stride(1), out.stride(2),
                                         d ** -0.5, n_q, n_h, pages.shape[1], tiles, GROUP=group, BLOCK_M=block_m,
                                         D=d, PAGE=page, SPLITS=splits)
    if splits > 1:
        _merge(partials, out, splits)
    return out.transpose(1, 2)


# ---- Steerling block rows ---------------------------------------------------------------------

def block_supported(q: Tensor, k_pool: Tensor) -> bool:
    """Whether `block_attention` serves these block rows (else: gather + SDPA)."""
    d = q.shape[3]
    return (triton is not None and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
            and k_pool.dtype == q.dtype and q.shape[2] == k_pool.shape[1] and d >= 16 and d & (d - 1) == 0)


def write_block_kv(k_pool: Tensor, v_pool: Tensor, write_page: Tensor, k: Tensor, v: Tensor) -> None:
    """Row r's block K/V (R, KV, 64, D) into page write_page[r] of the pool, one launch."""
    r, n_kv, page, d = k.shape
    assert k.stride(3) == 1 and v.stride(3) == 1 and k_pool.stride(3) == 1 and k_pool.stride() == v_pool.stride()
    jit(_write_block_kv_kernel)[(r, n_kv)](k, v, k_pool, v_pool, write_page.contiguous(),
                                            k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
                                            v.stride(2), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
                                            D=d, PAGE=page)


def block_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, pages: Tensor, n_visible: Tensor,
                    splits: int | None = None) -> Tensor:
    """softmax(q K^T / sqrt(d)) V of 64-query block rows over keys 0 .. n_visible[r] - 1 of
    their page tables, read in place.

    q (R, H, 64, D); k_pool, v_pool (pages, 64, KV, D); pages (R, P) long; n_visible (R,)
    long. splits: key splits (default `split_count`). Returns (R, H, 64, D), a transposed view
    of a (R, 64, H, D) tensor.
    """
    r, n_h, n_q, d = q.shape
    n_kv, page = k_pool.shape[2], k_pool.shape[1]
    if not splits:
        splits = 1 if pages.shape[1] < BLOCK_SPLIT_MIN_PAGES else split_count(r * n_h, pages.shape[1], q.device)
    out = torch.empty(r, n_q, n_h, d, dtype=q.dtype, device=q.device)
    if q.stride(3) != 1:
        q = q.contiguous()
    assert k_pool.stride(3) == 1 and k_pool.stride() == v_pool.stride()
    pages, n_visible = pages.contiguous(), n_visible.contiguous()
    partials = _partials(r, n_h, splits, n_q, d, q.device)
    # fp32 inputs only under the interpreter (tests): exact products there
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    jit(_block_attention_kernel)[(r, n_h, splits)](
        q, k_pool, v_pool, pages, n_visible, out, *partials,
        q.stride(0), q.stride(1), q.stride(2), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        pages.stride(0), out.stride(0), out.stride(1), out.stride(2),
        d ** -0.5, n_h, GROUP=n_h // n_kv, D=d, PAGE=page, SPLITS=splits, DOT_PRECISION=precision)
    if splits > 1:
        _merge(partials, out, splits)
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


class KernelUse:
    """Whether a Triton path serves its calls (switched off for good, with one warning, when it
    fails to build on its first call), and how often it did."""

    name = "Triton"

    def __init__(self) -> None:
        self.enabled = True
        self.calls = 0

    def _guarded(self, fn: Callable[..., Tensor], *args: Tensor) -> Tensor | None:
        try:
            out = fn(*args)
        except Exception as exc:   # a Triton build this kernel does not compile on
            if self.calls:
                raise
            self.enabled = False
            warnings.warn(f"{self.name} kernel unavailable ({type(exc).__name__}: {exc}); "
                          "using gather + SDPA", stacklevel=4)
            return None
        self.calls += 1
        return out


class PagedKernelUse(KernelUse):
    """The ISD query windows' kernel (`paged_attention`: decode windows and prompt chunks)."""

    name = "paged attention"

    def run(self, q: Tensor, kc: Tensor, vc: Tensor, pages: Tensor, positions: Tensor) -> Tensor | None:
        if not (self.enabled and supported(q)):
            return None
        return self._guarded(paged_attention, q, kc, vc, pages, positions)


def _write_and_attend(q: Tensor, k: Tensor, v: Tensor, kc: Tensor, vc: Tensor, write_page: Tensor,
                      pages: Tensor, n_visible: Tensor) -> Tensor:
    # every row's write is queued before any row reads: a request's commit row and decode row
    # may share the step (the decode row reads the commit row's page)
    write_block_kv(kc, vc, write_page, k, v)
    return block_attention(q, kc, vc, pages, n_visible)


class BlockKernelUse(KernelUse):
    """The Steerling block rows' kernels (`write_block_kv` + `block_attention`)."""

    name = "block attention"

    def run(self, q: Tensor, k: Tensor, v: Tensor, kc: Tensor, vc: Tensor, write_page: Tensor, pages: Tensor,
            n_visible: Tensor) -> Tensor | None:
        if not (self.enabled and block_supported(q, kc)):
            return None
        # a failed build writes nothing or the same bytes the fallback's index_copy_ writes again
        return self._guarded(_write_and_attend, q, k, v, kc, vc, write_page, pages, n_visible)


class _RowSdpa:
    """CPU: attention of each Steerling row alone over exactly its visible keys (0 .. n_visible
    - 1, all of them visible to every query of the row, so no mask): a row's result depends on
    its own queries and keys only, never on the step's page bucket or its other rows (the
    module docstring says why the batched call did). Host values, so never inside a CUDA graph."""

    def __init__(self, kv: KVCache, pages: Tensor, n_visible: Tensor):
        self.kv = kv
        page = kv.page
        self.rows = [(pages[i, : -(-n // page)], n) for i, n in enumerate(n_visible.tolist())]

    def __call__(self, layer: int, q: Tensor) -> Tensor:
        kc, vc = self.kv.k[layer], self.kv.v[layer]                           # (pages, 64, KV, hd)
        n_kv, hd = kc.shape[2], kc.shape[3]
        out = torch.empty_like(q)                                             # (R, H, 64, hd)
        for i, (pages, n) in enumerate(self.rows):
            keys = kc.index_select(0, pages).view(-1, n_kv, hd)[:n].transpose(0, 1)[None]
            vals = vc.index_select(0, pages).view(-1, n_kv, hd)[:n].transpose(0, 1)[None]
            out[i] = F.scaled_dot_product_attention(q[i:i + 1], keys.to(q.dtype), vals.to(q.dtype),
                                                    enable_gqa=True)[0]
        return out


def block_rows_attend(kv: KVCache, write_page: Tensor, pages: Tensor, n_visible: Tensor,
                      kernel: BlockKernelUse | None = None) -> AttendFn:
    """Steerling rows: each row's block K/V goes to its page `write_page`; it sees keys
    0 .. n_visible - 1 of its page table (block-causal). With `kernel` (CUDA, bf16/fp16) the
    pages are read in place; else (or once it failed to build) gather + SDPA: on the CPU one
    call per row over its own keys (`_RowSdpa`: batch invariant), elsewhere one masked call."""
    sdpa: _GatheredSdpa | _RowSdpa | None = None

    def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        nonlocal sdpa
        kc, vc = kv.k[layer], kv.v[layer]
        if kernel is not None:
            out = kernel.run(q, k, v, kc, vc, write_page, pages, n_visible)
            if out is not None:
                return out
        kc.index_copy_(0, write_page, k.transpose(1, 2).to(kc.dtype))
        vc.index_copy_(0, write_page, v.transpose(1, 2).to(vc.dtype))
        if sdpa is None:   # the mask only where gather + SDPA runs
            if kc.device.type == "cpu":
                sdpa = _RowSdpa(kv, pages, n_visible)
            else:
                key_pos = torch.arange(pages.shape[1] * kv.page, device=pages.device)
                sdpa = _GatheredSdpa(kv, pages, (key_pos[None, :] < n_visible[:, None])[:, None, None, :])  # (R,1,1,P*64)
        return sdpa(layer, q)

    return attend


def query_windows_attend(kv: KVCache, write_idx: Tensor, pages: Tensor, positions: Tensor,
                         kernel: PagedKernelUse) -> AttendFn:
    """ISD rows: query token (r, j) writes its K/V at flat page slot write_idx[r, j] (page * 64 +
    offset) and sees the keys at positions <= positions[r, j]."""
    n_kv, hd = kv.k.shape[3], kv.k.shape[4]
    sdpa: _GatheredSdpa | None = None
    # flat (page, offset, head) row of every (row, query, head) K/V vector
    heads = torch.arange(n_kv, device=pages.device)[None, None, :]
    widx = (write_idx[:, :, None] * n_kv + heads).reshape(-1)                                  # (R*Q*KV,)

    def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        nonlocal sdpa
        kc, vc = kv.k[layer], kv.v[layer]
        kc.view(-1, hd).index_copy_(0, widx, k.transpose(1, 2).reshape(-1, hd).to(kc.dtype))
        vc.view(-1, hd).index_copy_(0, widx, v.transpose(1, 2).reshape(-1, hd).to(vc.dtype))
        out = kernel.run(q, kc, vc, pages, positions)   # on the GPU in half precision: pages read in place
        if out is not None:
            return out
        if sdpa is None:   # the (R, 1, Q, P*64) mask only where gather + SDPA runs
            key_pos = torch.arange(pages.shape[1] * kv.page, device=pages.device)
            sdpa = _GatheredSdpa(kv, pages, (key_pos[None, None, :] <= positions[:, :, None])[:, None])
        return sdpa(layer, q)

    return attend
