"""The ISD verify rule: accept drafts left to right with min(1, p/q), correct at the first rejection.

One verify call handles R rows (requests), each with K = N - 1 drafts ``s_1..s_K``:

* ``p_i = softmax(p_logits[i] / T)``: the target (clean, causal) distribution at the
  position *before* ``s_i``. Top-k / top-p filtering, if any, is already in ``p_logits``
  as ``-inf`` entries (dividing ``-inf`` by T leaves it ``-inf``).
* ``q_i = softmax(q_logits[i])``: the proposal distribution the draft was drawn from.
  **The stored draft logits are already divided by T** (the decoder scales them once, when
  it proposes). Dividing them by T again -- the bug reported against the released verify
  kernel -- makes the ratio use ``softmax(l / T^2)`` instead of the distribution the draft
  came from, and the output is no longer the target distribution whenever T != 1
  (``tests/test_isd.py`` shows a chi-square test catching it).
* Accept ``s_i`` iff ``u_accept[i] * q_i(s_i) < p_i(s_i)``. For u in [0, 1) this is
  ``u < min(1, p/q)``; the product form needs no division, so ``q(s) == 0`` accepts and
  ``p(s) == q(s) == 0`` rejects without NaNs.
* At the first rejection i, the correction is drawn from ``normalize(max(0, p_i - q_i))``
  by **inverse CDF in vocabulary order** with the single uniform ``u_resid[i]``: the
  first id j whose running sum of the residual exceeds ``u * Z`` (Z the residual's sum).
  Inverse CDF needs one uniform per row, where Gumbel-max needs V; the Triton kernel uses
  the same rule so both agree token for token. If rounding leaves no positive residual
  (only possible when p and q agree to float precision), the correction is drawn from p.
* Greedy rows (T = 0): accept iff ``s_i == argmax p_i``; the correction is ``argmax p_i``
  (argmax of the logits, first index on ties, as ``torch.argmax``).

Speculative sampling is lossless only if the draft really was drawn from the q passed
here. With argmax drafts, pass a one-hot q (``onehot_logits``): the rule then accepts with
probability p(s) and corrects from p with s removed, which is exact. Argmax drafts with the
soft q (what the released I-DLM code does) are *not* exact at T > 0.

Three implementations, one contract:
``verify_reference`` (float64, plain loops: the oracle), ``verify_torch`` (batched, float32,
the formulas the kernel uses) and ``verify_triton`` (Triton programs per (row, vocabulary
split); see ``cde/isd/verify_kernel.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["onehot_logits", "verify_reference", "verify_torch", "verify_triton"]


def _check(p_logits: Tensor, q_logits: Tensor, drafts: Tensor, temperature: Tensor, u_accept: Tensor,
           u_resid: Tensor, greedy: Tensor) -> tuple[int, int, int]:
    if p_logits.dim() != 3 or q_logits.shape != p_logits.shape:
        raise ValueError(f"p_logits {tuple(p_logits.shape)} and q_logits {tuple(q_logits.shape)} "
                         "must both be (R, K, V)")
    r, k, v = p_logits.shape
    for name, t, shape in (("drafts", drafts, (r, k)), ("u_accept", u_accept, (r, k)), ("u_resid", u_resid, (r, k)),
                           ("temperature", temperature, (r,)), ("greedy", greedy, (r,))):
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
    if k and (drafts.min() < 0 or drafts.max() >= v):
        raise ValueError("draft ids must lie in [0, V)")
    bad_t = (~greedy.bool()) & ~(temperature > 0)
    if bool(bad_t.any()):
        raise ValueError("non-greedy rows need temperature > 0")
    return r, k, v


def onehot_logits(tokens: Tensor, vocab_size: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Logits of the point mass at ``tokens`` (0 there, -inf elsewhere): the q of an argmax draft."""
    out = torch.full((*tokens.shape, vocab_size), float("-inf"), dtype=dtype, device=tokens.device)
    return out.scatter_(-1, tokens.long()[..., None], 0.0)


def verify_reference(p_logits: Tensor, q_logits: Tensor, drafts: Tensor, temperature: Tensor, u_accept: Tensor,
                     u_resid: Tensor, greedy: Tensor) -> tuple[Tensor, Tensor]:
    """The oracle: the rule as written, in float64, one row and one draft at a time.

    Acceptance is literally ``u < min(1, p(s) / q(s))`` (q(s) = 0 counts as ratio inf, unless
    p(s) = 0 too: that draft is rejected, as the product form of the other two rules does).
    Returns (n_accepted (R,) int64, correction (R,) int64, -1 where every draft was accepted).
    """
    r, k, v = _check(p_logits, q_logits, drafts, temperature, u_accept, u_resid, greedy)
    n_acc = torch.zeros(r, dtype=torch.int64)
    corr = torch.full((r,), -1, dtype=torch.int64)
    for row in range(r):
        for i in range(k):
            s = int(drafts[row, i])
            logits_p = p_logits[row, i].double().cpu()
            if bool(greedy[row]):
                best = int(torch.argmax(logits_p))
                if s == best:
                    n_acc[row] += 1
                    continue
                corr[row] = best
                break
            p = torch.softmax(logits_p / float(temperature[row]), dim=-1)
            q = torch.softmax(q_logits[row, i].double().cpu(), dim=-1)  # already scaled: no / T
            # p(s) = 0 (a filtered or never-output id) always rejects, even where q(s) = 0 too
            ratio = 0.0 if float(p[s]) == 0.0 else float("inf") if float(q[s]) == 0.0 else float(p[s] / q[s])
            if float(u_accept[row, i]) < min(1.0, ratio):
                n_acc[row] += 1
                continue
            resid = torch.clamp(p - q, min=0.0)
            if float(resid.sum()) <= 0.0:
                resid = p
            target = float(u_resid[row, i]) * float(resid.sum())
            running, pick = 0.0, -1
            for j in range(v):
                running += float(resid[j])
                if running > target:
                    pick = j
                    break
            if pick < 0:  # rounding at the very end of the CDF: last id with mass
                pick = int(torch.nonzero(resid > 0)[-1])
            corr[row] = pick
            break
    return n_acc, corr


def verify_torch(p_logits: Tensor, q_logits: Tensor, drafts: Tensor, temperature: Tensor, u_accept: Tensor,
                 u_resid: Tensor, greedy: Tensor) -> tuple[Tensor, Tensor]:
    """Batched verify in float32 (the kernel's arithmetic: logits * (1/T), u * q(s) < p(s)).

    p_logits (R, K, V): target logits at the positions before each draft (raw, filtered
    entries -inf). q_logits (R, K, V): stored draft logits, already temperature-scaled.
    drafts (R, K) ids; temperature (R,); u_accept, u_resid (R, K) uniforms in [0, 1);
    greedy (R,) bool. Returns (n_accepted (R,) int64, correction (R,) int64 or -1).
    """
    r, k, v = _check(p_logits, q_logits, drafts, temperature, u_accept, u_resid, greedy)
    dev = p_logits.device
    n_acc = torch.zeros(r, dtype=torch.int64, device=dev)
    corr = torch.full((r,), -1, dtype=torch.int64, device=dev)
    if r == 0 or k == 0:
        return n_acc, corr
    greedy = greedy.to(device=dev, dtype=torch.bool)
    inv_t = torch.where(greedy, torch.ones_like(temperature, dtype=torch.float32),
                        1.0 / temperature.to(device=dev, dtype=torch.float32).clamp(min=1e-30))
    lp = p_logits.float()
    p = torch.softmax(lp * inv_t[:, None, None], dim=-1)
    q = torch.softmax(q_logits.float(), dim=-1)  # NOT divided by T again (see module docstring)
    d = drafts.long().to(dev)
    ps = p.gather(-1, d[..., None]).squeeze(-1)
    qs = q.gather(-1, d[..., None]).squeeze(-1)
    best = lp.argmax(-1)
    accept = torch.where(greedy[:, None], d == best, u_accept.to(dev).float() * qs < ps)
    n_acc = torch.cumprod(accept.long(), dim=-1).sum(-1)
    rejected = n_acc < k
    if not bool(rejected.any()):
        return n_acc, corr
    rows = torch.nonzero(rejected).squeeze(-1)
    i = n_acc[rows]
    p_i, q_i = p[rows, i], q[rows, i]
    resid = torch.clamp(p_i - q_i, min=0.0)
    z = resid.sum(-1, keepdim=True)
    resid = torch.where(z > 0, resid, p_i)
    z = resid.sum(-1, keepdim=True)
    target = u_resid.to(dev).float()[rows, i][:, None] * z
    cdf = torch.cumsum(resid, dim=-1)
    crossed = cdf > target
    first = torch.where(crossed.any(-1), crossed.float().argmax(-1),
                        torch.full_like(i, v))
    idx = torch.arange(v, device=dev)
    last_pos = torch.where(resid > 0, idx, torch.full_like(idx, -1)).max(-1).values
    sampled = torch.where(first < v, first, last_pos)
    corr[rows] = torch.where(greedy[rows], best[rows, i], sampled)
    return n_acc, corr


def verify_triton(p_logits: Tensor, q_logits: Tensor, drafts: Tensor, temperature: Tensor, u_accept: Tensor,
                  u_resid: Tensor, greedy: Tensor, block: int = 1024) -> tuple[Tensor, Tensor]:
    """``verify_torch`` in Triton (``cde/isd/verify_kernel.py``): the vocabulary is cut into
    splits and each pass runs one program per (row, draft, split), then a small per-row
    combine. One pass computes the online softmax of p and q together (running max and
    sum-exp) plus argmax p; an accepted draft costs only that pass. On rejection two more
    passes compute the residual's normalizer and its inverse-CDF pick. On CPU it runs under
    Triton's interpreter: set ``TRITON_INTERPRET=1`` before the first call (Triton reads it
    when the kernel is jitted).
    """
    from cde.isd.verify_kernel import launch

    _check(p_logits, q_logits, drafts, temperature, u_accept, u_resid, greedy)
    return launch(p_logits, q_logits, drafts, temperature, u_accept, u_resid, greedy, block)
