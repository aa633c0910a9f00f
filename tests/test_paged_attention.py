"""The Triton paged attention (worker_svc/engine/attention.py) against the runner's gather +
SDPA path: under Triton's CPU interpreter (fp32, tight) and on
a GPU (bf16/fp16, and inside the ISD engine)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.paged_attention_cases import make_case, reference
from tests.triton_child import HAS_TRITON, run_child


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install -r requirements-test.txt)")
def test_paged_attention_equals_gather_and_sdpa_under_the_interpreter():
    proc = run_child("from tests.paged_attention_cases import interpreter_child; interpreter_child()",
                     interpret=True)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["max_abs_err"] < 1e-5, report


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs triton and CUDA")
def test_paged_attention_on_the_gpu_matches_sdpa_in_half_precision():
    from worker_svc.engine.attention import paged_attention, supported

    for dtype in (torch.bfloat16, torch.float16):
        for seed, n_q in ((11, 1), (12, 4), (13, 7), (14, 8)):
            case = make_case(seed, n_q, dtype, "cuda", n_rows=5, n_h=32, n_kv=8, d=128, n_pages=32)
            assert supported(case[0])
            got = paged_attention(*case).float()
            want = reference(*(c.float() if c.is_floating_point() else c for c in case))
            err = float((got - want).abs().max())
            assert err < 2e-2, (dtype, n_q, err)


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs triton and CUDA")
def test_isd_engine_in_bf16_uses_the_paged_kernel_and_its_logits_track_the_sdpa_path():
    """In the engine the kernel replaces gather + SDPA for decode windows: one forward's logits
    with it and without it (same inputs, bf16) agree to bf16 rounding."""
    from tests.tiny_models import tiny_model
    from worker_svc.engine import isd_runner
    from worker_svc.engine.isd_engine import IsdEngine, IsdOptions

    model = tiny_model(5).to("cuda", torch.bfloat16)
    engine = IsdEngine(model, max_slots=4, n_pages=64, max_stride=4)
    handles = [engine.submit(f"r{i}", list(range(3 + 50 * i)), IsdOptions(24, stride=s))
               for i, s in enumerate((1, 4, 2))]
    while engine.has_work():
        engine.step()
    assert all(h.out for h in handles)
    assert engine.runner.paged_calls > 0
    # the same decode window through both paths
    captured = {}
    real_forward = isd_runner.IsdRunner.forward

    def spy(self, inp, window):
        captured["inp"], captured["window"] = inp, window
        return real_forward(self, inp, window)

    isd_runner.IsdRunner.forward = spy
    try:
        h = engine.submit("spy", list(range(70)), IsdOptions(3, stride=4))
        while engine.has_work():
            engine.step()
        assert h.out
    finally:
        isd_runner.IsdRunner.forward = real_forward
    inp, window = captured["inp"], captured["window"]
    with_kernel = engine.runner.forward(inp, window).float()
    engine.runner.use_paged_attention = False
    without = engine.runner.forward(inp, window).float()
    engine.runner.use_paged_attention = True
    scale = float(without.abs().max())
    assert float((with_kernel - without).abs().max()) < 0.05 * scale
