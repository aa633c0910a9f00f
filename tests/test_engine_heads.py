"""Concept heads only at the step's candidate positions (steerling_runner.compact_heads): the
engine still equals the reference decoder token for token and record for record, the heads
really run on fewer rows, and the host's per-row bound is an upper bound that is checked.

float64 CPU, tiny configs, fresh seeds (the seed is in every failure report). Scenarios mix
what changes which positions are candidates: steering (amplify and suppress), k > 1 tokens per
step, confidence thresholds (a varying number of commits per step), overlapped and
synchronous steps, multi-row prompts whose commit rows share steps with decode rows, and
preemption. Known-concept interventions are not an engine feature (only the reference decoder
takes them), so they are not tested here.
"""

from __future__ import annotations

import random

import pytest
import torch

from cde.blocks import BLOCK
from cde.steerling.config import TINY
from cde.steerling.sampling import SamplingParams
from tests.options import decode_options
from tests.steerling_engine_cases import VOCAB, check_against_reference, make_model, steer
from worker_svc.engine.job import Job
from worker_svc.engine.runtime import ROW_BUCKETS, bucket
from worker_svc.engine.steerling_engine import SteerlingEngine
from worker_svc.engine.steerling_graphs import HEAD_BUCKETS, head_bucket
from worker_svc.engine.steerling_runner import compact_heads

pytestmark = pytest.mark.parity

# the tiny model's max softmax probabilities lie around 0.011-0.02: thresholds in that band
# commit a varying number of positions per step
THRESHOLD_MIXED, THRESHOLD_HIGH = 0.013, 0.02


def submit_all(engine, model, rng, specs, submitted, prefix):
    for i, (length, new, mode, k, threshold, sp) in enumerate(specs):
        prompt = [rng.randrange(256) for _ in range(length)]
        st = steer(model, [rng.randrange(model.cfg.n_known) for _ in range(2)], mode) if mode else None
        opts = decode_options(new, sampling=sp, tokens_per_step=k, confidence_threshold=threshold,
                              seed=rng.randrange(1 << 40))
        rid = f"{prefix}{i}"
        submitted[rid] = (prompt, opts, st, engine.submit(Job(rid, prompt, opts, steering=st)))


@pytest.mark.parametrize("overlap", [True, False])
def test_compacted_heads_equal_the_reference_with_steering_thresholds_and_shared_prefill(overlap, seed):
    model = make_model(seed)
    # two prompt blocks per step at most: a long prompt's commit rows share several steps with decode rows
    engine = SteerlingEngine(model, tokenizer_vocab_size=VOCAB, n_pages=64, max_prefill_rows=2, overlap=overlap)
    rng = random.Random(seed)
    submitted = {}
    greedy = SamplingParams(use_entropy_sampling=False, temperature=0.0)
    submit_all(engine, model, rng, [   # prompt length, max new, steering, k, threshold, sampling
        (5, 70, "amplify", 1, None, SamplingParams()),
        (64, 100, "suppress", 4, None, SamplingParams(use_entropy_sampling=False, temperature=0.8, top_p=0.9)),
        (30, 90, None, 8, THRESHOLD_MIXED, SamplingParams()),
    ], submitted, "a")
    for _ in range(6):
        engine.step()
    submit_all(engine, model, rng, [
        (300, 80, "amplify", 3, None, greedy),             # 4 full prompt blocks + a partial one
        (130, 60, "suppress", 16, THRESHOLD_HIGH, SamplingParams()),
    ], submitted, "b")
    for _ in range(3):
        engine.step()
    submit_all(engine, model, rng, [(200, 70, None, 2, None, SamplingParams())], submitted, "c")
    engine.run_until_idle()
    assert engine.stats().pages_used == 0
    assert (engine.overlapped_steps > 0) == overlap, f"seed={seed}"
    s = engine.strategy
    assert s.head_rows < 0.75 * s.position_rows, f"seed={seed}: {s.head_rows} of {s.position_rows}"
    check_against_reference(model, engine, submitted)


def test_compacted_heads_equal_the_reference_under_preemption(seed):
    model = make_model(seed, TINY.replace(eot_id=None))   # every request runs to length
    engine = SteerlingEngine(model, tokenizer_vocab_size=VOCAB, n_pages=8)   # 7 usable pages
    rng = random.Random(seed)
    submitted = {}
    submit_all(engine, model, rng, [
        (70, 150, "amplify", 4, None, SamplingParams()),
        (10, 180, None, 3, THRESHOLD_MIXED, SamplingParams()),
        (64, 120, "suppress", 4, None, SamplingParams()),
        (100, 100, None, 2, None, SamplingParams(use_entropy_sampling=False, temperature=0.0)),
    ], submitted, "p")
    engine.run_until_idle()
    assert engine.preemptions > 0, f"seed={seed}"
    assert engine.stats().pages_used == 0
    check_against_reference(model, engine, submitted)


def test_heads_run_on_the_bucket_of_the_candidates_only(seed):
    """Synchronous steps: each step's bound N is exactly its decode rows' masked positions, its HB
    the bucket of N (0 without decode rows), and model.heads receives HB rows (the runner's
    own count of what it passed, every step eager on the CPU)."""
    model = make_model(seed, TINY.replace(eot_id=None))   # every request runs to length
    engine = SteerlingEngine(model, tokenizer_vocab_size=VOCAB, n_pages=64, max_prefill_rows=2, overlap=False)
    rng = random.Random(seed)
    # the long prompt alone first: its first step has commit rows only; the 3-token request
    # ends last, alone, its block's masks falling below 32 and 16
    jobs = [(250, 60, 4), (3, 100, 1), (64, 70, 2)]
    seen_hb, prefill_only, fewer = set(), 0, 0
    while engine.has_work() or jobs:
        if jobs and engine.steps in (0, 1, 2):
            length, new, k = jobs.pop(0)
            engine.submit(Job(f"h{len(jobs)}", [rng.randrange(256) for _ in range(length)],
                              decode_options(new, sampling=SamplingParams(), tokens_per_step=k,
                                             seed=rng.randrange(1 << 40))))
        engine.table.finish_cancelled()
        engine.table.admit()
        plan = engine.strategy.plan(engine.table)   # the rows step() is about to run (nothing changes in between)
        rows = plan.rows if plan is not None else []
        expected = sum(req.seq[slice(*req.block_range(b))].count(model.cfg.mask_id)
                       for req, b, d, _ in rows if d)
        before = engine.strategy.runner.heads_rows
        engine.step()
        n, hb = engine.strategy.last_heads
        assert n == expected, f"seed={seed}: bound {n}, {expected} masked positions"
        assert hb == head_bucket(n, bucket(len(rows), ROW_BUCKETS)) and n <= hb and hb != 1, f"seed={seed}"
        assert engine.strategy.runner.heads_rows - before == hb, f"seed={seed}: heads got other rows than HB"
        n_decode = sum(row.is_decode for row in rows)
        prefill_only += n_decode == 0
        fewer += 0 < hb < BLOCK * n_decode
        seen_hb.add(hb)
    assert prefill_only > 0 and fewer > 0, f"seed={seed}: {prefill_only} prefill-only, {fewer} smaller steps"
    assert {0, 16, 32, 64} <= seen_hb, f"seed={seed}: {sorted(seen_hb)}"
    s = engine.strategy
    assert s.runner.heads_rows == s.head_rows < 0.75 * s.position_rows, f"seed={seed}"


def test_a_bound_below_the_real_masks_is_caught_on_the_host(seed):
    """The bound must hold for every live row; a step launched with one too low fails when its
    results are applied (the device caps the row, so the row would silently lose a candidate)."""
    model = make_model(seed, TINY.replace(eot_id=None))   # no early end: the request is still decoding
    engine = SteerlingEngine(model, tokenizer_vocab_size=VOCAB, n_pages=16, overlap=False)
    engine.submit(Job("x", list(range(10)), decode_options(60, seed=seed)))
    engine.step()
    engine.step()
    plan = engine.strategy.plan(engine.table)
    rows = plan.rows
    launched = engine.strategy.execute(plan)
    (i,) = [i for i, row in enumerate(rows) if row.is_decode]
    req, b = rows[i].req, rows[i].block
    assert launched.row_bounds[i] == req.seq[slice(*req.block_range(b))].count(model.cfg.mask_id) > 1
    launched.row_bounds[i] -= 1
    with pytest.raises(RuntimeError, match="bound"):
        engine.strategy.update(engine.table, launched)


def test_compact_heads_puts_every_candidate_first_in_order(seed):
    g = torch.Generator().manual_seed(seed)
    mask_id = 7
    for _ in range(50):
        r = int(torch.randint(1, 9, (1,), generator=g))
        tokens = torch.where(torch.rand(r, BLOCK, generator=g) < torch.rand(r, 1, generator=g), mask_id, 3)
        decode = torch.rand(r, generator=g) < 0.7
        masks = ((tokens == mask_id) & decode[:, None]).sum(1)
        # a bound per row: mostly the exact count, sometimes more, sometimes (a dropped row) less
        bound = (masks + torch.randint(-3, 4, (r,), generator=g)).clamp(min=0) * decode
        hb = head_bucket(int(bound.sum()), bucket(r, ROW_BUCKETS))
        if hb == 0:
            continue
        got = compact_heads(tokens, mask_id, decode, bound, hb)
        want = [i * BLOCK + j for i in range(r) for j in range(BLOCK)
                if decode[i] and tokens[i, j] == mask_id
                and int(((tokens[i, : j + 1] == mask_id)).sum()) <= int(bound[i])]
        n = len(want)
        assert n <= hb and got.flat.shape == (hb,), f"seed={seed}"
        assert got.flat[:n].tolist() == want, f"seed={seed}"
        assert (got.flat[n:] == 0).all(), f"seed={seed}: padding entries must point at position 0"
        assert got.candidate.reshape(-1).nonzero().squeeze(1).tolist() == want, f"seed={seed}"
        assert got.index.reshape(-1)[want].tolist() == list(range(n)), f"seed={seed}"
        assert int(got.index.min()) >= 0 and int(got.index.max()) < hb, f"seed={seed}"


def test_head_buckets_are_upper_bounds_and_never_one():
    for rb in ROW_BUCKETS:
        for n in range(0, BLOCK * rb + 1):
            hb = head_bucket(n, rb)
            assert (hb == 0) == (n == 0) and n <= hb <= BLOCK * rb and hb != 1, (n, rb, hb)
    assert HEAD_BUCKETS == tuple(sorted(set(HEAD_BUCKETS)))
