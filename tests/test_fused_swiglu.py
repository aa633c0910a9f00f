"""cde/fused_swiglu.py's Triton SwiGLU against the eager function (cde.steerling.kernels.swiglu):
under Triton's CPU interpreter, compiled for sm_90 without a GPU, and on a GPU in bf16."""

from __future__ import annotations

import json

import pytest
import torch

from tests.triton_child import HAS_TRITON, run_child

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
    proc = run_child(f"import sys; sys.argv = ['x', '{seed}', 'cpu', '{dtype}']\n" + CHILD, interpret=True)
    assert proc.returncode == 0, f"seed {seed}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["shape"] == [3, 5, 1300], report
    # exp differs from libm's by an ulp or so; in bf16 that can flip silu's rounding by one ulp,
    # which the product's rounding can turn into two
    assert report["max_ulps"] <= (4.0 if dtype == "float32" else 2.0), report


@needs_triton
def test_fused_swiglu_compiles_for_sm90():
    code = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from cde.fused_swiglu import _kernel, BLOCK
jit = _kernel()
consts = {"UP_FIRST": True, "BLOCK": BLOCK}
sig = {p.name: "constexpr" if p.name in consts else {"h_ptr": "*bf16", "out_ptr": "*bf16"}.get(p.name, "i32")
       for p in jit.params}
k = triton.compile(ASTSource(jit, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))
print(sorted(k.asm))
"""
    proc = run_child(code, interpret=False)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"
    assert "cubin" in proc.stdout, proc.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs triton and CUDA")
def test_fused_swiglu_on_the_gpu(seed):
    proc = run_child(f"import sys; sys.argv = ['x', '{seed}', 'cuda', 'bfloat16']\n" + CHILD, interpret=False)
    assert proc.returncode == 0, f"seed {seed}\nstderr:\n{proc.stderr[-6000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["max_ulps"] <= 2.0, report
