"""The asyncio front of the engine: concurrent streams, early close cancels, errors surface."""

from __future__ import annotations

import asyncio

import torch

from cde.steerling.config import TINY
from cde.steerling.model import SteerlingModel
from cde.steerling.reference_decoder import DecodeOptions, generate
from worker_svc.engine.async_engine import AsyncEngine
from worker_svc.engine.steerling_engine import BlockEvent, FinishEvent, SteerlingEngine, StepEvent

VOCAB = 264


def test_concurrent_streams_match_reference_and_close_cancels():
    model = SteerlingModel(TINY).init_random(11, std=0.05).to(torch.float64).eval()
    engine = SteerlingEngine(model, tokenizer_vocab_size=VOCAB, n_pages=32)
    front = AsyncEngine(engine)
    front.start()

    async def collect(rid, prompt, opts):
        return [e async for e in front.generate(rid, prompt, opts)]

    async def early_close():
        stream = front.generate("quit", list(range(20)), DecodeOptions(300, seed=9))
        async for ev in stream:
            if isinstance(ev, BlockEvent):
                break
        await stream.aclose()

    async def main():
        jobs = [collect(f"r{i}", list(range(5 + 40 * i)), DecodeOptions(70, seed=i)) for i in range(3)]
        results = await asyncio.gather(*jobs, early_close())
        return results[:3]

    try:
        results = asyncio.run(main())
        for i, events in enumerate(results):
            fin = events[-1]
            assert isinstance(fin, FinishEvent)
            assert any(isinstance(e, StepEvent) for e in events)
            ref = generate(model, list(range(5 + 40 * i)), DecodeOptions(70, seed=i), tokenizer_vocab_size=VOCAB)
            assert fin.output_tokens == ref.output_tokens
        for _ in range(100):   # the closed stream's request is cancelled at the next step
            if engine.stats().running == 0 and engine.stats().waiting == 0:
                break
            asyncio.run(asyncio.sleep(0.05))
        assert engine.stats().pages_used == 0
    finally:
        front.stop()
