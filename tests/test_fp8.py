"""FP8 (e4m3) trunk weights (cde/fp8.py): the quantization's error bound, the product against the
unquantized one, a converted model against its bf16/fp32 self, and the engine on a converted
model against the reference decoder on the same model (exact: the same modules)."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from cde.fp8 import E4M3_MAX, Fp8Linear, quantize_rows, to_fp8
from cde.steerling.config import TINY
from cde.steerling.sampling import SamplingParams
from tests.numerics import rel_err
from tests.options import decode_options
from tests.steerling_engine_cases import VOCAB, check_against_reference, make_model, steer
from worker_svc.engine.job import Job
from worker_svc.engine.steerling_engine import SteerlingEngine


def test_rows_quantize_within_e4m3s_rounding(seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 96, generator=g) * torch.rand(64, 1, generator=g) * 10
    q, s = quantize_rows(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (64, 1)
    back = q.float() * s
    # 3 mantissa bits: half an ulp is 2^-4 of the value; below 2^-6 x scale e4m3 is subnormal (steps of 2^-9)
    bound = w.abs() * 2 ** -4 + s * 2 ** -10
    assert ((back - w).abs() <= bound * (1 + 1e-6)).all(), f"seed={seed}"
    assert torch.allclose(back.abs().amax(1, keepdim=True), w.abs().amax(1, keepdim=True), rtol=1e-6), \
        f"seed={seed}: a row's largest value maps to {E4M3_MAX}"


def test_fp8_linear_is_close_to_the_unquantized_product(seed):
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(128, 80, bias=False)
    lin.weight.data = torch.randn(80, 128, generator=g) * 0.05
    x = torch.randn(3, 7, 128, generator=g)
    f = Fp8Linear.from_linear(lin)
    y = f(x)
    assert y.shape == (3, 7, 80) and y.dtype == x.dtype
    err = rel_err(y, lin(x))
    assert 0 < err < 0.06, f"seed={seed}: rel err {err}"   # two e4m3 roundings of ~2^-5 each, averaged


@pytest.mark.parity
def test_a_converted_model_stays_near_its_unquantized_self_and_the_engine_matches_its_reference(seed):
    model = make_model(seed, TINY.replace(eot_id=None), dtype=torch.float32)
    fp8 = copy.deepcopy(model)
    assert to_fp8(fp8) == 4 * TINY.n_layers
    assert fp8.transformer.lm_head.weight.dtype == torch.float32   # head and embeddings untouched
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (2, 100), generator=g)
    tokens[:, 70:] = TINY.mask_id
    with torch.no_grad():
        ref = model(tokens).logits
        err = rel_err(fp8(tokens).logits, ref)
        bf16_err = rel_err(copy.deepcopy(model).bfloat16()(tokens).logits.float(), ref)
    # e4m3 keeps 3 mantissa bits to bf16's 7: about 16x bf16's rounding (random tiny weights give
    # near-flat logits, so both are large here; the 8B figures come from the GPU bench)
    assert 2 * bf16_err < err < 24 * bf16_err, f"seed={seed}: logits rel err {err}, bf16 {bf16_err}"

    # engine = reference in float64, as the other parity tests: in float32 a batch shape's GEMM
    # rounding can move an activation across an e4m3 step and change a draw (seed 595493681)
    fp8 = copy.deepcopy(model).double()
    to_fp8(fp8)
    rng = random.Random(seed)
    engine = SteerlingEngine(fp8, tokenizer_vocab_size=VOCAB, n_pages=32)
    submitted = {}
    for i in range(3):
        prompt = [rng.randrange(256) for _ in range(rng.choice((5, 70)))]
        opts = decode_options(rng.choice((30, 70)), sampling=SamplingParams(), tokens_per_step=rng.choice((1, 3)),
                              seed=rng.randrange(1 << 40))
        st = steer(fp8, [rng.randrange(TINY.n_known) for _ in range(2)]) if i == 1 else None
        submitted[f"f{i}"] = (prompt, opts, st, engine.submit(Job(f"f{i}", prompt, opts, steering=st)))
    engine.run_until_idle()
    check_against_reference(fp8, engine, submitted)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
def test_scaled_mm_equals_the_emulated_product_on_the_gpu(seed):
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(4096, 1024, bias=False)
    lin.weight.data = torch.randn(1024, 4096, generator=g) * 0.02
    f = Fp8Linear.from_linear(lin).cuda()
    x = torch.randn(33, 4096, generator=g).cuda().bfloat16()
    y = f(x)
    xq, xs = quantize_rows(x)
    emulated = torch.nn.functional.linear(xq.float() * xs, f.dequantized())
    assert rel_err(y.float(), emulated) < 5e-3, f"seed={seed}"


@pytest.mark.e2e
def test_a_worker_with_fp8_weights_serves_attributed_text(tmp_path):
    """`worker_svc --weights fp8` through the stack: it converts the trunk, serves, and the served
    token attributions still add up (listed + other + residual = the token's logit: the heads are
    not quantized)."""
    import httpx

    from tests.stack_fixture import running_stack

    with running_stack(tmp_path / "run", worker_args=["--weights", "fp8"]) as stack:
        r = httpx.post(f"{stack.base_url}/v1/completions", timeout=120, json={
            "prompt": "Tell me about the sea.", "max_tokens": 40, "seed": 5, "attribution": "tokens"})
        assert r.status_code == 200, r.text
        log = next(s.log for s in stack.services if s.name == "worker0").read_text()
        assert "FP8 (e4m3) weights:" in log, log[-2000:]
        tas = r.json()["cde"]["token_attributions"]
        assert tas
        for t in tas:
            listed = sum(c["score"] for c in t["top"]) + t["other"]["known"] + t["other"]["discovered"]
            assert abs(listed + t["residual"] - t["target_logit"]) <= 1e-3 * max(1.0, abs(t["target_logit"])), t
