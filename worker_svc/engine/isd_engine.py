"""ISD as a decoding strategy on the paged runtime: continuous batching for causal Qwen3 models.

The reference decoders (``cde/isd/decoder.py``) recompute everything every forward; this
engine runs the same step machine on a paged KV cache and batches all running requests into
one forward per step. The step loop, the request table (admission, preemption, finishing),
cancel, stats and the CUDA-graph cache are the shared runtime's (``runtime.EngineRuntime``,
``request_table.RequestTable``); this module is the ISD strategy: which rows a step has, how
their inputs are built and how their results are applied.

A request's state is host-side: its tokens (``out[-1]`` is the pending token, the one
without K/V yet), the drafts to verify next (or None: the next step is cold), its logical
forward count (the reference's ``DecodeStats.forwards``, the proposal draws' step counter)
and ``kv_len``, how many tokens of ``prompt + out`` have valid K/V in its pages. Each step
gives every running request rows of one batch:

* prefill: chunks of up to ``prefill_chunk`` prompt tokens (several chunk rows of one request
  may share a step: every row writes its K/V before any row attends). The chunk holding the
  last prompt token samples t0 from its logits, as the reference's prefill does;
* decode, stride N: cold ``[t0, M x (N-1)]`` (N queries) or verify
  ``[pending, s_1..s_{N-1}, M x (N-1)]`` (2N-1 queries); N = 1 is plain AR (1 query).
  Rows are padded to a common query length Q; the window's K/V go to the request's pages at
  their absolute positions, and after the step ``kv_len`` becomes the new window start:
  rejected drafts and mask slots are never context, the next window overwrites them.

Verify, acceptance, residual, bonus and the seeded draws follow the reference exactly (same
``counter_uniform`` streams, positions and step counters), so in float64 the engine's tokens
equal ``generate_ar_batch`` / ``generate_isd_batch`` token for token, greedy or sampled,
whatever a request is batched with (tests/test_isd_engine.py).

Scheduling: requests join and leave between steps; a cancelled request's pages are freed at
the next step. When a request needs a page and none is free, the most recently admitted
running request (possibly itself) is preempted: pages and slot freed, host state and stored
draft logits kept; on readmission its ``prompt + out[:-1]`` is prefilled again (no sampling,
no logical forward) and decoding resumes where it stopped, with identical output. A request
that could not fit even in an empty pool finishes with an "error" event instead.

Events (per request, in ``req.events``):

* ``IsdCommitEvent`` after every step that produced tokens: the accepted tokens (cut at a stop),
  where they start in the completion, the request's logical forward count, the drafts
  verified/accepted this step, and ``resumable``: True when the next step is cold, i.e.
  ``submit(..., committed=<all tokens so far>, next_step=step)`` elsewhere continues exactly
  as this engine would (from a non-resumable point the continuation is still greedy-exact and
  distribution-exact, but not draw-for-draw identical).
* ``IsdFinishEvent`` (a ``FinishEvent``) at the end, with usage: the ``DecodeStats`` the
  reference would report (forwards, tokens per forward, drafts proposed/accepted...), plus
  the physical forwards the request took part in (prefill chunks and recomputation counted)
  and its preemptions. For a resumed request ``forwards`` continues from ``next_step`` and
  ``generated`` counts the committed tokens too; the draft counters cover this engine only.

The device step (``isd_runner.py``) has fixed shapes per (rows, pages, Q, K) bucket and two
host-known flags: some sampled row uses top-k / top-p, and some row samples at all (a
greedy-only step is argmaxes only: no draws, no q writes, no verify kernel);
``cuda_graphs=True`` replays it through ``graphs.GraphCache``, one graph per bucket and flags.

Overlapped steps (``overlap=True``, the default): in steady decoding (nobody waiting, every
running request on its decode window, none cancelled or sure to end this step, pages for the
next window free whatever this step accepts) the next step is launched before this one's
results reach the host. Its rows are the same requests; their windows (kind, start, pending
token, drafts, forward count) are derived on the device from the carry buffer every step
writes (``isd_runner.advance``), exactly as ``_apply`` + ``_host_inputs`` would build them,
with the query length padded to 2N-1 since the kind is not known yet. Results come back
through pinned buffers and an event; the host applies step t while the GPU runs t+1, and
resolves t+1's rows afterwards. A request that ended in step t (a stop token) has its row in
t+1 computed and dropped. Everything else (prefill, admission, preemption, cancels) takes the
synchronous path.

Stops: the model's EOS ids plus the request's ``stop_ids``; the stop token is kept (as the
reference keeps EOS) and tokens after it in the same step are dropped.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from cde.blocks import PAGE, pages_for
from cde.isd.decoder import DecodeStats, cut_at_stop
from cde.options import IsdOptions
from cde.qwen3.model import Qwen3Model
from cde.tp import local_kv_heads
from worker_svc.engine.events import FinishEvent, IsdCommitEvent, IsdFinishEvent
from worker_svc.engine.isd_runner import PROPOSAL_CODES, IsdInputs, IsdRunner, VerifyFn
from worker_svc.engine.kv_cache import KVCache
from worker_svc.engine.job import Job
from worker_svc.engine.layouts import IsdResultLayout
from worker_svc.engine.request_table import PrefixQuery, RequestTable, TrackedRequest
from worker_svc.engine.runtime import (ROW_BUCKETS, DecodeStrategy, EngineRuntime, LaunchedStep, StepPlan, bucket,
                                       to_device)

__all__ = ["IsdCommitEvent", "IsdEngine", "IsdFinishEvent", "IsdRequest", "IsdStrategy", "RowKind"]

Q_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
PAGE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class RowKind(StrEnum):
    PREFILL = "prefill"         # prompt chunk (or recomputation after preemption): K/V only
    FIRST = "first"             # the chunk with the last prompt token: samples t0
    COLD = "cold"               # decode window [pending, M x (N-1)]
    VERIFY = "verify"           # decode window [pending, drafts, M x (N-1)]
    OVERLAPPED = "overlapped"   # a decode row of an overlapped step, its window derived on the device


PREFILL, FIRST, COLD, VERIFY, OVERLAPPED = RowKind


# ---- host-side request state ----------------------------------------------------------------

@dataclass(eq=False, kw_only=True)
class IsdRequest(TrackedRequest):
    options: IsdOptions
    stops: frozenset[int] = frozenset()               # the model's EOS ids and the request's stop_ids
    out: list[int] = field(default_factory=list)      # generated tokens; out[-1] is pending (no K/V yet)
    specs: list[int] | None = None                    # drafts for the next (verify) step; None: cold
    stats: DecodeStats = field(default_factory=DecodeStats)
    kv_len: int = 0
    saved_q: Tensor | None = None                     # the drafts' q logits while preempted
    constraint: object | None = None                  # structured output (cde.grammar.Constraint)
    device_forwards: int = 0

    @property
    def stride(self) -> int:
        return self.options.stride

    def forget_kv(self) -> None:
        self.kv_len = 0

    @property
    def kv_target(self) -> int:
        """Tokens that must have K/V before the next decode window: all but the pending one."""
        return len(self.prompt) + len(self.out) - 1 if self.out else len(self.prompt)

    def window(self) -> tuple[RowKind, int]:
        """The next decode row: (kind, query length)."""
        n = self.stride
        return (VERIFY, 2 * n - 1) if self.specs is not None else (COLD, n)

    def max_extent(self) -> int:
        """Largest position + 1 any row of this request can reach before it finishes."""
        p = len(self.prompt)
        return max(p, p + self.options.max_new_tokens + 2 * self.stride - 3)


@dataclass(eq=False)
class _Row:
    req: IsdRequest
    kind: RowKind
    start: int    # absolute position of the row's first query token
    length: int   # real query tokens


class _RowGeometry(NamedTuple):
    """A row's per-row scalars of the window (IsdInputs fields, but n_clean / ungated / start /
    length, from which the per-query arrays are built)."""

    start: int
    length: int
    n_clean: int        # leading queries at clean positions (LoRA gate = ungated); the rest are [MASK]s
    ungated: bool       # not lora_gated
    read_start: int
    clean_j: int
    mask_j0: int
    verify_row: bool
    n_drafts: int
    from_carry: bool


class _RowSampling(NamedTuple):
    greedy: bool
    temperature: float
    top_k: int
    top_p: float
    seed: int
    fwd_index: int
    proposal: int
    slot: int
    allow_slot: int


_GEOMETRY_DTYPES = dict(start=np.int64, length=np.int64, n_clean=np.int64, ungated=bool, read_start=np.int64,
                        clean_j=np.int64, mask_j0=np.int64, verify_row=bool, n_drafts=np.int64, from_carry=bool)
_PAD_GEOMETRY = _RowGeometry(start=0, length=0, n_clean=0, ungated=False, read_start=0, clean_j=0, mask_j0=1,
                             verify_row=False, n_drafts=0, from_carry=False)
_SAMPLING_DTYPES = dict(greedy=bool, temperature=np.float64, top_k=np.int64, top_p=np.float64, seed=np.int64,
                        fwd_index=np.int64, proposal=np.int64, slot=np.int64, allow_slot=np.int64)
_NO_SAMPLING = _RowSampling(greedy=True, temperature=1.0, top_k=0, top_p=1.0, seed=0, fwd_index=0, proposal=0,
                            slot=0, allow_slot=0)


def _columns(rows: list[NamedTuple], pad: NamedTuple, n_rows: int, dtypes: dict) -> dict[str, np.ndarray]:
    """Per-row named tuples (padded with `pad` to n_rows) -> one array per field, by name."""
    rows = rows + [pad] * (n_rows - len(rows))
    return {name: np.array(col, dtype=dtypes[name]) for name, col in zip(pad._fields, zip(*rows))}


def isd_kv_cache(cfg, dtype: torch.dtype, device: torch.device, n_pages: int | None, fraction: float,
                 max_slots: int, max_stride: int, prefix_caching: bool = False, n_kv_heads: int | None = None) -> KVCache:
    """The ISD engine's KV cache: `n_pages` (CPU: 256 by default), on a GPU at most what fits in
    `fraction` of the free memory beside the q-table of the drafts' proposal distributions."""
    n_kv = n_kv_heads or cfg.n_kv_heads   # a tensor-parallel rank holds its share (cde/tp.py)
    per_page = KVCache.bytes_per_page(cfg.n_layers, n_kv, PAGE, cfg.head_dim, dtype)
    if device.type == "cuda":
        q_table = (max_slots + 1) * max(max_stride - 1, 0) * cfg.vocab_size * 4
        free, _ = torch.cuda.mem_get_info(device)
        n = int((free * fraction - q_table) // per_page)
        n = min(n, n_pages) if n_pages is not None else n
    else:
        n = n_pages or 256
    return KVCache(cfg.n_layers, max(n, 2), n_kv, PAGE, cfg.head_dim, dtype, device, prefix_caching)


class IsdStrategy(DecodeStrategy):
    def __init__(self, model: Qwen3Model, kv: KVCache, *, max_slots: int, max_stride: int, prefill_chunk: int,
                 max_prefill_rows: int, prefill_rows_alone: int, verify_fn: VerifyFn | None, cuda_graphs: bool,
                 compile: bool, tokenizer_vocab_size: int | None, never_output_ids: tuple[int, ...]):
        if model.cfg.mask_token_id is None and max_stride > 1:
            raise ValueError("ISD (stride > 1) needs a model config with mask_token_id")
        if prefill_chunk not in Q_BUCKETS:
            raise ValueError(f"prefill_chunk must be one of {Q_BUCKETS}")
        self.model = model.eval()
        model.fuse_projections()   # 4 GEMMs per layer instead of 7 (cde/qwen3/model.py)
        self.cfg = model.cfg
        p = next(model.parameters())
        super().__init__(p.device)
        self.dtype = p.dtype
        self.kv = kv
        self.max_stride = max_stride
        self.runner = IsdRunner(model, self.kv, max_slots + 1, max(max_stride - 1, 0), verify_fn,
                                max_rows=bucket(max(max_slots + max(max_prefill_rows, 1), prefill_rows_alone),
                                                ROW_BUCKETS),
                                tokenizer_vocab_size=tokenizer_vocab_size, never_output=never_output_ids)
        self.prefill_chunk = prefill_chunk
        # Prompt chunks a step takes while other requests decode in it: 32 chunks of 64 = 2,048 prompt
        # tokens, as the Steerling engine's 32 commit rows, which bounds how long the running
        # requests' steps get (8B dims, H200: 8 x 4K prompts joining 8 running requests made their
        # steps 70 ms; 142 ms at 64 chunks, for the same total). At 8 (512 tokens a step) a 4K prompt
        # took 8 steps, each reading every weight again: first token 1.45x the dense prefill floor.
        self.max_prefill_rows = max_prefill_rows
        # ... and in a step nobody decodes in (nobody to stall): a 4K prompt in one step, first
        # token 1.27x that floor instead of 1.31x in two (bench/results, fd4929b).
        self.prefill_rows_alone = max(prefill_rows_alone, max_prefill_rows)
        self._eos = frozenset(self.cfg.eos_token_ids)
        self._admissions = itertools.count()
        # Overlapped steps derive their windows on the device (isd_runner.advance).
        self.device_step = self.runner.step
        if compile:
            self._compile()
        if cuda_graphs:   # replay the device step per input-shape bucket
            self.enable_graphs()
            self.device_step = self._graph_step

    def _compile(self) -> None:
        """Regional compilation of the layers' pointwise parts (cde/qwen3/kernels.py) and of the
        sampler's counter hash (isd_runner.SAMPLER_FUNCTIONS): one dynamic-shape graph per
        function for all layers and buckets; GEMMs, attention, the proposals and verify stay
        eager kernels (replayed from CUDA graphs on a GPU)."""
        from cde import regional
        from cde.qwen3 import kernels
        from worker_svc.engine.isd_runner import SAMPLER_FUNCTIONS

        self.model.use_kernels(kernels.compiled(self.counting_backend))
        self.runner.kernels = regional.compiled(SAMPLER_FUNCTIONS, self.counting_backend)

    def _graph_step(self, inp: IsdInputs, window: int, filtered: bool = True, sampling: bool = True,
                    overlapped: bool = False, constrained: bool = False) -> Tensor:
        """runner.step through the CUDA graph of its bucket: the shapes of the inputs (rows, query
        length, pages, drafts), the window the LM head reads and the host-known flags."""
        runner = self.runner
        key = (window, filtered, sampling, overlapped, constrained) + tuple(tuple(getattr(inp, f.name).shape)
                                                               for f in fields(IsdInputs))

        def keep_state(static: tuple[IsdInputs]):
            # each warm-up run overwrites the q-table rows of its slots that the next run's
            # verify reads, and the carry the next run's windows derive from: keep both
            slots = static[0].slot
            saved_q, saved_carry = runner.q_table.index_select(0, slots), runner.carry.clone()

            def restore() -> None:
                runner.q_table.index_copy_(0, slots, saved_q)
                runner.carry.copy_(saved_carry)
            return restore

        return self.graphs.run(key, (inp,), lambda i: runner.step(i, window, filtered, sampling, overlapped, constrained),
                                lambda: (IsdInputs(**{f.name: getattr(inp, f.name).clone() for f in fields(IsdInputs)}),),
                                keep_state)

    # ---- requests and the table's hooks --------------------------------------------------------
    def new_request(self, job: Job) -> IsdRequest:
        """`job.committed` (tokens already generated elsewhere) and `job.next_step` (the logical
        forward count of the IsdCommitEvent they end at) resume a request; exact when that event
        was ``resumable``. `stream_steps` and `records` change nothing here: every IsdCommitEvent
        carries tokens, and a causal model has no concept records."""
        prompt, options, steering = job.prompt, job.options, job.steering
        if not isinstance(options, IsdOptions):
            raise ValueError("the ISD engine takes IsdOptions")
        if steering is not None:
            raise ValueError("steering is not supported by the ISD engine")
        if not prompt:
            raise ValueError("prompt must contain at least one token")
        v = self.cfg.vocab_size
        if any(not 0 <= t < v for t in prompt):
            raise ValueError(f"prompt token ids must lie in [0, {v})")
        if options.stride > self.max_stride:
            raise ValueError(f"stride {options.stride} exceeds this engine's max_stride {self.max_stride}")
        if len(prompt) + options.max_new_tokens > self.cfg.max_positions:
            raise ValueError(f"prompt + max_new_tokens = {len(prompt) + options.max_new_tokens} exceeds the "
                             f"context of {self.cfg.max_positions}")
        committed = list(job.committed)
        if any(not 0 <= t < v for t in committed):
            raise ValueError(f"committed token ids must lie in [0, {v})")
        stops = self._eos | frozenset(options.stop_ids)
        if committed and cut_at_stop(committed, stops, options.max_new_tokens)[1] is not None:
            raise ValueError("committed tokens already end the request")
        req = IsdRequest(request_id=job.request_id, prompt=list(prompt), options=options, stops=stops, out=committed,
                         constraint=job.constraint)
        if committed:
            req.stats.forwards = job.next_step
        return req

    def admission_refusal(self, req: IsdRequest, idle: bool) -> str | None:
        worst = pages_for(req.max_extent())
        if worst > self.kv.pool.usable:
            return f"request needs up to {worst} KV pages; the pool has {self.kv.pool.usable}"
        return None

    # admission checks the first window's pages are free; `plan` allocates them with the window
    admission_takes_pages = False

    def pages_to_admit(self, req: IsdRequest) -> int:
        return min(pages_for(req.kv_target + 2 * req.stride - 1), pages_for(req.max_extent()))

    def admission_stamp(self) -> int:
        return next(self._admissions)

    def prefix_query(self, req: IsdRequest) -> PrefixQuery:
        # the last prompt token is always forwarded: its logits sample the first token; an
        # ungated LoRA changes the K/V of clean tokens, so those requests share a trie of their own
        tokens = req.prompt + req.out
        return PrefixQuery(tokens, len(tokens), req.kv_target if req.out else len(req.prompt) - 1,
                           namespace=not req.options.lora_gated)

    def on_admit(self, req: IsdRequest) -> None:
        req.kv_len = req.hit_blocks * PAGE
        if req.saved_q is not None:
            self.runner.q_table[req.slot, : req.stride - 1] = req.saved_q
            req.saved_q = None

    def on_preempt(self, req: IsdRequest) -> None:
        if req.specs is not None and req.stride > 1:
            req.saved_q = self.runner.q_table[req.slot, : req.stride - 1].clone()

    def finish_event(self, req: IsdRequest, reason: str, error: str) -> FinishEvent:
        cut, _ = cut_at_stop(req.out, req.stops, req.options.max_new_tokens)
        req.stats.generated = len(cut)
        return IsdFinishEvent(req.request_id, reason, list(cut), len(req.prompt), len(cut), req.stats.forwards,
                              error, stats=req.stats, device_forwards=req.device_forwards,
                              preemptions=req.preemptions)

    # ---- one step ------------------------------------------------------------------------------
    def plan(self, table: RequestTable) -> StepPlan[_Row] | None:
        rows: list[_Row] = []
        running = list(table.running)
        decoding = any(r.running and r.out and r.kv_len == r.kv_target for r in running)
        budget = self.max_prefill_rows if decoding else self.prefill_rows_alone
        for req in running:
            if not req.running:  # preempted for an earlier request's pages
                continue
            own: list[_Row] = []
            kv, target = req.kv_len, req.kv_target
            while kv < target and (budget > 0 or not rows and not own):
                end = min(target, kv + self.prefill_chunk)
                own.append(_Row(req, FIRST if end == target and not req.out else PREFILL, kv, end - kv))
                kv = end
                budget -= 1
            if kv == target and req.out:
                kind, length = req.window()
                own.append(_Row(req, kind, target, length))
            if not own:
                continue
            # pages 0..n-1, preempting the most recently admitted request (maybe req itself) while none is free
            if not table.ensure_pages(req, pages_for(max(r.start + r.length for r in own)), may_preempt_itself=True):
                continue
            rows += own
        rows = [r for r in rows if r.req.running]
        return StepPlan(rows) if rows else None

    def plan_ahead(self, table: RequestTable, inflight: StepPlan[_Row | None]) -> StepPlan[_Row] | None:
        """The next step's rows if it can be launched before inflight's results are applied, else
        None. Only when it is sure to be the same requests' decode windows: nobody waiting (no
        admission), every running request has exactly its decode row here (none is cancelled:
        the runtime plans nothing ahead then), none sure to end with this step (max_new_tokens), and pages for the next window
        whatever this step accepts (up to N tokens further, 2N - 1 long) are free without
        preempting. A stop token can still end a request: its row in the next step is computed
        and dropped. Allocates those pages."""
        rows = inflight.rows
        if table.waiting or len(rows) != len(table.running):
            return None
        if any(req.constraint is not None for req in table.running):
            return None   # a grammar's masks for the next window need this step's tokens on the host
        wanted = []   # pages each request needs for its worst-case next window
        for row in rows:
            if row is None or row.kind not in (COLD, VERIFY):
                return None
            req = row.req
            if req.finished or len(req.out) + 1 >= req.options.max_new_tokens:
                return None
            wanted.append(pages_for(min(row.start + 3 * req.stride - 1, req.max_extent())))
        if sum(max(n - len(row.req.pages), 0) for row, n in zip(rows, wanted)) > self.kv.pool.free:
            return None
        for row, n in zip(rows, wanted):   # enough pages are free: never preempts
            table.ensure_pages(row.req, n, may_preempt_itself=True)
        return StepPlan([_Row(row.req, OVERLAPPED, row.start, 2 * row.req.stride - 1) for row in rows],
                        overlapped=True)

    def resolve_ahead(self, plan: StepPlan[_Row]) -> StepPlan[_Row | None]:
        """The step before `plan` is applied: its OVERLAPPED rows become the windows the device
        derived, None for requests that ended meanwhile (their results are dropped)."""
        return StepPlan([self._resolve(row) for row in plan.rows], overlapped=True)

    def _resolve(self, row: _Row) -> _Row | None:
        """An OVERLAPPED row, once the step before it is applied: the window the device derived
        (the request's next window), or None if the request ended meanwhile (results dropped)."""
        req = row.req
        if not req.running:   # finished, or preempted
            self.dropped_rows += 1
            return None
        kind, length = req.window()
        assert req.kv_len == req.kv_target, "an overlapped row must continue a decode window"
        return _Row(req, kind, req.kv_target, length)

    def host_inputs(self, rows: list[_Row]) -> tuple[IsdInputs, int]:
        """The step's inputs as numpy arrays (IsdInputs fields) and its K (the most drafts a row
        proposes). One Python pass collects
        each row's padded token / page / draft lists and its scalars; the arrays are then built
        by a fixed number of whole-array numpy operations instead of ~20 numpy stores and small
        ops per row (at 32-64 rows those were most of the host's time per step)."""
        mask_id = self.runner.mask_id
        n = len(rows)
        rb = bucket(n, ROW_BUCKETS)
        n_drafts = max((r.req.stride - 1 for r in rows if r.kind in (COLD, VERIFY, OVERLAPPED)), default=0)
        q_len = bucket(max(r.length for r in rows), Q_BUCKETS)
        pb = bucket(max(len(r.req.pages) for r in rows), PAGE_BUCKETS)
        pad_q, pad_p, pad_k = [0] * q_len, [0] * pb, [0] * n_drafts
        tokens, pages, drafts = [], [], []     # padded rows, one np.array each at the end
        geometry, sampling = [], []
        for row in rows:
            req, o = row.req, row.req.options
            nk = req.stride - 1
            # n_clean: leading queries at clean positions (LoRA gate = not lora_gated); the
            # rest of the row's queries are [MASK]s (gate on)
            if row.kind in (PREFILL, FIRST):
                p = len(req.prompt)
                lo, hi = row.start, row.start + row.length
                seq = req.prompt[lo:hi] + req.out[max(lo - p, 0):max(hi - p, 0)]
                n_clean, read, clean_j, mask_j0, specs = row.length, row.length - 1, 0, 1, ()
            elif row.kind in (COLD, OVERLAPPED):   # OVERLAPPED: placeholders, derived on the device
                seq = [req.out[-1]] + [mask_id] * nk
                n_clean, read, clean_j, mask_j0, specs = 1, 0, 0, 1, ()
            else:
                assert req.specs is not None
                seq = [req.out[-1]] + req.specs + [mask_id] * nk
                n_clean, read, clean_j, mask_j0, specs = req.stride, 0, nk, req.stride, req.specs
            tokens.append(seq + pad_q[len(seq):])
            pages.append(req.pages + pad_p[len(req.pages):])
            drafts.append([*specs] + pad_k[len(specs):])
            geometry.append(_RowGeometry(start=row.start, length=row.length, n_clean=n_clean,
                                         ungated=not o.lora_gated, read_start=read, clean_j=clean_j, mask_j0=mask_j0,
                                         verify_row=row.kind == VERIFY, n_drafts=nk,
                                         from_carry=row.kind == OVERLAPPED))
            sampling.append(_NO_SAMPLING if row.kind == PREFILL else _RowSampling(
                greedy=o.greedy, temperature=1.0 if o.greedy else o.temperature, top_k=o.top_k, top_p=o.top_p,
                seed=o.seed, fwd_index=req.stats.forwards, proposal=PROPOSAL_CODES[o.proposal],
                slot=req.slot if row.kind != FIRST else 0, allow_slot=req.slot if req.constraint is not None else 0))
        pad = rb - n
        tokens = np.array(tokens + [pad_q] * pad, dtype=np.int64)
        pages = np.array(pages + [pad_p] * pad, dtype=np.int64)
        drafts = np.array(drafts + [pad_k] * pad, dtype=np.int64).reshape(rb, n_drafts)
        g = _columns(geometry, _PAD_GEOMETRY, rb, _GEOMETRY_DTYPES)
        start = g.pop("start")
        q = np.arange(q_len, dtype=np.int64)
        positions = start[:, None] + q                                   # padding rows: 0 .. Q-1
        real = q < g.pop("length")[:, None]                              # (R, Q) real query tokens
        gate = np.where(q < g.pop("n_clean")[:, None], g.pop("ungated")[:, None], real)
        page_of = pages[np.arange(rb)[:, None], np.minimum(positions // PAGE, pb - 1)]
        write_idx = np.where(real, page_of * PAGE + positions % PAGE, q % PAGE)   # padding: scratch page 0
        inp = IsdInputs(tokens=tokens, positions=positions, gate=gate, write_idx=write_idx, pages=pages,
                        win_pos=start + g["read_start"], drafts=drafts, **g,
                        **_columns(sampling, _NO_SAMPLING, rb, _SAMPLING_DTYPES))
        return inp, n_drafts

    def execute(self, plan: StepPlan[_Row]) -> LaunchedStep:
        """Build the step's inputs, run it on the device and start the copy of its results."""
        rows = plan.rows
        host, n_drafts = self.host_inputs(rows)
        inp = to_device(host, self.device)
        # host-known flags (graph bucket): work only sampled rows need; greedy rows never filter
        sampled = [r.req.options for r in rows if r.kind != PREFILL and not r.req.options.greedy]
        filtered = any(o.top_k > 0 or o.top_p < 1 for o in sampled)
        constrained = self._write_masks(rows, n_drafts)
        packed = self.device_step(inp, 2 * n_drafts + 1, filtered, bool(sampled), plan.overlapped, constrained)
        self.forwards += 1
        return LaunchedStep(plan, IsdResultLayout(n_drafts), *self.pinned.start_copy(packed[:len(rows)]))

    def _write_masks(self, rows: list[_Row], n_drafts: int) -> bool:
        """Structured output: each grammar row's allowed ids at window indices 0..n_drafts into its
        slot of the runner's table (a first or cold row: its clean token's; a verify row: after the
        tokens out and each prefix of its drafts, then the bonus's). Whether the step has any."""
        any_row = False
        for row in rows:
            c = row.req.constraint
            if c is None or row.kind == PREFILL:
                continue
            any_row = True
            masks = np.ones((n_drafts + 1, self.cfg.vocab_size), dtype=bool)
            if row.kind == VERIFY:
                along = c.allowed_along(row.req.specs)
                masks[: len(along)] = along
            else:
                masks[0] = c.allowed()
            self.runner.allow_table[row.req.slot, : n_drafts + 1] = torch.from_numpy(masks).to(self.device)
        return any_row

    def update(self, table: RequestTable, step: LaunchedStep) -> None:
        self.apply(table, step.rows, step.results(), step.layout)

    def apply(self, table: RequestTable, rows: list[_Row | None], packed: Tensor, layout: IsdResultLayout) -> None:
        res = packed.tolist()
        at_clean, at_accepted, at_correction = layout.CLEAN, layout.n_accepted, layout.correction
        touched: set[IsdRequest] = set()   # identity hash (eq=False)
        for row, r in zip(rows, res):
            if row is None:   # an overlapped row whose request ended before the step was applied
                continue
            req = row.req
            if req not in touched:
                touched.add(req)
                req.device_forwards += 1
            if row.kind == PREFILL:
                req.kv_len = row.start + row.length
                self._publish(table, req)
                continue
            before = len(req.out)
            st = req.stats
            nk = req.stride - 1
            clean, n_acc, corr = r[at_clean], r[at_accepted], r[at_correction]
            new_specs = r[layout.drafts][:nk]
            proposed = accepted = 0
            rejected = None
            if row.kind == FIRST:
                req.kv_len = row.start + row.length
                st.forwards = 1
                req.out.append(clean)
            elif row.kind == COLD:
                st.forwards += 1
                if nk:
                    st.cold_steps += 1
                req.kv_len = row.start + 1
                req.out.append(clean)
                req.specs = new_specs if nk else None
            else:
                st.forwards += 1
                st.verify_steps += 1
                drafted = req.specs
                assert drafted is not None
                a = min(n_acc, nk)
                proposed, accepted = nk, a
                st.proposed += nk
                st.accepted += a
                if a == nk:
                    st.full_accepts += 1
                    req.out.extend(drafted + [clean])
                    req.specs = new_specs
                else:
                    req.out.extend(drafted[:a] + [corr])
                    req.specs = None
                    rejected = drafted[a]
                req.kv_len = row.start + 1 + a
            # out[:before] holds no stop and fewer than max_new tokens (else the request had
            # finished), so the rule only needs the new tokens (all of out made it quadratic)
            new, reason = cut_at_stop(req.out[before:], req.stops, req.options.max_new_tokens - before)
            if req.constraint is not None:
                for t in new:
                    req.constraint.advance(t)
            self._publish(table, req)
            if new:
                req.events.append(IsdCommitEvent(req.request_id, st.forwards, before, new, proposed, accepted,
                                                 req.specs is None, rejected))
            if reason is not None:
                table.finish(req, reason)


    @staticmethod
    def _publish(table: RequestTable, req: IsdRequest) -> None:
        """Offer the request's full pages below kv_len (final K/V of prompt + accepted tokens) to the prefix cache."""
        n = req.kv_len // PAGE
        if n > req.published and table.pool.cache is not None:
            table.publish(req, req.prompt + req.out, n)


class IsdEngine(EngineRuntime):
    """The ISD strategy on the runtime, with its own request table and KV cache; adds warm-up."""

    def __init__(self, model: Qwen3Model, *, max_slots: int = 64, n_pages: int | None = None, max_stride: int = 8,
                 prefill_chunk: int = 64, max_prefill_rows: int = 32, prefill_rows_alone: int = 64,
                 kv_fraction: float = 0.85,
                 verify_fn: VerifyFn | None = None, cuda_graphs: bool = False, compile: bool = False,
                 overlap: bool = True, tokenizer_vocab_size: int | None = None,
                 never_output_ids: tuple[int, ...] = (), prefix_caching: bool = True):
        p = next(model.parameters())
        kv = isd_kv_cache(model.cfg, p.dtype, p.device, n_pages, kv_fraction, max_slots, max_stride, prefix_caching,
                          local_kv_heads(model))
        strategy = IsdStrategy(model, kv, max_slots=max_slots, max_stride=max_stride, prefill_chunk=prefill_chunk,
                               max_prefill_rows=max_prefill_rows, prefill_rows_alone=prefill_rows_alone,
                               verify_fn=verify_fn, cuda_graphs=cuda_graphs, compile=compile,
                               tokenizer_vocab_size=tokenizer_vocab_size, never_output_ids=never_output_ids)
        super().__init__(strategy, RequestTable(kv.pool, max_slots, strategy), kv, overlap=overlap)

    def warmup(self, max_rows: int = 4, max_new_tokens: int = 8, strides: tuple[int, ...] | None = None) -> None:
        """Run throwaway requests through the shapes traffic will use (one and several rows,
        prefill chunks, AR and ISD windows, greedy and sampled), before the worker serves."""
        strides = strides or tuple(sorted({1, min(4, self.strategy.max_stride)}))
        v = self.strategy.cfg.vocab_size
        # each stride alone (AR-only steps have one query: compiled code specializes sizes 1)
        # and all mixed, at one row and several
        for n_rows in sorted({1, min(2, max_rows), max_rows}):
            for group in [(n,) for n in strides] + [strides]:
                self.run_throwaway([
                    Job(f"__warmup_{n_rows}_{n}_{i}_{len(group)}", [i % v] * (PAGE * (i % 2) + 3),
                        IsdOptions(max_new_tokens=max_new_tokens, stride=n, temperature=0.0 if i % 2 else 0.7,
                                   top_k=0 if i % 2 else 8, top_p=1.0, seed=i, proposal="sample", lora_gated=True,
                                   stop_ids=()))
                    for i in range(n_rows) for n in group])
        self.freeze_heap()
