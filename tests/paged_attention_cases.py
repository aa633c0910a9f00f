"""Random paged-attention cases (ISD decode windows and prompt chunks, Steerling block rows) and
the gather + SDPA path they are checked against, shared by tests/test_paged_attention.py,
tests/test_block_attention.py and the child processes that run the Triton kernels under the CPU
interpreter (``interpreter_child``, ``chunk_interpreter_child``, ``block_interpreter_child``,
``split_interpreter_child``) or compile them for sm_90 (``tests.triton_child.sm90_compile_child``)."""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from torch import Tensor

from cde.blocks import PAGE


def make_case(seed: int, n_q: int, dtype=torch.float32, device="cpu", n_rows=3, n_h=8, n_kv=2, d=32, n_pages=16):
    """Random pool, page tables (physical pages shuffled) and query windows at different offsets,
    the way the ISD runner lays them out: row i's window starts at `start[i]`."""
    g = torch.Generator().manual_seed(seed)
    k_pool = torch.randn(n_pages, PAGE, n_kv, d, generator=g)
    v_pool = torch.randn(n_pages, PAGE, n_kv, d, generator=g)
    q = torch.randn(n_rows, n_h, n_q, d, generator=g)
    starts = [int(x) for x in torch.randint(0, 3 * PAGE - n_q, (n_rows,), generator=g)]
    starts[0] = 0                                      # a window at the very first position
    perm = torch.randperm(n_pages - 1, generator=g) + 1
    n_tab = 4
    pages = perm[: n_rows * n_tab].view(n_rows, n_tab).clone()
    for i, s in enumerate(starts):                     # entries past the last query: scratch page 0
        pages[i, (s + n_q - 1) // PAGE + 1:] = 0
    positions = torch.tensor(starts)[:, None] + torch.arange(n_q)[None, :]
    to = lambda t: t.to(device=device, dtype=dtype)    # noqa: E731
    return to(q), to(k_pool), to(v_pool), pages.to(device), positions.to(device)


def reference(q, k_pool, v_pool, pages, positions):
    """The runner's path: gather the pages, additive mask key position <= query position, SDPA."""
    r, p = pages.shape
    n_kv, d = k_pool.shape[2], k_pool.shape[3]
    keys = k_pool.index_select(0, pages.reshape(-1)).view(r, p * PAGE, n_kv, d).transpose(1, 2)
    vals = v_pool.index_select(0, pages.reshape(-1)).view(r, p * PAGE, n_kv, d).transpose(1, 2)
    visible = torch.arange(p * PAGE, device=q.device)[None, None, :] <= positions[:, :, None]
    mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill_(~visible, float("-inf"))[:, None]
    return F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, enable_gqa=True)


def interpreter_child() -> None:
    from worker_svc.engine.attention import paged_attention

    worst = 0.0
    for seed, n_q in ((1, 1), (2, 3), (3, 7), (4, 8)):
        case = make_case(seed, n_q)
        got, want = paged_attention(*case), reference(*case)
        assert got.shape == want.shape
        worst = max(worst, float((got - want).abs().max()))
    print(json.dumps({"max_abs_err": worst}))


# ---- ISD prompt chunks ------------------------------------------------------------------------

def make_chunk_case(seed: int, n_q: int, dtype=torch.float32, device="cpu", n_h=4, n_kv=2, d=32, n_pages=24,
                    n_tab=4):
    """Prompt-chunk rows of n_q queries the way the ISD engine lays them out (one table width for
    the step, physical pages shuffled, positions start + j for every query, padding included):
    0: a prompt's first chunk (start 0) whose table also holds its later chunks' pages (keys it
       must not see); 1: a chunk starting mid-page; 2: one starting on a page boundary, table
       entries past its window scratch page 0; 3: the prompt's last chunk, shorter than n_q,
       ending on the table's last key: its padding queries' positions run past the table;
    4: a padding row (scratch page 0, positions 0 .. n_q - 1)."""
    assert n_q <= (n_tab - 1) * PAGE
    g = torch.Generator().manual_seed(seed)
    rnd = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))   # noqa: E731  lo..hi
    span = n_tab * PAGE
    mid = PAGE * rnd(0, (span - n_q) // PAGE - 1) + rnd(1, PAGE - 1)
    mid = min(mid, span - n_q)
    boundary = PAGE * rnd(0, (span - n_q) // PAGE)
    last_len = rnd(1, n_q - 1)
    starts = [0, mid, boundary, span - last_len, 0]
    perm = (torch.randperm(n_pages - 1, generator=g) + 1)[: 4 * n_tab].view(4, n_tab)
    pages = torch.zeros(5, n_tab, dtype=torch.long)
    pages[:4] = perm
    pages[2, (boundary + n_q - 1) // PAGE + 1:] = 0
    positions = torch.tensor(starts)[:, None] + torch.arange(n_q)[None, :]
    k_pool = torch.randn(n_pages, PAGE, n_kv, d, generator=g)
    v_pool = torch.randn(n_pages, PAGE, n_kv, d, generator=g)
    q = torch.randn(5, n_h, n_q, d, generator=g)
    to = lambda t: t.to(device=device, dtype=dtype)    # noqa: E731
    return to(q), to(k_pool), to(v_pool), pages.to(device), positions.to(device)


# (n_q, n_h, n_kv, splits) under the interpreter: one tile (16 x GQA 2 = 32 packed rows), GQA 3
# (33 x 3 = 99 rows: 2 tiles, the boundary inside a query's heads), 64 x GQA 2 (2 tiles) and
# 64 x GQA 4 (4 tiles), with 1 and several key splits; 128 queries without GQA (2 tiles; the
# merge in 2 tiles of 64 queries)
CHUNK_INTERPRETER_CASES = ((16, 4, 2, 1), (16, 4, 2, 3), (33, 6, 2, 1), (33, 6, 2, 2), (64, 4, 2, 2),
                           (64, 8, 2, 1), (128, 2, 2, 2))


def chunk_interpreter_child(seed: int) -> None:
    """The ISD kernel on prompt chunks against gather + SDPA, and with positions - 1 (an
    off-by-one in the causal rule the comparison must catch)."""
    from worker_svc.engine.attention import paged_attention, query_tiles

    reports = {}
    for i, (n_q, n_h, n_kv, splits) in enumerate(CHUNK_INTERPRETER_CASES):
        q, k_pool, v_pool, pages, positions = make_chunk_case(seed + i, n_q, n_h=n_h, n_kv=n_kv)
        want = reference(q, k_pool, v_pool, pages, positions)
        got = paged_attention(q, k_pool, v_pool, pages, positions, splits=splits)
        shifted = paged_attention(q, k_pool, v_pool, pages, positions - 1, splits=splits)
        reports[f"{n_q}q x {n_h}/{n_kv} heads x {splits} splits"] = {
            "tiles": query_tiles(n_q, n_h // n_kv)[1],
            "layout": list(got.shape) == list(want.shape) and got.transpose(1, 2).is_contiguous(),
            "max_abs_err": float((got - want).abs().max()),
            # the least any real row moves (queries at positions >= 1: at 0, nothing is left to see)
            "off_by_one_err": min(float((shifted - want)[i, :, positions[i] >= 1].abs().max()) for i in range(4))}
    print(json.dumps(reports))


# ---- Steerling block rows ---------------------------------------------------------------------

def make_block_case(seed: int, dtype=torch.float32, device="cpu", n_h=8, n_kv=2, d=32, n_pages=32, n_tab=5):
    """Block rows the way the Steerling runner lays them out: row r is block b of its request,
    its page table holds the request's pages 0..b (physical pages shuffled, the rest scratch page
    0), its block K/V goes to its own page, and it sees keys 0 .. n_visible - 1 = 64 * b + row_len - 1.
    Rows: one that sees only (part of) its own page, one ending mid-page, one ending on a page
    boundary, a full table, a random one, and a padding row (scratch page 0, n_visible 64)."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda hi: int(torch.randint(1, hi + 1, (1,), generator=g))   # noqa: E731  1..hi
    blocks = [0, rnd(n_tab - 2), rnd(n_tab - 1), n_tab - 1, rnd(n_tab) - 1]
    row_lens = [rnd(PAGE - 1), rnd(PAGE - 1), PAGE, rnd(PAGE), rnd(PAGE)]
    perm = (torch.randperm(n_pages - 1, generator=g) + 1)[: len(blocks) * n_tab].view(len(blocks), n_tab)
    pages = torch.zeros(len(blocks) + 1, n_tab, dtype=torch.long)            # last row: padding
    for i, b in enumerate(blocks):
        pages[i, : b + 1] = perm[i, : b + 1]
    n_rows = pages.shape[0]
    write_page = pages[torch.arange(n_rows), torch.tensor(blocks + [0])].clone()
    n_visible = torch.tensor([PAGE * b + n for b, n in zip(blocks, row_lens)] + [PAGE])
    k_pool = torch.randn(n_pages, PAGE, n_kv, d, generator=g)
    v_pool = torch.randn(n_pages, PAGE, n_kv, d, generator=g)
    q = torch.randn(n_rows, n_h, PAGE, d, generator=g)
    # the block's own K/V as the model hands them over: (R, KV, 64, D) views of a (R, 64, KV, D) tensor
    k = torch.randn(n_rows, PAGE, n_kv, d, generator=g).transpose(1, 2)
    v = torch.randn(n_rows, PAGE, n_kv, d, generator=g).transpose(1, 2)
    to = lambda t: t.to(device=device, dtype=dtype)    # noqa: E731
    return dict(q=to(q), k=to(k), v=to(v), k_pool=to(k_pool), v_pool=to(v_pool), write_page=write_page.to(device),
                pages=pages.to(device), n_visible=n_visible.to(device))


def block_gather_sdpa(case: dict) -> tuple[Tensor, Tensor, Tensor]:
    """The runner's fallback (block_rows_attend without a kernel): pools after the write, output."""
    from worker_svc.engine.attention import block_rows_attend
    from worker_svc.engine.kv_cache import KVCache

    k_pool = case["k_pool"]
    kv = KVCache(1, k_pool.shape[0], k_pool.shape[2], PAGE, k_pool.shape[3], k_pool.dtype, k_pool.device)
    kv.k[0].copy_(k_pool)
    kv.v[0].copy_(case["v_pool"])
    attend = block_rows_attend(kv, case["write_page"], case["pages"], case["n_visible"])
    out = attend(0, case["q"], case["k"], case["v"])
    return kv.k[0], kv.v[0], out


def block_kernel_errors(case: dict, splits: int) -> dict:
    """The Triton write + block attention against `block_gather_sdpa`, and the same kernel with
    n_visible - 1 (an off-by-one in visibility the comparison must catch)."""
    from worker_svc.engine.attention import block_attention, write_block_kv

    want_k, want_v, want = block_gather_sdpa(case)
    kc, vc = case["k_pool"].clone(), case["v_pool"].clone()
    write_block_kv(kc, vc, case["write_page"], case["k"], case["v"])
    got = block_attention(case["q"], kc, vc, case["pages"], case["n_visible"], splits=splits)
    shifted = block_attention(case["q"], kc, vc, case["pages"], case["n_visible"] - 1, splits=splits)
    return {"write_exact": bool(torch.equal(kc, want_k) and torch.equal(vc, want_v)),
            "layout": list(got.shape) == list(want.shape) and got.transpose(1, 2).is_contiguous(),
            "max_abs_err": float((got.float() - want.float()).abs().max()),
            "off_by_one_err": float((shifted.float() - want.float()).abs().max())}


def block_interpreter_child(seed: int) -> None:
    """Splits 1, 2 and 5 (more splits than some rows have pages: empty splits); 4 query heads on
    2 kv heads, kept small for the interpreter."""
    reports = {str(s): block_kernel_errors(make_block_case(seed + s, n_h=4), s) for s in (1, 2, 5)}
    print(json.dumps(reports))


def split_interpreter_child(seed: int) -> None:
    """The ISD kernel with forced splits against gather + SDPA, and with positions - 1."""
    from worker_svc.engine.attention import paged_attention

    reports = {}
    for i, (n_q, splits) in enumerate(((1, 2), (4, 3), (8, 4))):
        q, k_pool, v_pool, pages, positions = make_case(seed + i, n_q)
        want = reference(q, k_pool, v_pool, pages, positions)
        got = paged_attention(q, k_pool, v_pool, pages, positions, splits=splits)
        shifted = paged_attention(q, k_pool, v_pool, pages, positions - 1, splits=splits)
        reports[f"{n_q}x{splits}"] = {"max_abs_err": float((got - want).abs().max()),
                                      "off_by_one_err": float((shifted - want).abs().max())}
    print(json.dumps(reports))
