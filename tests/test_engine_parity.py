"""The fast engine against the reference decoder: token for token, record for record.

CPU, tiny configs, fresh seeds. Batches mix prompt lengths (64-aligned and not), steering on
some requests only, requests joining mid-flight, k > 1 tokens per step and a page pool small
enough to force preemption.

Token-for-token runs use float64 weights: the paged engine and the full-recompute reference
sum in different orders, and in fp32 two masked positions whose confidences tie to within
~1e-6 (common with random tiny models: 64 confidences packed into a narrow band) may swap,
after which the texts legitimately diverge. In float64 such ties are ~1e-9 as likely, so
token equality is a sharp test of the logic. The fp32 numerics are tested separately: the
engine's paged forward equals the reference's dense forward to <= 1e-5 relative.
"""

from __future__ import annotations

import random

import pytest
import torch

from cde.steerling.config import TINY
from cde.steerling.reference_decoder import generate
from cde.steerling.sampling import SamplingParams
from tests.options import decode_options
from tests.steerling_engine_cases import VOCAB, check_against_reference, make_model, steer
from worker_svc.engine import steerling_engine, steerling_plan
from worker_svc.engine.job import Job
from worker_svc.engine.steerling_engine import BlockEvent, FinishEvent, SteerlingEngine, StepEvent
from worker_svc.engine.runtime import PinnedPairs
from tests.seeding import draw_seed

pytestmark = pytest.mark.parity


@pytest.mark.parametrize("overlap", [True, False])
def test_mixed_batch_with_steering_joins_and_k_per_step(overlap, seed):
    """overlap=True: steady steps are launched before the previous step's results are applied
    (tokens from the device's block table); the output must not change."""
    model = make_model(seed)
    engine = SteerlingEngine(model, tokenizer_vocab_size=VOCAB, n_pages=64, overlap=overlap)
    rng = random.Random(seed)
    submitted = {}
    specs = [  # prompt length, max new, steering, tokens per step, sampling
        (1, 70, None, 1, SamplingParams()),
        (63, 66, "amplify", 1, SamplingParams()),
        (64, 128, None, 2, SamplingParams(use_entropy_sampling=False, temperature=0.7, top_p=0.9)),
        (65, 60, "suppress", 1, SamplingParams(use_entropy_sampling=False, temperature=0.0)),
        (130, 90, None, 3, SamplingParams()),
    ]

    def submit(i, spec):
        length, new, mode, k, sp = spec
        prompt = [rng.randrange(256) for _ in range(length)]
        st = steer(model, [rng.randrange(TINY.n_known) for _ in range(2)], mode) if mode else None
        opts = decode_options(new, sampling=sp, tokens_per_step=k, seed=rng.randrange(1 << 40))
        submitted[f"r{i}"] = (prompt, opts, st, engine.submit(Job(f"r{i}", prompt, opts, steering=st)))

    for i, spec in enumerate(specs[:3]):
        submit(i, spec)
    for _ in range(7):          # later requests join mid-flight
        engine.step()
    submit(3, specs[3])
    for _ in range(20):
        engine.step()
    submit(4, specs[4])
    engine.run_until_idle()
    assert engine.stats().pages_used == 0
    assert (engine.overlapped_steps > 0) == overlap
    check_against_reference(model, engine, submitted)


def test_steps_launch_ahead_through_block_closes_and_arrivals(seed):
    """Staggered traffic: requests arrive while a step is in flight (as the worker's threads
    submit), blocks close and requests end at different steps, some steered (amplified with a
    strength that drops to 0 after 24 tokens, or suppressed with a relu mask), some 4 tokens per
    step. Every step but the first after an idle spell is launched before the previous one's results are applied -- a closing block's commit row takes
    the device's tokens, its next block's decode row and an arrival's rows the host's -- and every
    request still equals the reference decoder alone."""
    model = make_model(seed, TINY.replace(eot_id=None))   # no early end: every close is foreseen
    engine = SteerlingEngine(model, tokenizer_vocab_size=VOCAB, n_pages=64)
    rng = random.Random(seed)
    arrivals = sorted(rng.sample(range(1, 100), 5))
    submitted, i, idle_arrivals = {}, 0, 0
    while i < len(arrivals) or engine.has_work():
        if i < len(arrivals) and (engine.steps >= arrivals[i] or not engine.has_work()):
            idle_arrivals += not engine.has_work()   # an idle engine's next step is the host's
            prompt = [rng.randrange(256) for _ in range(rng.choice((3, 64, 70, 130)))]
            opts = decode_options(rng.choice((60, 100, 130)), sampling=SamplingParams(),
                                  tokens_per_step=rng.choice((1, 4)), seed=rng.randrange(1 << 40))
            st = (None, steer(model, [1, 5, 9]), steer(model, [2, 4], "suppress"))[i % 3]
            submitted[f"a{i}"] = (prompt, opts, st, engine.submit(Job(f"a{i}", prompt, opts, steering=st)))
            i += 1
        engine.step()
        # between steps of a busy engine the next one is already in flight
        assert engine.inflight is not None or not engine.has_work(), f"seed={seed}: step {engine.steps}"
    host_built = engine.steps - engine.overlapped_steps
    assert host_built == idle_arrivals, f"seed={seed}: {host_built} of {engine.steps} steps built from the host"
    assert engine.stats().pages_used == 0
    check_against_reference(model, engine, submitted)


def test_overlapped_steps_survive_an_eot_that_ends_a_request_early():
    """<|eot_id|> made likely: requests end mid-block while the next step is already running
    (its row then finds the block filled and is dropped); tokens still equal the reference.
    A run drops such a row ~7 times in 8; up to 4 fresh seeds until one does."""
    dropped = 0
    for _ in range(4):
        seed = draw_seed()
        model = make_model(seed)
        with torch.no_grad():
            model.transformer.lm_head.weight[model.cfg.eot_id] *= 4.0
        engine = SteerlingEngine(model, tokenizer_vocab_size=VOCAB, n_pages=64)
        rng = random.Random(seed)
        submitted = {}
        for i, length in enumerate((3, 40, 64, 100)):
            prompt = [rng.randrange(256) for _ in range(length)]
            opts = decode_options(120, sampling=SamplingParams(), seed=rng.randrange(1 << 40))
            submitted[f"e{i}"] = (prompt, opts, None, engine.submit(Job(f"e{i}", prompt, opts)))
        engine.run_until_idle()
        assert engine.overlapped_steps > 0 and engine.stats().pages_used == 0
        check_against_reference(model, engine, submitted)
        dropped = engine.strategy.dropped_rows
        if dropped:
            break
    assert dropped > 0, "no speculative row was dropped in 4 runs: the early end was not exercised"


def test_result_buffers_alternate_from_the_first_call():
    """Both engines copy a launched step's results into PinnedPairs buffers; with overlap the
    next step's copy is started before this one's results are read, so two calls in a row (for
    one shape) must never return the same buffer. The first version returned its first buffer
    twice, which on a GPU gave a request the next step's tokens."""
    pairs = PinnedPairs(pin=False)
    for shape in ((3, 7), (5, 2)):
        got = [pairs.next(shape, torch.int64) for _ in range(6)]
        assert all(a.data_ptr() != b.data_ptr() for a, b in zip(got, got[1:])), shape
        assert {t.data_ptr() for t in got} == {got[0].data_ptr(), got[1].data_ptr()}, "two buffers per shape"
        assert all(t.shape == shape and t.dtype == torch.int64 for t in got)


def test_preemption_with_a_tiny_page_pool_gives_the_same_output(seed):
    model = make_model(seed, TINY.replace(eot_id=None))  # no early <|eot_id|>: every request runs to length
    # 7 usable pages; four requests each needing 3-4 pages at the end
    engine = SteerlingEngine(model, tokenizer_vocab_size=VOCAB, n_pages=8)
    rng = random.Random(seed)
    submitted = {}
    for i, (length, new) in enumerate([(70, 150), (10, 180), (64, 120), (100, 100)]):
        prompt = [rng.randrange(256) for _ in range(length)]
        opts = decode_options(new, sampling=SamplingParams(), tokens_per_step=4, seed=i + seed)
        submitted[f"p{i}"] = (prompt, opts, None, engine.submit(Job(f"p{i}", prompt, opts)))
    engine.run_until_idle()
    assert engine.preemptions > 0
    # readmitted after a preemption, a request is not counted (nor its queue wait) again
    assert engine.stats().pages_used == 0 and engine.stats().admitted == 4
    check_against_reference(model, engine, submitted)


def test_gqa_and_mqa_configs_match_too(seed):
    cfg = TINY.replace(n_layers=2, n_embd=96, n_head=6, n_kv_heads=1, n_known=70, n_discovered=50,
                       topk_known=5, topk_discovered=7, concept_chunk=16)
    model = make_model(seed, cfg)
    engine = SteerlingEngine(model, tokenizer_vocab_size=VOCAB, n_pages=32)
    submitted = {}
    for i, length in enumerate((5, 64, 77)):
        prompt = list(range(length))
        opts = decode_options(64, sampling=SamplingParams(), seed=seed + i)
        submitted[str(i)] = (prompt, opts, None, engine.submit(Job(str(i), prompt, opts)))
    engine.run_until_idle()
    check_against_reference(model, engine, submitted)


def test_cancel_frees_pages_within_one_step():
    model = make_model(1)
    engine = SteerlingEngine(model, tokenizer_vocab_size=VOCAB, n_pages=32)
    a = engine.submit(Job("a", list(range(200)), decode_options(300)))
    b = engine.submit(Job("b", list(range(30)), decode_options(300)))
    for _ in range(3):
        engine.step()
    used = engine.stats().pages_used
    assert used == len(a.pages) + len(b.pages) and used > 0
    assert engine.cancel("a")
    engine.step()
    assert engine.stats().pages_used == len(b.pages)
    assert [e.reason for e in engine.drain(a) if isinstance(e, FinishEvent)] == ["cancelled"]
    assert not engine.cancel("a")
    engine.cancel("b")
    engine.run_until_idle()
    assert engine.stats().pages_used == 0 and engine.stats().running == 0


def test_requests_that_can_never_fit_fail_clearly():
    model = make_model(2)
    engine = SteerlingEngine(model, tokenizer_vocab_size=VOCAB, n_pages=3)
    h = engine.submit(Job("big", list(range(200)), decode_options(10)))
    engine.run_until_idle()
    (fin,) = [e for e in engine.drain(h) if isinstance(e, FinishEvent)]
    assert fin.reason == "error" and "KV pages" in fin.error
    with pytest.raises(ValueError, match="duplicate"):
        engine.submit(Job("x", [1], decode_options(4)))
        engine.submit(Job("x", [1], decode_options(4)))
    with pytest.raises(ValueError, match="context"):
        engine.submit(Job("y", [1] * 1000, decode_options(100)))


def test_fp32_paged_forward_equals_dense_reference_forward(seed):
    """In fp32, the logits the engine samples from equal the reference's (<= 1e-5 relative) for
    every decode row of a mixed batch, at a state reached by real decoding."""
    from cde.steerling.model import dense_block_causal_attend

    model = make_model(seed, dtype=torch.float32)
    engine = SteerlingEngine(model, tokenizer_vocab_size=VOCAB, n_pages=64, overlap=False)   # inspects one planned step
    rng = random.Random(seed)
    for i, length in enumerate((1, 63, 64, 65, 130)):
        engine.submit(Job(f"f{i}", [rng.randrange(256) for _ in range(length)], decode_options(100, seed=i)))
    for _ in range(rng.randrange(5, 30)):
        engine.step()
    captured = {}
    runner = engine.strategy.runner
    real_trunk, real_score = runner.trunk, runner.score

    def spy_trunk(inp):
        tokens, hidden = real_trunk(inp)
        captured["tokens"] = tokens
        return tokens, hidden

    def spy_score(hidden, head_rows):
        out = real_score(hidden, head_rows)
        captured["logits"], captured["rows"] = out.logits, head_rows
        return out

    runner.trunk, runner.score = spy_trunk, spy_score
    rows = engine.strategy.plan(engine.table).rows
    engine.step()
    # the engine scores only its candidate (masked) positions: compare those, through its map
    head_rows = captured["rows"]
    checked = 0
    with torch.no_grad():
        for i, (req, b, is_decode, _) in enumerate(rows):
            if not is_decode:
                continue
            start, end = req.block_range(b)
            seq = torch.tensor([req.seq[:end]])
            seq[0, start:end] = captured["tokens"][i, : end - start]   # the state the engine saw
            pos = torch.arange(end)[None]
            h = model.hidden_states(seq, pos, dense_block_causal_attend(pos, 64))
            ref = model.heads(h[0, start:end]).logits
            at = head_rows.candidate[i, : end - start].nonzero().squeeze(1)
            assert at.numel() == int((seq[0, start:end] == model.cfg.mask_id).sum()) > 0
            ours = captured["logits"][head_rows.index[i, at]]
            ref = ref[at]
            assert float((ours - ref).abs().max() / ref.abs().max()) <= 1e-5
            checked += 1
    assert checked >= 1


def test_resume_from_committed_blocks_gives_the_same_output(seed):
    """A request restarted on another engine from its committed blocks and step counter
    (what the scheduler does when a worker dies) ends exactly as if it had never stopped."""
    model = make_model(seed, TINY.replace(eot_id=None))
    prompt = list(range(70))
    opts = decode_options(200, sampling=SamplingParams(), tokens_per_step=2, seed=seed)
    ref = generate(model, prompt, opts, tokenizer_vocab_size=VOCAB)
    first = ref.blocks[0]
    committed = ref.sequence[70:first.end]
    steps_done = sum(1 for s in ref.steps if s.block == first.block)
    engine = SteerlingEngine(model, tokenizer_vocab_size=VOCAB, n_pages=16)
    h = engine.submit(Job("resumed", prompt, opts, committed=committed, next_step=steps_done))
    engine.run_until_idle()
    events = list(engine.drain(h))
    fin = [e for e in events if isinstance(e, FinishEvent)][0]
    assert fin.output_tokens == ref.output_tokens
    assert [b.tokens for b in events if isinstance(b, BlockEvent)] == [b.tokens for b in ref.blocks[1:]]
    with pytest.raises(ValueError, match="block boundary"):
        engine.submit(Job("bad", prompt, opts, committed=committed[:-1]))


@pytest.mark.parametrize("overlap", [True, False])
def test_confidence_thresholds_with_steering_equal_the_reference(overlap, seed):
    """Threshold rows commit between one and k tokens a step. With overlap the next step is
    launched before the host knows how many: only when no count could close the block, and
    (amplify's hard cutoff) only while every count gives the same steering strength."""
    model = make_model(seed)
    engine = SteerlingEngine(model, tokenizer_vocab_size=VOCAB, n_pages=64, overlap=overlap)
    rng = random.Random(seed)
    submitted = {}
    for i, (length, new, mode, k) in enumerate([(5, 100, "amplify", 4), (64, 70, "suppress", 3), (70, 80, None, 8)]):
        prompt = [rng.randrange(256) for _ in range(length)]
        st = steer(model, [rng.randrange(TINY.n_known) for _ in range(2)], mode) if mode else None
        # tiny random models spread ~0.004-0.03 of probability over their best token: 0.01 splits them
        opts = decode_options(new, sampling=SamplingParams(), tokens_per_step=k, confidence_threshold=0.01,
                             seed=rng.randrange(1 << 40))
        submitted[f"t{i}"] = (prompt, opts, st, engine.submit(Job(f"t{i}", prompt, opts, steering=st)))
    engine.run_until_idle()
    commits = {len(e.positions) for _, _, _, h in submitted.values() for e in h.events if isinstance(e, StepEvent)}
    assert len(commits) >= 3, f"seed {seed}: the threshold never split a step's commits ({sorted(commits)})"
    assert (engine.overlapped_steps > 0) == overlap, f"seed {seed}"
    check_against_reference(model, engine, submitted)


def test_a_closed_blocks_next_decode_row_joins_its_commit_step_only_while_steps_are_small(seed, monkeypatch):
    """A lone request's block boundaries cost no forward (its commit row and next decode row share
    a step: one forward per token at one token per step); five requests in lockstep close their
    blocks together, and their decode rows wait a step rather than grow the batch into the next
    row bucket. Both equal the reference."""
    model = make_model(seed, TINY.replace(eot_id=None))
    rng = random.Random(seed)
    real_plan = steerling_plan.plan_rows   # planned from the host's state or ahead of a step in flight
    for n_requests, folded in ((1, True), (5, False)):
        engine = SteerlingEngine(model, tokenizer_vocab_size=VOCAB, n_pages=64)
        widths = []

        def plan(states, max_prefill_rows):
            rows = real_plan(states, max_prefill_rows)
            widths.append(len(rows))
            return rows

        # a module function both planners (steerling_engine's plan, steerling_plan's plan_ahead) look up
        monkeypatch.setattr(steerling_engine, "plan_rows", plan)
        monkeypatch.setattr(steerling_plan, "plan_rows", plan)
        submitted = {}
        for i in range(n_requests):
            prompt = [rng.randrange(256) for _ in range(64)]     # whole blocks: decoding starts at a boundary
            opts = decode_options(128, sampling=SamplingParams(), seed=seed + i)
            submitted[f"f{i}"] = (prompt, opts, None, engine.submit(Job(f"f{i}", prompt, opts)))
        engine.run_until_idle()
        check_against_reference(model, engine, submitted)
        if folded:
            assert engine.strategy.forwards == 128 and max(widths) == 2, (seed, engine.strategy.forwards, widths)
        else:   # 2 blocks: 1 boundary, a step of commit rows only
            # (the first step: the prompts' commit rows with their decode rows, as prefill always does)
            assert engine.strategy.forwards == 128 + 1 and max(widths[1:]) == n_requests, \
                (seed, engine.strategy.forwards, widths)


def test_queue_wait_is_counted_once_per_request_from_submit_to_admission():
    """EngineStats.admitted / queue_s_sum (the worker's Info reports them): a request that waits
    for the only slot is counted when it is first admitted, with at least the time it waited
    (readmission after a preemption: test_preemption_with_a_tiny_page_pool_gives_the_same_output)."""
    import time

    engine = SteerlingEngine(make_model(5), tokenizer_vocab_size=VOCAB, n_pages=32, max_slots=1)
    first = engine.submit(Job("first", list(range(1, 20)), decode_options(64, seed=1)))
    second = engine.submit(Job("second", list(range(1, 30)), decode_options(64, seed=2)))
    t0 = time.perf_counter()
    engine.step()
    assert engine.stats().admitted == 1   # one slot: the second waits
    while not first.finished:
        engine.step()
    waited = time.perf_counter() - t0
    engine.run_until_idle()
    st = engine.stats()
    assert st.admitted == 2 and second.queued_at is None
    assert waited <= st.queue_s_sum < waited + 5.0, (st.queue_s_sum, waited)


def test_a_request_without_records_gets_blocks_without_them_beside_one_with(seed):
    """records=False (the worker's no_records: a request without attributions): its blocks carry no
    concept records, while a request sharing its steps still gets every committed token's; both
    equal the reference decoder."""
    model = make_model(seed)
    engine = SteerlingEngine(model, tokenizer_vocab_size=VOCAB, n_pages=32)
    rng = random.Random(seed)
    jobs = {rid: ([rng.randrange(256) for _ in range(20 + 30 * i)],
                  decode_options(150, sampling=SamplingParams(), seed=seed + i))
            for i, rid in enumerate(("with", "without"))}
    handles = {rid: engine.submit(Job(rid, p, o, records=rid == "with")) for rid, (p, o) in jobs.items()}
    solo = engine.submit(Job("solo-without", jobs["without"][0], jobs["without"][1], records=False))
    engine.run_until_idle()
    for rid, h in [*handles.items(), ("solo-without", solo)]:
        events = list(engine.drain(h))
        blocks = [e for e in events if isinstance(e, BlockEvent)]
        assert blocks, f"seed={seed} {rid}"
        if rid == "with":
            assert all(b.records is not None and len(b.records) > 0 for b in blocks), f"seed={seed}"
        else:
            assert all(b.records is None for b in blocks), f"seed={seed} {rid}"
        prompt, opts = jobs["with" if rid == "with" else "without"]
        assert events[-1].output_tokens == generate(model, prompt, opts, tokenizer_vocab_size=VOCAB).output_tokens, \
            f"seed={seed} {rid}"
