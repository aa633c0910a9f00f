"""The Triton paged attention (worker_svc/engine/attention.py) against the runner's gather +
SDPA path, for decode windows and prompt chunks (query tiles): under Triton's CPU interpreter
(fp32, tight), compiled for sm_90 without a GPU, and on a GPU (bf16/fp16, and inside the ISD
engine)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.paged_attention_cases import make_case, make_chunk_case, reference
from tests.triton_child import HAS_TRITON, assert_compiles_for_sm90, child_report, run_child

# fp32 inputs and ieee dots under the interpreter: only the summation order differs from SDPA's
FP32_TOL = 1e-5
# positions - 1 hides each query's own key: with at most 4 pages of N(0, 1) keys/values a query's
# output moves by ~1/256 or more (the chunk report gives the least any real row moves)
OFF_BY_ONE_MIN = 1e-3
# bf16/fp16 on the GPU: P and the output rounded to 8 mantissa bits, the fp32 reference summed
# in another order
HALF_TOL = 2e-2


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install -r requirements-test.txt)")
def test_paged_attention_equals_gather_and_sdpa_under_the_interpreter():
    proc = run_child("from tests.paged_attention_cases import interpreter_child; interpreter_child()",
                     interpret=True)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["max_abs_err"] < 1e-5, report


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install -r requirements-test.txt)")
def test_prompt_chunks_equal_gather_and_sdpa_under_the_interpreter(seed):
    """16, 33, 64 and 128 queries per row (1, 2 and 4 query tiles; a tile boundary inside a query's
    heads at GQA 3), rows at different offsets, padding queries past the table, a padding row,
    1 and several key splits; positions - 1 must be caught."""
    report = child_report("from tests.paged_attention_cases import chunk_interpreter_child; "
                          "chunk_interpreter_child(int(sys.argv[1]))", interpret=True, argv=(seed,))
    assert {r["tiles"] for r in report.values()} == {1, 2, 4}, (seed, report)
    for case, r in report.items():
        assert r["layout"], (seed, case, r)
        assert r["max_abs_err"] < FP32_TOL, (seed, case, r)
        assert r["off_by_one_err"] > OFF_BY_ONE_MIN, (seed, case, r)


def test_query_tiles_keep_decode_windows_in_one_tile_and_bound_prompt_chunks():
    from worker_svc.engine.attention import MAX_QUERIES, MAX_TILE_ROWS, query_tiles
    from worker_svc.engine.isd_engine import Q_BUCKETS

    assert max(Q_BUCKETS) <= MAX_QUERIES          # every prompt chunk the engine accepts is served
    # decode windows: the one tile of before (next power of two of Q * GROUP, at least 16)
    assert [query_tiles(q, 4) for q in (1, 2, 3, 4, 8)] == [(16, 1), (16, 1), (16, 1), (16, 1), (32, 1)]
    assert query_tiles(8, 8) == (64, 1)
    # prompt chunks: tiles of 64 packed rows covering every row exactly once
    assert query_tiles(64, 4) == (64, 4) and query_tiles(33, 3) == (64, 2) and query_tiles(128, 8) == (64, 16)
    for n_q in range(1, MAX_QUERIES + 1):
        for group in (1, 2, 3, 4, 8):
            block_m, tiles = query_tiles(n_q, group)
            assert 16 <= block_m <= MAX_TILE_ROWS and block_m & (block_m - 1) == 0, (n_q, group)
            assert (tiles - 1) * block_m < n_q * group <= tiles * block_m, (n_q, group, block_m, tiles)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install -r requirements-test.txt)")
def test_prompt_chunk_tiles_compile_for_sm90():
    """The 64-row query tile at I-DLM's shapes (GQA 4, head_dim 128), 1 and 8 splits, and the
    merge over a 128-query chunk's tiles."""
    kernel = ("worker_svc.engine.attention", "_paged_attention_kernel")
    merge = ("worker_svc.engine.attention", "_merge_splits_kernel")
    assert_compiles_for_sm90(
        [(*kernel, {"GROUP": 4, "BLOCK_M": 64, "D": 128, "PAGE": 64, "SPLITS": 1}),
         (*kernel, {"GROUP": 4, "BLOCK_M": 64, "D": 128, "PAGE": 64, "SPLITS": 8}),
         (*merge, {"SPLITS": 8, "BLOCK_T": 64, "D": 128})],
        {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16", "pm_ptr": "*fp32",
         "pl_ptr": "*fp32", "pacc_ptr": "*fp32", "pages_ptr": "*i64", "qpos_ptr": "*i64", "scale": "fp32"})


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs triton and CUDA")
def test_prompt_chunks_on_the_gpu_match_sdpa_in_half_precision(seed):
    from worker_svc.engine.attention import paged_attention, supported

    for dtype in (torch.bfloat16, torch.float16):
        for n_q in (16, 33, 64, 128):
            for splits in (1, 4, None):
                case = make_chunk_case(seed + n_q, n_q, dtype, "cuda", n_h=32, n_kv=8, d=128, n_pages=64, n_tab=12)
                assert supported(case[0])
                got = paged_attention(*case, splits=splits).float()
                want = reference(*(c.float() if c.is_floating_point() else c for c in case))
                err = float((got - want).abs().max())
                assert err < HALF_TOL, (seed, dtype, n_q, splits, err)


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
    """In the engine the kernel replaces gather + SDPA for decode windows and prompt chunks: a
    decode window's and a 64-query prompt chunk's logits with it and without it (same inputs,
    bf16) agree to bf16 rounding, and the chunk's forward runs the kernel in every layer."""
    from tests.options import isd_options
    from tests.tiny_models import tiny_model
    from worker_svc.engine import isd_runner
    from worker_svc.engine.isd_engine import IsdEngine
    from worker_svc.engine.job import Job

    model = tiny_model(5).to("cuda", torch.bfloat16)
    # no prefix cache: the spy's 70-token prompt shares its first 64 tokens with r2's and would
    # skip the chunk the test compares
    engine = IsdEngine(model, max_slots=4, n_pages=64, max_stride=4, prefix_caching=False)
    handles = [engine.submit(Job(f"r{i}", list(range(3 + 50 * i)), isd_options(24, stride=s)))
               for i, s in enumerate((1, 4, 2))]
    while engine.has_work():
        engine.step()
    assert all(h.out for h in handles)
    assert engine.strategy.runner.paged_calls > 0
    # the same decode window (the last forward) and prompt chunk (the first) through both paths
    captured = {}
    real_forward = isd_runner.IsdRunner.forward

    def spy(self, inp, window):
        captured.setdefault("chunk", (inp, window))
        captured["inp"], captured["window"] = inp, window
        return real_forward(self, inp, window)

    isd_runner.IsdRunner.forward = spy
    try:
        h = engine.submit(Job("spy", list(range(70)), isd_options(3, stride=4)))
        while engine.has_work():
            engine.step()
        assert h.out
    finally:
        isd_runner.IsdRunner.forward = real_forward
    inp, window = captured["inp"], captured["window"]
    with_kernel = engine.strategy.runner.forward(inp, window).float()
    engine.strategy.runner.use_paged_attention = False
    without = engine.strategy.runner.forward(inp, window).float()
    engine.strategy.runner.use_paged_attention = True
    scale = float(without.abs().max())
    assert float((with_kernel - without).abs().max()) < 0.05 * scale
    chunk, chunk_window = captured["chunk"]
    assert chunk.positions.shape[1] == 64                      # the 70-token prompt's 64 + 6 chunk rows
    calls = engine.strategy.runner.paged_calls
    with_kernel = engine.strategy.runner.forward(chunk, chunk_window).float()
    assert engine.strategy.runner.paged_calls - calls == model.cfg.n_layers, (calls, engine.strategy.runner.paged_calls)
    engine.strategy.runner.use_paged_attention = False
    without = engine.strategy.runner.forward(chunk, chunk_window).float()
    engine.strategy.runner.use_paged_attention = True
    assert float((with_kernel - without).abs().max()) < 0.05 * float(without.abs().max())
