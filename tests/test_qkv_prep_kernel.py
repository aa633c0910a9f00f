"""cde/steerling/qkv_prep_kernel.py's one-launch qkv prep against the eager function
(cde.steerling.kernels.qkv_prep): under Triton's CPU interpreter in bf16 and fp16, compiled for
sm_90 without a GPU, and on a GPU (where `dispatching` must pick the kernel)."""

from __future__ import annotations

import pytest
import torch

from tests.triton_child import HAS_TRITON, assert_compiles_for_sm90, child_report

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install -r requirements-test.txt)")

# Error unit of an output element: the activation dtype's eps times the magnitudes that meet in
# it, |n*cos| + |rotated(n)*sin| + |out| (n: eager's normed head). The kernel may flip a rounding
# of n (reduction order, rsqrt's last bit) or of the output; each flip moves the output by at
# most eps times one of those terms, so a correct kernel stays within ~1 unit (also under the
# interpreter, whose fp32 -> bf16 casts truncate where the GPU rounds to nearest: still one ulp
# per rounding; fp16 casts round to nearest there too and mostly match bit for bit). A wrong one does
# not: inputs are ~4 sigma past the clip, so skipping the clamp changes most normed values by
# O(1); rotating the wrong half, or normalizing k with q's weights, moves outputs by O(|n|), i.e.
# ~1/eps (128 in bf16) units. The child scores such wrong references against the kernel too.
# Cases: odd T, B > 1, slot blocks that mix q, k and v heads (10 + 2*4 slots, a block of 16),
# per-row gathered rope tables (the model's) and broadcast ones (zero strides), a clip that is
# not a bf16 value.
CHILD = """
import json, sys, torch
from cde.steerling import kernels
from cde.steerling.model import rope_tables
from cde.steerling.qkv_prep_kernel import dispatching, qkv_prep
first_seed, device, dtype = int(sys.argv[1]), sys.argv[2], getattr(torch, sys.argv[3])
eps_dtype = torch.finfo(dtype).eps

def units(got, want, n, cos, sin):
    nf = n.float()
    half = nf.shape[-1] // 2
    rot = torch.cat((-nf[..., half:], nf[..., :half]), dim=-1)
    scale = (nf * cos).abs() + (rot * sin).abs() + want.float().abs()
    return float(((got.float() - want.float()).abs() / (eps_dtype * scale).clamp_min(1e-30)).max())

def wrong_rope(x, cos, sin):   # rotate-half with the minus on the wrong half
    xf = x.float()
    half = xf.shape[-1] // 2
    return (xf * cos + torch.cat((xf[..., half:], -xf[..., :half]), dim=-1) * sin).to(x.dtype)

def heads(qkv, h, kv, hd):
    b, t, _ = qkv.shape
    q, k, v = qkv.split([h * hd, kv * hd, kv * hd], dim=2)
    return [z.reshape(b, t, -1, hd).transpose(1, 2) for z in (q, k, v)]

report = {"cases": [], "max_units": 0.0, "v_exact": True, "layout": True, "wrong_min_units": float("inf")}
for seed in range(first_seed, first_seed + 3):
    for b, t, h, kv, hd, clip, gathered in [(2, 37, 10, 4, 128, 2.53, True), (3, 5, 4, 2, 64, 1.7, False)]:
        g = torch.Generator().manual_seed(seed)
        qkv = (torch.randn(b, t, (h + 2 * kv) * hd, generator=g) * 4 * clip).to(dtype)
        qw = (1 + 0.5 * torch.randn(hd, generator=g)).to(dtype)
        kw = (1 + 0.5 * torch.randn(hd, generator=g)).to(dtype)
        cos_t, sin_t = rope_tables(hd, 4096, 10000.0)
        if gathered:
            pos = torch.randint(0, 4096, (b, t), generator=g)
            cos, sin = cos_t[pos].unsqueeze(1), sin_t[pos].unsqueeze(1)
        else:
            cos, sin = (z[None, None, :t].expand(b, 1, t, hd) for z in (cos_t, sin_t))
        args = (1e-5, cos, sin, h, kv, hd, clip)
        want = kernels.qkv_prep(qkv, qw, kw, *args)
        moved = [z.to(device) for z in (qkv, qw, kw, cos, sin)]
        out = qkv_prep(moved[0], moved[1], moved[2], 1e-5, moved[3], moved[4], h, kv, hd, clip)
        got = [z.cpu() for z in out]   # (a copy off the GPU is compacted: the layout is checked on `out`)
        if device == "cuda":   # the engine's path: the dispatcher must take the kernel, not the fallback
            def refuse(*a):
                raise AssertionError("dispatching fell back on CUDA")
            via = dispatching(refuse)(moved[0], moved[1], moved[2], 1e-5, moved[3], moved[4], h, kv, hd, clip)
            assert all(torch.equal(x.cpu(), y) for x, y in zip(via, got))
        qc, kc, vc = heads(qkv.clamp(-clip, clip), h, kv, hd)
        nq, nk = kernels.rms_norm(qc, qw, 1e-5), kernels.rms_norm(kc, kw, 1e-5)
        u = max(units(got[0], want[0], nq, cos, sin), units(got[1], want[1], nk, cos, sin))
        report["max_units"] = max(report["max_units"], u)
        report["v_exact"] &= torch.equal(got[2], want[2])
        # eager's layout: heads of a token adjacent (transposed views of (B, T, heads, hd)), last dim contiguous
        report["layout"] &= all(x.shape == y.shape and x.stride()[1:] == (hd, x.stride(2), 1)
                                and x.stride(2) >= y.stride(2) for x, y in zip(out, want))
        # wrong references the tolerance must reject: no clamp, wrong rotation half, k with q's weights
        qr, kr, vr = heads(qkv, h, kv, hd)
        unclamped_q = kernels.apply_rope(kernels.rms_norm(qr, qw, 1e-5), cos, sin)
        wrong = [units(got[0], unclamped_q, nq, cos, sin),
                 units(got[0], wrong_rope(nq, cos, sin), nq, cos, sin),
                 units(got[1], kernels.apply_rope(kernels.rms_norm(kc, qw, 1e-5), cos, sin), nk, cos, sin),
                 0.0 if torch.equal(got[2], vr) else float("inf")]   # v must differ from the unclamped input
        report["wrong_min_units"] = min(report["wrong_min_units"], min(wrong))
        report["cases"].append([seed, b, t, h, kv, hd, u, wrong])
print(json.dumps(report))
"""


def _check(report):
    # within one rounding (see the unit above); exact where eager is exact (v: the clamp alone)
    # (1.05: the fp32 arithmetic's own last bits on top of the flips)
    assert report["max_units"] <= 1.05, report
    assert report["v_exact"] and report["layout"], report
    assert report["wrong_min_units"] > 8.0, report


@needs_triton
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_qkv_prep_kernel_equals_eager_under_the_interpreter(dtype, seed):
    report = child_report(CHILD, interpret=True, argv=(seed, "cpu", dtype))
    assert len(report["cases"]) == 6, report
    _check(report)


@needs_triton
def test_qkv_prep_kernel_compiles_for_sm90():
    assert_compiles_for_sm90([("cde.steerling.qkv_prep_kernel", "_qkv_prep_kernel", {"HALF": half, "SLOTS": 16})
                              for half in (32, 64)],
                             {"qkv_ptr": "*bf16", "qw_ptr": "*bf16", "kw_ptr": "*bf16", "cos_ptr": "*fp32",
                              "sin_ptr": "*fp32", "out_ptr": "*bf16", "clip": "fp32", "eps": "fp32"})


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs triton and CUDA")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_qkv_prep_kernel_on_the_gpu(dtype, seed):
    _check(child_report(CHILD, interpret=False, argv=(seed, "cuda", dtype)))
