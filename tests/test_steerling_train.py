"""steerling-small's training code on the CPU: the attention layout, the catalog copy the GPU
machine reads, and the whole pipeline at tiny sizes (stand-in data) writing a loadable bundle."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_noisy_clean_mask_is_what_serving_sees():
    from train.steerling_objective import noisy_clean_mask

    t, block = 256, 64
    m = noisy_clean_mask(t, block, "cpu")
    blk = torch.arange(t) // block
    for q in range(0, t, 37):
        for k in range(0, t, 29):
            # noisy query: its own block (bidirectional) + clean blocks strictly before
            assert bool(m[q, k]) == bool(blk[q] == blk[k]), (q, k)
            assert bool(m[q, t + k]) == bool(blk[k] < blk[q]), (q, k)
            # clean query: clean blocks up to its own, never the noisy half
            assert not bool(m[t + q, k]), (q, k)
            assert bool(m[t + q, t + k]) == bool(blk[k] <= blk[q]), (q, k)


def test_catalog_summary_equals_the_parquet():
    from train import build_data
    from train.steerling_data import catalog_summary_from_parquet, read_catalog_summary

    assert read_catalog_summary() == catalog_summary_from_parquet(build_data.CATALOG), \
        "train/artifacts/catalog_summary.json is stale: python -m train.steerling_data --write-catalog-summary"


@pytest.mark.slow
def test_tiny_training_run_writes_a_bundle_that_loads(tmp_path):
    from cde.steerling.loading import load_model

    out = tmp_path / "bundle"
    proc = subprocess.run([sys.executable, "-m", "train.train_steerling", "--out", str(out), "--device", "cpu",
                           "--tiny", "--time-budget-s", "25", "--reserve-s", "5", "--log-every-s", "5"],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "trained " in proc.stdout and "skipped=0" in proc.stdout, proc.stdout[-2000:]
    log = json.loads((out / "training_log.json").read_text())
    assert log["steps"] > 0 and log["skipped_steps"] == 0
    model = load_model(out)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_prefetcher_gives_the_inline_sequence_and_raises_where_inline_would():
    import numpy as np

    from train.prefetch import Prefetcher

    seed = int(np.random.SeedSequence().entropy % 2**31)
    inline_rng, ahead_rng = np.random.default_rng(seed), np.random.default_rng(seed)
    inline = [inline_rng.integers(0, 1000, size=7) for _ in range(20)]
    with Prefetcher(lambda: ahead_rng.integers(0, 1000, size=7), depth=3) as ahead:
        got = [ahead.next() for _ in range(20)]
    assert all((a == b).all() for a, b in zip(inline, got)), f"seed {seed}: prefetched batches differ"

    calls = iter(range(10))
    def make():
        i = next(calls)
        if i == 2:
            raise RuntimeError("corpus shard unreadable")
        return i
    failing = Prefetcher(make, depth=2)
    assert [failing.next(), failing.next()] == [0, 1]
    with pytest.raises(RuntimeError, match="corpus shard unreadable"):
        failing.next()
    failing.close()
    assert not failing._thread.is_alive()
    with pytest.raises(ValueError, match="depth"):
        Prefetcher(lambda: 0, depth=0)


def test_attribution_rank_loss_is_the_ce_of_served_contributions_and_falls_when_the_label_leads():
    from cde.steerling.config import TINY
    from cde.steerling.model import SteerlingModel
    from train.steerling_objective import attribution_rank_loss

    seed = int(torch.randint(0, 2**31, ()).item())
    torch.manual_seed(seed)
    model = SteerlingModel(TINY).init_random(seed, std=0.05)
    c, v = TINY.n_known, TINY.vocab_size
    b, t = 2, 16
    logits = torch.randn(b, t, c)
    tokens = torch.randint(0, v, (b, t))
    labels = torch.full((b, t), -1)
    labels[0, 3], labels[1, 7], labels[1, 9] = 5, 11, 2
    masked = torch.ones(b, t, dtype=torch.bool)
    masked[1, 9] = False                          # unmasked positions are not attributed
    got = attribution_rank_loss(model, logits, tokens, labels, masked)

    # by hand, in float64, row by row: contribution_c = sigmoid(l_c) * E_c . W_lm[y]
    emb = model.known_head.concept_embedding.weight[:c].double()
    w = model.transformer.lm_head.weight.double()
    losses = []
    for (i, j) in [(0, 3), (1, 7)]:
        contrib = torch.sigmoid(logits[i, j].double()) * (emb @ w[tokens[i, j]])
        z = contrib / contrib.std()
        losses.append(torch.logsumexp(z, 0) - z[labels[i, j]])
    want = torch.stack(losses).mean()
    assert abs(float(got) - float(want)) < 1e-4, f"seed {seed}: {float(got)} vs by hand {float(want)}"

    with torch.no_grad():                         # the labelled concepts now point at their tokens
        for (i, j) in [(0, 3), (1, 7)]:
            model.known_head.concept_embedding.weight[labels[i, j]] = 3 * w[tokens[i, j]].float()
        logits[0, 3, 5] = logits[1, 7, 11] = 4.0
    assert float(attribution_rank_loss(model, logits, tokens, labels, masked)) < float(want) - 1.0, f"seed {seed}"
    none = torch.zeros_like(masked)
    assert float(attribution_rank_loss(model, logits, tokens, labels, none)) == 0.0


def test_served_attribution_rank_loss_ranks_within_the_served_record_and_pushes_the_label_into_it():
    """v4's known_attr (served_k > 0) against a by-hand float64 computation: CE over the
    contributions of the served_k largest-logit concepts plus the label (std over those), plus
    relu(k-th largest other logit - label logit + margin); far lower once the label leads."""
    from cde.steerling.config import TINY
    from cde.steerling.model import SteerlingModel
    from train.steerling_objective import attribution_rank_loss

    seed = int(torch.randint(0, 2**31, ()).item())
    torch.manual_seed(seed)
    model = SteerlingModel(TINY).init_random(seed, std=0.05)
    c, v, k = TINY.n_known, TINY.vocab_size, 4
    b, t = 2, 16
    logits = torch.randn(b, t, c)
    tokens = torch.randint(0, v, (b, t))
    labels = torch.full((b, t), -1)
    labels[0, 3], labels[1, 7] = 5, 11
    masked = torch.ones(b, t, dtype=torch.bool)
    got = attribution_rank_loss(model, logits, tokens, labels, masked, served_k=k, margin=1.0)

    emb = model.known_head.concept_embedding.weight[:c].double()
    w = model.transformer.lm_head.weight.double()
    ranks, hinges = [], []
    for (i, j) in [(0, 3), (1, 7)]:
        lab = int(labels[i, j])
        row = logits[i, j].double()
        served = sorted(set(row.topk(k).indices.tolist()) | {lab})
        contrib = torch.sigmoid(row) * (emb @ w[tokens[i, j]])
        z = contrib[served] / contrib[served].std()
        ranks.append(torch.logsumexp(z, 0) - z[served.index(lab)])
        others = torch.cat([row[:lab], row[lab + 1:]])
        hinges.append(torch.relu(others.topk(k).values[-1] - row[lab] + 1.0))
    want = torch.stack(ranks).mean() + torch.stack(hinges).mean()
    assert abs(float(got) - float(want)) < 1e-4, f"seed {seed}: {float(got)} vs by hand {float(want)}"

    with torch.no_grad():   # labels far ahead in logit (hinge 0) and pointing at their tokens
        for (i, j) in [(0, 3), (1, 7)]:
            model.known_head.concept_embedding.weight[labels[i, j]] = 3 * w[tokens[i, j]].float()
            logits[i, j, labels[i, j]] = 50.0
    low = attribution_rank_loss(model, logits, tokens, labels, masked, served_k=k)
    assert float(low) < float(want) - 1.0, f"seed {seed}: {float(low)} vs {float(want)}"


def test_flex_attention_mask_is_the_dense_noisy_clean_mask():
    """The trainer's GPU attention (flex_attend) allows exactly what the dense mask SDPA uses does,
    at every (query, key) of several shapes; and FlexAttention on the CPU with it equals SDPA."""
    from train.steerling_objective import noisy_clean_mask, noisy_clean_mask_mod

    for t, block in [(128, 64), (256, 64), (192, 32)]:
        q = torch.arange(2 * t)[:, None].expand(2 * t, 2 * t)
        k = torch.arange(2 * t)[None, :].expand(2 * t, 2 * t)
        got = noisy_clean_mask_mod(t, block)(0, 0, q, k)
        assert torch.equal(got, noisy_clean_mask(t, block, "cpu")), (t, block)

    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    seed = int(torch.randint(0, 2**31, ()).item())
    g = torch.Generator().manual_seed(seed)
    t, block = 128, 64
    qh, kvh, d = 4, 2, 16
    q, k, v = (torch.randn(1, h, 2 * t, d, generator=g) for h in (qh, kvh, kvh))
    mask = create_block_mask(noisy_clean_mask_mod(t, block), None, None, 2 * t, 2 * t, device="cpu")
    got = flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=noisy_clean_mask(t, block, "cpu"),
                                                            enable_gqa=True)
    assert (got - want).abs().max() < 1e-5, f"seed {seed}: {(got - want).abs().max()}"
