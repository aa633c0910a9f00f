"""The GPU floor for one forward at a preset's sizes, measured in the same run as the engine.

The method (docs/BENCHMARKS.md): random bf16 weights, the dense projections of every
layer + the LM head for `queries` tokens per sequence, SDPA over `context` cached keys,
captured in a CUDA graph and replayed, so launch gaps are excluded. No norms, no RoPE, no
concept heads: it is the part no implementation can avoid.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def measure_floor(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int,
                  batches: list[int], queries: int = 64, context: int = 512, iters: int = 20,
                  device: str = "cuda") -> dict[int, float]:
    """ms per forward for each batch size."""
    torch.manual_seed(0)
    dt = torch.bfloat16
    hd = hidden // heads

    def mk(*shape):
        return torch.randn(*shape, device=device, dtype=dt) * 0.02

    ws = [dict(qkv=mk((heads + 2 * kv_heads) * hd, hidden), o=mk(hidden, heads * hd), gu=mk(2 * ffn, hidden),
               d=mk(hidden, ffn)) for _ in range(layers)]
    lm = mk(vocab, hidden)

    def fwd(h, ctx, b):
        for w in ws:
            q, k, v = (h @ w["qkv"].T).split([heads * hd, kv_heads * hd, kv_heads * hd], -1)
            q = q.view(b, queries, heads, hd).transpose(1, 2)
            k = torch.cat([ctx, k.view(b, queries, kv_heads, hd).transpose(1, 2)], 2)
            v = torch.cat([ctx, v.view(b, queries, kv_heads, hd).transpose(1, 2)], 2)
            a = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            h = h + a.transpose(1, 2).reshape(b * queries, heads * hd) @ w["o"].T
            g, u = (h @ w["gu"].T).chunk(2, -1)
            h = h + (F.silu(g) * u) @ w["d"].T
        return h @ lm.T

    out: dict[int, float] = {}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for b in batches:
        h = mk(b * queries, hidden)
        ctx = mk(b, kv_heads, context, hd)
        for _ in range(2):
            fwd(h, ctx, b)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            res = fwd(h, ctx, b)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        out[b] = start.elapsed_time(end) / iters
        del graph, res, h, ctx
        torch.cuda.empty_cache()
    ws.clear()   # free the weights before empty_cache (fwd, which reads ws and lm, is done)
    lm = None
    torch.cuda.empty_cache()
    return out
