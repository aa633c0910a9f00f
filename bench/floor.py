"""The GPU floor for one forward at a preset's sizes, measured in the same run as the engine.

The method (docs/BENCHMARKS.md): random bf16 weights, the dense projections of every
layer + the LM head for `queries` tokens per sequence, SDPA over `context` cached keys
(concatenated per layer as the anchors do, or, for long contexts, a K/V cache per layer:
`decode_ms`'s `kv`), captured in a CUDA graph and replayed, so launch gaps are excluded. No norms, no RoPE, no
concept heads: it is the part no implementation can avoid.

`weights="fp8"`: the trunk's projections as `cde.fp8.Fp8Linear` runs them (e4m3 weights with
per-output-channel scales, the activations quantized per token, `torch._scaled_mm`), the LM head
dense, as the engine's `--weights fp8` has them: the FP8 floor.

The prefill floor (`FloorModel.prefill_ms`) is one forward of a whole L-token prompt: the same
projections for L tokens, causal attention over the L keys (flash SDPA) and the LM head only
for the tokens whose logits the engine samples from. On the CPU (tests) the forwards are
timed eagerly: the code runs, the figures mean nothing.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F


class FloorModel:
    """Random dense weights at a preset's sizes, for the decode and prefill floors."""

    def __init__(self, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int,
                 device: str = "cuda", iters: int = 20, weights: str = "dense"):
        torch.manual_seed(0)
        self.device, self.iters = device, iters
        self.dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        self.hidden, self.heads, self.kv_heads = hidden, heads, kv_heads
        self.hd = hidden // heads
        hd = self.hd
        self.ws = [dict(qkv=self._mk((heads + 2 * kv_heads) * hd, hidden), o=self._mk(hidden, heads * hd),
                        gu=self._mk(2 * ffn, hidden), d=self._mk(hidden, ffn)) for _ in range(layers)]
        self.lm = self._mk(vocab, hidden)
        if weights == "fp8":   # the trunk's projections as the engine's --weights fp8 runs them (cde/fp8.py)
            from cde.fp8 import Fp8Linear
            self.ws = [{name: Fp8Linear(w) for name, w in ws.items()} for ws in self.ws]
        elif weights != "dense":
            raise ValueError(f"weights must be 'dense' or 'fp8', got {weights!r}")

    @staticmethod
    def _proj(h, w):
        return h @ w.T if isinstance(w, torch.Tensor) else w(h)

    def _mk(self, *shape):
        return torch.randn(*shape, device=self.device, dtype=self.dtype) * 0.02

    def _layers(self, h, b: int, n: int, attend):
        """Every layer's projections on (b * n, hidden) rows; attend(q, k, v) -> (b, heads, n, hd)."""
        heads, kvh, hd = self.heads, self.kv_heads, self.hd
        for w in self.ws:
            q, k, v = self._proj(h, w["qkv"]).split([heads * hd, kvh * hd, kvh * hd], -1)
            a = attend(q.view(b, n, heads, hd).transpose(1, 2), k.view(b, n, kvh, hd).transpose(1, 2),
                       v.view(b, n, kvh, hd).transpose(1, 2))
            h = h + self._proj(a.transpose(1, 2).reshape(b * n, heads * hd), w["o"])
            g, u = self._proj(h, w["gu"]).chunk(2, -1)
            h = h + self._proj(F.silu(g) * u, w["d"])
        return h

    def _time_ms(self, fwd) -> float:
        """ms per call of fwd(): CUDA-graph replays on the GPU, eager calls on the CPU."""
        if not self.device.startswith("cuda"):
            fwd()
            t = time.perf_counter()
            for _ in range(2):
                fwd()
            return (time.perf_counter() - t) / 2 * 1e3
        for _ in range(2):
            fwd()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fwd()
        for _ in range(3):
            graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(self.iters):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        del graph
        torch.cuda.empty_cache()
        return start.elapsed_time(end) / self.iters

    def decode_ms(self, batch: int, queries: int, context: int, kv: str = "concat") -> float:
        """One decode forward: `queries` new tokens per sequence attend `context` cached keys + themselves.

        kv="concat" (the anchors' method, ANCHORS / gpu_floor.py): one cached context shared by
        every layer, concatenated with the new keys in each layer. That copy grows with the
        context (at 4K it costs more than the engine's whole attention) and the shared context
        may sit in L2, so it is no floor at long contexts. kv="cached": a K/V cache per layer,
        (batch, kv_heads, context + queries, hd), the new keys written into its tail and SDPA
        over the whole of it: the unavoidable reads and the one write."""
        h = self._mk(batch * queries, self.hidden)
        if kv == "concat":
            ctx = self._mk(batch, self.kv_heads, context, self.hd)

            def attend(q, k, v):
                return F.scaled_dot_product_attention(q, torch.cat([ctx, k], 2), torch.cat([ctx, v], 2),
                                                      enable_gqa=True)

            return self._time_ms(lambda: self._layers(h, batch, queries, attend) @ self.lm.T)
        if kv != "cached":
            raise ValueError(f"kv must be 'concat' or 'cached', got {kv!r}")
        caches = [(self._mk(batch, self.kv_heads, context + queries, self.hd),
                   self._mk(batch, self.kv_heads, context + queries, self.hd)) for _ in self.ws]
        layer = iter(())

        def attend(q, k, v):
            kc, vc = next(layer)
            kc[:, :, context:].copy_(k)
            vc[:, :, context:].copy_(v)
            return F.scaled_dot_product_attention(q, kc, vc, enable_gqa=True)

        def fwd():
            nonlocal layer
            layer = iter(caches)
            return self._layers(h, batch, queries, attend) @ self.lm.T

        try:
            return self._time_ms(fwd)
        finally:
            caches.clear()

    def prefill_ms(self, batch: int, length: int, head_tokens: int) -> float:
        """One forward of `length` prompt tokens per sequence, causal attention over them, LM head
        on the last `head_tokens` of each (0: none; the engine then only needs the K/V).
        Causal rather than block-causal: block-causal attends at most 63 keys more per query
        (+32 x length score entries, 64 / length of the causal ones), so causal flash SDPA is
        a lower bound for both masks."""
        h = self._mk(batch * length, self.hidden)

        def attend(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        def fwd():
            out = self._layers(h, batch, length, attend)
            if head_tokens:
                out = out.view(batch, length, -1)[:, length - head_tokens:] @ self.lm.T
            return out

        return self._time_ms(fwd)

    def free(self) -> None:
        self.ws.clear()
        self.lm = None
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()


def measure_floor(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int,
                  batches: list[int], queries: int = 64, context: int = 512, iters: int = 20,
                  device: str = "cuda", weights: str = "dense") -> dict[int, float]:
    """ms per decode forward for each batch size (`weights` "fp8": e4m3 trunk projections)."""
    model = FloorModel(layers, hidden, heads, kv_heads, ffn, vocab, device, iters, weights)
    try:
        return {b: model.decode_ms(b, queries, context) for b in batches}
    finally:
        model.free()
