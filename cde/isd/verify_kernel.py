"""Triton kernel for the ISD verify rule (contract and arithmetic: ``cde/isd/verify.py``).

One program per row (request). For draft i = 0..K-1, while nothing was rejected yet:

1. one pass over vocabulary tiles computes, for p (logits * 1/T) and q (stored logits,
   already scaled) together, a per-lane online softmax (running max and rescaled sum-exp)
   plus the argmax of the p logits (first index on ties, like ``torch.argmax``);
2. p(s) and q(s) come from the draft's own logit; accept iff ``u * q(s) < p(s)`` (greedy
   rows: iff s == argmax). Acceptance -- the common case -- needs nothing else;
3. on rejection: a second pass sums the residual ``max(0, p - q)`` (and p, the fallback
   when no residual mass survives rounding); a third scans the tiles in vocabulary order
   with a carried prefix sum and picks the first id whose running residual exceeds
   ``u_resid * Z``. Inverse CDF uses one uniform per row, so it equals ``verify_torch``'s
   rule exactly; Gumbel-max would need V uniforms per row.

Everything is float32 whatever the logits' dtype. ``-inf`` logits (top-k/top-p filtered
ids, lanes past V) contribute exactly 0; a lane whose running max is still -inf is shifted
by 0 instead, so no ``-inf - -inf`` NaN is formed. Each row must have a finite logit in p
and in q (a distribution to speak of).

The kernel is jitted lazily, on first launch, because ``triton.jit`` decides at decoration
time between compiling and Triton's CPU interpreter (``TRITON_INTERPRET=1``); the jitted
function is cached per mode.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


def _isd_verify_kernel(p_ptr, q_ptr, drafts_ptr, inv_t_ptr, ua_ptr, ur_ptr, greedy_ptr, n_acc_ptr, corr_ptr,
                       K, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    inv_t = tl.load(inv_t_ptr + row)
    is_greedy = tl.load(greedy_ptr + row) != 0
    neg_inf = float("-inf")
    n_acc = row * 0
    corr = row * 0 - 1
    active = row * 0 + 1
    for i in range(0, K):
        if active != 0:
            base = (row * K + i).to(tl.int64) * V
            s = tl.load(drafts_ptr + row * K + i)
            # ---- pass 1: online softmax of p and q, argmax of p ----------------------
            mp = tl.full([BLOCK], neg_inf, tl.float32)
            sp = tl.zeros([BLOCK], tl.float32)
            mq = tl.full([BLOCK], neg_inf, tl.float32)
            sq = tl.zeros([BLOCK], tl.float32)
            best_val = tl.max(tl.full([BLOCK], neg_inf, tl.float32), 0)
            best_idx = row * 0
            for start in range(0, V, BLOCK):
                idx = start + offs
                m = idx < V
                xl = tl.load(p_ptr + base + idx, mask=m, other=neg_inf).to(tl.float32)
                x = xl * inv_t
                y = tl.load(q_ptr + base + idx, mask=m, other=neg_inf).to(tl.float32)
                # A lane whose running max is still -inf holds sum 0: shift by 0 there, so
                # exp(-inf - 0) = 0 and no -inf - -inf NaN is ever formed.
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
                best_idx = tl.where(better, start + tile_arg, best_idx)
                best_val = tl.where(better, tile_max, best_val)
            max_p = tl.max(mp, 0)
            max_q = tl.max(mq, 0)
            sum_p = tl.sum(sp * tl.exp(mp - max_p), 0)  # max_p is finite: a row has a finite logit
            sum_q = tl.sum(sq * tl.exp(mq - max_q), 0)
            p_s = tl.exp(tl.load(p_ptr + base + s).to(tl.float32) * inv_t - max_p) / sum_p
            q_s = tl.exp(tl.load(q_ptr + base + s).to(tl.float32) - max_q) / sum_q
            u = tl.load(ua_ptr + row * K + i)
            accepted = tl.where(is_greedy, s == best_idx, u * q_s < p_s)
            if accepted:
                n_acc += 1
            else:
                active = row * 0
                corr = best_idx
                if not is_greedy:
                    # ---- pass 2: residual normalizer (and p's mass, the fallback) -----
                    zr = tl.zeros([BLOCK], tl.float32)
                    zp = tl.zeros([BLOCK], tl.float32)
                    for start in range(0, V, BLOCK):
                        idx = start + offs
                        m = idx < V
                        x = tl.load(p_ptr + base + idx, mask=m, other=neg_inf).to(tl.float32) * inv_t
                        y = tl.load(q_ptr + base + idx, mask=m, other=neg_inf).to(tl.float32)
                        pj = tl.exp(x - max_p) / sum_p
                        qj = tl.exp(y - max_q) / sum_q
                        zr += tl.maximum(pj - qj, 0.0)
                        zp += pj
                    z_resid = tl.sum(zr, 0)
                    use_p = z_resid <= 0.0
                    total = tl.where(use_p, tl.sum(zp, 0), z_resid)
                    target = tl.load(ur_ptr + row * K + i) * total
                    # ---- pass 3: inverse CDF in vocabulary order ----------------------
                    carry = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
                    pick = row * 0 + V
                    last_pos = row * 0 - 1
                    for start in range(0, V, BLOCK):
                        idx = start + offs
                        m = idx < V
                        x = tl.load(p_ptr + base + idx, mask=m, other=neg_inf).to(tl.float32) * inv_t
                        y = tl.load(q_ptr + base + idx, mask=m, other=neg_inf).to(tl.float32)
                        pj = tl.exp(x - max_p) / sum_p
                        qj = tl.exp(y - max_q) / sum_q
                        rj = tl.where(m, tl.where(use_p, pj, tl.maximum(pj - qj, 0.0)), 0.0)
                        cdf = tl.cumsum(rj, 0) + carry
                        pick = tl.minimum(pick, tl.min(tl.where(m & (cdf > target), idx, V), 0))
                        last_pos = tl.maximum(last_pos, tl.max(tl.where(rj > 0.0, idx, -1), 0))
                        carry += tl.sum(rj, 0)
                    corr = tl.where(pick < V, pick, last_pos)
    tl.store(n_acc_ptr + row, n_acc)
    tl.store(corr_ptr + row, corr)


_JITTED: dict[bool, object] = {}


def kernel():
    """The jitted kernel for the current mode (compiled, or interpreted under TRITON_INTERPRET=1)."""
    mode = bool(triton.knobs.runtime.interpret)
    if mode not in _JITTED:
        _JITTED[mode] = triton.jit(_isd_verify_kernel)
    return _JITTED[mode]


def launch(p_logits: Tensor, q_logits: Tensor, drafts: Tensor, temperature: Tensor, u_accept: Tensor,
           u_resid: Tensor, greedy: Tensor, block: int = 1024) -> tuple[Tensor, Tensor]:
    """Run the kernel over R rows; inputs as ``verify_torch`` (shapes already checked)."""
    r, k, v = p_logits.shape
    dev = p_logits.device
    n_acc = torch.zeros(r, dtype=torch.int32, device=dev)
    corr = torch.full((r,), -1, dtype=torch.int32, device=dev)
    if r == 0 or k == 0:
        return n_acc.long(), corr.long()
    greedy_b = greedy.to(device=dev, dtype=torch.bool)
    inv_t = torch.where(greedy_b, torch.ones(r, dtype=torch.float32, device=dev),
                        1.0 / temperature.to(device=dev, dtype=torch.float32).clamp(min=1e-30))
    block = max(16, min(int(block), triton.next_power_of_2(v)))
    kernel()[(r,)](
        p_logits.contiguous(), q_logits.contiguous(), drafts.to(device=dev, dtype=torch.int32).contiguous(),
        inv_t.contiguous(), u_accept.to(device=dev, dtype=torch.float32).contiguous(),
        u_resid.to(device=dev, dtype=torch.float32).contiguous(), greedy_b.to(torch.int32).contiguous(),
        n_acc, corr, k, v, BLOCK=block)
    return n_acc.long(), corr.long()
