"""The CUDA-graph keys a Steerling step replays are all captured by the warm-up
(steerling_graphs.capture_plan), whatever the traffic: requests arriving at different steps,
users resubmitting as their last request ends (what load through the services looks like),
several tokens per step, confidence thresholds, prompts of several blocks, preemption. The keys
are host-side decisions, so the CPU engine shows them; with CUDA graphs each key outside the
plan would be a capture of a few step times inside serving (tests/test_engine_gpu.py checks
that none happens on a GPU)."""

from __future__ import annotations

import random

import pytest

from cde.steerling.config import TINY
from cde.steerling.model import SteerlingModel
from cde.steerling.sampling import SamplingParams
from tests.options import decode_options
from worker_svc.engine.job import Job
from worker_svc.engine.runtime import ROW_BUCKETS, bucket
from worker_svc.engine.steerling_engine import FinishEvent, SteerlingEngine
from worker_svc.engine.steerling_graphs import capture_plan, graph_keys, head_buckets_for


def _recording(engine: SteerlingEngine) -> list[tuple]:
    keys: list[tuple] = []
    strategy = engine.strategy
    execute = strategy.device_step

    def recording(rb, pb, hb, layout, fwd, smp):
        keys.extend(graph_keys(rb, pb, layout.tokens_per_step, hb, strategy.capture_rows))
        return execute(rb, pb, hb, layout, fwd, smp)

    strategy.device_step = recording
    return keys


@pytest.mark.parametrize("seed", [0])
def test_closed_loop_traffic_replays_only_keys_the_warmup_captures(seed):
    rng = random.Random(seed)
    model = SteerlingModel(TINY).init_random(seed).eval()
    # few pages: the closed loop also preempts
    engine = SteerlingEngine(model, tokenizer_vocab_size=264, n_pages=24, max_slots=12, capture_rows=8,
                             max_prefill_rows=6)
    keys = _recording(engine)
    plan = set(engine.strategy.capture_plan())
    n = 0

    def submit():
        nonlocal n
        n += 1
        tps = rng.choice((1, 1, 2, 4, 16))
        threshold = rng.choice((None, None, 0.5))
        return engine.submit(Job(f"r{n}", [rng.randrange(256) for _ in range(rng.randrange(1, 200))],
                                 decode_options(rng.randrange(16, 300), sampling=SamplingParams(),
                                                seed=rng.randrange(1 << 30), tokens_per_step=tps,
                                                confidence_threshold=threshold)))

    live = {}
    for user in range(10):   # users arriving a few steps apart, each resubmitting when its request ends
        live[user] = submit()
        for _ in range(rng.randrange(0, 4)):
            engine.step()
    for _ in range(80):
        engine.step()
        for user, handle in list(live.items()):
            if any(isinstance(e, FinishEvent) for e in handle.events):
                handle.events.clear()
                live[user] = submit()
    used = set(keys)
    served_from_graphs = {k for k in used if k[0] != "eager"}
    missing = served_from_graphs - plan
    assert not missing, f"seed={seed}: keys the warm-up does not capture: {sorted(missing)[:10]}"
    # the traffic really was varied: several row buckets, tokens per step, and steps beyond capture_rows
    assert len({k[1] for k in used}) >= 4 and len({k[2] for k in used if k[0] == "heads"}) >= 2, f"seed={seed}"
    capture_rows = engine.strategy.capture_rows
    assert any(k[0] == "eager" and k[1] > capture_rows for k in used), f"seed={seed}: no step above capture_rows"
    assert any(k[0] == "eager" and k[1] <= capture_rows for k in used), f"seed={seed}: no step of many tokens"
    assert engine.preemptions > 0, f"seed={seed}: the loop never preempted"


def test_the_capture_plan_is_every_head_bucket_of_every_row_bucket_and_bounded():
    plan = capture_plan(48, 64, (1, 4, 16, 64))
    trunks = [k for k in plan if k[0] == "trunk"]
    heads = [k for k in plan if k[0] == "heads"]
    rbs = [b for b in ROW_BUCKETS if b <= 48]
    assert sorted(trunks) == sorted(("trunk", rb, pb) for rb in rbs for pb in (2, 4, 8, 16, 32, 64))
    for rb in rbs:
        want = {("heads", rb, t, hb) for t in (1, 4, 16, 64) if rb * t <= 48 * 4 for hb in head_buckets_for(rb)}
        assert not any(k[1] == rb and rb * k[2] > 48 * 4 for k in heads)
        assert want <= set(heads) and 64 * rb in head_buckets_for(rb) and 16 in head_buckets_for(rb)
    assert len(set(plan)) == len(plan) < 1000          # what the worker's warm-up captures at 8B dims
    assert plan[0][1] == bucket(48, ROW_BUCKETS)       # largest first (the graphs share one pool)
