"""Random paged-attention cases and the gather + SDPA path they are checked against, shared by
tests/test_paged_attention.py and the child process that runs the Triton kernel under the CPU
interpreter (``interpreter_child``)."""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

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
