"""Block diffusion (Steerling) as a decoding strategy on the paged runtime: continuous batching at step granularity over the paged runtime.

Each call to `step()` builds one batch of 64-token rows from the running requests:
- a request whose prompt (or, after preemption, whose committed blocks) is not yet in the
  cache contributes commit rows for those blocks (chunked by `max_prefill_rows`) and, once
  they are all in, its decode row in the same step;
- a request whose active block just finished contributes one commit row (its final K/V),
  unless that block ends the request (nobody will attend to it); the decode row of its next
  block, which reads the commit row's page (every row writes its K/V before any row attends),
  joins that step when the row costs little (`_fold_decode_row`), else comes a step later;
- every other request contributes its active block as a decode row.
Requests join and leave between any two steps. When a request needs a page and none is
free, the most recently admitted request is preempted: its pages are freed and it is
recomputed later from its committed tokens. Because randomness depends only on (seed,
position, step), preemption and batching never change a seeded request's output.

The host keeps each request's tokens; the device keeps KV pages, steering vectors, relu
masks and seen-token bitmaps per slot. One device-to-host copy per step brings back the
chosen positions, tokens and raw concept records.

Concept heads run only on the positions that need them (steerling_runner.py): the host bounds,
per decode row, the masked positions the row has at this step (exact for a step built from the
host's tokens; for an overlapped step, masks left - min(tokens_per_step, masks left), since the
step in flight commits exactly that many, or masks left - 1 for a confidence-threshold row, which
commits at least one), buckets their sum N into HB head rows
(`head_bucket`: HB >= N, never 1) and the device compacts those positions' hidden states into HB
rows. When a step's results are applied the host checks that each live row really had at most
its bound (`_apply`), so a wrong bound fails loudly instead of silently dropping a candidate.

CUDA graphs: a step replays two graphs, the trunk's for (rows, pages) and the heads and
sampler's for (rows, tokens per step, head rows), which meet in a per-row-bucket buffer the
trunk graph copies its tokens and hidden states into. One graph per (rows, pages, tokens per
step, head rows) would be their product, thousands of keys: the lockstep warm-up covered a few
dozen, and traffic whose requests start at different times (a closed loop of users, each
submitting as its last request finishes) kept meeting new ones, each a capture of a few step
times inside serving. Split, the keys are few enough that `warmup` captures every one up to
`capture_rows` rows (`capture_plan`, `capturable`: also at most 4 x capture_rows sampled positions);
a larger step runs eagerly (at that size the GPU time, not the launches, bounds it), so nothing is
captured while serving.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from cde.blocks import BLOCK
from cde.steerling.attribution import RawRecords
from cde.steerling.model import SteerlingModel
from cde.steerling.reference_decoder import DecodeOptions, clean_output, terminal_ids
from cde.steerling.sampling import banned_ids
from cde.steerling.steering import PreparedSteering, resolve_alpha
from worker_svc.engine.events import BlockEvent, FinishEvent, StepEvent
from worker_svc.engine.kv_cache import KVCache
from worker_svc.engine.layouts import BlockResultLayout, BlockResults
from worker_svc.engine.request_table import TrackedRequest
from worker_svc.engine.runtime import ROW_BUCKETS, EngineRuntime, LaunchedStep, bucket, to_device
from worker_svc.engine.steerling_runner import DeviceTables, ForwardInputs, HeadInputs, SamplerInputs, StepRunner

__all__ = ["BlockEvent", "BlockRequest", "BlockRow", "FinishEvent", "SteerlingEngine", "StepEvent",
           "TOKENS_PER_STEP_BUCKETS"]

_ARANGE_BLOCK = np.arange(BLOCK, dtype=np.int64)
log = logging.getLogger(__name__)

PAGE_BUCKETS = (2, 4, 8, 16, 32, 64)
# Up to this many rows a step is bound by reading the weights (8B dims on an H200: 5.7 ms for 1
# row, 8.8 ms for 4): a closed block's next decode row joins its commit row's step (`_plan`).
FOLD_ROWS = 4
TOKENS_PER_STEP_BUCKETS = (1, 4, 16, 64)
# Head rows per step: fine below one block (a lone request's last masks), then whole blocks.
# Never 1: the compiled confidence pass would specialize on a size-1 dimension.
HEAD_BUCKETS = (16, 32) + tuple(BLOCK * b for b in ROW_BUCKETS)


# Plan point: a step in flight with at least this many head rows has the next step planned only once
# its trunk is done (an event between its trunk and its heads), so a request arriving meanwhile joins
# the next step instead of the one after (up to ~0.85 of a step sooner at C = 32). Its heads and
# sampler (8B dims, H200: ~1 ms at 256 head rows, ~8 ms at 2,048) must outlast the host's planning and
# launch of that step, or the GPU idles (`EngineStats.late_plan_misses` counts those steps).
PLAN_LATE_HEAD_ROWS = 256


def head_buckets_for(row_bucket: int) -> tuple[int, ...]:
    """The head-row buckets a step of `row_bucket` rows can use (besides 0: no heads)."""
    return tuple(b for b in HEAD_BUCKETS if b <= BLOCK * row_bucket)


# CUDA graphs serve a step only while rows x tokens per step <= capture_rows x this: the sampler's
# transients grow with the positions it draws at ((rows x tokens per step) x vocab in fp32, several
# times over), and the graphs keep their pool's peak (at 8B dims, 48 rows x 64 tokens per step
# filled an H200 beside the KV cache). A step past it runs eagerly, GPU-bound at that size anyway.
SAMPLED_PER_ROW = 4


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


def head_bucket(n_candidates: int, row_bucket: int) -> int:
    """Head rows of a step with at most `n_candidates` candidate positions over `row_bucket`
    rows: 0 without any (no heads run), else a bucket >= n_candidates, at most 64 per row."""
    if n_candidates == 0:
        return 0
    return min(bucket(n_candidates, HEAD_BUCKETS), BLOCK * row_bucket)


# ---- host-side request state ------------------------------------------------------------------

@dataclass(eq=False, kw_only=True)
class BlockRequest(TrackedRequest):
    options: DecodeOptions
    steering: PreparedSteering | None
    seq: list[int]
    gen_end: int
    kv_blocks: int = 0               # blocks 0..kv_blocks-1 have final K/V in the cache
    active: int = 0                  # index of the block being decoded
    step: int = 0
    committed: int = 0
    block_records: list = field(default_factory=list)
    stream_steps: bool = True        # a StepEvent per step (else only blocks and the finish)
    records: bool = True             # raw concept records with its blocks (for attributions)

    # its active block's predecessor just closed and awaits its commit row: the active block's
    # decode row may or may not join that step (SteerlingEngine._fold_decode_row)
    closed_block: bool = False

    def block_range(self, b: int) -> tuple[int, int]:
        return b * BLOCK, min((b + 1) * BLOCK, self.gen_end)

    def forget_kv(self) -> None:
        self.kv_blocks = 0
        self.closed_block = False


class RowAhead(NamedTuple):
    """A request's decode row in the step in flight, as a row of the step planned after it sees
    it (`SteerlingEngine._rows_ahead`)."""

    block: int      # the block it decodes: this step's row of that block takes the device's tokens
    commits: int    # tokens it commits: exactly this many (a confidence-threshold row: 1 .. this many)
    closes: bool    # its block closes (then this step commits it and may decode the next)


class BlockRow(NamedTuple):
    """One 64-token row of a step: a request's block, decoded (sampled) or committed (K/V only).
    ahead: set in a step launched before the previous one's results are applied, for a request
    that the previous step decodes."""

    req: BlockRequest
    block: int
    is_decode: bool
    ahead: RowAhead | None = None


class SteerlingEngine(EngineRuntime):
    def __init__(self, model: SteerlingModel, *, tokenizer_vocab_size: int | None = None, max_slots: int = 64,
                 n_pages: int | None = None, max_prefill_rows: int = 32, compile: bool = False,
                 cuda_graphs: bool = False, kv_fraction: float = 0.85, overlap: bool = True,
                 capture_rows: int = 48, never_output_ids: tuple[int, ...] = (),
                 plan_late_head_rows: int | None = PLAN_LATE_HEAD_ROWS):
        self.model = model.eval()
        self.cfg = model.cfg
        p = next(model.parameters())
        self.dtype = p.dtype
        kv = KVCache.sized_from_free_memory(self.cfg, self.dtype, p.device, kv_fraction, n_pages)
        super().__init__(kv, p.device, max_slots=max_slots, overlap=overlap)
        self.tables = DeviceTables(max_slots + 1, self.cfg.n_embd, self.cfg.vocab_size, self.dtype, self.device)
        # never sampled: the model's own bans, ids past the tokenizer and the tokenizer's holes
        banned = banned_ids(self.cfg, tokenizer_vocab_size, self.device, never_output_ids)
        self.runner = StepRunner(model, self.kv, self.tables, banned)
        self.max_prefill_rows = max_prefill_rows
        self.want_records = True   # copy raw concept records to the host (off only in benchmarks)
        self.topk_known = min(self.cfg.topk_known, self.cfg.n_known)
        self.topk_discovered = min(self.cfg.topk_discovered, self.cfg.n_discovered)
        self.head_rows = 0          # head rows the launched steps scored (sum of their HB)
        self.position_rows = 0      # positions the launched steps forwarded (sum of 64 x row bucket)
        self.last_heads = (0, 0)    # the last launched step's (candidate bound N, head rows HB)
        # CUDA graphs serve steps of at most this many rows (bucketed); warm-up captures them all
        self.capture_rows = bucket(capture_rows, ROW_BUCKETS)
        self.eager_steps = 0        # steps with CUDA graphs on that ran eagerly (not `capturable`)
        self._handoff: dict[int, tuple[Tensor, Tensor]] = {}   # row bucket -> trunk graphs' (tokens, hidden)
        self._idle: dict[tuple[int, int], Tensor] = {}         # (rows, width) -> results of a step without heads
        # A step with at least this many head rows is given a plan point between its trunk and its
        # heads (None: never): the next step is planned there, not as soon as this one is launched.
        self.plan_late_head_rows = plan_late_head_rows
        self._accelerate(compile, cuda_graphs)

    # ---- compilation ----------------------------------------------------------------------
    def _compile(self) -> None:
        """Regional compilation: the layers' pointwise parts (cde.steerling.kernels), one graph
        per function for all layers and shapes, plus the sampler's confidence pass. GEMMs,
        attention, heads and the rest of the sampler stay eager kernels (cuBLAS / SDPA / top-k);
        under CUDA graphs their launches are replayed.
        Compiling the whole 32-layer forward instead took minutes per bucket on an H200."""
        from cde.steerling import kernels

        compiled = kernels.compiled(self._counting_backend)
        self.model.use_kernels(compiled)
        self.runner.kernels = compiled

    # ---- public API -----------------------------------------------------------------------
    def submit(self, request_id: str, prompt: list[int], options: DecodeOptions,
               steering: PreparedSteering | None = None, committed: list[int] | None = None,
               next_step: int = 0, stream_steps: bool = True, records: bool = True) -> BlockRequest:
        """Queue a request. `committed` (whole blocks already generated elsewhere, e.g. by a
        worker that died) and `next_step` resume it exactly where it stopped. stream_steps=False:
        no StepEvent per step (a served request that nobody watches denoise: its stream then wakes
        only per block, see worker_svc/engine/async_engine.py). records=False: its blocks come
        without raw concept records (a request without attributions)."""
        if not prompt:
            raise ValueError("prompt must contain at least one token")
        gen_end = len(prompt) + options.max_new_tokens
        if gen_end > self.cfg.block_size:
            raise ValueError(f"prompt + max_new_tokens = {gen_end} exceeds the context of {self.cfg.block_size}")
        if options.tokens_per_step > TOKENS_PER_STEP_BUCKETS[-1]:
            raise ValueError(f"tokens_per_step must be <= {TOKENS_PER_STEP_BUCKETS[-1]}")
        committed = list(committed or [])
        if len(committed) >= options.max_new_tokens or (len(committed) and (len(prompt) + len(committed)) % BLOCK):
            raise ValueError("committed tokens must end on a block boundary before max_new_tokens")
        seq = list(prompt) + committed + [self.cfg.mask_id] * (options.max_new_tokens - len(committed))
        return self._queue(BlockRequest(request_id=request_id, prompt=list(prompt), options=options,
                                        steering=steering, seq=seq, gen_end=gen_end,
                                        active=(len(prompt) + len(committed)) // BLOCK, committed=len(committed),
                                        step=next_step, stream_steps=stream_steps, records=records))

    @property
    def tokens_per_step_buckets(self) -> tuple[int, ...]:
        return tuple(t for t in TOKENS_PER_STEP_BUCKETS if t <= self.cfg.diff_block_size)

    def warmup(self, max_rows: int = 4, max_new_tokens: int = 70) -> None:
        """Compile (and, with CUDA graphs, capture) the step for the shapes traffic will use, before SERVING.

        Runs throwaway requests covering one row and several rows (PyTorch specializes size
        1), prefill + decode + commit rows, several page counts and every tokens-per-step bucket;
        their blocks decode from 64 masks down to 1, so the steps pass through the head-row
        buckets of up to max_rows blocks (HB >= 16: the confidence pass never sees a size 1).
        With CUDA graphs it then captures every key of `capture_plan` up to `capture_rows` rows
        and the model's context.
        """
        for n_rows in sorted({1, min(2, max_rows), max_rows}):
            for tokens_per_step in self.tokens_per_step_buckets:
                self._run_throwaway([(f"__warmup_{n_rows}_{tokens_per_step}_{i}", [1] * (BLOCK * (i % 2) + 3),
                                      DecodeOptions(min(max_new_tokens, 128), tokens_per_step=tokens_per_step))
                                     for i in range(n_rows)])
        if self._graphs is not None:
            self.capture_graphs()
        self.freeze_heap()

    def capture_plan(self) -> list[tuple]:
        """The graph keys `capture_graphs` captures: every step of at most capture_rows rows."""
        return capture_plan(self.capture_rows, -(-self.cfg.block_size // BLOCK), self.tokens_per_step_buckets)

    @torch.no_grad()   # (called from warmup, outside the step loop's no_grad: with autograd on, the
    # handoff buffers' grad_fn kept every captured trunk's activations alive, ~85 GB at 8B dims)
    def capture_graphs(self) -> int:
        """Capture every key of `capture_plan` not captured yet, on all-padding inputs (they touch
        only the scratch page and slot); returns how many."""
        new = 0
        for key in self.capture_plan():
            rb = key[1]
            if key in self._graphs.graphs or rb > self.capture_rows:
                continue
            try:
                if key[0] == "trunk":
                    self._trunk_graph(rb, key[2], self.runner.neutral_inputs(rb, key[2])[0])
                else:
                    _, _, tps, hb = key
                    self._heads_graph(rb, hb, BlockResultLayout(tps, self.topk_known, self.topk_discovered),
                                      self.runner.neutral_head_inputs(rb), self.runner.neutral_inputs(rb, 1)[1])
            except torch.OutOfMemoryError:
                # the KV pool left too little for this bucket: serve it (and larger) eagerly instead
                smaller = [b for b in ROW_BUCKETS if b < rb]
                if not smaller:
                    raise
                log.warning("CUDA graphs: out of memory capturing %s; steps of more than %d rows run eagerly "
                            "(a smaller --kv-pages or --capture-rows avoids this)", key, smaller[-1])
                self.capture_rows = smaller[-1]
                torch.cuda.empty_cache()
                continue
            new += 1
        return new

    # ---- the request table's hooks ------------------------------------------------------------
    def _admission_refusal(self, req: BlockRequest) -> str | None:
        need = req.active + 1
        if not self.table.running and need > self.kv.pool.usable:
            return f"request needs {need} KV pages; the pool has {self.kv.pool.usable}"
        return None

    def _pages_to_admit(self, req: BlockRequest) -> int:
        return req.active + 1

    def _admission_stamp(self) -> int:
        return self.steps

    def _on_admit(self, req: BlockRequest) -> None:
        self.table.ensure_pages(req, req.active + 1, may_preempt_itself=False)   # free: never preempts
        s = req.slot
        self.tables.seen[s] = False
        # non-blocking copies: an arrival is admitted while the step before it runs (`_rows_ahead`),
        # and a blocking one would wait for that step before the next could be launched
        ids = torch.tensor([t for t in req.seq if t != self.cfg.mask_id] + [self.cfg.mask_id])
        self.tables.seen[s, ids.to(self.device, non_blocking=True)] = True
        st = req.steering
        self.tables.steer[s] = 0 if st is None else st.direction.to(self.device, self.dtype, non_blocking=True)
        self.tables.relu[s] = (0 if st is None or st.relu_mask is None
                               else st.relu_mask.to(self.device, non_blocking=True))

    def _finish_event(self, req: BlockRequest, reason: str, error: str) -> FinishEvent:
        stops = terminal_ids(self.cfg, req.options)
        out = clean_output(req.seq[len(req.prompt):], self.cfg, stops)
        return FinishEvent(req.request_id, reason, out, len(req.prompt), len(out), req.step, error)

    # ---- one step (EngineRuntime.step runs them) -----------------------------------------------
    def _rows_ahead(self, rows: list[BlockRow]) -> list[BlockRow] | None:
        """The next step's rows, planned before `rows`' results are applied, or None when that
        plan could be wrong. The step in flight commits exactly min(tokens_per_step, masks left)
        tokens of each decode row (a confidence-threshold row: between one and that many), so
        which blocks close in it is known, unless a threshold row may or may not close (None).
        A block that closes gets its commit row (tokens from the device's block-token table)
        and its next block's decode row, whose page is taken now; the request's last block
        ends it. Arrivals are admitted into the planned step, after those pages (None when
        the pool cannot give them without preempting). A cancel also waits for a step built
        from the host. An <|eot_id|> or a stop id can still end a request early: its rows in
        the next step are then dropped when applied (`_apply`)."""
        running = self.table.running
        in_step = {id(r.req) for r in rows}
        if in_step != {id(req) for req in running} or any(r.req.cancel_requested for r in rows):
            return None
        mask = self.cfg.mask_id
        decoded: dict[int, RowAhead] = {}          # id(req) -> its decode row's block and commits
        kv_after: dict[int, int] = {}
        opening: list[tuple[BlockRequest, int]] = []   # (request, pages it needs) for each block that opens
        for req, b, is_decode, _ in rows:
            if not is_decode:
                kv_after[id(req)] = max(kv_after.get(id(req), req.kv_blocks), b + 1)
                continue
            start, end = req.block_range(b)
            left = req.seq[start:end].count(mask)
            most = min(req.options.tokens_per_step, left)
            threshold = req.options.confidence_threshold is not None
            closes = left == most
            if threshold and ((closes and left > 1) or (not closes and self._alpha_ahead(req, most) is None)):
                return None   # it may or may not close / its strength depends on how many it commits
            decoded[id(req)] = RowAhead(b, most, closes)
            if closes and not self._ends_at(req, b):
                opening.append((req, b + 2))
        # pages of the blocks that open: all of them, or no plan
        if sum(max(0, n - len(req.pages)) for req, n in opening) > self.kv.pool.free:
            return None
        for req, n in opening:
            self.table.ensure_pages(req, n, may_preempt_itself=False)   # free pages: never preempts
        self.table.admit()
        states = []
        for req in running:
            d = decoded.get(id(req))
            if id(req) not in in_step:                    # admitted just now
                states.append((req, req.kv_blocks, req.active, req.closed_block, None))
            else:
                kv = kv_after.get(id(req), req.kv_blocks)
                if d is not None and d.closes:
                    if not self._ends_at(req, d.block):
                        states.append((req, kv, d.block + 1, True, d))
                    continue
                states.append((req, kv, req.active, req.closed_block and kv < req.active, d))
        return self._plan_rows(states) or None   # (every request ends in the step in flight)

    @staticmethod
    def _ends_at(req: BlockRequest, b: int) -> bool:
        """Whether block b is the request's last (closing it finishes the request)."""
        return req.block_range(b)[1] >= req.gen_end

    @staticmethod
    def _alpha_ahead(req: BlockRequest, most: int) -> float | None:
        """The steering strength of the step after one that commits between 1 (threshold rows) or
        exactly (other rows) `most` tokens: None when a threshold row's strength would depend on the count."""
        st = req.steering
        if st is None:
            return 0.0
        if req.options.confidence_threshold is None:
            return resolve_alpha(st.schedule, st.base_alpha, req.committed + most, st.cutoff_tokens)
        alphas = {resolve_alpha(st.schedule, st.base_alpha, req.committed + n, st.cutoff_tokens)
                  for n in range(1, most + 1)}
        return alphas.pop() if len(alphas) == 1 else None

    def _plan(self) -> list[BlockRow]:
        """The rows of this step, in running order, from the host's state."""
        return self._plan_rows([(req, req.kv_blocks, req.active, req.closed_block, None) for req in self.table.running])

    def _plan_rows(self, states: list[tuple[BlockRequest, int, int, bool, RowAhead | None]]) -> list[BlockRow]:
        """A step's rows from each running request's (kv_blocks, active, closed_block) -- the host's,
        or as they will be after the step in flight (`_rows_ahead`: then `ahead` is the request's
        decode row in that step, which its rows carry)."""
        groups: list[tuple[list[BlockRow], BlockRow | None]] = []   # a request's rows, its optional decode row
        prefill_budget = self.max_prefill_rows
        for req, kv_blocks, active, closed_block, ahead in states:
            rows: list[BlockRow] = []
            # blocks whose final K/V must be in the cache before the request can decode on (its
            # prompt, recomputation after preemption, or the block it just finished)
            if kv_blocks < active:
                n = min(active - kv_blocks, max(prefill_budget, 1))
                prefill_budget -= n
                rows = [BlockRow(req, b, False, ahead) for b in range(kv_blocks, kv_blocks + n)]
                if kv_blocks + n < active:
                    groups.append((rows, None))
                    continue
                if closed_block:
                    groups.append((rows, BlockRow(req, active, True, ahead)))
                    continue
            groups.append((rows + [BlockRow(req, active, True, ahead)], None))
        n_rows = sum(len(g) for g, _ in groups)
        planned: list[BlockRow] = []
        for rows, optional in groups:
            planned += rows
            if optional is not None and self._fold_decode_row(n_rows):
                planned.append(optional)
                n_rows += 1
        return planned

    @staticmethod
    def _fold_decode_row(n_rows: int) -> bool:
        """Whether a step of `n_rows` rows takes one more: the decode row of a request whose block
        closed, beside its commit row. Yes while the step is small (FOLD_ROWS: it is bound by the
        weights' reads, and a row costs a fraction of the step the request would otherwise skip)
        or the row fills padding of the step's row bucket; else the request decodes a step later
        (a batch that grew into the next bucket would cost every row more)."""
        return n_rows + 1 <= FOLD_ROWS or bucket(n_rows + 1, ROW_BUCKETS) == bucket(n_rows, ROW_BUCKETS)

    def _launch(self, rows: list[BlockRow], overlapped: bool = False) -> LaunchedStep:
        """Build the step's inputs, run it on the device and start the copy of its results.
        A row with `ahead` belongs to a step planned before the previous step's results are applied
        (`overlapped`): the row of the block that step decodes takes the device's block-token table,
        and the request's step counter and steering strength run one step and its commits further."""
        cfg = self.cfg
        n = len(rows)
        rb = bucket(n, ROW_BUCKETS)
        max_block = max(row.block for row in rows)
        pb = bucket(max_block + 1, PAGE_BUCKETS)
        layout = BlockResultLayout(
            bucket(max((row.req.options.tokens_per_step for row in rows if row.is_decode), default=1), TOKENS_PER_STEP_BUCKETS),
            self.topk_known, self.topk_discovered)
        # Host inputs are filled as numpy arrays (a scalar store costs ~0.1 us there, ~2 us
        # into a torch tensor) and become tensors once: the host part of a step stays small
        # next to the GPU's (it is pure overhead at batch 1).
        i64 = np.int64
        fwd = ForwardInputs(
            tokens=np.full((rb, BLOCK), cfg.pad_id, dtype=i64), positions=np.zeros((rb, BLOCK), dtype=i64),
            write_page=np.zeros(rb, dtype=i64), pages=np.zeros((rb, pb), dtype=i64),
            n_visible=np.full(rb, BLOCK, dtype=i64), steer_slot=np.zeros(rb, dtype=i64),
            alpha=np.zeros(rb, dtype=np.float32), inject_layer=np.full(rb, cfg.n_layers + 1, dtype=i64),
            from_table=np.zeros(rb, dtype=bool))
        smp = SamplerInputs(
            decode=np.zeros(rb, dtype=bool), slot=fwd.steer_slot, rep=np.ones(rb, dtype=np.float32),
            greedy=np.ones(rb, dtype=bool), entropy=np.zeros(rb, dtype=bool),
            temperature=np.ones(rb, dtype=np.float32), top_p=np.ones(rb, dtype=np.float32),
            seed=np.zeros(rb, dtype=i64), step=np.zeros(rb, dtype=i64), tokens_per_step=np.zeros(rb, dtype=i64),
            threshold=np.full(rb, -np.inf, dtype=np.float32), heads=np.zeros(rb, dtype=i64))
        for i, (req, b, is_decode, ahead) in enumerate(rows):
            start, end = req.block_range(b)
            left = req.seq[start:end].count(cfg.mask_id) if is_decode else 0
            steps_ahead = committed_least = 0
            if ahead is not None:
                steps_ahead = 1
                if ahead.block == b:   # the step in flight changes this block: its tokens are the device's
                    fwd.from_table[i] = True
                    if is_decode:      # it commits min(tokens_per_step, left) of them; a threshold row at least one
                        committed_least = 1 if req.options.confidence_threshold is not None else ahead.commits
            if not fwd.from_table[i]:
                fwd.tokens[i, : end - start] = req.seq[start:end]
            smp.heads[i] = left - committed_least   # masks the row has at this step, at most
            fwd.positions[i] = _ARANGE_BLOCK + start
            fwd.write_page[i] = req.pages[b]
            fwd.pages[i, : b + 1] = req.pages[: b + 1]
            fwd.n_visible[i] = b * BLOCK + (end - start)
            fwd.steer_slot[i] = req.slot
            if req.steering is not None and is_decode:
                st = req.steering
                fwd.alpha[i] = (self._alpha_ahead(req, ahead.commits) if ahead is not None else
                                resolve_alpha(st.schedule, st.base_alpha, req.committed, st.cutoff_tokens))
                fwd.inject_layer[i] = st.inject_layer
            if is_decode:
                o, sp = req.options, req.options.sampling
                smp.decode[i] = True
                smp.rep[i] = sp.repetition_penalty
                smp.greedy[i] = sp.greedy
                smp.entropy[i] = sp.use_entropy_sampling
                smp.temperature[i] = sp.temperature
                smp.top_p[i] = sp.top_p
                smp.seed[i] = o.seed
                smp.step[i] = req.step + steps_ahead
                smp.tokens_per_step[i] = o.tokens_per_step
                if o.confidence_threshold is not None:
                    smp.threshold[i] = o.confidence_threshold
        bounds = smp.heads[:n].tolist()
        n_candidates = sum(bounds)
        hb = head_bucket(n_candidates, rb)
        assert n_candidates <= hb, f"{n_candidates} candidate positions, {hb} head rows"
        packed, plan_point = self._execute_device(rb, pb, hb, layout, to_device(fwd, self.device),
                                                  to_device(smp, self.device))
        self.forwards += 1
        self.head_rows += hb
        self.last_heads = (n_candidates, hb)
        self.position_rows += rb * BLOCK
        n_cols = packed.shape[1] if self._wants_records(rows) else layout.sampled_width
        return LaunchedStep(rows, layout, *self._pinned.start_copy(packed[:n, :n_cols]), host_plan=bounds,
                            plan_point=plan_point)

    def _apply_step(self, launched: LaunchedStep) -> None:
        self._apply(launched.rows, launched.layout.unpack(launched.results(), self._wants_records(launched.rows)),
                    launched.host_plan)

    def _wants_records(self, rows: list[BlockRow]) -> bool:
        """Whether a step's results bring its concept records to the host: only when a decode row's
        request asked for them (a request without attributions never reads them)."""
        return self.want_records and any(row.req.records for row in rows if row.is_decode)

    def _execute_device(self, rb: int, pb: int, hb: int, layout: BlockResultLayout, fwd: ForwardInputs,
                        smp: SamplerInputs) -> tuple[Tensor, object | None]:
        """The device step: the trunk, then the heads and sampler on `hb` head rows (none: the
        trunk only, and all-zero results nobody reads). Returns (packed results, plan point)."""
        graphs = self._graphs is not None and capturable(rb, layout.tokens_per_step, self.capture_rows)
        if graphs:
            self._trunk_graph(rb, pb, fwd)
            tokens, hidden = self._handoff_buffers(rb)
        else:
            if self._graphs is not None:
                self.eager_steps += 1
            tokens, hidden = self.runner.trunk(fwd)
        if hb == 0:
            out = self._idle.get((rb, layout.width))
            if out is None:
                out = self._idle[(rb, layout.width)] = torch.zeros(rb, layout.width, dtype=torch.int32,
                                                                   device=self.device)
            return out, None
        plan_point = None
        if self.plan_late_head_rows is not None and hb >= self.plan_late_head_rows and self.device.type == "cuda":
            plan_point = torch.cuda.Event()
            plan_point.record()
        hin = HeadInputs(fwd.positions, fwd.n_visible)
        if graphs:
            return self._heads_graph(rb, hb, layout, hin, smp), plan_point
        return self.runner.heads_and_sample(layout, tokens, hidden, hin, smp, hb), plan_point

    def _handoff_buffers(self, rb: int) -> tuple[Tensor, Tensor]:
        """Where the trunk graphs of `rb` rows leave (tokens, hidden) for the heads graphs of `rb` rows
        (allocated outside any capture: it outlives every graph that uses it)."""
        bufs = self._handoff.get(rb)
        if bufs is None:
            bufs = self._handoff[rb] = (torch.zeros(rb, BLOCK, dtype=torch.long, device=self.device),
                                        torch.zeros(rb * BLOCK, self.cfg.n_embd, dtype=self.dtype, device=self.device))
        return bufs

    def _trunk_graph(self, rb: int, pb: int, fwd: ForwardInputs) -> None:
        tokens_buf, hidden_buf = self._handoff_buffers(rb)

        def trunk(f: ForwardInputs) -> Tensor:
            tokens, hidden = self.runner.trunk(f)
            tokens_buf.copy_(tokens)
            hidden_buf.copy_(hidden)
            return tokens_buf

        self._graphs.run(("trunk", rb, pb), (fwd,), trunk, lambda: (self.runner.neutral_inputs(rb, pb)[0],))

    def _heads_graph(self, rb: int, hb: int, layout: BlockResultLayout, hin: HeadInputs, smp: SamplerInputs) -> Tensor:
        tokens_buf, hidden_buf = self._handoff_buffers(rb)
        return self._graphs.run(("heads", rb, layout.tokens_per_step, hb), (hin, smp),
                                lambda h, s: self.runner.heads_and_sample(layout, tokens_buf, hidden_buf, h, s, hb),
                                lambda: (self.runner.neutral_head_inputs(rb), self.runner.neutral_inputs(rb, 1)[1]))

    def _apply(self, rows: list[BlockRow], results: BlockResults, head_bounds: list[int] | None = None) -> None:
        """head_bounds: the per-row bounds the step was launched with (checked, see module doc)."""
        # numpy views of the host copy: per-row indexing there is ~10x cheaper than torch's
        res = BlockResults(*(None if t is None else t.numpy() for t in results))
        pos_sel, tok_sel, valid = res.positions, res.tokens, res.valid
        closed = []
        for i, (req, b, is_decode, _) in enumerate(rows):
            if req.finished:   # ended by the previous step (<|eot_id|>) after this one was launched
                self.dropped_rows += 1
                continue
            if not is_decode:
                req.kv_blocks = max(req.kv_blocks, b + 1)
                if req.kv_blocks >= req.active:
                    req.closed_block = False
                continue
            if head_bounds is not None:
                # the host's tokens now are the ones the step ran on: its bound must have held
                start, end = req.block_range(b)
                masks = req.seq[start:end].count(self.cfg.mask_id)
                if masks > head_bounds[i]:
                    raise RuntimeError(f"request {req.request_id}: {masks} masked positions in a step "
                                       f"launched with a bound of {head_bounds[i]} head rows")
            keep = np.flatnonzero(valid[i])
            if keep.size == 0:  # cannot happen for a block with masks left; never burn a step
                continue
            positions = pos_sel[i, keep].tolist()
            toks = tok_sel[i, keep].tolist()
            for p, t in zip(positions, toks):
                req.seq[p] = t
            req.committed += len(toks)
            if req.stream_steps:
                req.events.append(StepEvent(req.request_id, req.step, positions, toks))
            if res.known_idx is not None and req.records:
                # numpy pieces in RawRecords field order; one RawRecords per block when it closes
                # (torch.from_numpy per step and field costs more than the rest of this loop)
                req.block_records.append(tuple(a[i, keep] for a in (
                    pos_sel, tok_sel, res.target, res.known_idx, res.known_logits, res.disc_idx, res.disc_logits)))
            req.step += 1
            eot = self.cfg.eot_id is not None and self.cfg.eot_id in toks
            start, end = req.block_range(b)
            if eot:
                p = positions[toks.index(self.cfg.eot_id)]
                for q in range(p + 1, req.gen_end):
                    req.seq[q] = self.cfg.eos_id
            if eot or self.cfg.mask_id not in req.seq[start:end]:
                closed.append((req, b, eot))
        # every close first (finished requests free their pages), then the others move on
        continuing = [req for req, b, eot in closed if self._close_block(req, b, eot)]
        for req in continuing:
            self._advance(req)

    def _close_block(self, req: BlockRequest, b: int, eot: bool) -> bool:
        """Report the closed block; finish the request if it ends there. True if it goes on."""
        start, end = req.block_range(b)
        first = max(start, len(req.prompt))
        records = (RawRecords(*(torch.from_numpy(np.concatenate(parts)) for parts in zip(*req.block_records)))
                   if req.block_records else None)
        req.block_records = []
        stops = terminal_ids(self.cfg, req.options)
        reason = ("stop" if eot or any(t in stops for t in req.seq[len(req.prompt):end])
                  else "length" if end >= req.gen_end else None)
        req.events.append(BlockEvent(req.request_id, b, first, end, req.seq[first:end], records, reason is not None,
                                     next_step=req.step))
        if reason is not None:
            self.table.finish(req, reason)
            return False
        return True

    def _advance(self, req: BlockRequest) -> None:
        """The next block becomes active; its page is taken now, unless another request's advance
        in the same step preempted this one (readmission then allocates its pages)."""
        req.active += 1
        if req not in self.table.running:
            return
        req.closed_block = True
        if not self.table.ensure_pages(req, req.active + 1, may_preempt_itself=False):
            # nothing left to preempt: wait for pages (kept state; recomputed on readmission)
            self.table.preempt(req)
