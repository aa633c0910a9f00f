"""Attributions are reproducible to the bit whatever is computed beside them (issue: the same
seeded request gave chunk attributions differing by 3e-5 between runs).

A token's attribution must depend only on its own record: computed in a block of 64 rows, alone,
or in another block's company, the float32 results are identical. With float32 dot products this
fails (a BLAS picks another kernel, and another summation order, for another row count); the
module accumulates in float64 and rounds once. Likewise a chunk's scores do not depend on how its
rows were split across blocks. Tables are 1,024 wide (8B-class widths are 4,096) so the sums are
long enough for summation order to matter.
"""
from __future__ import annotations

import torch

from cde.steerling.attribution import RawRecords, chunk_scores, token_attribution

D, N_KNOWN, N_DISC, VOCAB, K_KNOWN, K_DISC, ROWS = 1024, 600, 900, 2000, 8, 16, 64


def _tables(seed: int):
    g = torch.Generator().manual_seed(seed)
    known, disc, lm = (torch.randn(n, D, generator=g) for n in (N_KNOWN, N_DISC, VOCAB))
    return (lambda i: known[i]), (lambda i: disc[i]), (lambda t: lm[t]), g


def _records(g: torch.Generator, n: int, start: int = 0) -> RawRecords:
    return RawRecords(
        positions=torch.arange(start, start + n), tokens=torch.randint(0, VOCAB, (n,), generator=g),
        target_logits=torch.randn(n, generator=g) * 5,
        known_idx=torch.randint(0, N_KNOWN, (n, K_KNOWN), generator=g), known_logits=torch.randn(n, K_KNOWN, generator=g),
        disc_idx=torch.randint(0, N_DISC, (n, K_DISC), generator=g), disc_logits=torch.randn(n, K_DISC, generator=g))


def _rows(r: RawRecords, idx) -> RawRecords:
    idx = torch.as_tensor(idx, dtype=torch.long)
    return RawRecords(*(getattr(r, f)[idx] for f in RawRecords.__dataclass_fields__))


def test_token_attribution_does_not_depend_on_its_company(seed):
    known, disc, lm, g = _tables(seed)
    recs = _records(g, ROWS)
    full = token_attribution(recs, known, disc, lm)
    perm = torch.randperm(ROWS, generator=g)
    shuffled = token_attribution(_rows(recs, perm), known, disc, lm)
    fields = ("known_contrib", "disc_contrib", "residual")
    for i in range(ROWS):
        alone = token_attribution(_rows(recs, [i]), known, disc, lm)
        for f in fields:
            assert torch.equal(getattr(alone, f)[0], getattr(full, f)[i]), \
                f"seed={seed}: row {i} alone vs in a block of {ROWS}: {f} differs"
    for f in fields:
        assert torch.equal(getattr(shuffled, f), getattr(full, f)[perm]), f"seed={seed}: {f} depends on row order"


def test_chunk_scores_do_not_depend_on_the_block_split(seed):
    known, disc, lm, g = _tables(seed)
    recs = _records(g, ROWS)
    whole = token_attribution(recs, known, disc, lm)
    cut = 1 + seed % (ROWS - 1)   # the chunk's rows as two blocks' worth, attributed separately
    parts = [token_attribution(_rows(recs, range(0, cut)), known, disc, lm),
             token_attribution(_rows(recs, range(cut, ROWS)), known, disc, lm)]
    joined = type(whole)(*(torch.cat([getattr(p, f) for p in parts]) for f in whole.__dataclass_fields__))
    a = chunk_scores(whole, range(ROWS), ROWS, N_KNOWN)
    b = chunk_scores(joined, range(ROWS), ROWS, N_KNOWN)
    assert a == b, f"seed={seed}: chunk scores differ when its rows come in blocks split at {cut}"
