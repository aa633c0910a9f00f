"""CUDA graphs of an engine's device step, one per bucket (both engines).

Each graph owns static input buffers (dataclasses of tensors); a step copies its small
host-built inputs into them and replays the captured step, so the host issues one replay
instead of thousands of kernel launches. The engine names the bucket: the shapes its step
depends on plus its host-known flags, so a graph is never replayed for another path. All
graphs share one memory pool and are captured on first use (warm-up captures the common
buckets before the worker reports SERVING).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import fields
from typing import Any

import torch
from torch import Tensor

StepFn = Callable[..., Tensor]   # step(*inputs) -> packed results, inputs as dataclasses of tensors


def copy_inputs(dst: tuple, src: tuple) -> None:
    for d, s in zip(dst, src):
        for f in fields(d):
            getattr(d, f.name).copy_(getattr(s, f.name), non_blocking=True)


class _Graph:
    def __init__(self, pool, step: StepFn, static: tuple, keep_state: Callable[[tuple], Callable[[], None]] | None):
        dev = next(getattr(static[0], f.name) for f in fields(static[0])).device
        self.inputs = static
        # The warm-up runs execute the step for real: state they change that the real step then
        # reads (the engine says which) is put back after each.
        restore = keep_state(static) if keep_state is not None else None
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm up (compiles, Triton autotune) outside the capture
                step(*static)
                if restore is not None:
                    restore()
        torch.cuda.current_stream(dev).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = step(*static)

    def replay(self, inputs: tuple) -> Tensor:
        copy_inputs(self.inputs, inputs)
        self.graph.replay()
        return self.out


class GraphCache:
    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[Hashable, _Graph] = {}

    @property
    def captures(self) -> int:
        return len(self.graphs)

    def run(self, key: Hashable, inputs: tuple[Any, ...], step: StepFn, static_inputs: Callable[[], tuple],
            keep_state: Callable[[tuple], Callable[[], None]] | None = None) -> Tensor:
        """step(*inputs) through the bucket's graph, capturing it first if new: `static_inputs()`
        makes its input buffers (the shapes of `inputs`), `keep_state(buffers)` (optional) saves what the
        warm-up runs must not change and returns the function that puts it back."""
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs[key] = _Graph(self.pool, step, static_inputs(), keep_state)
        return g.replay(inputs)
