"""Where a request's run streams from: one of the scheduler's slots (at most max_running runs
placed at once), a worker's KV pages (a `Reservation`, the pool's bookkeeping) and the claim
in Redis that names the worker, for each attempt.

A request created running on a worker (`place_now` before `RequestStore.create(worker=...)`)
is claimed by the create and streams at once; otherwise each attempt reads the request back,
waits for a worker serving its model, reserves its pages and claims the request there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from cde.rpc.v1 import scheduler_pb2
from scheduler_svc.endings import Endings
from scheduler_svc.run_context import Deadline, DeadlinePassed, RunContext
from scheduler_svc.spec import pages_needed
from scheduler_svc.state import RUNNING, Claimed
from scheduler_svc.workers import Reservation, prompt_prefix


class Placement:
    def __init__(self, ctx: RunContext, request: scheduler_pb2.SubmitRequest, deadline: Deadline,
                 endings: Endings, on_worker_lost: Callable[[str], None]):
        self.ctx = ctx
        self.request = request
        self.rid = request.request_id
        self.deadline = deadline
        self.endings = endings
        self.on_worker_lost = on_worker_lost   # given to every reservation (the pool calls it)
        self.pages = pages_needed(request)
        self.avoid: set[str] = set()   # workers that failed this request (tried last)
        self.has_slot = False
        self.failures = 0              # lost or failed placements so far
        self._just_created = False
        self._at_create: Reservation | None = None

    # ---- before the run's task starts ---------------------------------------------------------
    async def place_now(self) -> Reservation | None:
        """A slot and the best worker's pages, taken now if both are free without waiting (the
        request can then be created running there), else None and the run waits for them itself.
        `unplace` gives them back if the create does not happen."""
        if self.ctx.slots.locked():
            return None
        prefix = prompt_prefix(self.request.prompt_tokens)
        worker = self.ctx.pool.pick(self.request.model, self.avoid, self.pages, prefix)
        if worker is None:
            return None
        await self.ctx.slots.acquire()   # not locked: takes a slot at once, no suspension (no await above)
        self.has_slot = True
        return self.ctx.pool.reserve(worker, self.rid, self.pages, self.on_worker_lost, prefix)

    def unplace(self, placed: Reservation | None) -> None:
        if placed is not None:
            self.ctx.pool.release(placed, placed=False)
            self.ctx.slots.release()
            self.has_slot = False

    def created(self, just_created: bool, placed: Reservation | None) -> None:
        """just_created: this instance created the request a moment ago, so the first attempt
        skips reading it back. placed: it was created running on this reservation's worker."""
        self._just_created = just_created
        self._at_create = placed

    # ---- the run's task -----------------------------------------------------------------------
    async def take_slot(self) -> None:
        if self.has_slot:
            return
        try:
            await asyncio.wait_for(self.ctx.slots.acquire(), self.deadline.left())
        except asyncio.TimeoutError:
            raise DeadlinePassed() from None
        self.has_slot = True

    async def claim(self) -> tuple[Reservation, Claimed] | None:
        """A worker's pages and the request claimed there for the next attempt; None when the
        request ended instead (its End is published)."""
        store, pool, limits = self.ctx.store, self.ctx.pool, self.ctx.limits
        while True:
            if self._at_create is not None:   # created running there: claimed by the create
                reservation, self._at_create = self._at_create, None
                self._just_created = False
                return reservation, Claimed(next_block=0, attempt=0)
            if self._just_created:
                self._just_created = False
            else:
                st = await store.get(self.rid)
                if st is None or st.terminal:
                    await self.endings.from_store(st)
                    return None
                if st.status == RUNNING:   # an attempt nobody streams any more (e.g. before a restart)
                    await store.requeue(self.rid)
                    if not self.count_failure():
                        await self.endings.give_up(grpc.StatusCode.UNAVAILABLE, "could not take the request over")
                        return None
                    continue
            wait = limits.queue_timeout_s
            left = self.deadline.left()
            prefix = prompt_prefix(self.request.prompt_tokens)
            worker = await pool.wait_for(self.request.model, self.avoid, wait if left is None else min(wait, left),
                                         self.pages, prefix)
            if worker is None:
                self.deadline.left()
                if self.request.model and pool.live():
                    await self.endings.give_up(grpc.StatusCode.NOT_FOUND,
                                               f"no worker serves model {self.request.model!r}")
                else:
                    await self.endings.give_up(grpc.StatusCode.UNAVAILABLE, f"no worker available within {wait:g}s")
                return None
            # Reserve the pages before the next await: the other runs of a burst pick meanwhile and
            # must see them, or they all land on the same worker.
            reservation = pool.reserve(worker, self.rid, self.pages, self.on_worker_lost, prefix)
            try:
                claimed = await store.claim(self.rid, worker.worker_id)
            except BaseException:
                pool.release(reservation, placed=False)
                raise
            if claimed is None:   # cancelled meanwhile (seen above next round) or claimed by another instance
                pool.release(reservation, placed=False)
                continue
            return reservation, claimed

    def count_failure(self) -> bool:
        """Count a lost or failed placement: True while another attempt is allowed."""
        self.failures += 1
        return self.failures <= self.ctx.limits.max_attempts

    async def requeue(self, worker_id: str) -> None:
        """Back to the queue after an attempt on ``worker_id`` was lost, after a short backoff."""
        await self.ctx.store.requeue(self.rid, worker_id)
        await asyncio.sleep(min(0.05 * self.failures, 1.0))

    def release(self) -> None:
        """The run's task is over: give back a reservation it never streamed from, and its slot."""
        if self._at_create is not None:
            self.ctx.pool.release(self._at_create, placed=False)
            self._at_create = None
        if self.has_slot:
            self.ctx.slots.release()
            self.has_slot = False
