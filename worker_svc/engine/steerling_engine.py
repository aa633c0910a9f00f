"""Block diffusion (Steerling) as a decoding strategy on the paged runtime: continuous batching at
step granularity. `SteerlingStrategy` turns a planned step (steerling_plan.py) into device inputs,
runs it (steerling_runner.py; CUDA graphs: steerling_graphs.py) and applies its results;
`SteerlingEngine` wires it to the runtime, the request table and a KV cache, and warms it up.

Requests join and leave between any two steps. When a request needs a page and none is free,
the most recently admitted request is preempted: its pages are freed and it is recomputed
later from its committed tokens. Because randomness depends only on (seed, position, step),
preemption and batching never change a seeded request's output.

The host keeps each request's tokens; the device keeps KV pages, steering vectors, relu masks
and seen-token bitmaps per slot. One device-to-host copy per step brings back the chosen
positions, tokens and raw concept records.

Concept heads run only on the positions that need them: the host bounds, per decode row, the
masked positions the row has at this step (exact for a step built from the host's tokens; for
an overlapped step, masks left - min(tokens_per_step, masks left), since the step in flight
commits exactly that many, or masks left - 1 for a confidence-threshold row, which commits at
least one), buckets their sum N into HB head rows (`head_bucket`: HB >= N, never 1) and the
device compacts those positions' hidden states into HB rows. When a step's results are applied
the host checks that each live row really had at most its bound, so a wrong bound fails loudly
instead of silently dropping a candidate.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from cde.blocks import BLOCK
from cde.options import DecodeOptions
from cde.steerling.attribution import RawRecords
from cde.steerling.model import SteerlingModel
from cde.steerling.reference_decoder import clean_output, terminal_ids
from cde.steerling.sampling import SamplingParams, banned_ids
from cde.steerling.steering import resolve_alpha
from cde.tp import local_kv_heads
from worker_svc.engine.events import BlockEvent, FinishEvent, StepEvent, TokenLogprob
from worker_svc.engine.job import Job
from worker_svc.engine.kv_cache import KVCache
from worker_svc.engine.layouts import TOP_LOGPROBS, BlockResultLayout, BlockResults
from worker_svc.engine.request_table import PrefixQuery, RequestTable
from worker_svc.engine.runtime import (ROW_BUCKETS, DecodeStrategy, EngineRuntime, LaunchedStep, StepPlan, bucket,
                                       to_device)
from worker_svc.engine.steerling_graphs import (PAGE_BUCKETS, TOKENS_PER_STEP_BUCKETS, StepGraphs, capturable,
                                                capture_plan, head_bucket)
from worker_svc.engine.steerling_plan import BlockRequest, BlockRow, alpha_ahead, host_states, plan_ahead, plan_rows
from worker_svc.engine.steerling_runner import DeviceTables, ForwardInputs, HeadInputs, SamplerInputs, StepRunner

__all__ = ["BlockEvent", "FinishEvent", "SteerlingEngine", "SteerlingStrategy", "StepEvent"]

_ARANGE_BLOCK = np.arange(BLOCK, dtype=np.int64)

# Plan point: a step in flight with at least this many head rows has the next step planned only once
# its trunk is done (an event between its trunk and its heads), so a request arriving meanwhile joins
# the next step instead of the one after (up to ~0.85 of a step sooner at C = 32). Its heads and
# sampler (8B dims, H200: ~1 ms at 256 head rows, ~8 ms at 2,048) must outlast the host's planning and
# launch of that step, or the GPU idles (`EngineStats.late_plan_misses` counts those steps).
PLAN_LATE_HEAD_ROWS = 256


class SteerlingStrategy(DecodeStrategy):
    def __init__(self, model: SteerlingModel, kv: KVCache, *, max_slots: int, tokenizer_vocab_size: int | None,
                 max_prefill_rows: int, compile: bool, cuda_graphs: bool, capture_rows: int,
                 never_output_ids: tuple[int, ...], plan_late_head_rows: int | None):
        self.model = model.eval()
        self.cfg = model.cfg
        p = next(model.parameters())
        super().__init__(p.device)
        self.dtype = p.dtype
        self.kv = kv
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
        self._idle: dict[tuple[int, int], Tensor] = {}         # (rows, width) -> results of a step without heads
        # A step with at least this many head rows is given a plan point between its trunk and its
        # heads (None: never): the next step is planned there, not as soon as this one is launched.
        self.plan_late_head_rows = plan_late_head_rows
        if compile:
            self._compile()
        self.step_graphs: StepGraphs | None = None
        if cuda_graphs:
            self.enable_graphs()
            self.step_graphs = StepGraphs(self.graphs, self.runner, self.cfg.n_embd, self.dtype, self.device)

    def _compile(self) -> None:
        """Regional compilation: the layers' pointwise parts (cde.steerling.kernels), one graph
        per function for all layers and shapes, plus the sampler's confidence pass. GEMMs,
        attention, heads and the rest of the sampler stay eager kernels (cuBLAS / SDPA / top-k);
        under CUDA graphs their launches are replayed.
        Compiling the whole 32-layer forward instead took minutes per bucket on an H200."""
        from cde.steerling import kernels

        compiled = kernels.compiled(self.counting_backend)
        self.model.use_kernels(compiled)
        self.runner.kernels = compiled

    @property
    def tokens_per_step_buckets(self) -> tuple[int, ...]:
        return tuple(t for t in TOKENS_PER_STEP_BUCKETS if t <= self.cfg.diff_block_size)

    def capture_plan(self) -> list[tuple]:
        """The graph keys `SteerlingEngine.capture_graphs` captures: every step of at most capture_rows rows."""
        return capture_plan(self.capture_rows, -(-self.cfg.block_size // BLOCK), self.tokens_per_step_buckets)

    # ---- requests and the table's hooks --------------------------------------------------------
    def new_request(self, job: Job) -> BlockRequest:
        """`job.committed` (whole blocks already generated elsewhere, e.g. by a worker that died)
        and `job.next_step` resume a request exactly where it stopped. stream_steps=False: no
        StepEvent per step (a served request that nobody watches denoise). records=False: its
        blocks come without raw concept records (a request without attributions)."""
        prompt, options = job.prompt, job.options
        if not isinstance(options, DecodeOptions):
            raise ValueError("the Steerling engine takes DecodeOptions")
        if not prompt:
            raise ValueError("prompt must contain at least one token")
        gen_end = len(prompt) + options.max_new_tokens
        if gen_end > self.cfg.block_size:
            raise ValueError(f"prompt + max_new_tokens = {gen_end} exceeds the context of {self.cfg.block_size}")
        if options.tokens_per_step > TOKENS_PER_STEP_BUCKETS[-1]:
            raise ValueError(f"tokens_per_step must be <= {TOKENS_PER_STEP_BUCKETS[-1]}")
        committed = list(job.committed)
        if len(committed) >= options.max_new_tokens or (len(committed) and (len(prompt) + len(committed)) % BLOCK):
            raise ValueError("committed tokens must end on a block boundary before max_new_tokens")
        if job.logprobs is not None and not 0 <= job.logprobs <= TOP_LOGPROBS:
            raise ValueError(f"logprobs alternatives must be in [0, {TOP_LOGPROBS}]")
        if job.constraint is not None and self.cfg.eot_id is None:
            raise ValueError("structured output needs a model with an <|eot_id|> to end on")
        seq = list(prompt) + committed + [self.cfg.mask_id] * (options.max_new_tokens - len(committed))
        return BlockRequest(request_id=job.request_id, prompt=list(prompt), options=options, steering=job.steering,
                            seq=seq, gen_end=gen_end, active=(len(prompt) + len(committed)) // BLOCK,
                            committed=len(committed), step=job.next_step, stream_steps=job.stream_steps,
                            records=job.records, logprobs=job.logprobs, constraint=job.constraint)

    def admission_refusal(self, req: BlockRequest, idle: bool) -> str | None:
        need = req.active + 1
        if idle and need > self.kv.pool.usable:
            return f"request needs {need} KV pages; the pool has {self.kv.pool.usable}"
        return None

    def pages_to_admit(self, req: BlockRequest) -> int:
        return req.active + 1

    def admission_stamp(self) -> int:
        return self.applied_steps

    def prefix_query(self, req: BlockRequest) -> PrefixQuery:
        # blocks before the active one are final (prompt or committed); commit rows are never steered
        return PrefixQuery(req.seq, len(req.prompt) + req.committed, req.active * BLOCK)

    def on_admit(self, req: BlockRequest) -> None:
        req.kv_blocks = req.hit_blocks
        s = req.slot
        self.tables.seen[s] = False
        # non-blocking copies: an arrival is admitted while the step before it runs (`plan_ahead`),
        # and a blocking one would wait for that step before the next could be launched
        ids = torch.tensor([t for t in req.seq if t != self.cfg.mask_id] + [self.cfg.mask_id])
        self.tables.seen[s, ids.to(self.device, non_blocking=True)] = True
        st = req.steering
        self.tables.steer[s] = 0 if st is None else st.direction.to(self.device, self.dtype, non_blocking=True)
        self.tables.relu[s] = (0 if st is None or st.relu_mask is None
                               else st.relu_mask.to(self.device, non_blocking=True))
        self._set_allowed(req)

    def _set_allowed(self, req: BlockRequest) -> None:
        """The slot's allowed ids for the request's next position: its grammar's, or every id."""
        if req.constraint is None:
            self.tables.allow[req.slot] = True
        else:
            self.tables.allow[req.slot] = torch.from_numpy(req.constraint.allowed()).to(self.device)

    def finish_event(self, req: BlockRequest, reason: str, error: str) -> FinishEvent:
        stops = terminal_ids(self.cfg, req.options)
        out = clean_output(req.seq[len(req.prompt):], self.cfg, stops)
        return FinishEvent(req.request_id, reason, out, len(req.prompt), len(out), req.step, error)

    # ---- one step ------------------------------------------------------------------------------
    def plan(self, table: RequestTable) -> StepPlan[BlockRow] | None:
        rows = plan_rows(host_states(table.running), self.max_prefill_rows)
        return StepPlan(rows) if rows else None

    def plan_ahead(self, table: RequestTable, inflight: StepPlan[BlockRow]) -> StepPlan[BlockRow] | None:
        if any(req.constraint is not None for req in table.running):
            return None   # a grammar's next mask needs the step's token on the host: no overlap meanwhile
        rows = plan_ahead(table, self.kv.pool, inflight.rows, self.cfg.mask_id, self.max_prefill_rows)
        return StepPlan(rows, overlapped=True) if rows else None

    def execute(self, plan: StepPlan[BlockRow]) -> LaunchedStep:
        """Build the step's inputs, run it on the device and start the copy of its results.
        A row with `ahead` belongs to a step planned before the previous step's results are applied
        (`overlapped`): the row of the block that step decodes takes the device's block-token table,
        and the request's step counter and steering strength run one step and its commits further."""
        rows = plan.rows
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
            if req.constraint is not None:
                smp.heads[i] = min(left, 1)         # its leftmost masked position only: left to right
            fwd.positions[i] = _ARANGE_BLOCK + start
            fwd.write_page[i] = req.pages[b]
            fwd.pages[i, : b + 1] = req.pages[: b + 1]
            fwd.n_visible[i] = b * BLOCK + (end - start)
            fwd.steer_slot[i] = req.slot
            if req.steering is not None and is_decode:
                st = req.steering
                fwd.alpha[i] = (alpha_ahead(req, ahead.commits) if ahead is not None else
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
                smp.tokens_per_step[i] = 1 if req.constraint is not None else o.tokens_per_step
                if o.confidence_threshold is not None:
                    smp.threshold[i] = o.confidence_threshold
        bounds = smp.heads[:n].tolist()
        n_candidates = sum(bounds)
        hb = head_bucket(n_candidates, rb)
        assert n_candidates <= hb, f"{n_candidates} candidate positions, {hb} head rows"
        packed, plan_point = self.device_step(rb, pb, hb, layout, to_device(fwd, self.device),
                                                  to_device(smp, self.device))
        self.forwards += 1
        self.head_rows += hb
        self.last_heads = (n_candidates, hb)
        self.position_rows += rb * BLOCK
        n_cols = layout.columns(self._wants_records(rows), any(row.req.logprobs is not None for row in rows if row.is_decode))
        return LaunchedStep(plan, layout, *self.pinned.start_copy(packed[:n, :n_cols]), row_bounds=bounds,
                            plan_point=plan_point)

    def update(self, table: RequestTable, step: LaunchedStep) -> None:
        self._apply(table, step.rows, step.layout.unpack(step.results()), step.row_bounds)

    def _wants_records(self, rows: list[BlockRow]) -> bool:
        """Whether a step's results bring its concept records to the host: only when a decode row's
        request asked for them (a request without attributions never reads them)."""
        return self.want_records and any(row.req.records for row in rows if row.is_decode)

    def device_step(self, rb: int, pb: int, hb: int, layout: BlockResultLayout, fwd: ForwardInputs,
                    smp: SamplerInputs) -> tuple[Tensor, torch.cuda.Event | None]:
        """The device step: the trunk, then the heads and sampler on `hb` head rows (none: the
        trunk only, and all-zero results nobody reads). Returns (packed results, plan point)."""
        graphs = self.step_graphs if (self.step_graphs is not None
                                      and capturable(rb, layout.tokens_per_step, self.capture_rows)) else None
        if graphs is not None:
            tokens, hidden = graphs.trunk(rb, pb, fwd)
        else:
            if self.step_graphs is not None:
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
        if graphs is not None:
            return graphs.heads(rb, hb, layout, hin, smp), plan_point
        return self.runner.heads_and_sample(layout, tokens, hidden, hin, smp, hb), plan_point

    def _apply(self, table: RequestTable, rows: list[BlockRow], results: BlockResults, head_bounds: list[int] | None = None) -> None:
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
                table.publish(req, req.seq, req.kv_blocks)
                continue
            if head_bounds is not None:
                # the host's tokens now are the ones the step ran on: its bound must have held
                start, end = req.block_range(b)
                masks = req.seq[start:end].count(self.cfg.mask_id)
                if masks > head_bounds[i] and req.constraint is None:
                    raise RuntimeError(f"request {req.request_id}: {masks} masked positions in a step "
                                       f"launched with a bound of {head_bounds[i]} head rows")
            keep = np.flatnonzero(valid[i])
            if keep.size == 0:  # cannot happen for a block with masks left; never burn a step
                continue
            positions = pos_sel[i, keep].tolist()
            toks = tok_sel[i, keep].tolist()
            for p, t in zip(positions, toks):
                req.seq[p] = t
            if req.constraint is not None:
                for t in toks:
                    req.constraint.advance(t)
                if self.cfg.eot_id not in toks:   # a grammar that is complete allows only <|eot_id|>
                    self._set_allowed(req)
            req.committed += len(toks)
            if req.stream_steps:
                req.events.append(StepEvent(req.request_id, req.step, positions, toks))
            if res.known_idx is not None and req.records:
                # numpy pieces in RawRecords field order; one RawRecords per block when it closes
                # (torch.from_numpy per step and field costs more than the rest of this loop)
                req.block_records.append(tuple(a[i, keep] for a in (
                    pos_sel, tok_sel, res.target, res.known_idx, res.known_logits, res.disc_idx, res.disc_logits)))
            if res.logprob is not None and req.logprobs is not None:
                k = req.logprobs
                for j, p in zip(keep.tolist(), positions):
                    req.block_logprobs[p] = TokenLogprob(float(res.logprob[i, j]), res.top_ids[i, j, :k].tolist(),
                                                         res.top_logprobs[i, j, :k].tolist())
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
        continuing = [req for req, b, eot in closed if self._close_block(table, req, b, eot)]
        for req in continuing:
            self._advance(table, req)

    def _close_block(self, table: RequestTable, req: BlockRequest, b: int, eot: bool) -> bool:
        """Report the closed block; finish the request if it ends there. True if it goes on."""
        start, end = req.block_range(b)
        first = max(start, len(req.prompt))
        records = (RawRecords(*(torch.from_numpy(np.concatenate(parts)) for parts in zip(*req.block_records)))
                   if req.block_records else None)
        req.block_records = []
        logprobs = None
        if req.logprobs is not None:   # in position order; a position filled after <|eot_id|> was never sampled
            logprobs = [req.block_logprobs.get(p) for p in range(first, end)]
            req.block_logprobs = {}
        stops = terminal_ids(self.cfg, req.options)
        reason = ("stop" if eot or any(t in stops for t in req.seq[len(req.prompt):end])
                  else "length" if end >= req.gen_end else None)
        req.events.append(BlockEvent(req.request_id, b, first, end, req.seq[first:end], records, reason is not None,
                                     next_step=req.step, logprobs=logprobs))
        if reason is not None:
            table.finish(req, reason)
            return False
        return True

    def _advance(self, table: RequestTable, req: BlockRequest) -> None:
        """The next block becomes active; its page is taken now, unless another request's advance
        in the same step preempted this one (readmission then allocates its pages)."""
        req.active += 1
        if req not in table.running:
            return
        req.closed_block = True
        if not table.ensure_pages(req, req.active + 1, may_preempt_itself=False):
            # nothing left to preempt: wait for pages (kept state; recomputed on readmission)
            table.preempt(req)


class SteerlingEngine(EngineRuntime):
    """The Steerling strategy on the runtime, with its own request table and a KV cache sized from
    the free device memory (or `n_pages`); adds the warm-up that compiles and captures."""

    def __init__(self, model: SteerlingModel, *, tokenizer_vocab_size: int | None = None, max_slots: int = 64,
                 n_pages: int | None = None, max_prefill_rows: int = 32, compile: bool = False,
                 cuda_graphs: bool = False, kv_fraction: float = 0.85, overlap: bool = True,
                 capture_rows: int = 48, never_output_ids: tuple[int, ...] = (),
                 plan_late_head_rows: int | None = PLAN_LATE_HEAD_ROWS, prefix_caching: bool = True):
        p = next(model.parameters())
        kv = KVCache.sized_from_free_memory(model.cfg, p.dtype, p.device, kv_fraction, n_pages,
                                            prefix_caching=prefix_caching, n_kv_heads=local_kv_heads(model))
        strategy = SteerlingStrategy(model, kv, max_slots=max_slots, tokenizer_vocab_size=tokenizer_vocab_size,
                                     max_prefill_rows=max_prefill_rows, compile=compile, cuda_graphs=cuda_graphs,
                                     capture_rows=capture_rows, never_output_ids=never_output_ids,
                                     plan_late_head_rows=plan_late_head_rows)
        super().__init__(strategy, RequestTable(kv.pool, max_slots, strategy), kv, overlap=overlap)

    def warmup(self, max_rows: int = 4, max_new_tokens: int = 70) -> None:
        """Compile (and, with CUDA graphs, capture) the step for the shapes traffic will use, before SERVING.

        Runs throwaway requests covering one row and several rows (PyTorch specializes size
        1), prefill + decode + commit rows, several page counts and every tokens-per-step bucket;
        their blocks decode from 64 masks down to 1, so the steps pass through the head-row
        buckets of up to max_rows blocks (HB >= 16: the confidence pass never sees a size 1).
        With CUDA graphs it then captures every key of `capture_plan` up to `capture_rows` rows.
        """
        s = self.strategy
        for n_rows in sorted({1, min(2, max_rows), max_rows}):
            for tokens_per_step in s.tokens_per_step_buckets:
                options = DecodeOptions(min(max_new_tokens, 128), SamplingParams(), tokens_per_step=tokens_per_step,
                                        confidence_threshold=None, seed=0, stop_ids=())
                self.run_throwaway([Job(f"__warmup_{n_rows}_{tokens_per_step}_{i}", [1] * (BLOCK * (i % 2) + 3),
                                        options) for i in range(n_rows)])
        if s.step_graphs is not None:
            self.capture_graphs()
        self.freeze_heap()

    def capture_graphs(self) -> int:
        """Capture every key of the strategy's `capture_plan` not captured yet; returns how many."""
        s = self.strategy
        new, s.capture_rows = s.step_graphs.capture(s.capture_plan(), s.capture_rows, s.topk_known,
                                                    s.topk_discovered)
        return new
