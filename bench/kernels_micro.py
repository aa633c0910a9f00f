"""Micro-benchmarks of single kernels at Steerling-8B dims (GPU only).

    python -m bench.kernels_micro --out bench/results/kernels-micro-h200.json

* qkv prep: the Inductor-compiled `kernels.qkv_prep` (dynamic shapes, as `regional.compiled`
  builds it) against the one-launch Triton kernel (cde/steerling/qkv_prep_kernel.py), at 1 and 32
  rows of 64 tokens (batch 1 and C = 32).
* `block_attention` (worker_svc/engine/attention.py) at 1 and 32 rows over page tables of 2, 4,
  8, 16 and 64 pages, with splits = 1 and the default `split_count`: whether short contexts
  should split.

Random non-zero inputs (qkv ~4x past the clip, as the test does). Each figure is the mean of
`--iters` (>= 200) CUDA-graph replays of one call, timed with CUDA events after warm-up: the
engine replays its steps from graphs, so this is the kernels' GPU time without launch gaps.
`launch_loop_ms` is the same call launched eagerly in a loop (what Python + driver launches cost).
Writes one JSON: commit (CDE_COMMIT, else git's HEAD), gpu, torch, triton, the timings.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch

TOKENS = 64
ROWS = (1, 32)
PAGE_COUNTS = (2, 4, 8, 16, 64)


def _events_ms(run: Callable[[], object], iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def time_call(fn: Callable[[], object], iters: int, warmup: int) -> dict:
    """ms per call: CUDA-graph replays of one call, and the call launched in a loop."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # warm-up (compiles, autotunes) off the capture stream
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(warmup):
        graph.replay()
    replay = _events_ms(graph.replay, iters)
    loop = _events_ms(fn, iters)
    del graph
    return {"graph_ms": replay, "launch_loop_ms": loop}


def bench_qkv_prep(cfg, iters: int, warmup: int) -> list[dict]:
    from cde import regional
    from cde.steerling import kernels, qkv_prep_kernel
    from cde.steerling.model import rope_tables

    compiled = regional.compiled({"qkv_prep": kernels.qkv_prep}).qkv_prep
    h, kv, hd, clip = cfg.n_head, cfg.n_kv_heads, cfg.head_dim, cfg.clip_qkv
    g = torch.Generator(device="cuda").manual_seed(0)
    cos_t, sin_t = rope_tables(hd, cfg.block_size, cfg.rope_base, "cuda")
    dtype = torch.bfloat16
    out = []
    for rows in ROWS:
        qkv = (torch.randn(rows, TOKENS, (h + 2 * kv) * hd, device="cuda", generator=g) * 4 * clip).to(dtype)
        qw = (1 + 0.1 * torch.randn(hd, device="cuda", generator=g)).to(dtype)
        kw = (1 + 0.1 * torch.randn(hd, device="cuda", generator=g)).to(dtype)
        pos = torch.randint(0, cfg.block_size, (rows, TOKENS), device="cuda", generator=g)
        cos, sin = cos_t[pos].unsqueeze(1), sin_t[pos].unsqueeze(1)
        args = (qkv, qw, kw, cfg.norm_eps, cos, sin, h, kv, hd, clip)
        diff = max(float((a.float() - b.float()).abs().max())
                   for a, b in zip(compiled(*args), qkv_prep_kernel.qkv_prep(*args)))
        rec = {"rows": rows, "tokens": TOKENS, "max_abs_diff": diff,
               "compiled": time_call(lambda: compiled(*args), iters, warmup),
               "triton": time_call(lambda: qkv_prep_kernel.qkv_prep(*args), iters, warmup)}
        rec["graph_speedup"] = rec["compiled"]["graph_ms"] / rec["triton"]["graph_ms"]
        print(json.dumps(rec), flush=True)
        out.append(rec)
    return out


def bench_block_attention(cfg, iters: int, warmup: int) -> list[dict]:
    from worker_svc.engine.attention import block_attention, split_count

    h, kv, hd, page = cfg.n_head, cfg.n_kv_heads, cfg.head_dim, cfg.diff_block_size
    dtype = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(1)
    pool_pages = max(ROWS) * max(PAGE_COUNTS) + 1   # every row its own pages; page 0 the scratch page
    k_pool = torch.randn(pool_pages, page, kv, hd, device="cuda", generator=g).to(dtype)
    v_pool = torch.randn(pool_pages, page, kv, hd, device="cuda", generator=g).to(dtype)
    out = []
    for rows in ROWS:
        # q as the qkv prep hands it over: a transposed view of (R, 64, H, hd)
        q = torch.randn(rows, page, h, hd, device="cuda", generator=g).to(dtype).transpose(1, 2)
        for n_pages in PAGE_COUNTS:
            pages = 1 + torch.arange(rows * n_pages, device="cuda").view(rows, n_pages)
            # every key visible: the last page is the row's own block
            n_visible = torch.full((rows,), n_pages * page, device="cuda", dtype=torch.long)
            default = split_count(rows * h, n_pages, q.device)
            for splits in sorted({1, default}):
                rec = {"rows": rows, "pages": n_pages, "splits": splits, "default_splits": default,
                       **time_call(lambda s=splits: block_attention(q, k_pool, v_pool, pages, n_visible, s),
                                   iters, warmup)}
                print(json.dumps(rec), flush=True)
                out.append(rec)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the JSON to write")
    ap.add_argument("--iters", type=int, default=500, help="timed replays per figure (at least 200)")
    ap.add_argument("--warmup", type=int, default=20)
    args = ap.parse_args(argv)
    if args.iters < 200:
        ap.error("--iters must be at least 200")
    if not torch.cuda.is_available():
        raise SystemExit("bench.kernels_micro times CUDA kernels and needs a CUDA GPU; none is visible here")
    import triton

    from bench.steerling import git_commit
    from cde.steerling.config import preset

    cfg = preset("steerling-8b")
    record = {"commit": git_commit(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "iters": args.iters, "warmup": args.warmup, "dtype": "torch.bfloat16",
              "dims": {"n_head": cfg.n_head, "n_kv_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
                       "tokens_per_row": TOKENS}}
    record["qkv_prep"] = bench_qkv_prep(cfg, args.iters, args.warmup)
    record["block_attention"] = bench_block_attention(cfg, args.iters, args.warmup)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
