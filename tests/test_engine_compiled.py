"""The compiled engine path on the CPU: same tokens as the reference, no recompiles after warm-up."""

from __future__ import annotations

import pytest
import torch

from cde.steerling import kernels
from cde.steerling.config import TINY
from cde.steerling.model import SteerlingModel
from cde.steerling.reference_decoder import generate
from cde.steerling.sampling import SamplingParams
from tests.options import decode_options
from tests.oracle import assert_close_to_rounding
from worker_svc.engine.job import Job
from worker_svc.engine.steerling_engine import FinishEvent, SteerlingEngine

pytestmark = [pytest.mark.parity, pytest.mark.slow]
VOCAB = 264


def finish_of(engine, handle):
    (fin,) = [e for e in engine.drain(handle) if isinstance(e, FinishEvent)]
    return fin


def test_compiled_engine_matches_reference_and_never_recompiles_after_warmup():
    cfg = TINY.replace(n_layers=2)
    model = SteerlingModel(cfg).init_random(5, std=0.05).to(torch.float64).eval()
    engine = SteerlingEngine(model, tokenizer_vocab_size=VOCAB, n_pages=64, compile=True)
    engine.warmup()
    compiles = engine.strategy.compiles
    assert compiles >= 1
    # new mixes of rows, pages and k after warm-up
    reqs = []
    for i, (length, new, k) in enumerate([(3, 70, 1), (64, 80, 2), (140, 40, 3), (65, 130, 1)]):
        prompt = list(range(length))
        opts = decode_options(new, sampling=SamplingParams(), tokens_per_step=k, seed=100 + i)
        reqs.append((prompt, opts, engine.submit(Job(f"c{i}", prompt, opts))))
        engine.step()
    engine.run_until_idle()
    assert engine.strategy.compiles == compiles, "recompiled after warm-up"
    model.use_kernels(kernels.EAGER)   # the reference runs the plain eager layers
    for prompt, opts, h in reqs:
        ref = generate(model, prompt, opts, tokenizer_vocab_size=VOCAB)
        assert finish_of(engine, h).output_tokens == ref.output_tokens


def test_compiled_kernels_equal_eager_on_fresh_inputs(seed):
    """Each fused function against its eager self: fp32 to rounding, bf16 to bf16 rounding."""
    kn = kernels.compiled()
    g = torch.Generator().manual_seed(seed)
    for dtype in (torch.float32, torch.bfloat16):
        b, t, h, kv, hd = 3, 64, 4, 2, 16
        rnd = lambda *s: torch.randn(*s, generator=g).to(dtype)   # noqa: E731
        qkv = rnd(b, t, (h + 2 * kv) * hd) * 3
        qw, kw = rnd(hd), rnd(hd)
        cos, sin = torch.randn(b, 1, t, hd, generator=g), torch.randn(b, 1, t, hd, generator=g)
        for got, want in zip(kn.qkv_prep(qkv, qw, kw, 1e-5, cos, sin, h, kv, hd, 2.5),
                             kernels.qkv_prep(qkv, qw, kw, 1e-5, cos, sin, h, kv, hd, 2.5)):
            assert_close_to_rounding(got, want, dtype)
        x, y, w = rnd(b, t, 32), rnd(b, t, 32), rnd(32)
        coef, vec = torch.rand(b, t, generator=g), rnd(b, 32)
        assert_close_to_rounding(kn.add_norm(x, y, w, 1e-5), kernels.add_norm(x, y, w, 1e-5), dtype)
        assert_close_to_rounding(kn.add_norm_steer(x, y, w, 1e-5, coef, vec),
                                 kernels.add_norm_steer(x, y, w, 1e-5, coef, vec), dtype)
        assert_close_to_rounding(kn.swiglu(qkv), kernels.swiglu(qkv), dtype)
        # the sampler's confidence: bans, penalties on seen ids, relu suppression all in play
        v = 50
        logits, relu = rnd(b, t, v) * 4, torch.rand(b, 1, v, generator=g) * (torch.rand(b, 1, v, generator=g) < 0.3)
        seen = torch.rand(b, 1, v, generator=g) < 0.2
        rep, banned = torch.tensor([1.0, 1.3, 0.8]), torch.rand(v, generator=g) < 0.1
        torch.testing.assert_close(kn.confidence(logits, relu, seen, rep, banned),
                                   kernels.confidence(logits, relu, seen, rep, banned), rtol=1e-5, atol=1e-6)
    # the counter hash is integer arithmetic: exact, including 64-bit seeds
    seed = torch.randint(-2**62, 2**62, (257,), generator=g)
    pos, step = torch.randint(0, 1 << 20, (257,), generator=g), torch.randint(0, 1 << 16, (257,), generator=g)
    for stream in (0, 3):
        assert torch.equal(kn.counter_uniform(seed, pos, step, stream), kernels.counter_uniform(seed, pos, step, stream))


def test_compiled_confidence_at_equals_eager(seed):
    """The compacted sampler's confidence (tables looked up per head row by slot, fused when
    compiled) against its eager self, for head-row counts that vary (one dynamic graph)."""
    kn = kernels.compiled()
    g = torch.Generator().manual_seed(seed)
    slots, v = 5, 50
    relu = torch.rand(slots, v, generator=g) * (torch.rand(slots, v, generator=g) < 0.3)
    seen = torch.rand(slots, v, generator=g) < 0.2
    banned = torch.rand(v, generator=g) < 0.1
    for n in (16, 48, 64):
        logits = torch.randn(n, v, generator=g) * 4
        slot = torch.randint(0, slots, (n,), generator=g)
        rep = torch.tensor([1.0, 1.3, 0.8, 1.0, 1.1])[slot]
        eager = kernels.confidence_at(logits, relu, seen, slot, rep, banned)
        torch.testing.assert_close(kn.confidence_at(logits, relu, seen, slot, rep, banned), eager,
                                   rtol=1e-5, atol=1e-6, msg=lambda m: f"seed={seed}: {m}")
