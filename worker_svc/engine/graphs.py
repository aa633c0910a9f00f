"""CUDA graphs for the engine step, one per (rows, pages, k) bucket.

Each graph owns static input buffers; a step copies its (small) inputs into them and
replays the captured forward + sampler, so the host issues one replay instead of
thousands of kernel launches. All graphs share one memory pool. Graphs are captured on
first use (warm-up captures the common buckets before the worker reports SERVING).
"""

from __future__ import annotations

from dataclasses import fields

import torch

from worker_svc.engine.runner import BLOCK, ForwardInputs, SamplerInputs


class _Graph:
    def __init__(self, engine, rb: int, pb: int, kmax: int):
        dev = engine.device
        cfg = engine.cfg
        long = dict(dtype=torch.long, device=dev)
        self.fwd = ForwardInputs(
            tokens=torch.full((rb, BLOCK), cfg.pad_id, **long), positions=torch.zeros((rb, BLOCK), **long),
            write_page=torch.zeros(rb, **long), pages=torch.zeros((rb, pb), **long),
            n_visible=torch.full((rb,), BLOCK, **long), steer_slot=torch.zeros(rb, **long),
            alpha=torch.zeros(rb, dtype=torch.float32, device=dev), inject_layer=torch.zeros(rb, **long),
            from_table=torch.zeros(rb, dtype=torch.bool, device=dev))
        f32 = dict(dtype=torch.float32, device=dev)
        b = dict(dtype=torch.bool, device=dev)
        self.smp = SamplerInputs(
            decode=torch.zeros(rb, **b), slot=torch.zeros(rb, **long), rep=torch.ones(rb, **f32),
            greedy=torch.ones(rb, **b), entropy=torch.zeros(rb, **b), temperature=torch.ones(rb, **f32),
            top_p=torch.ones(rb, **f32), seed=torch.zeros(rb, **long), step=torch.zeros(rb, **long),
            k=torch.zeros(rb, **long), threshold=torch.full((rb,), float("-inf"), **f32))

        def run():
            return engine.runner.step(kmax, self.fwd, self.smp)

        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm up (compiles, autotunes) outside the capture
                run()
        torch.cuda.current_stream(dev).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=engine._graphs.pool):
            self.out = run()

    def replay(self, fwd: ForwardInputs, smp: SamplerInputs):
        for dst, src in ((self.fwd, fwd), (self.smp, smp)):
            for f in fields(dst):
                getattr(dst, f.name).copy_(getattr(src, f.name), non_blocking=True)
        self.graph.replay()
        return self.out


class GraphCache:
    def __init__(self, engine):
        self.engine = engine
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int, int], _Graph] = {}

    @property
    def captures(self) -> int:
        return len(self.graphs)

    def run(self, rb: int, pb: int, kmax: int, fwd: ForwardInputs, smp: SamplerInputs):
        key = (rb, pb, kmax)
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs[key] = _Graph(self.engine, rb, pb, kmax)
        return g.replay(fwd, smp)
