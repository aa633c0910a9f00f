"""The engine: continuous batching at step granularity over the paged runtime.

Each call to `step()` builds one batch of 64-token rows from the running requests:
- a request whose prompt (or, after preemption, whose committed blocks) is not yet in the
  cache contributes commit rows for those blocks (chunked by `max_prefill_rows`) and, once
  they are all in, its decode row in the same step;
- a request whose active block just finished contributes one commit row (its final K/V),
  unless that block ends the request (nobody will attend to it);
- every other request contributes its active block as a decode row.
Requests join and leave between any two steps. When a request needs a page and none is
free, the most recently admitted request is preempted: its pages are freed and it is
recomputed later from its committed tokens. Because randomness depends only on (seed,
position, step), preemption and batching never change a seeded request's output.

The host keeps each request's tokens; the device keeps KV pages, steering vectors, relu
masks and seen-token bitmaps per slot. One device-to-host copy per step brings back the
chosen positions, tokens and raw concept records.
"""

from __future__ import annotations

import gc
import itertools
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from cde.steerling.attribution import RawRecords
from cde.steerling.model import SteerlingModel
from cde.steerling.reference_decoder import DecodeOptions, clean_output, terminal_ids
from cde.steerling.sampling import banned_ids
from cde.steerling.steering import PreparedSteering, resolve_alpha
from worker_svc.engine.kv_cache import KVCache
from worker_svc.engine.runner import BLOCK, DeviceTables, ForwardInputs, SamplerInputs, StepRunner, unpack

_ARANGE_BLOCK = np.arange(BLOCK, dtype=np.int64)

ROW_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128)
PAGE_BUCKETS = (2, 4, 8, 16, 32, 64)
K_BUCKETS = (1, 4, 16, 64)


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if n <= b:
            return b
    return n


# ---- events ---------------------------------------------------------------------------------

@dataclass
class StepEvent:
    request_id: str
    step: int
    positions: list[int]
    tokens: list[int]


@dataclass
class BlockEvent:
    request_id: str
    block: int
    start: int
    end: int
    tokens: list[int]          # sequence[start:end] when the block closed
    records: RawRecords
    last: bool = False         # the request finishes with this block


@dataclass
class FinishEvent:
    request_id: str
    reason: str                # stop | length | cancelled | error
    output_tokens: list[int]
    prompt_tokens: int
    completion_tokens: int
    steps: int
    error: str = ""


Event = StepEvent | BlockEvent | FinishEvent


# ---- host-side request state ------------------------------------------------------------------

@dataclass(eq=False)   # identity: `in` on the running list must not compare fields
class Request:
    request_id: str
    prompt: list[int]
    options: DecodeOptions
    steering: PreparedSteering | None
    seq: list[int]
    gen_end: int
    arrival: int
    events: deque = field(default_factory=deque)
    slot: int = 0
    pages: list[int] = field(default_factory=list)
    kv_blocks: int = 0               # blocks 0..kv_blocks-1 have final K/V in the cache
    active: int = 0                  # index of the block being decoded
    step: int = 0
    committed: int = 0
    block_records: list = field(default_factory=list)
    pending_commit: bool = False     # active block finished; write its final K/V next step
    done: bool = False
    cancelled: bool = False
    admitted_at: int = -1

    @property
    def first_block(self) -> int:
        return len(self.prompt) // BLOCK

    def block_range(self, b: int) -> tuple[int, int]:
        return b * BLOCK, min((b + 1) * BLOCK, self.gen_end)


@dataclass
class LaunchedStep:
    """A step on its way (both engines): its rows, its K (the largest tokens or drafts per row,
    which the packed layout depends on) and its packed results, whose device-to-host copy is
    pending until `done`."""

    rows: list
    kmax: int
    host: Tensor
    done: object | None   # torch.cuda.Event, None on the CPU

    def results(self) -> Tensor:
        """The packed results on the host, once their copy has landed."""
        if self.done is not None:
            self.done.synchronize()
        return self.host


class PinnedPairs:
    """Two pinned host buffers per (shape, dtype), handed out in turn: a launched step's results
    land in one while the step before it may still be read from the other. (An earlier version
    handed out the first buffer twice in a row: an overlapped step's copy could then overwrite
    the results of the step launched just before it, with the same shape, before they were read.)"""

    def __init__(self, pin: bool = True):
        self.pin = pin   # False: plain host memory (tests without a GPU)
        self._bufs: dict[tuple, list[Tensor]] = {}

    def next(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        bufs = self._bufs.setdefault((tuple(shape), dtype), [])
        if len(bufs) < 2:
            bufs.append(torch.empty(shape, dtype=dtype, pin_memory=self.pin))
        else:
            bufs.append(bufs.pop(0))
        return bufs[-1]

    def start_copy(self, out: Tensor) -> tuple[Tensor, object | None]:
        """A launched step's one device-to-host copy of its results, started now (before a later
        step can reuse a CUDA graph's output buffer) into the next pinned buffer: (host tensor,
        event to wait on). On the CPU the results are already there: (out, None)."""
        if out.device.type != "cuda":
            return out, None
        host = self.next(out.shape, out.dtype)
        host.copy_(out, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return host, done


@dataclass
class EngineStats:
    pages_total: int
    pages_used: int
    pages_free: int
    running: int
    waiting: int
    steps: int
    forwards: int
    compiles: int
    preemptions: int
    graphs: int = 0


class StepLoop:
    """What both engines (this one and isd_engine.IsdEngine) share around their own `submit`:
    the step loop with overlapped steps, cancel, stats, draining a request's events, running
    until idle, warm-up and counting compilations. A subclass sets `_lock`, `requests`,
    `waiting`, `running`, `kv`, `steps`, `forwards`, `compiles`, `preemptions`, `_graphs`,
    `overlap`, `overlapped_steps` and `_inflight`, and implements the step's parts:
    `_finish_cancelled`, `_admit`, `_plan` (the rows of a step), `_rows_ahead` (the next step's
    rows if it can be launched before this one's results are applied, else None), `_launch`
    (-> LaunchedStep), `_apply_step` and `_resolve_ahead`."""

    @torch.no_grad()
    def step(self) -> None:
        """Apply one step's results, launching it first unless it is already running. With
        overlap, in steady decoding the next step is launched before this one's results are
        read, so the host's bookkeeping and the device-to-host copy hide behind the GPU."""
        if self._inflight is None:
            with self._lock:
                self._finish_cancelled()
                self._admit()
                rows = self._plan()
            if not rows:
                return
            self._inflight = self._launch(rows)
        current, nxt = self._inflight, None
        if self.overlap:
            with self._lock:   # submit/cancel (other threads) touch waiting/cancelled; launch unlocked
                ahead = self._rows_ahead(current.rows)
            if ahead is not None:
                nxt = self._launch(ahead, overlapped=True)
                self.overlapped_steps += 1
        with self._lock:
            self._apply_step(current)
            self.steps += 1
            if nxt is not None:
                self._resolve_ahead(nxt)
            else:   # nothing in flight: a cancel frees its pages now, not a step later
                self._finish_cancelled()
        self._inflight = nxt

    def _resolve_ahead(self, launched: LaunchedStep) -> None:
        """After the step before `launched` is applied: what its rows turned out to be (a no-op
        where the rows launched ahead already are the rows)."""

    def cancel(self, request_id: str) -> bool:
        with self._lock:
            req = self.requests.get(request_id)
            if req is None or req.done:
                return False
            req.cancelled = True
            return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._inflight is not None)

    def stats(self) -> EngineStats:
        pool = self.kv.pool
        return EngineStats(pool.usable, pool.used, pool.free, len(self.running), len(self.waiting),
                           self.steps, self.forwards, self.compiles, self.preemptions,
                           self._graphs.captures if self._graphs is not None else 0)

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        for _ in range(max_steps):
            if not self.has_work():
                return
            self.step()
        raise RuntimeError("engine did not become idle")

    def _run_throwaway(self, jobs) -> None:
        """Warm-up: submit (request_id, prompt, options) jobs, run them to the end, forget them."""
        for request_id, prompt, options in jobs:
            self.submit(request_id, prompt, options)
        self.run_until_idle()
        for request_id, _, _ in jobs:
            self.requests.pop(request_id, None)

    @staticmethod
    def freeze_heap() -> None:
        """After warm-up: move every object alive now (model, graphs, compiled code, tables) out
        of the garbage collector's view. They live as long as the process, and a full
        collection that walks them all stalls the step loop for tens of milliseconds at a time."""
        gc.collect()
        gc.freeze()

    def drain(self, req) -> Iterator:
        while req.events:
            yield req.events.popleft()

    def _counting_backend(self, gm, example_inputs):
        """torch.compile backend: inductor, counting each compilation (tests fail on a recompile)."""
        self.compiles += 1
        from torch._inductor.compile_fx import compile_fx
        return compile_fx(gm, example_inputs)


class Engine(StepLoop):
    def __init__(self, model: SteerlingModel, *, tokenizer_vocab_size: int | None = None, max_slots: int = 64,
                 n_pages: int | None = None, max_prefill_rows: int = 32, compile: bool = False,
                 cuda_graphs: bool = False, kv_fraction: float = 0.85, overlap: bool = True):
        self.model = model.eval()
        self.cfg = model.cfg
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.kv = KVCache.sized_from_free_memory(self.cfg, self.dtype, self.device, kv_fraction, n_pages)
        self.tables = DeviceTables(max_slots + 1, self.cfg.n_embd, self.cfg.vocab_size, self.dtype, self.device)
        self.runner = StepRunner(model, self.kv, self.tables, banned_ids(self.cfg, tokenizer_vocab_size, self.device))
        self.max_prefill_rows = max_prefill_rows
        self.want_records = True   # copy raw concept records to the host (off only in benchmarks)
        self.k_known = min(self.cfg.topk_known, self.cfg.n_known)
        self.k_disc = min(self.cfg.topk_discovered, self.cfg.n_discovered)
        self._free_slots = list(range(max_slots, 0, -1))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self.steps = self.forwards = self.preemptions = 0
        self._lock = threading.Lock()
        self.compiles = 0
        # Overlap: in steady decoding the next step is launched before this one's results are
        # read (its tokens come from the device's block-token table), so the host's
        # bookkeeping and the device-to-host copy hide behind the GPU's next step.
        self.overlap = overlap
        self._inflight: LaunchedStep | None = None
        self.overlapped_steps = 0
        self.dropped_rows = 0      # rows of a launched step whose request ended before it was applied
        self._pinned = PinnedPairs()
        if compile:
            self._compile()
        self._graphs = None
        if cuda_graphs:
            if self.device.type != "cuda":
                raise ValueError("cuda_graphs needs a CUDA device")
            from worker_svc.engine.graphs import GraphCache
            self._graphs = GraphCache(self)

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
               next_step: int = 0) -> Request:
        """Queue a request. `committed` (whole blocks already generated elsewhere, e.g. by a
        worker that died) and `next_step` resume it exactly where it stopped."""
        if not prompt:
            raise ValueError("prompt must contain at least one token")
        gen_end = len(prompt) + options.max_new_tokens
        if gen_end > self.cfg.block_size:
            raise ValueError(f"prompt + max_new_tokens = {gen_end} exceeds the context of {self.cfg.block_size}")
        if options.tokens_per_step > K_BUCKETS[-1]:
            raise ValueError(f"tokens_per_step must be <= {K_BUCKETS[-1]}")
        committed = list(committed or [])
        if len(committed) >= options.max_new_tokens or (len(committed) and (len(prompt) + len(committed)) % BLOCK):
            raise ValueError("committed tokens must end on a block boundary before max_new_tokens")
        with self._lock:
            if request_id in self.requests:
                raise ValueError(f"duplicate request id {request_id!r}")
            seq = list(prompt) + committed + [self.cfg.mask_id] * (options.max_new_tokens - len(committed))
            req = Request(request_id, list(prompt), options, steering, seq, gen_end, next(self._arrivals))
            req.active = (len(prompt) + len(committed)) // BLOCK
            req.committed = len(committed)
            req.step = next_step
            self.requests[request_id] = req
            self.waiting.append(req)
        return req

    def warmup(self, max_rows: int = 4, max_new_tokens: int = 70) -> None:
        """Compile (and, on GPU, capture) the step for the shapes traffic will use, before SERVING.

        Runs throwaway requests covering one row and several rows (PyTorch specializes size
        1), prefill + decode + commit rows, several page counts and every k bucket.
        """
        for n_rows in sorted({1, min(2, max_rows), max_rows}):
            for k in K_BUCKETS:
                if k > self.cfg.diff_block_size:
                    continue
                self._run_throwaway([(f"__warmup_{n_rows}_{k}_{i}", [1] * (64 * (i % 2) + 3),
                                      DecodeOptions(min(max_new_tokens, 128), tokens_per_step=k))
                                     for i in range(n_rows)])
        self.freeze_heap()

    # ---- scheduling -----------------------------------------------------------------------
    def _release(self, req: Request) -> None:
        self.kv.pool.release(req.pages)
        req.pages = []
        req.kv_blocks = 0
        if req.slot:
            self._free_slots.append(req.slot)
            req.slot = 0

    def _finish(self, req: Request, reason: str, error: str = "") -> None:
        req.done = True
        self._release(req)
        if req in self.running:
            self.running.remove(req)
        stops = terminal_ids(self.cfg, req.options)
        out = clean_output(req.seq[len(req.prompt):], self.cfg, stops)
        req.events.append(FinishEvent(req.request_id, reason, out, len(req.prompt), len(out), req.step, error))
        del self.requests[req.request_id]

    def _preempt_one(self, needing: Request) -> bool:
        """Free the pages of the most recently admitted other running request."""
        victims = [r for r in self.running if r is not needing]
        if not victims:
            return False
        victim = max(victims, key=lambda r: r.admitted_at)
        self.running.remove(victim)
        self._release(victim)
        self.waiting.appendleft(victim)
        self.preemptions += 1
        return True

    def _ensure_pages(self, req: Request, n_blocks: int) -> bool:
        """Make sure blocks 0..n_blocks-1 of req have pages, preempting others if needed."""
        while len(req.pages) < n_blocks:
            page = self.kv.pool.alloc()
            if page is None:
                if not self._preempt_one(req):
                    return False
                continue
            req.pages.append(page)
        return True

    def _admit(self) -> None:
        while self.waiting and self._free_slots:
            req = self.waiting[0]
            if req.cancelled:
                self.waiting.popleft()
                self._finish(req, "cancelled")
                continue
            need = req.active + 1
            if self.kv.pool.free < need:
                if not self.running and need > self.kv.pool.usable:
                    self.waiting.popleft()
                    self._finish(req, "error", f"request needs {need} KV pages; the pool has {self.kv.pool.usable}")
                    continue
                break
            self.waiting.popleft()
            req.slot = self._free_slots.pop()
            req.admitted_at = self.steps
            self._ensure_pages(req, need)
            self._init_slot(req)
            self.running.append(req)

    def _init_slot(self, req: Request) -> None:
        s = req.slot
        self.tables.seen[s] = False
        ids = torch.tensor([t for t in req.seq if t != self.cfg.mask_id] + [self.cfg.mask_id], device=self.device)
        self.tables.seen[s, ids] = True
        st = req.steering
        self.tables.steer[s] = 0 if st is None else st.direction.to(self.device, self.dtype)
        self.tables.relu[s] = 0 if st is None or st.relu_mask is None else st.relu_mask.to(self.device)

    # ---- one step (StepLoop.step runs them) --------------------------------------------------
    def _finish_cancelled(self) -> None:
        for req in [r for r in self.running if r.cancelled]:
            self._finish(req, "cancelled")

    def _rows_ahead(self, rows: list[tuple[Request, int, bool]]) -> list[tuple[Request, int, bool]] | None:
        """`rows` again if the next step can be launched before their results are applied, else
        None. Only when it is sure to be the same decode rows: no arrivals or cancels to handle, every running request
        decoding, no confidence threshold (so a step commits exactly min(k, masks left)), and
        every block keeps a mask after this step (no block closes). An <|eot_id|> can still end
        a request early: its row in the next step then finds its block filled (samples nothing)
        and its results are dropped."""
        if self.waiting or len(rows) != len(self.running):
            return None
        for req, b, is_decode in rows:
            if not is_decode or req.cancelled or req.done or req.options.confidence_threshold is not None:
                return None
            start, end = req.block_range(b)
            left = req.seq[start:end].count(self.cfg.mask_id)
            if left - min(req.options.tokens_per_step, left) < 1:
                return None
        return rows

    def _plan(self) -> list[tuple[Request, int, bool]]:
        """(request, block index, is_decode) rows for this step."""
        rows: list[tuple[Request, int, bool]] = []
        prefill_budget = self.max_prefill_rows
        for req in self.running:
            # blocks whose final K/V must be in the cache before the request can decode on
            target = req.active + 1 if req.pending_commit else req.active
            if req.kv_blocks < target:
                n = min(target - req.kv_blocks, max(prefill_budget, 1))
                prefill_budget -= n
                rows += [(req, b, False) for b in range(req.kv_blocks, req.kv_blocks + n)]
                if req.kv_blocks + n < target or req.pending_commit:
                    continue
            rows.append((req, req.active, True))
        return rows

    def _launch(self, rows: list[tuple[Request, int, bool]], overlapped: bool = False) -> LaunchedStep:
        """Build the step's inputs, run it on the device and start the copy of its results.
        overlapped: the previous step's results are not applied yet; its decode rows continue
        from the device's block-token table, one step and min(k, masks left) tokens further."""
        cfg = self.cfg
        n = len(rows)
        rb = bucket(n, ROW_BUCKETS)
        max_block = max(b for _, b, _ in rows)
        pb = bucket(max_block + 1, PAGE_BUCKETS)
        kmax = bucket(max((r.options.tokens_per_step for r, _, d in rows if d), default=1), K_BUCKETS)
        # Host inputs are filled as numpy arrays (a scalar store costs ~0.1 us there, ~2 us
        # into a torch tensor) and become tensors once: the host part of a step stays small
        # next to the GPU's (it is pure overhead at batch 1).
        i64 = np.int64
        tokens = np.full((rb, BLOCK), cfg.pad_id, dtype=i64)
        positions = np.zeros((rb, BLOCK), dtype=i64)
        write_page = np.zeros(rb, dtype=i64)
        pages = np.zeros((rb, pb), dtype=i64)
        n_visible = np.full(rb, BLOCK, dtype=i64)
        slot = np.zeros(rb, dtype=i64)
        alpha = np.zeros(rb, dtype=np.float32)
        inject = np.full(rb, cfg.n_layers + 1, dtype=i64)
        decode = np.zeros(rb, dtype=bool)
        rep = np.ones(rb, dtype=np.float32)
        greedy = np.ones(rb, dtype=bool)
        entropy = np.zeros(rb, dtype=bool)
        temperature = np.ones(rb, dtype=np.float32)
        top_p = np.ones(rb, dtype=np.float32)
        seed = np.zeros(rb, dtype=i64)
        stepc = np.zeros(rb, dtype=i64)
        k = np.zeros(rb, dtype=i64)
        threshold = np.full(rb, -np.inf, dtype=np.float32)
        from_table = np.zeros(rb, dtype=bool)
        for i, (req, b, is_decode) in enumerate(rows):
            start, end = req.block_range(b)
            ahead = committed_ahead = 0
            if overlapped:
                from_table[i] = True
                ahead = 1
                left = req.seq[start:end].count(cfg.mask_id)
                committed_ahead = min(req.options.tokens_per_step, left)
            else:
                tokens[i, : end - start] = req.seq[start:end]
            positions[i] = _ARANGE_BLOCK + start
            write_page[i] = req.pages[b]
            pages[i, : b + 1] = req.pages[: b + 1]
            n_visible[i] = b * BLOCK + (end - start)
            slot[i] = req.slot
            if req.steering is not None and is_decode:
                st = req.steering
                alpha[i] = resolve_alpha(st.schedule, st.base_alpha, req.committed + committed_ahead,
                                         st.cutoff_tokens)
                inject[i] = st.inject_layer
            if is_decode:
                o, sp = req.options, req.options.sampling
                decode[i] = True
                rep[i] = sp.repetition_penalty
                greedy[i] = sp.greedy
                entropy[i] = sp.use_entropy_sampling
                temperature[i] = sp.temperature
                top_p[i] = sp.top_p
                seed[i] = o.seed
                stepc[i] = req.step + ahead
                k[i] = o.tokens_per_step
                if o.confidence_threshold is not None:
                    threshold[i] = o.confidence_threshold
        dev = self.device

        def put(a: np.ndarray) -> Tensor:
            return torch.from_numpy(a).to(dev, non_blocking=True)

        fwd = ForwardInputs(*(put(a) for a in (tokens, positions, write_page, pages, n_visible, slot, alpha, inject,
                                                from_table)))
        smp = SamplerInputs(*(put(a) for a in (decode, slot, rep, greedy, entropy, temperature, top_p, seed, stepc,
                                               k, threshold)))
        packed = self._execute_device(rb, pb, kmax, fwd, smp)
        self.forwards += 1
        n_cols = packed.shape[1] if self.want_records else 4 * kmax
        return LaunchedStep(rows, kmax, *self._pinned.start_copy(packed[:n, :n_cols]))

    def _apply_step(self, launched: LaunchedStep) -> None:
        self._apply(launched.rows, unpack(launched.results(), launched.kmax, self.k_known, self.k_disc,
                                          self.want_records))

    def _execute_device(self, rb: int, pb: int, kmax: int, fwd: ForwardInputs, smp: SamplerInputs) -> Tensor:
        if self._graphs is not None:
            return self._graphs.run(rb, pb, kmax, fwd, smp)
        return self.runner.step(kmax, fwd, smp)

    def _apply(self, rows, results) -> None:
        # numpy views of the host copy: per-row indexing there is ~10x cheaper than torch's
        pos_sel, tok_sel, valid, target, kidx, klog, didx, dlog = (
            None if t is None else t.numpy() for t in results)
        closed, advance = [], []
        for i, (req, b, is_decode) in enumerate(rows):
            if req.done:   # ended by the previous step (<|eot_id|>) after this one was launched
                self.dropped_rows += 1
                continue
            if not is_decode:
                req.kv_blocks = max(req.kv_blocks, b + 1)
                if req.pending_commit and b == req.active:
                    advance.append(req)
                continue
            keep = np.flatnonzero(valid[i])
            if keep.size == 0:  # cannot happen for a block with masks left; never burn a step
                continue
            positions = pos_sel[i, keep].tolist()
            toks = tok_sel[i, keep].tolist()
            for p, t in zip(positions, toks):
                req.seq[p] = t
            req.committed += len(toks)
            req.events.append(StepEvent(req.request_id, req.step, positions, toks))
            if kidx is not None:
                # numpy pieces; one RawRecords per block when it closes (torch.from_numpy per
                # step and field costs more than the rest of this loop)
                req.block_records.append(tuple(a[i, keep] for a in (pos_sel, tok_sel, target, kidx, klog, didx, dlog)))
            req.step += 1
            eot = self.cfg.eot_id is not None and self.cfg.eot_id in toks
            start, end = req.block_range(b)
            if eot:
                p = positions[toks.index(self.cfg.eot_id)]
                for q in range(p + 1, req.gen_end):
                    req.seq[q] = self.cfg.eos_id
            if eot or self.cfg.mask_id not in req.seq[start:end]:
                closed.append((req, b, eot))
        for req, b, eot in closed:
            self._close_block(req, b, eot)
        for req in advance:
            req.pending_commit = False
            self._advance(req)

    def _close_block(self, req: Request, b: int, eot: bool) -> None:
        start, end = req.block_range(b)
        first = max(start, len(req.prompt))
        records = (RawRecords(*(torch.from_numpy(np.concatenate(parts)) for parts in zip(*req.block_records)))
                   if req.block_records else None)
        req.block_records = []
        stops = terminal_ids(self.cfg, req.options)
        reason = ("stop" if eot or any(t in stops for t in req.seq[len(req.prompt):end])
                  else "length" if end >= req.gen_end else None)
        req.events.append(BlockEvent(req.request_id, b, first, end, req.seq[first:end], records, reason is not None))
        if reason is not None:
            self._finish(req, reason)
        else:
            req.pending_commit = True

    def _advance(self, req: Request) -> None:
        req.active += 1
        if not self._ensure_pages(req, req.active + 1):
            # nothing left to preempt: wait for pages (kept state; recomputed on readmission)
            self.running.remove(req)
            self._release(req)
            self.waiting.appendleft(req)
            self.preemptions += 1
