"""Block diffusion logprobs in the engine: each committed token's log-softmax over the raw logits
at the step that committed it, and the most likely ids there, equal to the reference decoder's
(full recompute, cde/steerling/reference_decoder.py) for steered and unsteered requests, one and
several tokens per step; positions never sampled (filled after <|eot_id|>) carry none, and a
request that did not ask gets none."""

from __future__ import annotations

import math
import random

import pytest
import torch

from cde.steerling.config import TINY
from cde.steerling.reference_decoder import generate
from cde.steerling.sampling import SamplingParams
from tests.options import decode_options
from tests.steerling_engine_cases import VOCAB, make_model, steer
from worker_svc.engine.events import BlockEvent
from worker_svc.engine.job import Job
from worker_svc.engine.steerling_engine import SteerlingEngine

TOL = 1e-5   # the engine's float32 logsumexp vs the reference's float32 log_softmax


@pytest.fixture(autouse=True, scope="module")
def one_intraop_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parity
def test_committed_tokens_logprobs_equal_the_reference_decoders(seed):
    model = make_model(seed, TINY)
    rng = random.Random(seed)
    engine = SteerlingEngine(model, tokenizer_vocab_size=VOCAB, n_pages=64)
    cases = []
    for i, (k, tps, greedy, steered) in enumerate([(5, 1, True, False), (20, 4, False, True), (0, 2, False, False),
                                                    (None, 1, False, False), (3, 3, False, True)]):
        prompt = [rng.randrange(256) for _ in range(rng.choice((5, 64, 90)))]
        sampling = SamplingParams(use_entropy_sampling=False, temperature=0.0) if greedy else SamplingParams()
        opts = decode_options(rng.choice((40, 100)), sampling=sampling, tokens_per_step=tps, seed=rng.randrange(1 << 40))
        st = steer(model, [rng.randrange(TINY.n_known) for _ in range(2)]) if steered else None
        handle = engine.submit(Job(f"r{i}", prompt, opts, steering=st, logprobs=k))
        cases.append((f"r{i}", prompt, opts, st, k, handle))
    engine.run_until_idle()
    checked = 0
    for rid, prompt, opts, st, k, handle in cases:
        tag = f"seed={seed} {rid} (alternatives {k})"
        blocks = [e for e in engine.drain(handle) if isinstance(e, BlockEvent)]
        ref = generate(model, prompt, opts, st, tokenizer_vocab_size=VOCAB)
        assert [b.tokens for b in blocks] == [b.tokens for b in ref.blocks], tag
        for b in blocks:
            if k is None:
                assert b.logprobs is None, tag
                continue
            assert len(b.logprobs) == len(b.tokens), tag
            for p, lp in zip(range(b.start, b.end), b.logprobs):
                if p not in ref.logprobs:   # filled with EOS after <|eot_id|>: never sampled
                    assert lp is None, f"{tag} position {p}"
                    continue
                want, want_ids, want_lps = ref.logprobs[p]
                assert abs(lp.logprob - want) <= TOL * max(1.0, abs(want)), f"{tag} position {p}: {lp.logprob} vs {want}"
                assert lp.top_ids == want_ids[:k], f"{tag} position {p}: {lp.top_ids} vs {want_ids[:k]}"
                assert all(abs(g - w) <= TOL * max(1.0, abs(w)) for g, w in zip(lp.top_logprobs, want_lps)), tag
                assert sum(math.exp(v) for v in lp.top_logprobs) <= 1 + 1e-5 and lp.logprob <= 0, tag
                checked += 1
    assert checked > 100, f"seed={seed}: only {checked} tokens compared"
