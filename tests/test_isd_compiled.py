"""The causal engine's fast paths on the CPU: regional compilation of the Qwen3 layers
(cde/qwen3/kernels.py) gives the reference decoder's tokens and never recompiles after warm-up;
fused q/k/v and gate/up projections give the separate projections' forward, with and without
a LoRA attached."""

from __future__ import annotations

import random

import pytest
import torch

from cde.isd.decoder import generate_ar_batch, generate_isd_batch
from cde.isd.toy import lag_model
from cde.qwen3 import kernels
from cde.qwen3.config import preset
from cde.qwen3.model import Qwen3Model
from tests.options import isd_options
from tests.oracle import assert_close_to_rounding
from tests.tiny_models import random_lora
from worker_svc.engine.isd_engine import IsdEngine, IsdFinishEvent
from worker_svc.engine.job import Job

pytestmark = [pytest.mark.parity, pytest.mark.slow]


def test_compiled_qwen3_kernels_equal_eager_on_fresh_inputs(seed):
    kn = kernels.compiled()
    g = torch.Generator().manual_seed(seed)
    for dtype in (torch.float32, torch.bfloat16):
        b, t, h, kv, hd = 3, 7, 4, 2, 16
        rnd = lambda *s: torch.randn(*s, generator=g).to(dtype)   # noqa: E731
        q, k = rnd(b, t, h, hd), rnd(b, t, kv, hd)
        qw, kw = rnd(hd), rnd(hd)
        cos, sin = rnd(b, 1, t, hd), rnd(b, 1, t, hd)
        for got, want in zip(kn.qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin),
                             kernels.qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin)):
            assert_close_to_rounding(got, want, dtype)
        x, y, w = rnd(b, t, 32), rnd(b, t, 32), rnd(32)
        assert_close_to_rounding(kn.rms_norm(x, w, 1e-6), kernels.rms_norm(x, w, 1e-6), dtype)
        for got, want in zip(kn.add_rms_norm(x, y, w, 1e-6), kernels.add_rms_norm(x, y, w, 1e-6)):
            assert_close_to_rounding(got, want, dtype)
        assert_close_to_rounding(kn.silu_mul(x, y), kernels.silu_mul(x, y), dtype)


def test_compiled_isd_engine_matches_the_reference_and_never_recompiles_after_warmup(seed):
    model = lag_model(seed).double().eval()
    engine = IsdEngine(model, n_pages=64, compile=True)
    engine.warmup(max_rows=4, max_new_tokens=8)
    compiles = engine.strategy.compiles
    assert compiles >= 1
    rng = random.Random(seed)
    vocab = [i for i in range(model.cfg.vocab_size) if i != model.cfg.mask_token_id
             and i not in model.cfg.eos_token_ids]
    jobs = [(f"j{i}", [rng.choice(vocab) for _ in range(n)], isd_options(16, stride=s, temperature=t, seed=i))
            for i, (n, s, t) in enumerate([(3, 4, 0.0), (70, 2, 0.8), (1, 1, 0.0), (65, 4, 1.0)])]
    handles = []
    for rid, prompt, opts in jobs:   # joining mid-flight
        handles.append(engine.submit(Job(rid, prompt, opts)))
        engine.step()
    engine.run_until_idle()
    assert engine.strategy.compiles == compiles, "recompiled after warm-up"
    model.use_kernels(kernels.EAGER)   # the reference runs the plain eager layers
    for (rid, prompt, opts), h in zip(jobs, handles):
        (fin,) = [e for e in engine.drain(h) if isinstance(e, IsdFinishEvent)]
        if opts.stride == 1:
            (ref,) = generate_ar_batch(model, [prompt], opts.max_new_tokens, opts.temperature, seeds=[opts.seed])
        else:
            (ref,) = generate_isd_batch(model, [prompt], opts.max_new_tokens, opts.stride, opts.temperature,
                                        seeds=[opts.seed])
        assert fin.output_tokens == ref.tokens, (seed, rid)


@pytest.mark.parametrize("with_lora", [False, True])
def test_fused_projections_equal_the_separate_ones(with_lora, seed):
    plain = Qwen3Model(preset("tiny")).init_random(seed).eval()
    fused = Qwen3Model(preset("tiny")).eval()
    fused.load_state_dict(plain.state_dict())
    fused.fuse_projections()
    if with_lora:
        random_lora(plain, seed, 0.1)
        random_lora(fused, seed, 0.1)
    tokens = torch.randint(0, 500, (2, 37), generator=torch.Generator().manual_seed(seed))
    gate = torch.rand(2, 37, generator=torch.Generator().manual_seed(seed + 1)) < 0.5
    with torch.no_grad():
        torch.testing.assert_close(fused(tokens, lora_gate=gate), plain(tokens, lora_gate=gate), rtol=1e-5, atol=1e-5)
        # the separate weights are views of the fused ones: an in-place update reaches the fused GEMM
        fused.model.layers[0].self_attn.k_proj.weight.mul_(2.0)
        plain.model.layers[0].self_attn.k_proj.weight.mul_(2.0)
        torch.testing.assert_close(fused(tokens, lora_gate=gate), plain(tokens, lora_gate=gate), rtol=1e-5, atol=1e-5)


def test_moving_a_fused_model_goes_back_to_the_separate_projections():
    plain = Qwen3Model(preset("tiny")).init_random(3).eval()
    fused = Qwen3Model(preset("tiny")).eval()
    fused.load_state_dict(plain.state_dict())
    fused.fuse_projections()
    fused = fused.to(torch.float64)   # the fused tensors stay behind: they must not be used any more
    assert fused.model.layers[0].self_attn.qkv is None and fused.model.layers[0].mlp.gate_up is None
    tokens = torch.randint(0, 500, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(fused(tokens), plain.double()(tokens))
