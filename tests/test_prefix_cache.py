"""Prefix caching (worker_svc/engine/prefix_cache.py, the page pool's reference counts, admission in
request_table.py): the pool's bookkeeping under random operations, eviction order, and both
engines' outputs with shared prompts equal to the reference decoders (so equal with the cache on
and off), with hits counted, under preemption too."""

from __future__ import annotations

import random

import pytest
import torch

from cde.blocks import PAGE
from cde.isd.toy import lag_model
from cde.steerling.config import TINY
from cde.steerling.sampling import SamplingParams
from tests.isd_engine_harness import check_all, prompts_for, run_in_waves
from tests.options import decode_options, isd_options
from tests.steerling_engine_cases import VOCAB, check_against_reference, make_model, steer
from tests.tiny_models import random_lora
from worker_svc.engine.isd_engine import IsdEngine, IsdFinishEvent
from worker_svc.engine.job import Job
from worker_svc.engine.kv_cache import PagePool
from worker_svc.engine.steerling_engine import SteerlingEngine


@pytest.fixture(autouse=True, scope="module")
def one_intraop_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def blocks(*ids: int) -> list[tuple[int, ...]]:
    """One 64-token block per id (its tokens all that id)."""
    return [(i,) * PAGE for i in ids]


def check_pool(pool: PagePool, held: dict[str, list[int]], tag: str) -> None:
    """Every usable page is exactly one of: free, parked (cached, nobody holds it), held; a page's
    reference count is how many holders list it."""
    free, parked = set(pool._free), set(pool.cache._parked)
    counts = {}
    for pages in held.values():
        for p in pages:
            counts[p] = counts.get(p, 0) + 1
    assert len(free) == len(pool._free), f"{tag}: a page twice in the free list"
    assert not free & parked and not free & counts.keys() and not parked & counts.keys(), tag
    assert free | parked | counts.keys() == set(range(1, pool.n_pages)), f"{tag}: a page got lost"
    assert all(pool._refs[p] == counts.get(p, 0) for p in range(1, pool.n_pages)), tag
    assert all(pool.cache.holds(p) for p in parked), f"{tag}: a parked page that is not cached"
    assert pool.free == len(free) + len(parked) and pool.used == len(counts), tag


def test_pool_parks_shares_and_evicts_least_recently_released_first():
    pool = PagePool(6, prefix_caching=True)    # 5 usable
    a = [pool.alloc() for _ in range(3)]
    pool.publish(blocks(1, 2, 3), a)
    assert pool.cached_prefix(blocks(1, 2, 9)) == (a[:2], 0)        # held: taking them costs no free page
    assert pool.cached_prefix(blocks(2)) == ([], 0)                 # a block is found only after its prefix
    assert pool.cached_prefix(blocks(1, 2), namespace="other") == ([], 0)
    pool.release(a)
    assert pool.free == 5 and pool.used == 0
    assert pool.cached_prefix(blocks(1, 2, 3)) == (a, 3)            # parked: each one taken uses a free page
    pool.share(a[:2])
    assert pool.free == 3 and pool._refs[a[0]] == 1
    # two free pages, then eviction takes the parked block (1, 2, 3)'s last page, nothing else
    got = [pool.alloc() for _ in range(3)]
    assert got[2] == a[2] and pool.cached_prefix(blocks(1, 2, 3)) == (a[:2], 0)
    assert pool.alloc() is None
    pool.release(got + a[:2])
    # released last block first: a[1] parked before a[0], so it goes first, and evicting a[0]
    # would drop a[1] with it
    assert pool.free == 5
    pool._free.clear()
    assert pool.alloc() == a[1] and pool.cached_prefix(blocks(1, 2)) == (a[:1], 1)
    assert pool.alloc() == a[0] and pool.cached_prefix(blocks(1)) == ([], 0)


def test_evicting_a_block_drops_the_blocks_under_it_and_a_held_child_is_freed_on_release():
    pool = PagePool(8, prefix_caching=True)
    a = [pool.alloc() for _ in range(2)]
    pool.publish(blocks(1, 2), a)
    b = [pool.alloc() for _ in range(3)]          # its own copy of block 1 (computed before a's was cached)
    pool.publish(blocks(1, 2, 3), b)              # blocks 1, 2 keep a's pages; block 3 goes under a's block 2
    assert pool.cached_prefix(blocks(1, 2, 3)) == (a + b[2:], 0)
    pool.release(a)                               # a's pages parked, b still holds block 3's page
    pool._free.clear()
    assert pool.alloc() == a[1]                   # evicted: block 3 (held by b) is no longer cached
    assert pool.cached_prefix(blocks(1, 2, 3)) == (a[:1], 1)
    pool.release(b)
    assert b[2] in pool._free and b[0] in pool._free and not pool.cache.holds(b[2])


def test_random_operations_keep_every_page_accounted_for(seed):
    rng = random.Random(seed)
    pool = PagePool(rng.randrange(4, 20), prefix_caching=True)
    held: dict[str, list[int]] = {}
    names = iter(range(1 << 30))
    for op in range(400):
        tag = f"seed={seed} op {op}"
        kind = rng.random()
        if kind < 0.5:   # admit: reuse the cached prefix of a random prompt, allocate the rest
            prompt = blocks(*[rng.randrange(3) for _ in range(rng.randrange(1, 5))])
            hits, parked = pool.cached_prefix(prompt)
            need = len(prompt) + rng.randrange(2)
            if pool.free - parked < need - len(hits):
                continue
            pool.share(hits)
            pages = hits + [pool.alloc() for _ in range(need - len(hits))]
            assert None not in pages, f"{tag}: admission checked the pages were there"
            held[f"r{next(names)}"] = pages
            if rng.random() < 0.8:
                pool.publish(prompt, pages)
        elif held:
            rid = rng.choice(sorted(held))
            pool.release(held.pop(rid))
        check_pool(pool, held, tag)
    for rid in list(held):
        pool.release(held.pop(rid))
    check_pool(pool, held, f"seed={seed} end")
    assert pool.used == 0


# ---- the engines -----------------------------------------------------------------------------

def _shared_prompts(rng: random.Random, system: list[int], n: int, vocab: int) -> list[list[int]]:
    """Prompts that start with the same system prompt, some identical, some shorter than it."""
    out = []
    for i in range(n):
        if i % 4 == 3:
            out.append(system[: rng.randrange(1, len(system))])
        else:
            out.append(system + [rng.randrange(vocab) for _ in range(rng.choice((0, 1, 40, 70)))])
    return out


@pytest.mark.parity
@pytest.mark.parametrize("n_pages", [64, 7])
def test_steerling_engine_with_shared_prompts_equals_the_reference(n_pages, seed):
    """Waves of requests sharing a 130-token system prompt (2 full blocks), steered and not, many
    tokens per step and one: every output equals the reference decoder's; later waves hit the
    cache. n_pages=7 (6 usable, one request needs up to 6): requests are preempted and cached pages evicted meanwhile."""
    model = make_model(seed, TINY.replace(eot_id=None))
    rng = random.Random(seed)
    system = [rng.randrange(256) for _ in range(130)]
    engines = {on: SteerlingEngine(model, tokenizer_vocab_size=VOCAB, n_pages=n_pages, prefix_caching=on)
               for on in (True, False)}
    submitted = {on: {} for on in engines}
    prompts = _shared_prompts(rng, system, 8, 256)
    specs = []
    for i, prompt in enumerate(prompts):
        st = steer(model, [rng.randrange(TINY.n_known) for _ in range(2)]) if i % 3 == 1 else None
        opts = decode_options(150 if n_pages < 64 else rng.choice((30, 70)), sampling=SamplingParams(), tokens_per_step=rng.choice((1, 4)),
                              seed=rng.randrange(1 << 40))
        specs.append((f"s{i}", prompt, opts, st))
    for on, engine in engines.items():
        for wave in (specs[:3], specs[3:]):
            for rid, prompt, opts, st in wave:
                submitted[on][rid] = (prompt, opts, st, engine.submit(Job(rid, prompt, opts, steering=st)))
            engine.run_until_idle()
        assert engine.stats().pages_used == 0, f"seed={seed} cache {on}"
    on, off = engines[True].stats(), engines[False].stats()
    assert off.prefix_cache_hits == 0 and on.prefix_cache_hits >= 2 * PAGE * 3, f"seed={seed}: {on}"
    assert off.prefix_cache_queries == 0 and on.prefix_cache_queries >= sum(len(p) for p in prompts), f"seed={seed}"
    if n_pages < 64:
        assert on.preemptions > 0, f"seed={seed}: the pool never ran out"
    seqs = {flag: {rid: h.seq for rid, (_, _, _, h) in submitted[flag].items()} for flag in engines}
    assert seqs[True] == seqs[False], f"seed={seed}: the cache changed an output"
    check_against_reference(model, engines[True], submitted[True])


@pytest.mark.parity
@pytest.mark.parametrize("n_pages", [64, 9])
def test_isd_engine_with_shared_prompts_equals_the_reference(n_pages, seed):
    """Waves of ISD / R-ISD / AR requests (greedy and sampled, LoRA gated and not) sharing a
    130-token system prompt: every request equals the reference decoder alone; the ungated
    LoRA's K/V of clean tokens differ from the base model's, so those requests share only among
    themselves. n_pages=9: preemption and eviction meanwhile."""
    model = lag_model(seed, lag=4, vocab=64, beta=1.0)
    random_lora(model, seed + 1, scale=0.5)
    rng = random.Random(seed)
    system = prompts_for(model, rng, (130,))[0]
    vocab = [t for t in range(model.cfg.vocab_size) if t != model.cfg.mask_token_id and t not in model.cfg.eos_token_ids]
    prompts = [[vocab[t % len(vocab)] for t in p] for p in _shared_prompts(rng, system, 10, len(vocab))]
    jobs = []
    for i, prompt in enumerate(prompts):
        stride, temp = rng.choice(((1, 0.0), (3, 0.0), (4, 0.8), (2, 1.0), (1, 0.7)))
        jobs.append((f"i{i}", prompt, isd_options(40, stride=stride, temperature=temp, lora_gated=i % 3 != 2,
                                                  seed=rng.randrange(1 << 30))))
    events = {}
    stats = {}
    for on in (True, False):
        engine = IsdEngine(model, n_pages=n_pages, prefix_caching=on)
        events[on] = run_in_waves(engine, jobs, waves=3, steps_between=30)
        stats[on] = engine.stats()
    assert stats[False].prefix_cache_hits == 0 and stats[True].prefix_cache_hits >= 2 * PAGE * 3, \
        f"seed={seed}: {stats[True]}"
    if n_pages == 9:
        assert stats[True].preemptions > 0, f"seed={seed}: the pool never ran out"
    outs = {on: {rid: [e for e in ev if isinstance(e, IsdFinishEvent)][0].output_tokens for rid, ev in events[on].items()}
            for on in events}
    assert outs[True] == outs[False], f"seed={seed}: the cache changed an output"
    check_all(model, events[True], jobs, f"seed={seed} cache on")


# ---- n > 1: simultaneous requests with one prompt prefill it once ----------------------------

@pytest.mark.parity
def test_steerling_requests_submitted_together_prefill_a_shared_prompt_once(seed):
    """Four requests with one 140-token prompt (2 full blocks), submitted in the same step as n = 4
    choices are: the later three wait for the first's prefill and reuse its two pages (hits 3 x 2
    blocks, the pool never holds more than one copy of them), and every output equals the cache-off
    engine's and the reference decoder's."""
    model = make_model(seed, TINY.replace(eot_id=None))
    rng = random.Random(seed)
    prompt = [rng.randrange(256) for _ in range(140)]
    outs, stats, peaks = {}, {}, {}
    for on in (True, False):
        engine = SteerlingEngine(model, tokenizer_vocab_size=VOCAB, n_pages=64, prefix_caching=on)
        submitted = {}
        for i in range(4):
            opts = decode_options(40, sampling=SamplingParams(), tokens_per_step=2, seed=seed + i)
            submitted[f"c{i}"] = (prompt, opts, None, engine.submit(Job(f"c{i}", prompt, opts)))
        peak = 0
        while engine.has_work():
            engine.step()
            peak = max(peak, engine.stats().pages_used)
        outs[on] = {rid: h.seq for rid, (_, _, _, h) in submitted.items()}
        stats[on], peaks[on] = engine.stats(), peak
        if on:
            check_against_reference(model, engine, submitted)
    assert stats[True].prefix_cache_hits == 3 * 2 * PAGE, f"seed={seed}: {stats[True]}"
    assert stats[False].prefix_cache_hits == 0, f"seed={seed}"
    # each request: 2 prompt pages + its active block's page (+ one it may open); shared: 2 + 4 x own
    assert peaks[True] <= peaks[False] - 2 * 3, f"seed={seed}: peak pages {peaks}"
    assert outs[True] == outs[False], f"seed={seed}: sharing changed an output"


@pytest.mark.parity
def test_isd_requests_submitted_together_prefill_a_shared_prompt_once(seed):
    """The same for ISD (stride 3, sampled): n = 4 requests with one 150-token prompt submitted
    together hit the first one's two prompt pages; outputs equal the reference decoder's."""
    model = lag_model(seed, lag=4, vocab=64, beta=1.0)
    rng = random.Random(seed)
    prompt = prompts_for(model, rng, (150,))[0]
    jobs = [(f"c{i}", prompt, isd_options(30, stride=3, temperature=0.8, seed=seed + i)) for i in range(4)]
    events, stats = {}, {}
    for on in (True, False):
        engine = IsdEngine(model, n_pages=64, prefix_caching=on)
        events[on] = run_in_waves(engine, jobs, waves=1, steps_between=0)
        stats[on] = engine.stats()
    assert stats[True].prefix_cache_hits == 3 * 2 * PAGE, f"seed={seed}: {stats[True]}"
    outs = {on: {rid: [e for e in ev if isinstance(e, IsdFinishEvent)][0].output_tokens for rid, ev in events[on].items()}
            for on in events}
    assert outs[True] == outs[False], f"seed={seed}: sharing changed an output"
    check_all(model, events[True], jobs, f"seed={seed} cache on")
