"""Which rows a Steerling step has: the host-side request state and the planner, from the host's
state (`plan_rows`) or ahead of the step in flight (`plan_ahead`, overlapped steps). No device
work here; steerling_engine.py launches what is planned.

A step's rows, each 64 tokens:
- a request whose prompt (or, after preemption, whose committed blocks) is not yet in the
  cache contributes commit rows for those blocks (chunked by `max_prefill_rows`) and, once
  they are all in, its decode row in the same step;
- a request whose active block just finished contributes one commit row (its final K/V),
  unless that block ends the request (nobody will attend to it); the decode row of its next
  block, which reads the commit row's page (every row writes its K/V before any row attends),
  joins that step when the row costs little (`fold_decode_row`), else comes a step later;
- every other request contributes its active block as a decode row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from cde.blocks import BLOCK
from cde.options import DecodeOptions
from cde.steerling.steering import PreparedSteering, resolve_alpha
from worker_svc.engine.kv_cache import PagePool
from worker_svc.engine.request_table import RequestTable, TrackedRequest
from worker_svc.engine.runtime import ROW_BUCKETS, bucket

# Up to this many rows a step is bound by reading the weights (8B dims on an H200: 5.7 ms for 1
# row, 8.8 ms for 4): a closed block's next decode row joins its commit row's step.
FOLD_ROWS = 4


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
    logprobs: int | None = None      # each committed token's logprob and this many alternatives; None: not asked
    block_logprobs: dict = field(default_factory=dict)   # the active block's, by position (TokenLogprob)
    constraint: Any = None           # structured output (cde.grammar.Constraint): one token a step, left to right

    # its active block's predecessor just closed and awaits its commit row: the active block's
    # decode row may or may not join that step (`fold_decode_row`)
    closed_block: bool = False

    def block_range(self, b: int) -> tuple[int, int]:
        return b * BLOCK, min((b + 1) * BLOCK, self.gen_end)

    def ends_at(self, b: int) -> bool:
        """Whether block b is the request's last (closing it finishes the request)."""
        return self.block_range(b)[1] >= self.gen_end

    def forget_kv(self) -> None:
        self.kv_blocks = 0
        self.closed_block = False


class RowAhead(NamedTuple):
    """A request's decode row in the step in flight, as a row of the step planned after it sees
    it (`plan_ahead`)."""

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


class RequestState(NamedTuple):
    """A running request as the planned step finds it: the host's state, or as it will be after
    the step in flight (then `ahead` is its decode row there)."""

    req: BlockRequest
    kv_blocks: int
    active: int
    closed_block: bool
    ahead: RowAhead | None


def fold_decode_row(n_rows: int) -> bool:
    """Whether a step of `n_rows` rows takes one more: the decode row of a request whose block
    closed, beside its commit row. Yes while the step is small (FOLD_ROWS: it is bound by the
    weights' reads, and a row costs a fraction of the step the request would otherwise skip)
    or the row fills padding of the step's row bucket; else the request decodes a step later
    (a batch that grew into the next bucket would cost every row more)."""
    return n_rows + 1 <= FOLD_ROWS or bucket(n_rows + 1, ROW_BUCKETS) == bucket(n_rows, ROW_BUCKETS)


def host_states(running: list[BlockRequest]) -> list[RequestState]:
    return [RequestState(req, req.kv_blocks, req.active, req.closed_block, None) for req in running]


def plan_rows(states: list[RequestState], max_prefill_rows: int) -> list[BlockRow]:
    """A step's rows, in running order, from each request's state."""
    groups: list[tuple[list[BlockRow], BlockRow | None]] = []   # a request's rows, its optional decode row
    prefill_budget = max_prefill_rows
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
        if optional is not None and fold_decode_row(n_rows):
            planned.append(optional)
            n_rows += 1
    return planned


def alpha_ahead(req: BlockRequest, most: int) -> float | None:
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


def plan_ahead(table: RequestTable, pool: PagePool, rows: list[BlockRow], mask_id: int,
               max_prefill_rows: int) -> list[BlockRow] | None:
    """The next step's rows, planned before `rows`' results are applied, or None when that
    plan could be wrong. The step in flight commits exactly min(tokens_per_step, masks left)
    tokens of each decode row (a confidence-threshold row: between one and that many), so
    which blocks close in it is known, unless a threshold row may or may not close (None).
    A block that closes gets its commit row (tokens from the device's block-token table)
    and its next block's decode row, whose page is taken now; the request's last block
    ends it. Arrivals are admitted into the planned step, after those pages (None when
    the pool cannot give them without preempting). A cancel also waits for a step built
    from the host (the runtime plans nothing ahead while a request is cancelled). An <|eot_id|> or a stop id can still end a request early: its rows in
    the next step are then dropped when applied."""
    running = table.running
    in_step = {id(r.req) for r in rows}
    if in_step != {id(req) for req in running}:
        return None
    decoded: dict[int, RowAhead] = {}          # id(req) -> its decode row's block and commits
    kv_after: dict[int, int] = {}
    opening: list[tuple[BlockRequest, int]] = []   # (request, pages it needs) for each block that opens
    for req, b, is_decode, _ in rows:
        if not is_decode:
            kv_after[id(req)] = max(kv_after.get(id(req), req.kv_blocks), b + 1)
            continue
        start, end = req.block_range(b)
        left = req.seq[start:end].count(mask_id)
        most = min(req.options.tokens_per_step, left)
        threshold = req.options.confidence_threshold is not None
        closes = left == most
        if threshold and ((closes and left > 1) or (not closes and alpha_ahead(req, most) is None)):
            return None   # it may or may not close / its strength depends on how many it commits
        decoded[id(req)] = RowAhead(b, most, closes)
        if closes and not req.ends_at(b):
            opening.append((req, b + 2))
    # pages of the blocks that open: all of them, or no plan
    if sum(max(0, n - len(req.pages)) for req, n in opening) > pool.free:
        return None
    for req, n in opening:
        table.ensure_pages(req, n, may_preempt_itself=False)   # free pages: never preempts
    table.admit()
    states = []
    for req in running:
        d = decoded.get(id(req))
        if id(req) not in in_step:                    # admitted just now
            states.append(RequestState(req, req.kv_blocks, req.active, req.closed_block, None))
        else:
            kv = kv_after.get(id(req), req.kv_blocks)
            if d is not None and d.closes:
                if not req.ends_at(d.block):
                    states.append(RequestState(req, kv, d.block + 1, True, d))
                continue
            states.append(RequestState(req, kv, req.active, req.closed_block and kv < req.active, d))
    return plan_rows(states, max_prefill_rows) or None   # (every request ends in the step in flight)
