"""The compiled engine path on the CPU: same tokens as the reference, no recompiles after warm-up."""

from __future__ import annotations

import pytest
import torch

from cde.steerling.config import TINY
from cde.steerling.model import SteerlingModel
from cde.steerling.reference_decoder import DecodeOptions, generate
from cde.steerling.sampling import SamplingParams
from worker_svc.engine.engine import Engine, FinishEvent

pytestmark = [pytest.mark.parity, pytest.mark.slow]
VOCAB = 264


def finish_of(engine, handle):
    (fin,) = [e for e in engine.drain(handle) if isinstance(e, FinishEvent)]
    return fin


def test_compiled_engine_matches_reference_and_never_recompiles_after_warmup():
    cfg = TINY.replace(n_layers=2)
    model = SteerlingModel(cfg).init_random(5, std=0.05).to(torch.float64).eval()
    engine = Engine(model, tokenizer_vocab_size=VOCAB, n_pages=64, compile=True)
    engine.warmup()
    compiles = engine.compiles
    assert compiles >= 1
    # new mixes of rows, pages and k after warm-up
    reqs = []
    for i, (length, new, k) in enumerate([(3, 70, 1), (64, 80, 2), (140, 40, 3), (65, 130, 1)]):
        prompt = list(range(length))
        opts = DecodeOptions(new, SamplingParams(), tokens_per_step=k, seed=100 + i)
        reqs.append((prompt, opts, engine.submit(f"c{i}", prompt, opts)))
        engine.step()
    engine.run_until_idle()
    assert engine.compiles == compiles, "recompiled after warm-up"
    for prompt, opts, h in reqs:
        ref = generate(model, prompt, opts, tokenizer_vocab_size=VOCAB)
        assert finish_of(engine, h).output_tokens == ref.output_tokens
