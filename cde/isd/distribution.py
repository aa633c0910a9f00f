"""Goodness of fit of sampled sequences to an exact distribution: the check that R-ISD's outputs
are distributed as the base model's (the test suite on toy models, train.eval_idlm on the
trained one)."""

from __future__ import annotations

import torch


def pooled_chi_square(counts: dict[tuple[int, ...], int], exact: dict[tuple[int, ...], float],
                      n: int) -> tuple[float, int, float, float]:
    """Pearson chi-square of `n` samples' `counts` against `exact` probabilities: (stat, df, p,
    total variation). The least likely cells are pooled into one until the pool expects >= 5
    samples (the test's large-sample approximation needs it). A sample outside the exact
    distribution's support gives stat = inf, p = 0 at once."""
    if set(counts) - set(exact):
        return float("inf"), 0, 0.0, 1.0
    keys = sorted(exact, key=exact.get)
    e = torch.tensor([exact[k] * n for k in keys], dtype=torch.float64)
    o = torch.tensor([counts.get(k, 0) for k in keys], dtype=torch.float64)
    cut = int(torch.searchsorted(torch.cumsum(e, 0), torch.tensor(5.0, dtype=torch.float64))) + 1
    e = torch.cat([e[:cut].sum()[None], e[cut:]])
    o = torch.cat([o[:cut].sum()[None], o[cut:]])
    stat = float(((o - e) ** 2 / e).sum())
    df = len(e) - 1
    p = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64)))
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - exact[k]) for k in exact)
    return stat, df, p, tv
