"""The asyncio front of the engine: concurrent streams, early close cancels, errors surface."""

from __future__ import annotations

import asyncio
import threading
import time

import torch

from cde.steerling.config import TINY
from cde.steerling.model import SteerlingModel
from cde.steerling.reference_decoder import generate
from tests.options import decode_options
from worker_svc.engine.async_engine import AsyncEngine
from worker_svc.engine.job import Job
from worker_svc.engine.steerling_engine import BlockEvent, FinishEvent, SteerlingEngine, StepEvent

VOCAB = 264


def test_concurrent_streams_match_reference_and_close_cancels():
    model = SteerlingModel(TINY).init_random(11, std=0.05).to(torch.float64).eval()
    engine = SteerlingEngine(model, tokenizer_vocab_size=VOCAB, n_pages=32)
    front = AsyncEngine(engine)
    front.start()

    async def collect(rid, prompt, opts):
        return [e async for e in front.generate(Job(rid, prompt, opts))]

    async def early_close():
        stream = front.generate(Job("quit", list(range(20)), decode_options(300, seed=9)))
        async for ev in stream:
            if isinstance(ev, BlockEvent):
                break
        await stream.aclose()

    async def main():
        jobs = [collect(f"r{i}", list(range(5 + 40 * i)), decode_options(70, seed=i)) for i in range(3)]
        results = await asyncio.gather(*jobs, early_close())
        return results[:3]

    try:
        results = asyncio.run(main())
        for i, events in enumerate(results):
            fin = events[-1]
            assert isinstance(fin, FinishEvent)
            assert any(isinstance(e, StepEvent) for e in events)
            ref = generate(model, list(range(5 + 40 * i)), decode_options(70, seed=i), tokenizer_vocab_size=VOCAB)
            assert fin.output_tokens == ref.output_tokens
        for _ in range(100):   # the closed stream's request is cancelled at the next step
            if engine.stats().running == 0 and engine.stats().waiting == 0:
                break
            asyncio.run(asyncio.sleep(0.05))
        assert engine.stats().pages_used == 0
    finally:
        front.stop()


def test_a_request_without_step_streaming_gets_only_blocks_with_the_same_step_counter():
    """stream_steps=False (what a served request that nobody watches denoise asks for) drops the
    per-step events; its blocks carry the step counter a resumed request continues from, equal
    to what the step events would have said, and the same tokens."""
    model = SteerlingModel(TINY).init_random(12, std=0.05).to(torch.float64).eval()
    engine = SteerlingEngine(model, tokenizer_vocab_size=VOCAB, n_pages=32)
    front = AsyncEngine(engine)
    front.start()

    async def collect(rid, stream_steps):
        return [e async for e in front.generate(Job(rid, list(range(30)), decode_options(150, seed=4),
                                                stream_steps=stream_steps))]

    async def main():
        return await asyncio.gather(collect("steps", True), collect("blocks", False))

    try:
        with_steps, blocks_only = asyncio.run(main())
    finally:
        front.stop()
    assert not any(isinstance(e, StepEvent) for e in blocks_only)
    want = [(e.block, e.tokens, e.next_step) for e in with_steps if isinstance(e, BlockEvent)]
    got = [(e.block, e.tokens, e.next_step) for e in blocks_only if isinstance(e, BlockEvent)]
    assert got == want and len(got) >= 2
    last_step = 0
    for e in with_steps:   # a block's counter is the one after its last step
        if isinstance(e, StepEvent):
            last_step = e.step
        elif isinstance(e, BlockEvent):
            assert e.next_step == last_step + 1, (e.block, e.next_step, last_step)
    assert blocks_only[-1].output_tokens == with_steps[-1].output_tokens


def test_submit_and_cancel_do_not_wait_for_the_step_in_flight():
    """The step thread waits for a step's results outside the engine's lock: submit and cancel,
    which the worker's gRPC event loop calls, return at once while the device is still busy.
    (Waiting inside the lock froze the worker's whole loop, every stream and every Submit, for
    the rest of a step: ~40 ms for a third of the requests arriving at C = 32 on the H200.)"""
    model = SteerlingModel(TINY).init_random(13, std=0.05).to(torch.float64).eval()
    engine = SteerlingEngine(model, tokenizer_vocab_size=VOCAB, n_pages=32)
    gate, waiting = threading.Event(), threading.Event()

    class SlowCopy:
        """A step's torch.cuda.Event whose results land only when the test opens the gate."""

        def synchronize(self) -> None:
            waiting.set()
            gate.wait(30)

        def query(self) -> bool:
            return gate.is_set()

    execute = engine.strategy.execute

    def slow_execute(plan):
        step = execute(plan)
        step.done = SlowCopy()
        return step

    engine.strategy.execute = slow_execute
    front = AsyncEngine(engine)
    front.start()
    try:
        engine.submit(Job("a", list(range(10)), decode_options(64, seed=1)))
        assert waiting.wait(30), "the step thread never waited for a step's results"
        t = time.perf_counter()
        engine.submit(Job("b", list(range(12)), decode_options(64, seed=2)))
        assert engine.cancel("a")
        held = time.perf_counter() - t
        assert held < 1.0, f"submit + cancel waited {held:.1f} s for the step in flight"
    finally:
        gate.set()
        front.stop()
