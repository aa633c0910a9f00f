"""cde/fused_swiglu.py's Triton SwiGLU against the eager function (cde.steerling.kernels.swiglu):
under Triton's CPU interpreter, compiled for sm_90 without a GPU, and on a GPU in bf16."""

from __future__ import annotations


import pytest
import torch

from tests.triton_child import HAS_TRITON, assert_compiles_for_sm90, child_report

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install -r requirements-test.txt)")

# Rows x width not multiples of the kernel's block; prints the largest error in units of the
# activation dtype's resolution at the value (0 = bit-identical to eager).
CHILD = """
import json, sys, torch
from cde.steerling import kernels
from cde.fused_swiglu import swiglu
seed, device, dtype = int(sys.argv[1]), sys.argv[2], getattr(torch, sys.argv[3])
g = torch.Generator().manual_seed(seed)
h = (torch.randn(3, 5, 2 * 1300, generator=g) * 4).to(dtype).to(device)
got, want = swiglu(h).float().cpu(), kernels.swiglu(h).float().cpu()
ulp = torch.finfo(dtype).eps * want.abs().clamp_min(1e-6)
print(json.dumps({"seed": seed, "shape": list(got.shape), "max_ulps": float(((got - want).abs() / ulp).max())}))
"""


@needs_triton
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_swiglu_equals_eager_under_the_interpreter(dtype, seed):
    report = child_report(CHILD, interpret=True, argv=(seed, "cpu", dtype))
    assert report["shape"] == [3, 5, 1300], report
    # exp differs from libm's by an ulp or so; in bf16 that can flip silu's rounding by one ulp,
    # which the product's rounding can turn into two
    assert report["max_ulps"] <= (4.0 if dtype == "float32" else 2.0), report


@needs_triton
def test_fused_swiglu_compiles_for_sm90():
    assert_compiles_for_sm90([("cde.fused_swiglu", "_swiglu_kernel", {"UP_FIRST": up_first, "BLOCK": 1024})
                              for up_first in (True, False)], {"h_ptr": "*bf16", "out_ptr": "*bf16"})


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs triton and CUDA")
def test_fused_swiglu_on_the_gpu(seed):
    report = child_report(CHILD, interpret=False, argv=(seed, "cuda", "bfloat16"))
    assert report["max_ulps"] <= 2.0, report
