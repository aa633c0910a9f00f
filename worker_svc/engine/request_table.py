"""The request table both engines share: slots, the waiting queue, the running list, and a
request's life through them (admit, preempt, release, finish), plus the page allocation that
preempts when the pool runs dry.

What differs between the decoders (how many pages admission needs, what a slot holds on the
device, what a finished request reports) comes from the strategy through `RequestHooks`; the
bookkeeping here is the same for both. The hooks never call back into the table.

With a prefix cache on the pool, admission first reuses the pages of the longest cached prefix
of the request's full 64-token blocks (the strategy says which tokens may be covered), and the
strategies publish each block whose final K/V is in the cache (`publish`). A request whose next
uncached block a running request is computing now waits for it to be published (so n > 1 choices,
admitted together, prefill their prompt once).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from collections.abc import Hashable, Sequence
from typing import NamedTuple, Protocol

from cde.blocks import PAGE

from worker_svc.engine.events import FinishEvent
from worker_svc.engine.kv_cache import PagePool


class RequestStatus(Enum):
    WAITING = "waiting"     # queued (new, or preempted: no slot, no pages)
    RUNNING = "running"     # admitted: holds a slot and is in the running list
    FINISHED = "finished"   # its FinishEvent is queued; it has left the table


@dataclass(eq=False, kw_only=True)   # identity: `in` on the running list must not compare fields
class TrackedRequest:
    """What the table keeps of every request; each engine's request type extends it."""

    request_id: str
    prompt: list[int]
    events: deque = field(default_factory=deque)
    status: RequestStatus = RequestStatus.WAITING
    cancel_requested: bool = False   # set by another thread (cancel); the step loop finishes it
    slot: int = 0                    # device-side state row; 0 (scratch) unless RUNNING
    pages: list[int] = field(default_factory=list)
    admitted_at: int = -1            # preemption picks the most recently admitted
    preemptions: int = 0
    queued_at: float | None = None   # when it was added, until its first admission
    hit_blocks: int = 0              # leading blocks whose K/V came from the prefix cache at admission
    published: int = 0               # leading blocks offered to the prefix cache since admission
    prefix_namespace: Hashable = None

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def running(self) -> bool:
        return self.status is RequestStatus.RUNNING

    def forget_kv(self) -> None:
        """Its pages are gone: nothing of it is in the cache any more."""
        raise NotImplementedError


class PrefixQuery(NamedTuple):
    """What a request may take from the prefix cache at admission."""

    tokens: Sequence[int]     # its tokens (prompt, then generated)
    known: int                # how many of them are known so far (counted as prefix cache queries)
    cacheable: int            # how many leading ones may take their K/V from the cache
    namespace: Hashable = None   # requests computing different K/V for the same tokens differ here


NO_PREFIX = PrefixQuery((), 0, 0)


class RequestHooks(Protocol):
    """What a decoder decides in a request's life through the table (its `DecodeStrategy`)."""

    # True: an admitted request is given its `pages_to_admit` pages at once (Steerling: its
    # block's page); False: admission only waits until they are free and the step's plan
    # allocates them (ISD, whose next window may need more)
    admission_takes_pages: bool

    def admission_refusal(self, req: TrackedRequest, idle: bool) -> str | None:
        """Why the request can never be admitted (it then finishes with an error), else None.
        idle: no request is running."""

    def pages_to_admit(self, req: TrackedRequest) -> int:
        """Pages that must be free to admit the request (see `admission_takes_pages`), cache hits included."""

    def prefix_query(self, req: TrackedRequest) -> PrefixQuery:
        """What the request may reuse (on_admit then finds `hit_blocks` set)."""

    def admission_stamp(self) -> int:
        """`admitted_at` of a request admitted now (preemption picks the largest)."""

    def on_admit(self, req: TrackedRequest) -> None:
        """The request just got a slot and its pages: set up its device-side state."""

    def on_preempt(self, req: TrackedRequest) -> None:
        """The request is about to lose its slot and pages: keep what it needs back."""

    def finish_event(self, req: TrackedRequest, reason: str, error: str) -> FinishEvent:
        """The event a finishing request reports."""


class RequestTable:
    def __init__(self, pool: PagePool, max_slots: int, hooks: RequestHooks):
        self.pool = pool
        self.hooks = hooks
        self.requests: dict[str, TrackedRequest] = {}
        self.waiting: deque[TrackedRequest] = deque()
        self.running: list[TrackedRequest] = []
        self._free_slots = list(range(max_slots, 0, -1))   # slot 0 is scratch
        self.preemptions = 0
        self.admitted = 0        # requests admitted for the first time
        self.queue_s_sum = 0.0   # their waits from `add` to that admission, summed
        self.prefix_cache_queries = 0   # known tokens of admitted requests (vLLM's prefix_cache_queries)
        self.prefix_cache_hits = 0      # of those, with K/V from the prefix cache (prefix_cache_hits)

    def add(self, req: TrackedRequest) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        self.requests[req.request_id] = req
        req.queued_at = time.perf_counter()
        self.waiting.append(req)

    def admit(self) -> None:
        """Admit waiting requests in order while a slot is free and the pool has the pages the
        hooks ask for (given them when the hooks' `admission_takes_pages`); one that can never
        fit finishes with an error."""
        s = self.hooks
        while self.waiting and self._free_slots:
            req = self.waiting[0]
            if req.cancel_requested:
                self.waiting.popleft()
                self.finish(req, "cancelled")
                continue
            refusal = s.admission_refusal(req, not self.running)
            if refusal is not None:
                self.waiting.popleft()
                self.finish(req, "error", refusal)
                continue
            need = s.pages_to_admit(req)
            query = s.prefix_query(req) if self.pool.cache is not None else NO_PREFIX
            hits, held_by_nobody = self.pool.cached_prefix(_blocks(query.tokens, query.cacheable // PAGE),
                                                           query.namespace)
            if self.pool.free - held_by_nobody < need - len(hits):
                break
            if self.pool.cache is not None and self._computing_next_block(query, len(hits)):
                break   # wait a step or two and reuse its pages (n > 1 choices of one prompt) rather than recompute them
            self.waiting.popleft()
            req.slot = self._free_slots.pop()
            req.status = RequestStatus.RUNNING
            req.admitted_at = s.admission_stamp()
            if req.queued_at is not None:   # its first admission: the time it waited in the queue
                self.admitted += 1
                self.queue_s_sum += time.perf_counter() - req.queued_at
                req.queued_at = None
            self.running.append(req)
            if self.pool.cache is not None:
                self.pool.share(hits)
                req.pages = hits
                req.hit_blocks = req.published = len(hits)
                req.prefix_namespace = query.namespace
                self.prefix_cache_queries += query.known
                self.prefix_cache_hits += len(hits) * PAGE
            if s.admission_takes_pages:
                self.ensure_pages(req, need, may_preempt_itself=False)   # free: never preempts
            s.on_admit(req)

    def _computing_next_block(self, query: PrefixQuery, hits: int) -> bool:
        """Whether a running request is computing the K/V of the query's first uncached block now
        (the same tokens up to it, in the same namespace) and will publish it: simultaneous
        requests with one prompt then prefill it once. The wait ends when that block is
        published, or the request computing it leaves the running list."""
        if hits >= query.cacheable // PAGE:
            return False
        end = (hits + 1) * PAGE
        wanted = list(query.tokens[:end])
        for r in self.running:
            if r.prefix_namespace != query.namespace or r.published > hits:
                continue
            theirs = self.hooks.prefix_query(r)
            if theirs.cacheable >= end and list(theirs.tokens[:end]) == wanted:
                return True
        return False

    def release(self, req: TrackedRequest) -> None:
        """Give back the request's pages and slot."""
        self.pool.release(req.pages)
        req.pages = []
        req.hit_blocks = req.published = 0
        req.forget_kv()
        if req.slot:
            self._free_slots.append(req.slot)
            req.slot = 0

    def preempt(self, victim: TrackedRequest) -> None:
        """Back to the head of the queue without pages or slot; recomputed on readmission."""
        self.hooks.on_preempt(victim)
        self.running.remove(victim)
        self.release(victim)
        victim.status = RequestStatus.WAITING
        self.waiting.appendleft(victim)
        self.preemptions += 1
        victim.preemptions += 1

    def ensure_pages(self, req: TrackedRequest, n_pages: int, *, may_preempt_itself: bool) -> bool:
        """Give req pages 0..n_pages-1, preempting the most recently admitted running request while
        the pool is empty. may_preempt_itself: req is a candidate too (then False once it is the
        victim); else False when no other request is left to preempt."""
        while len(req.pages) < n_pages:
            page = self.pool.alloc()
            if page is None:
                candidates = self.running if may_preempt_itself else [r for r in self.running if r is not req]
                if not candidates:
                    return False
                victim = max(candidates, key=lambda r: r.admitted_at)
                self.preempt(victim)
                if victim is req:
                    return False
                continue
            req.pages.append(page)
        return True

    def publish(self, req: TrackedRequest, tokens: Sequence[int], n_blocks: int) -> None:
        """The request's first `n_blocks` blocks (of `tokens`) have their final K/V in its pages:
        later requests with the same prefix may reuse them."""
        if self.pool.cache is None or n_blocks <= req.published:
            return
        self.pool.publish(_blocks(tokens, n_blocks), req.pages[:n_blocks], req.prefix_namespace)
        req.published = n_blocks

    def finish(self, req: TrackedRequest, reason: str, error: str = "") -> None:
        """End the request: free what it holds, queue its FinishEvent, forget it."""
        req.status = RequestStatus.FINISHED
        self.release(req)
        if req in self.running:
            self.running.remove(req)
        req.events.append(self.hooks.finish_event(req, reason, error))
        self.requests.pop(req.request_id, None)

    def finish_cancelled(self) -> None:
        """Finish every request whose cancel was asked for, running or waiting."""
        for req in [r for r in self.running if r.cancel_requested]:
            self.finish(req, "cancelled")
        for req in [r for r in self.waiting if r.cancel_requested]:
            self.waiting.remove(req)
            self.finish(req, "cancelled")

    def cancel(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return False
        req.cancel_requested = True
        return True


def _blocks(tokens: Sequence[int], n: int) -> list[tuple[int, ...]]:
    return [tuple(tokens[b * PAGE:(b + 1) * PAGE]) for b in range(n)]
