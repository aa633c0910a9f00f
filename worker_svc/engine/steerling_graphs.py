"""The Steerling step's buckets and CUDA graphs.

A step replays two graphs, the trunk's for (rows, pages) and the heads and sampler's for (rows,
tokens per step, head rows), which meet in a per-row-bucket buffer the trunk graph copies its
tokens and hidden states into. One graph per (rows, pages, tokens per step, head rows) would be
their product, thousands of keys: traffic whose requests start at different times kept meeting
new ones, each a capture of a few step times inside serving. Split, the keys are few enough that
warm-up captures every one up to `capture_rows` rows (`capture_plan`, `capturable`: also at most
SAMPLED_PER_ROW x capture_rows sampled positions); a larger step runs eagerly (at that size the
GPU time, not the launches, bounds it), so nothing is captured while serving.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from cde.blocks import BLOCK
from worker_svc.engine.graphs import GraphCache
from worker_svc.engine.layouts import BlockResultLayout
from worker_svc.engine.runtime import ROW_BUCKETS, bucket
from worker_svc.engine.steerling_runner import ForwardInputs, HeadInputs, SamplerInputs, StepRunner

log = logging.getLogger(__name__)

PAGE_BUCKETS = (2, 4, 8, 16, 32, 64)
TOKENS_PER_STEP_BUCKETS = (1, 4, 16, 64)
# Head rows per step: fine below one block (a lone request's last masks), then whole blocks.
# Never 1: the compiled confidence pass would specialize on a size-1 dimension.
HEAD_BUCKETS = (16, 32) + tuple(BLOCK * b for b in ROW_BUCKETS)
# CUDA graphs serve a step only while rows x tokens per step <= capture_rows x this: the sampler's
# transients grow with the positions it draws at ((rows x tokens per step) x vocab in fp32, several
# times over), and the graphs keep their pool's peak (at 8B dims, 48 rows x 64 tokens per step
# filled an H200 beside the KV cache). A step past it runs eagerly, GPU-bound at that size anyway.
SAMPLED_PER_ROW = 4


def head_buckets_for(row_bucket: int) -> tuple[int, ...]:
    """The head-row buckets a step of `row_bucket` rows can use (besides 0: no heads)."""
    return tuple(b for b in HEAD_BUCKETS if b <= BLOCK * row_bucket)


def head_bucket(n_candidates: int, row_bucket: int) -> int:
    """Head rows of a step with at most `n_candidates` candidate positions over `row_bucket`
    rows: 0 without any (no heads run), else a bucket >= n_candidates, at most 64 per row."""
    if n_candidates == 0:
        return 0
    return min(bucket(n_candidates, HEAD_BUCKETS), BLOCK * row_bucket)


def capturable(rb: int, tokens_per_step: int, capture_rows: int) -> bool:
    """Whether a step of `rb` rows and `tokens_per_step` runs from CUDA graphs."""
    return rb <= capture_rows and rb * tokens_per_step <= capture_rows * SAMPLED_PER_ROW


def graph_keys(rb: int, pb: int, tokens_per_step: int, hb: int, capture_rows: int) -> list[tuple]:
    """The CUDA graphs a step replays: the trunk's, and the heads and sampler's unless it has no
    decode row (hb = 0); [("eager", rb, tokens_per_step)] for a step that is not `capturable`."""
    if not capturable(rb, tokens_per_step, capture_rows):
        return [("eager", rb, tokens_per_step)]
    return [("trunk", rb, pb)] + ([("heads", rb, tokens_per_step, hb)] if hb else [])


def capture_plan(max_rows: int, max_pages: int, tokens_per_step_buckets: tuple[int, ...]) -> list[tuple]:
    """Every graph key of the `capturable` steps with at most `max_pages` pages per row (max_rows
    = capture_rows), largest first: the graphs share one memory pool, and smaller captures reuse
    what the larger left."""
    max_rows = bucket(max_rows, ROW_BUCKETS)
    keys: list[tuple] = []
    for rb in ROW_BUCKETS:
        if rb > max_rows:
            break
        keys += [("trunk", rb, pb) for pb in PAGE_BUCKETS if pb <= bucket(max_pages, PAGE_BUCKETS)]
        keys += [("heads", rb, tps, hb) for tps in tokens_per_step_buckets if capturable(rb, tps, max_rows)
                 for hb in head_buckets_for(rb)]
    return keys[::-1]


class StepGraphs:
    """The trunk and heads graphs of the Steerling step, over one GraphCache."""

    def __init__(self, cache: GraphCache, runner: StepRunner, n_embd: int, dtype: torch.dtype,
                 device: torch.device):
        self.cache = cache
        self.runner = runner
        self.n_embd, self.dtype, self.device = n_embd, dtype, device
        self._handoff: dict[int, tuple[Tensor, Tensor]] = {}    # row bucket -> trunk graphs' (tokens, hidden)

    def handoff(self, rb: int) -> tuple[Tensor, Tensor]:
        """Where the trunk graphs of `rb` rows leave (tokens, hidden) for the heads graphs of `rb` rows
        (allocated outside any capture: it outlives every graph that uses it)."""
        bufs = self._handoff.get(rb)
        if bufs is None:
            bufs = self._handoff[rb] = (torch.zeros(rb, BLOCK, dtype=torch.long, device=self.device),
                                        torch.zeros(rb * BLOCK, self.n_embd, dtype=self.dtype, device=self.device))
        return bufs

    def trunk(self, rb: int, pb: int, fwd: ForwardInputs) -> tuple[Tensor, Tensor]:
        """The trunk of `rb` rows and `pb` pages from its graph; (tokens, hidden) in `handoff(rb)`."""
        tokens_buf, hidden_buf = self.handoff(rb)

        def trunk(f: ForwardInputs) -> Tensor:
            tokens, hidden = self.runner.trunk(f)
            tokens_buf.copy_(tokens)
            hidden_buf.copy_(hidden)
            return tokens_buf

        self.cache.run(("trunk", rb, pb), (fwd,), trunk, lambda: (self.runner.neutral_inputs(rb, pb)[0],))
        return tokens_buf, hidden_buf

    def heads(self, rb: int, hb: int, layout: BlockResultLayout, hin: HeadInputs, smp: SamplerInputs) -> Tensor:
        """The heads and sampler on `hb` head rows from their graph, reading `handoff(rb)`."""
        tokens_buf, hidden_buf = self.handoff(rb)
        return self.cache.run(("heads", rb, layout.tokens_per_step, hb), (hin, smp),
                              lambda h, s: self.runner.heads_and_sample(layout, tokens_buf, hidden_buf, h, s, hb),
                              lambda: (self.runner.neutral_head_inputs(rb), self.runner.neutral_inputs(rb, 1)[1]))

    @torch.no_grad()   # (outside the step loop's no_grad: with autograd on, the handoff buffers'
    # grad_fn kept every captured trunk's activations alive, ~85 GB at 8B dims)
    def capture(self, keys: list[tuple], capture_rows: int, topk_known: int, topk_discovered: int) -> tuple[int, int]:
        """Capture every key of at most `capture_rows` rows not captured yet, on all-padding inputs
        (they touch only the scratch page and slot). Returns (how many, capture_rows): out of memory
        at a bucket, steps of that many rows and more run eagerly instead (a smaller capture_rows)."""
        new = 0
        for key in keys:
            rb = key[1]
            if key in self.cache.graphs or rb > capture_rows:
                continue
            try:
                if key[0] == "trunk":
                    self.trunk(rb, key[2], self.runner.neutral_inputs(rb, key[2])[0])
                else:
                    _, _, tps, hb = key
                    self.heads(rb, hb, BlockResultLayout(tps, topk_known, topk_discovered),
                               self.runner.neutral_head_inputs(rb), self.runner.neutral_inputs(rb, 1)[1])
            except torch.OutOfMemoryError:
                smaller = [b for b in ROW_BUCKETS if b < rb]
                if not smaller:
                    raise
                log.warning("CUDA graphs: out of memory capturing %s; steps of more than %d rows run eagerly "
                            "(a smaller --kv-pages or --capture-rows avoids this)", key, smaller[-1])
                capture_rows = smaller[-1]
                torch.cuda.empty_cache()
                continue
            new += 1
        return new, capture_rows
