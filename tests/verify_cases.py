"""Fixed inputs for the ISD verify rule (cde/isd/verify.py) and what each must produce, shared by
tests/test_isd.py and the child process that runs the Triton kernels under the CPU interpreter
(``triton_child``, see tests/triton_child.py)."""

from __future__ import annotations

import json
import math

import torch

from cde.isd.decoder import generate_isd_batch
from cde.isd.toy import lag_model
from cde.isd.verify import verify_reference, verify_torch

Args = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def realistic_case(g: torch.Generator, r: int, k: int, v: int) -> Args:
    """q close to p, drafts drawn from q, temperatures around 1, a fifth greedy (drafts mostly argmax)."""
    p = torch.randn(r, k, v, generator=g) * 2.5
    t = torch.rand(r, generator=g) * 1.2 + 0.4
    q = (p + torch.randn(r, k, v, generator=g)) / t[:, None, None]  # stored scaled once
    drafts = torch.multinomial(torch.softmax(q, -1).reshape(-1, v), 1, generator=g).reshape(r, k)
    greedy = torch.rand(r, generator=g) < 0.2
    drafts[greedy] = torch.where(torch.rand(int(greedy.sum()), k, generator=g) < 0.7,
                                 p[greedy].argmax(-1), drafts[greedy])
    return (p, q, drafts, t, torch.rand(r, k, generator=g, dtype=torch.float64),
            torch.rand(r, k, generator=g, dtype=torch.float64), greedy)


def verify_cases() -> dict[str, Args]:
    """Fixed inputs (p_logits, q_logits, drafts, T, u_accept, u_resid, greedy), V = 37 (and one
    realistic case with V = 1000, many vocabulary tiles and splits in the Triton kernels)."""
    g = torch.Generator().manual_seed(1234)
    r, k, v = 96, 4, 37

    def uniforms() -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.rand(r, k, generator=g, dtype=torch.float64), torch.rand(r, k, generator=g, dtype=torch.float64))

    cases: dict[str, Args] = {}
    cases["random"] = realistic_case(g, r, k, v)
    # p == q exactly (q stored as p * (1/T), the kernel's own scaling): everything accepted.
    p = torch.randn(r, k, v, generator=g) * 2.0
    t = torch.rand(r, generator=g) + 0.5
    q = p * (1.0 / t)[:, None, None]
    drafts = torch.multinomial(torch.softmax(q, -1).reshape(-1, v), 1, generator=g).reshape(r, k)
    cases["p_equals_q"] = (p, q, drafts, t, *uniforms(), torch.zeros(r, dtype=torch.bool))
    # q certain of the draft, p all but excludes it: the first draft is rejected.
    p = torch.randn(r, k, v, generator=g)
    drafts = torch.randint(0, v, (r, k), generator=g)
    p.scatter_(-1, drafts[..., None], -30.0)
    q = torch.zeros(r, k, v).scatter_(-1, drafts[..., None], 30.0)
    cases["first_rejected"] = (p, q, drafts, torch.full((r,), 0.9), *uniforms(), torch.zeros(r, dtype=torch.bool))
    # Top-k filtered p (-inf outside 5 ids); drafts half inside, half outside the support.
    p = torch.randn(r, k, v, generator=g) * 2.0
    keep = torch.zeros(r, k, v, dtype=torch.bool).scatter_(-1, torch.topk(p, 5, dim=-1).indices, True)
    p = p.masked_fill(~keep, float("-inf"))
    q = torch.randn(r, k, v, generator=g)
    inside = torch.topk(p, 5, dim=-1).indices[..., 0]
    drafts = torch.where(torch.rand(r, k, generator=g) < 0.5, inside, torch.randint(0, v, (r, k), generator=g))
    cases["filtered_p"] = (p, q, drafts, torch.full((r,), 1.3), *uniforms(), torch.zeros(r, dtype=torch.bool))
    # Greedy with tied maxima (first index wins, as torch.argmax) across tile boundaries.
    p = torch.randn(r, k, v, generator=g)
    p[:, :, 3] = 9.0
    p[:, :, 20] = 9.0
    p[:, :, 36] = 9.0
    drafts = torch.where(torch.rand(r, k, generator=g) < 0.6, 3, 20) * torch.ones(r, k, dtype=torch.long)
    cases["greedy_ties"] = (p, torch.randn(r, k, v, generator=g), drafts, torch.zeros(r), *uniforms(),
                            torch.ones(r, dtype=torch.bool))
    cases["random_v1000"] = realistic_case(g, 16, 3, 1000)
    # Never-output ids (cde.isd.decoder.ban_): they had the largest raw logits in p and q and are
    # -inf in both; half the drafts are such ids (a decoder never proposes them, the rule must
    # still reject them) and no correction may be one. Sampled and greedy rows.
    banned = torch.tensor([0, 17, 36])
    p = torch.randn(r, k, v, generator=g) * 2.0
    p[..., banned] = 20.0
    q = p + torch.randn(r, k, v, generator=g)
    p[..., banned] = float("-inf")
    q[..., banned] = float("-inf")
    drafts = torch.where(torch.rand(r, k, generator=g) < 0.5, banned[torch.randint(0, 3, (r, k), generator=g)],
                         torch.multinomial(torch.softmax(q, -1).reshape(-1, v), 1, generator=g).reshape(r, k))
    cases["banned_ids"] = (p, q, drafts, torch.full((r,), 0.7), *uniforms(), torch.rand(r, generator=g) < 0.3)
    return cases


def path_margin(args: Args, row: int) -> float:
    """Smallest float64 distance of any decision on this row's path to its boundary."""
    p_logits, q_logits, drafts, temp, ua, ur, greedy = args
    margin = math.inf
    for i in range(drafts.shape[1]):
        s = int(drafts[row, i])
        lp = p_logits[row, i].double()
        if bool(greedy[row]):
            top2 = torch.topk(lp, 2).values
            margin = min(margin, float(top2[0] - top2[1]))
            if s == int(lp.argmax()):
                continue
            return margin
        p = torch.softmax(lp / float(temp[row]), -1)
        q = torch.softmax(q_logits[row, i].double(), -1)
        ratio = math.inf if float(q[s]) == 0 else float(p[s] / q[s])
        margin = min(margin, abs(float(ua[row, i]) - min(1.0, ratio)))
        if float(ua[row, i]) < min(1.0, ratio):
            continue
        resid = torch.clamp(p - q, min=0)
        resid = resid if float(resid.sum()) > 0 else p
        cdf = torch.cumsum(resid, 0) / resid.sum()
        return min(margin, float((cdf - float(ur[row, i])).abs().min()))
    return margin


def assert_same_decisions(name: str, got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor],
                          args: Args, eps: float = 1e-5) -> None:
    differ = ((got[0] != want[0]) | (got[1] != want[1])).nonzero().flatten().tolist()
    unexplained = [r for r in differ if path_margin(args, r) >= eps]
    assert not unexplained, (f"{name}: rows {unexplained[:8]} differ away from any decision boundary: "
                             f"got {[(int(got[0][r]), int(got[1][r])) for r in unexplained[:8]]}, "
                             f"want {[(int(want[0][r]), int(want[1][r])) for r in unexplained[:8]]}")
    assert len(differ) <= 1, f"{name}: {len(differ)} boundary disagreements is more than rounding explains"


def check_case_semantics(name: str, args: Args, result: tuple[torch.Tensor, torch.Tensor]) -> None:
    """What each edge case must produce, whatever the implementation."""
    p_logits, _, drafts, _, _, _, greedy = args
    n_acc, corr = result
    r, k = drafts.shape
    assert ((n_acc == k) == (corr == -1)).all(), f"{name}: correction -1 iff every draft accepted"
    if name.startswith("random"):
        assert 0 < int((n_acc == k).sum()) < r and int((n_acc == 0).sum()) > 0, f"{name}: paths not exercised"
    if name == "p_equals_q":
        assert (n_acc == k).all(), f"{name}: p == q must accept every draft"
    if name == "first_rejected":
        assert (n_acc == 0).all(), f"{name}: p(s) ~ 0 < q(s) ~ 1 must reject the first draft"
        assert (corr != drafts[:, 0]).all(), f"{name}: the residual has no mass at the rejected draft"
    if name == "filtered_p":
        rej = (n_acc < k).nonzero().flatten()
        at = p_logits[rej, n_acc[rej]]
        assert torch.isfinite(at.gather(-1, corr[rej][:, None])).all(), f"{name}: correction outside p's support"
        outside = ~torch.isfinite(p_logits.gather(-1, drafts[..., None]).squeeze(-1))
        first_out = torch.where(outside.any(-1), outside.float().argmax(-1), torch.full((r,), k))
        assert (n_acc <= first_out).all(), f"{name}: a draft with p(s) = 0 was accepted"
    if name == "banned_ids":
        banned = torch.tensor([0, 17, 36])
        is_banned = torch.isin(drafts, banned)
        first_banned = torch.where(is_banned.any(-1), is_banned.float().argmax(-1), torch.full((r,), k))
        assert (n_acc <= first_banned).all(), f"{name}: a never-output draft was accepted"
        assert not torch.isin(corr, banned).any(), f"{name}: a correction is a never-output id"
        assert (n_acc < k).any() and (n_acc == k).any(), f"{name}: paths not exercised"
    if name == "greedy_ties":
        assert greedy.all()
        expect_acc = torch.cumprod((drafts == 3).long(), -1).sum(-1)
        assert torch.equal(n_acc, expect_acc), f"{name}: ties must resolve to the first index"
        assert ((corr == 3) | (corr == -1)).all(), f"{name}: greedy correction must be the first argmax"


TRITON_ROWS = 32
# (block, split_tiles) per vocabulary size: V = 37 is 3 tiles of 16 (the last one partial) in 3
# splits (ties across splits in greedy_ties), or one tile of 64 with masked lanes (and for the
# "random" case also 3 tiles in one split); V = 1000 is 8 tiles of 128 in 8 splits or 4 splits of
# 4 tiles of 64 (the last tile and split partial)
KERNEL_CONFIGS = {37: ((16, 1), (64, 1)), 1000: ((128, 1), (64, 4))}


def triton_child() -> None:
    """Runs in a child process with TRITON_INTERPRET=1 (see test_verify_triton_interpreter)."""
    from cde.isd.verify import verify_triton
    from cde.isd.verify_kernel import launch

    report = {}
    for name, args in verify_cases().items():
        args = tuple(a[:TRITON_ROWS] for a in args)  # the interpreter runs programs one by one
        want = verify_reference(*args)
        ref32 = verify_torch(*args)
        configs = KERNEL_CONFIGS[args[0].shape[-1]] + (((16, 4),) if name == "random" else ())
        for block, split in configs[:1] if name == "banned_ids" else configs:   # the interpreter is slow
            got = launch(*args, block=block, split_tiles=split)
            tag = f"{name}/{block}x{split}"
            check_case_semantics(name, args, got)
            assert_same_decisions(f"{tag} vs reference", got, want, args)
            assert_same_decisions(f"{tag} vs torch", got, ref32, args)
            report[tag] = int((got[0] == args[2].shape[1]).sum())
    # Inside the decoder: identical tokens with the kernel or the torch rule (fixed seeds).
    model = lag_model(5, lag=3, vocab=32, beta=1.5)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10]] * 4
    kwargs = dict(max_new=12, stride=3, temperature=0.7, seeds=range(100, 100 + len(prompts)))
    a = generate_isd_batch(model, prompts, verify_fn=verify_torch, **kwargs)
    b = generate_isd_batch(model, prompts, verify_fn=lambda *x: verify_triton(*x, block=16), **kwargs)
    assert [g.tokens for g in a] == [g.tokens for g in b], "decoder output differs with the Triton kernel"
    report["decoder_acceptance"] = sum(g.stats.accepted for g in b) / sum(g.stats.proposed for g in b)
    print(json.dumps(report))
