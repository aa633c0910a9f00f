"""CUDA graphs for the ISD engine's device step, one per input-shape bucket.

Same idea as graphs.py for the Steerling step: each graph owns static `IsdInputs` buffers;
a step copies its small host-built inputs into them and replays the captured forward +
proposals + verify, so the host issues one replay instead of ~30 launches per layer. The
bucket is the shapes of the inputs (rows, query length, pages, drafts) plus the window the
LM head reads and the step's host-known flags (some row filters its vocabulary with top-k /
top-p; some row samples: without one the step is the greedy-only path; the step is overlapped:
its windows are derived on the device, `isd_runner.advance`), so a graph is never replayed
for another path. All graphs share one memory pool and the runner's carry buffer, and are
captured on first use.
"""

from __future__ import annotations

from dataclasses import fields

import torch

from worker_svc.engine.isd_runner import IsdInputs


def _key(inp: IsdInputs, window: int, filtered: bool, sampling: bool, overlapped: bool) -> tuple:
    return (window, filtered, sampling, overlapped) + tuple(tuple(getattr(inp, f.name).shape)
                                                            for f in fields(IsdInputs))


class _Graph:
    def __init__(self, runner, pool, inp: IsdInputs, window: int, filtered: bool, sampling: bool, overlapped: bool):
        dev = inp.tokens.device
        step = runner.step
        self.inp = IsdInputs(*(getattr(inp, f.name).clone() for f in fields(IsdInputs)))
        # The warm-up runs execute the step for real: KV writes repeat identically, but each run
        # overwrites the q-table rows of its slots that the next run's verify reads, and the
        # carry the next run's windows derive from: keep both.
        saved_q = runner.q_table.index_select(0, self.inp.slot)
        saved_carry = runner.carry.clone()
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):   # warm up (Triton autotune / compile) outside the capture
                step(self.inp, window, filtered, sampling, overlapped)
                runner.q_table.index_copy_(0, self.inp.slot, saved_q)
                runner.carry.copy_(saved_carry)
        torch.cuda.current_stream(dev).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = step(self.inp, window, filtered, sampling, overlapped)

    def replay(self, inp: IsdInputs):
        for f in fields(IsdInputs):
            getattr(self.inp, f.name).copy_(getattr(inp, f.name), non_blocking=True)
        self.graph.replay()
        return self.out


class IsdGraphCache:
    def __init__(self, runner):
        self.runner = runner
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple, _Graph] = {}

    @property
    def captures(self) -> int:
        return len(self.graphs)

    def run(self, inp: IsdInputs, window: int, filtered: bool = True, sampling: bool = True,
            overlapped: bool = False):
        key = _key(inp, window, filtered, sampling, overlapped)
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs[key] = _Graph(self.runner, self.pool, inp, window, filtered, sampling, overlapped)
        return g.replay(inp)
