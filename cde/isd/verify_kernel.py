"""Triton kernels for the ISD verify rule (contract and arithmetic: ``cde/isd/verify.py``).

The vocabulary (151,936 ids for Qwen3) is cut into S splits of ``split_tiles`` tiles of
``BLOCK`` ids, and every pass over it runs one program per (row, draft, split) instead of one
program per row walking the whole vocabulary: at one request that was a single SM streaming
~150 tiles per draft. Four launches, each small:

1. ``_stats_kernel`` (grid rows*K x S): for every draft i of every row, over its split, the
   online softmax of p (logits * 1/T) and q (stored logits, already scaled) -- running max
   and rescaled sum-exp per lane -- and the argmax of the p logits (first index on ties,
   like ``torch.argmax``). All K drafts are done at once; a draft past a rejection is simply
   not read.
2. ``_decide_kernel`` (grid rows): combines the splits' partials per draft and walks the
   drafts in order: p(s) and q(s) from the draft's own logit, accept iff ``u * q(s) < p(s)``
   (greedy rows: iff s == argmax). At the first rejection the correction is the argmax for a
   greedy row; a sampled row is marked for the residual draw with its draft's softmax stats.
3. ``_resid_kernel`` (grid rows x S, marked rows only): per split, the sum of the residual
   ``max(0, p - q)`` and of p (the fallback when no residual mass survives rounding), tile
   sum by tile sum, and the last id with mass.
4. ``_pick_kernel`` (grid rows, marked rows only): the total Z and ``target = u_resid * Z``,
   the first split whose running sum (a cumulative sum over the splits' sums) crosses the
   target, then an in-order scan from that split with a carried prefix sum: the first id
   whose running residual exceeds the target (the scan goes on past the split if rounding
   hid the crossing there; the last id with mass if it finds none). Inverse CDF with one
   uniform per row, as ``verify_torch``.

Everything is float32 whatever the logits' dtype. ``-inf`` logits (top-k/top-p filtered ids,
lanes past V) contribute exactly 0, also where a whole split is ``-inf``: a lane or split
whose max is still -inf is shifted by 0 instead, so no ``-inf - -inf`` NaN is formed. Each
row must have a finite logit in p and in q (a distribution to speak of).

The kernels are jitted lazily, on first launch, because ``triton.jit`` decides at decoration
time between compiling and Triton's CPU interpreter (``TRITON_INTERPRET=1``); the jitted
functions are cached per mode.
"""

from __future__ import annotations

import types

import torch
import triton
import triton.language as tl
from torch import Tensor


def _stats_kernel(p_ptr, q_ptr, inv_t_ptr, stats_ptr, best_ptr, K, V, S, SPLIT_TILES, BLOCK: tl.constexpr):
    rk = tl.program_id(0)     # row * K + draft
    split = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    neg_inf = float("-inf")
    inv_t = tl.load(inv_t_ptr + rk // K)
    base = rk.to(tl.int64) * V
    lo = split * SPLIT_TILES * BLOCK
    mp = tl.full([BLOCK], neg_inf, tl.float32)
    sp = tl.zeros([BLOCK], tl.float32)
    mq = tl.full([BLOCK], neg_inf, tl.float32)
    sq = tl.zeros([BLOCK], tl.float32)
    best_val = tl.max(tl.full([BLOCK], neg_inf, tl.float32), 0)
    best_idx = split * 0 + V
    for t in range(0, SPLIT_TILES):
        idx = lo + t * BLOCK + offs
        m = idx < V
        xl = tl.load(p_ptr + base + idx, mask=m, other=neg_inf).to(tl.float32)
        x = xl * inv_t
        y = tl.load(q_ptr + base + idx, mask=m, other=neg_inf).to(tl.float32)
        # a lane whose running max is still -inf holds sum 0: shift by 0 there (no -inf - -inf)
        mp_new = tl.maximum(mp, x)
        shift = tl.where(mp_new == neg_inf, 0.0, mp_new)
        sp = sp * tl.exp(mp - shift) + tl.exp(x - shift)
        mp = mp_new
        mq_new = tl.maximum(mq, y)
        shift = tl.where(mq_new == neg_inf, 0.0, mq_new)
        sq = sq * tl.exp(mq - shift) + tl.exp(y - shift)
        mq = mq_new
        tile_max = tl.max(xl, 0)
        tile_arg = tl.argmax(xl, 0)
        better = tile_max > best_val
        best_idx = tl.where(better, lo + t * BLOCK + tile_arg, best_idx)
        best_val = tl.where(better, tile_max, best_val)
    # a split may be all -inf (filtered): shift by 0 there too
    max_p = tl.max(mp, 0)
    max_q = tl.max(mq, 0)
    sum_p = tl.sum(sp * tl.exp(mp - tl.where(max_p == neg_inf, 0.0, max_p)), 0)
    sum_q = tl.sum(sq * tl.exp(mq - tl.where(max_q == neg_inf, 0.0, max_q)), 0)
    out = (rk.to(tl.int64) * S + split) * 5    # 5 floats per (row, draft, split); the best id apart
    tl.store(stats_ptr + out, max_p)
    tl.store(stats_ptr + out + 1, sum_p)
    tl.store(stats_ptr + out + 2, max_q)
    tl.store(stats_ptr + out + 3, sum_q)
    tl.store(stats_ptr + out + 4, best_val)
    tl.store(best_ptr + rk.to(tl.int64) * S + split, best_idx)


def _decide_kernel(p_ptr, q_ptr, drafts_ptr, inv_t_ptr, ua_ptr, greedy_ptr, stats_ptr, best_ptr, n_acc_ptr,
                   corr_ptr, rej_ptr, rej_stats_ptr, K, V, S, S_POW2: tl.constexpr):
    row = tl.program_id(0)
    so = tl.arange(0, S_POW2)
    sm = so < S
    neg_inf = float("-inf")
    inv_t = tl.load(inv_t_ptr + row)
    is_greedy = tl.load(greedy_ptr + row) != 0
    n_acc = row * 0
    corr = row * 0 - 1
    rej = row * 0 - 1
    active = row * 0 + 1
    for i in range(0, K):
        if active != 0:
            rk = (row * K + i).to(tl.int64)
            st = stats_ptr + (rk * S + so) * 5
            mps = tl.load(st, mask=sm, other=neg_inf)
            mqs = tl.load(st + 2, mask=sm, other=neg_inf)
            # max_p / max_q are finite (a row has a finite logit): a -inf split adds exp(-inf) * 0 = 0
            max_p = tl.max(mps, 0)
            max_q = tl.max(mqs, 0)
            sum_p = tl.sum(tl.load(st + 1, mask=sm, other=0.0) * tl.exp(mps - max_p), 0)
            sum_q = tl.sum(tl.load(st + 3, mask=sm, other=0.0) * tl.exp(mqs - max_q), 0)
            vals = tl.load(st + 4, mask=sm, other=neg_inf)
            # splits are in vocabulary order: the first one reaching the max holds the first argmax
            best_val = tl.max(vals, 0)
            ids = tl.load(best_ptr + rk * S + so, mask=sm, other=V)
            best_idx = tl.min(tl.where(sm & (vals == best_val), ids, V), 0)
            s = tl.load(drafts_ptr + rk)
            p_s = tl.exp(tl.load(p_ptr + rk * V + s).to(tl.float32) * inv_t - max_p) / sum_p
            q_s = tl.exp(tl.load(q_ptr + rk * V + s).to(tl.float32) - max_q) / sum_q
            u = tl.load(ua_ptr + rk)
            accepted = tl.where(is_greedy, s == best_idx, u * q_s < p_s)
            if accepted:
                n_acc += 1
            else:
                active = row * 0
                corr = best_idx
                if not is_greedy:   # the correction is the residual draw (_resid_kernel, _pick_kernel)
                    rej = i
                    tl.store(rej_stats_ptr + row * 4, max_p)
                    tl.store(rej_stats_ptr + row * 4 + 1, sum_p)
                    tl.store(rej_stats_ptr + row * 4 + 2, max_q)
                    tl.store(rej_stats_ptr + row * 4 + 3, sum_q)
    tl.store(n_acc_ptr + row, n_acc)
    tl.store(corr_ptr + row, corr)
    tl.store(rej_ptr + row, rej)


def _rejected_stats(inv_t_ptr, rej_stats_ptr, row):
    """The row's 1/T and the rejected draft's softmax stats (max p, sum p, max q, sum q) that
    _decide_kernel stored, for the residual passes."""
    return (tl.load(inv_t_ptr + row), tl.load(rej_stats_ptr + row * 4), tl.load(rej_stats_ptr + row * 4 + 1),
            tl.load(rej_stats_ptr + row * 4 + 2), tl.load(rej_stats_ptr + row * 4 + 3))


def _resid_tile(p_ptr, q_ptr, base, idx, V, inv_t, max_p, sum_p, max_q, sum_q):
    """The residual max(0, p - q) and p at the ids idx (0 past V)."""
    neg_inf = float("-inf")
    m = idx < V
    x = tl.load(p_ptr + base + idx, mask=m, other=neg_inf).to(tl.float32) * inv_t
    y = tl.load(q_ptr + base + idx, mask=m, other=neg_inf).to(tl.float32)
    pj = tl.where(m, tl.exp(x - max_p) / sum_p, 0.0)
    qj = tl.where(m, tl.exp(y - max_q) / sum_q, 0.0)
    return tl.maximum(pj - qj, 0.0), pj


def _resid_kernel(p_ptr, q_ptr, inv_t_ptr, rej_ptr, rej_stats_ptr, rsum_ptr, rlast_ptr, K, V, S, SPLIT_TILES,
                  BLOCK: tl.constexpr):
    row = tl.program_id(0)
    split = tl.program_id(1)
    i = tl.load(rej_ptr + row)
    if i >= 0:
        offs = tl.arange(0, BLOCK)
        inv_t, max_p, sum_p, max_q, sum_q = _rejected_stats(inv_t_ptr, rej_stats_ptr, row)
        base = (row * K + i).to(tl.int64) * V
        lo = split * SPLIT_TILES * BLOCK
        zr = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
        zp = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
        last_r = row * 0 - 1
        last_p = row * 0 - 1
        for t in range(0, SPLIT_TILES):
            idx = lo + t * BLOCK + offs
            rj, pj = _resid_tile(p_ptr, q_ptr, base, idx, V, inv_t, max_p, sum_p, max_q, sum_q)
            zr += tl.sum(rj, 0)   # tile by tile, as _pick_kernel's carry
            zp += tl.sum(pj, 0)
            last_r = tl.maximum(last_r, tl.max(tl.where(rj > 0.0, idx, -1), 0))
            last_p = tl.maximum(last_p, tl.max(tl.where(pj > 0.0, idx, -1), 0))
        out = row.to(tl.int64) * S + split
        tl.store(rsum_ptr + out * 2, zr)
        tl.store(rsum_ptr + out * 2 + 1, zp)
        tl.store(rlast_ptr + out * 2, last_r)
        tl.store(rlast_ptr + out * 2 + 1, last_p)


def _pick_kernel(p_ptr, q_ptr, inv_t_ptr, ur_ptr, rej_ptr, rej_stats_ptr, rsum_ptr, rlast_ptr, corr_ptr, K, V, S,
                 SPLIT_TILES, BLOCK: tl.constexpr, S_POW2: tl.constexpr):
    row = tl.program_id(0)
    i = tl.load(rej_ptr + row)
    if i >= 0:
        offs = tl.arange(0, BLOCK)
        inv_t, max_p, sum_p, max_q, sum_q = _rejected_stats(inv_t_ptr, rej_stats_ptr, row)
        so = tl.arange(0, S_POW2)
        sm = so < S
        parts = (row.to(tl.int64) * S + so) * 2
        zr = tl.load(rsum_ptr + parts, mask=sm, other=0.0)
        use_p = tl.sum(zr, 0) <= 0.0
        z = tl.where(use_p, tl.load(rsum_ptr + parts + 1, mask=sm, other=0.0), zr)
        target = tl.load(ur_ptr + row * K + i) * tl.sum(z, 0)
        # the first split whose running sum crosses the target, and the sum before it
        first = tl.min(tl.where(sm & (tl.cumsum(z, 0) > target), so, S), 0)
        carry = tl.sum(tl.where(so < first, z, 0.0), 0)
        last = tl.where(use_p, tl.load(rlast_ptr + parts + 1, mask=sm, other=-1),
                        tl.load(rlast_ptr + parts, mask=sm, other=-1))
        last_pos = tl.max(last, 0)
        # scan from that split in vocabulary order (past it only if rounding hid the crossing)
        pick = row * 0 + V
        base = (row * K + i).to(tl.int64) * V
        for t in range(first * SPLIT_TILES, S * SPLIT_TILES):
            if pick == V:
                idx = t * BLOCK + offs
                rj, pj = _resid_tile(p_ptr, q_ptr, base, idx, V, inv_t, max_p, sum_p, max_q, sum_q)
                rj = tl.where(use_p, pj, rj)
                cdf = tl.cumsum(rj, 0) + carry
                pick = tl.minimum(pick, tl.min(tl.where((idx < V) & (cdf > target), idx, V), 0))
                carry += tl.sum(rj, 0)
        tl.store(corr_ptr + row, tl.where(pick < V, pick, last_pos))


KERNELS = {"stats": _stats_kernel, "decide": _decide_kernel, "resid": _resid_kernel, "pick": _pick_kernel}
_JITTED: dict[bool, dict[str, object]] = {}


HELPERS = {"_rejected_stats": _rejected_stats, "_resid_tile": _resid_tile}   # called from the kernels


def _with_globals(fn, **names):
    """A copy of fn that sees `names` as globals (the helpers jitted for the same mode). The
    annotations travel too: Triton finds `tl.constexpr` parameters there (a copy without them
    runs under the interpreter but does not compile)."""
    copy = types.FunctionType(fn.__code__, {**fn.__globals__, **names}, fn.__name__, fn.__defaults__,
                              fn.__closure__)
    copy.__annotations__ = dict(fn.__annotations__)
    copy.__qualname__, copy.__module__ = fn.__qualname__, fn.__module__
    return copy


def kernel(name: str):
    """The jitted kernel `name` for the current mode (compiled, or interpreted under TRITON_INTERPRET=1);
    the kernels call the HELPERS jitted for the same mode."""
    mode = bool(triton.knobs.runtime.interpret)
    if mode not in _JITTED:
        helpers = {n: triton.jit(fn) for n, fn in HELPERS.items()}
        _JITTED[mode] = {n: triton.jit(_with_globals(fn, **helpers)) for n, fn in KERNELS.items()}
    return _JITTED[mode][name]


def launch(p_logits: Tensor, q_logits: Tensor, drafts: Tensor, temperature: Tensor, u_accept: Tensor,
           u_resid: Tensor, greedy: Tensor, block: int = 1024, split_tiles: int = 4) -> tuple[Tensor, Tensor]:
    """Run the four kernels over R rows; inputs as ``verify_torch`` (shapes already checked).
    The vocabulary splits hold ``split_tiles`` tiles of ``block`` ids each (the last one partial)."""
    r, k, v = p_logits.shape
    dev = p_logits.device
    n_acc = torch.zeros(r, dtype=torch.int32, device=dev)
    corr = torch.full((r,), -1, dtype=torch.int32, device=dev)
    if r == 0 or k == 0:
        return n_acc.long(), corr.long()
    greedy_b = greedy.to(device=dev, dtype=torch.bool)
    inv_t = torch.where(greedy_b, torch.ones(r, dtype=torch.float32, device=dev),
                        1.0 / temperature.to(device=dev, dtype=torch.float32).clamp(min=1e-30)).contiguous()
    block = max(16, min(int(block), triton.next_power_of_2(v)))
    split_tiles = max(1, min(int(split_tiles), triton.cdiv(v, block)))
    s = triton.cdiv(v, block * split_tiles)
    s_pow2 = triton.next_power_of_2(s)
    p, q = p_logits.contiguous(), q_logits.contiguous()
    f32 = dict(device=dev, dtype=torch.float32)
    stats = torch.empty(r * k * s * 5, **f32)
    best = torch.empty(r * k * s, dtype=torch.int32, device=dev)
    rej = torch.empty(r, dtype=torch.int32, device=dev)
    rej_stats = torch.empty(r * 4, **f32)
    rsum = torch.empty(r * s * 2, **f32)
    rlast = torch.empty(r * s * 2, dtype=torch.int32, device=dev)
    ur = u_resid.to(**f32).contiguous()
    kernel("stats")[(r * k, s)](p, q, inv_t, stats, best, k, v, s, split_tiles, BLOCK=block)
    kernel("decide")[(r,)](p, q, drafts.to(device=dev, dtype=torch.int32).contiguous(), inv_t,
                           u_accept.to(**f32).contiguous(), greedy_b.to(torch.int32).contiguous(), stats, best,
                           n_acc, corr, rej, rej_stats, k, v, s, S_POW2=s_pow2)
    kernel("resid")[(r, s)](p, q, inv_t, rej, rej_stats, rsum, rlast, k, v, s, split_tiles, BLOCK=block)
    kernel("pick")[(r,)](p, q, inv_t, ur, rej, rej_stats, rsum, rlast, corr, k, v, s, split_tiles, BLOCK=block,
                         S_POW2=s_pow2)
    return n_acc.long(), corr.long()
