"""The sampler's Triton confidence pass (cde.steerling.confidence_kernel.py) against the
elementwise function the CPU engine and the reference decoder use
(`cde.steerling.kernels.confidence`): under Triton's CPU interpreter, compiled for sm_90
without a GPU, and on a GPU in bf16."""

from __future__ import annotations


import pytest
import torch

from tests.triton_child import HAS_TRITON, assert_compiles_for_sm90, child_report

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install -r requirements-test.txt)")

# Fresh random rows: V not a multiple of the kernel's chunk, several slots with relu masks and
# seen bitmaps, repetition penalties 1 (off) and > 1, banned ids, one row whose best logits are
# all banned or penalized. Prints the largest relative error against the eager function.
CHILD = """
import json, sys, torch
from cde.steerling import kernels
from cde.steerling.confidence_kernel import row_confidence
seed, device, dtype = int(sys.argv[1]), sys.argv[2], getattr(torch, sys.argv[3])
g = torch.Generator().manual_seed(seed)
n, v, slots = 7, 5003, 4
logits = (torch.randn(n, v, generator=g) * 3).to(dtype)
relu = torch.rand(slots, v, generator=g) * (torch.rand(slots, 1, generator=g) < 0.5)
seen = torch.rand(slots, v, generator=g) < 0.05
banned = torch.rand(v, generator=g) < 0.01
slot = torch.randint(0, slots, (n,), generator=g)
rep = torch.where(torch.rand(n, generator=g) < 0.5, torch.ones(n), 1 + torch.rand(n, generator=g))
best = logits[3].float().topk(5).indices
banned[best[:3]] = True
seen[slot[3], best[3:]] = True
rep[3] = 1.7
args = [t.to(device) for t in (logits, relu, seen, banned, slot, rep)]
got = row_confidence(*args).cpu()
want = kernels.confidence(logits.float()[:, None, :], relu[slot][:, None, :], seen[slot][:, None, :], rep,
                          banned)[:, 0]
rel = float(((got - want).abs() / want).max())
print(json.dumps({"seed": seed, "max_rel_err": rel, "got": got.tolist(), "want": want.tolist()}))
"""


@needs_triton
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_confidence_kernel_equals_the_elementwise_pass_under_the_interpreter(dtype, seed):
    report = child_report(CHILD, interpret=True, argv=(seed, "cpu", dtype))
    # both sum ~5,000 fp32 terms in different orders: a few ulps of the sum
    assert report["max_rel_err"] < 1e-5, report


@needs_triton
def test_confidence_kernel_compiles_for_sm90():
    assert_compiles_for_sm90([("cde.steerling.confidence_kernel", "_confidence_kernel", {"BLOCK": 2048})],
                             {"logits_ptr": "*bf16", "relu_ptr": "*fp32", "seen_ptr": "*u8", "banned_ptr": "*u8",
                              "slot_ptr": "*i64", "rep_ptr": "*fp32", "out_ptr": "*fp32"})


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs triton and CUDA")
def test_confidence_kernel_on_the_gpu(seed):
    report = child_report(CHILD, interpret=False, argv=(seed, "cuda", "bfloat16"))
    assert report["max_rel_err"] < 1e-5, report
