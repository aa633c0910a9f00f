"""The Steerling block-row Triton kernels (worker_svc/engine/attention.py: K/V write, block
attention reading the pages in place) and split-KV in both attention kernels, against the
runner's gather + SDPA path: under Triton's CPU interpreter (fp32), compiled for sm_90 without a
GPU, and on a GPU (bf16/fp16, and through block_rows_attend)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.paged_attention_cases import block_gather_sdpa, make_block_case, make_case, reference
from tests.triton_child import HAS_TRITON, assert_compiles_for_sm90, run_child

needs_triton = pytest.mark.skipif(not HAS_TRITON,
                                  reason="triton is not installed (pip install -r requirements-test.txt)")
# fp32 inputs and ieee dots under the interpreter: only the summation order differs from SDPA's
# (online softmax over pages and splits), a few ulps of O(1) outputs
FP32_TOL = 1e-5
# An off-by-one in visibility drops or adds one N(0, 1) key/value for every query of a row:
# its output moves by ~1/n_keys * |v| >= 1/(5 * 64) even for the longest row, far above FP32_TOL
OFF_BY_ONE_MIN = 1e-3


def _child_report(code: str, seed: int) -> dict:
    proc = run_child(code, interpret=True)
    assert proc.returncode == 0, f"seed {seed}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_triton
def test_block_kernel_equals_gather_and_sdpa_under_the_interpreter(seed):
    """Rows seeing only their own page, ending mid-page and on a page boundary, a padding row,
    shuffled page tables, GQA (4 heads on 2), splits 1, 2 and 5 (empty splits)."""
    report = _child_report(f"from tests.paged_attention_cases import block_interpreter_child; "
                           f"block_interpreter_child({seed})", seed)
    for splits, r in report.items():
        assert r["write_exact"], (seed, splits, r)
        assert r["layout"], (seed, splits, r)
        assert r["max_abs_err"] < FP32_TOL, (seed, splits, r)
        assert r["off_by_one_err"] > OFF_BY_ONE_MIN, (seed, splits, r)


@needs_triton
def test_split_paged_kernel_equals_gather_and_sdpa_under_the_interpreter(seed):
    """The ISD decode-window kernel with its keys split across programs (1, 4 and 8 queries)."""
    report = _child_report(f"from tests.paged_attention_cases import split_interpreter_child; "
                           f"split_interpreter_child({seed})", seed)
    for case, r in report.items():
        assert r["max_abs_err"] < FP32_TOL, (seed, case, r)
        assert r["off_by_one_err"] > OFF_BY_ONE_MIN, (seed, case, r)


ATTENTION = "worker_svc.engine.attention"
SM90_KERNELS = [   # Steerling-8B shapes (GQA 8, head_dim 128), I-DLM's decode windows (GQA 4)
    (ATTENTION, "_block_attention_kernel", {"GROUP": 8, "D": 128, "PAGE": 64, "SPLITS": 1, "DOT_PRECISION": "tf32"}),
    (ATTENTION, "_block_attention_kernel", {"GROUP": 8, "D": 128, "PAGE": 64, "SPLITS": 8, "DOT_PRECISION": "tf32"}),
    (ATTENTION, "_paged_attention_kernel", {"GROUP": 4, "BLOCK_M": 32, "D": 128, "PAGE": 64, "SPLITS": 1}),
    (ATTENTION, "_paged_attention_kernel", {"GROUP": 4, "BLOCK_M": 32, "D": 128, "PAGE": 64, "SPLITS": 16}),
    (ATTENTION, "_merge_splits_kernel", {"SPLITS": 8, "BLOCK_T": 64, "D": 128}),
    (ATTENTION, "_merge_splits_kernel", {"SPLITS": 16, "BLOCK_T": 8, "D": 128}),
    (ATTENTION, "_merge_splits_kernel", {"SPLITS": 32, "BLOCK_T": 1, "D": 128}),   # AR: one query per row
    (ATTENTION, "_write_block_kv_kernel", {"D": 128, "PAGE": 64}),
]
# bf16 data, fp32 split partials, i64 tables
SM90_TYPES = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16", "kc_ptr": "*bf16",
              "vc_ptr": "*bf16", "pm_ptr": "*fp32", "pl_ptr": "*fp32", "pacc_ptr": "*fp32", "pages_ptr": "*i64",
              "qpos_ptr": "*i64", "nvis_ptr": "*i64", "page_ptr": "*i64", "scale": "fp32"}


@needs_triton
def test_attention_kernels_compile_for_sm90():
    """Both attention kernels (1 and several key splits), the merge and the K/V write."""
    assert_compiles_for_sm90(SM90_KERNELS, SM90_TYPES)


def test_split_count_comes_from_shapes_and_never_exceeds_the_pages():
    from worker_svc.engine.attention import MIN_PAGES_PER_SPLIT, split_count

    assert split_count(32, 64, torch.device("cpu")) == 1          # off CUDA: tests force their splits
    if torch.cuda.is_available():
        dev = torch.device("cuda")
        for programs in (1, 8, 32, 256, 4096):
            for n_pages in (1, 2, 7, 64):
                s = split_count(programs, n_pages, dev)
                assert 1 <= s <= max(1, n_pages // MIN_PAGES_PER_SPLIT), (programs, n_pages, s)


# bf16/fp16 on the GPU: P and the output are rounded to 8 (bf16) mantissa bits, ~0.4% of O(1)
# outputs per rounding, and the fp32 reference sums in another order: 2e-2 absolute (as for the
# ISD kernel's GPU test)
HALF_TOL = 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs triton and CUDA")
def test_block_kernel_on_the_gpu_matches_sdpa_in_half_precision(seed):
    from worker_svc.engine.attention import block_attention, block_supported, write_block_kv

    for i, dtype in enumerate((torch.bfloat16, torch.float16)):
        for splits in (1, 4, None):
            case = make_block_case(seed + i, dtype, "cuda", n_h=32, n_kv=4, d=128, n_pages=96, n_tab=16)
            assert block_supported(case["q"], case["k_pool"])
            want_k, want_v, _ = block_gather_sdpa(case)
            want = block_gather_sdpa({k: (t.float() if t.is_floating_point() else t) for k, t in case.items()})[2]
            kc, vc = case["k_pool"].clone(), case["v_pool"].clone()
            write_block_kv(kc, vc, case["write_page"], case["k"], case["v"])
            assert torch.equal(kc, want_k) and torch.equal(vc, want_v), (seed, dtype)
            got = block_attention(case["q"], kc, vc, case["pages"], case["n_visible"], splits=splits).float()
            err = float((got - want).abs().max())
            assert err < HALF_TOL, (seed, dtype, splits, err)


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs triton and CUDA")
def test_split_paged_kernel_on_the_gpu_matches_sdpa_in_half_precision(seed):
    from worker_svc.engine.attention import paged_attention

    for dtype in (torch.bfloat16, torch.float16):
        for n_q, splits in ((1, 2), (4, 8), (8, None)):
            case = make_case(seed + n_q, n_q, dtype, "cuda", n_rows=5, n_h=32, n_kv=8, d=128, n_pages=32)
            got = paged_attention(*case, splits=splits).float()
            want = reference(*(c.float() if c.is_floating_point() else c for c in case))
            err = float((got - want).abs().max())
            assert err < HALF_TOL, (seed, dtype, n_q, splits, err)


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs triton and CUDA")
def test_block_rows_attend_uses_the_kernel_on_the_gpu(seed):
    """block_rows_attend with a BlockKernelUse: the kernel serves the call (no fallback warning)
    and agrees with the same call without it."""
    import warnings

    from worker_svc.engine.attention import BlockKernelUse, block_rows_attend
    from worker_svc.engine.kv_cache import KVCache

    case = make_block_case(seed, torch.bfloat16, "cuda", n_h=32, n_kv=4, d=128, n_pages=96, n_tab=16)
    outs = []
    for use in (BlockKernelUse(), None):
        kp = case["k_pool"]
        kv = KVCache(1, kp.shape[0], kp.shape[2], kp.shape[1], kp.shape[3], kp.dtype, kp.device)
        kv.k[0].copy_(kp)
        kv.v[0].copy_(case["v_pool"])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            attend = block_rows_attend(kv, case["write_page"], case["pages"], case["n_visible"], use)
            outs.append(attend(0, case["q"], case["k"], case["v"]).float())
        fallbacks = [str(w.message) for w in caught if "kernel unavailable" in str(w.message)]
        assert not fallbacks, (seed, fallbacks)
        if use is not None:
            assert use.enabled and use.calls == 1, seed
    assert float((outs[0] - outs[1]).abs().max()) < HALF_TOL, seed


def test_block_kernel_use_falls_back_on_cpu_and_switches_off_once_when_its_first_build_fails(seed):
    from tests.paged_attention_cases import block_gather_sdpa
    from worker_svc.engine.attention import BlockKernelUse, block_rows_attend
    from worker_svc.engine.kv_cache import KVCache

    case = make_block_case(seed)
    kp = case["k_pool"]
    kv = KVCache(1, kp.shape[0], kp.shape[2], kp.shape[1], kp.shape[3], kp.dtype, kp.device)
    kv.k[0].copy_(kp)
    kv.v[0].copy_(case["v_pool"])
    use = BlockKernelUse()
    got = block_rows_attend(kv, case["write_page"], case["pages"], case["n_visible"], use)(
        0, case["q"], case["k"], case["v"])
    assert use.enabled and use.calls == 0, seed                   # fp32 on CPU: gather + SDPA
    assert torch.equal(got, block_gather_sdpa(case)[2]), seed

    def broken_build(*_):
        raise RuntimeError("no ptxas for this target")

    with pytest.warns(UserWarning, match="block attention kernel unavailable"):
        assert use._guarded(broken_build) is None
    assert not use.enabled
    served = BlockKernelUse()
    assert served._guarded(torch.zeros, 1) is not None and served.calls == 1
    with pytest.raises(RuntimeError, match="no ptxas"):         # after a success a failure is a real error
        served._guarded(broken_build)
