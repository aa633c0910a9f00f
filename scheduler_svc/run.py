"""One request's life in the scheduler: wait for a slot, place it on a worker, stream from
the worker, persist each block exactly once, attach attributions, fan events out to the
streams attached to it, and re-place it from its last committed block when its worker dies.

A `RequestRun` is a task of its own, independent of any client stream: Submit and Resume
streams *subscribe* to it. A subscriber first reads the stored blocks from Redis, then the
live ones from its queue, skipping indices it already has; a block is stored before it
is published, so nothing falls between the two. When the last subscriber leaves early the
request is cancelled: at once when its client said it left (`Detach`: the gateway's HTTP or
gRPC client is gone), else after the detach grace, so that a client whose stream merely broke
(its gateway process died) can Resume first.

Everything needed to pick the request up again lives in Redis (scheduler_svc/state.py owns
every key): the spec (scheduler_svc/spec.py: the SubmitRequest with the options the gateway
resolved, and the absolute deadline), the stored blocks (the final BlockCommitted protos,
attributions included, so a replay is identical; `next_step` in the last one says where the
worker's step counter stood), and the saved ending (the Finished message). A task cancelled
without a cancel request (scheduler shutdown) leaves Redis untouched for the next instance.

A run gets what it needs from the scheduler as a `RunContext` (store, worker pool, attribution
pool, slots, limits and three callbacks); it never reaches into the scheduler itself, and the
pool keeps its own page bookkeeping (`WorkerPool.reserve` / `release`).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
import redis.exceptions

from cde import trace
from cde.rpc.finish import FINISH_REASON_BY_NAME, FINISH_REASON_TEXT
from cde.rpc.v1 import common_pb2, scheduler_pb2, worker_pb2
from scheduler_svc.attribution import AttributionPool, AttributionSession
from scheduler_svc.spec import first_block, pages_needed, stored_after
from scheduler_svc.state import CANCELLED, FAILED, FINISHED, RUNNING, Claimed, RequestState, RequestStore
from scheduler_svc.workers import Reservation, WorkerHandle, WorkerPool

log = logging.getLogger("scheduler_svc.run")

# A transient Redis failure (pool wait ran out, dropped connection, a restart) while a request
# runs: retry the call with backoff for this long before the run gives up on Redis.
REDIS_RETRY_S = 30.0
_TRANSIENT = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
# The worker refused the request itself: retrying elsewhere cannot help.
REQUEST_FAULTS = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                            grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.NOT_FOUND,
                            grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNIMPLEMENTED,
                            grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED})


# ---- what a run is given ------------------------------------------------------------------------

@dataclass(frozen=True)
class RunLimits:
    queue_timeout_s: float   # how long a request waits for any worker before UNAVAILABLE
    max_attempts: int        # lost/failed placements before a request fails
    detach_grace_s: float    # after the last stream breaks without a Detach, before cancelling


@dataclass
class RelayTiming:
    """Cumulative time runs spend in this scheduler on the way to the worker and back with their
    first block (reported by Stats: where a request's time to first block goes)."""
    placed: int = 0
    submit_to_worker_s: float = 0.0
    first_blocks: int = 0
    first_block_relay_s: float = 0.0


@dataclass(frozen=True)
class RunContext:
    """What a request's run needs from the scheduler, handed to it."""
    store: RequestStore
    pool: WorkerPool
    attribution: AttributionPool | None
    slots: asyncio.Semaphore                               # at most max_running runs placed at once
    limits: RunLimits
    redis_failed: Callable[[Exception], Awaitable[None]]   # a Redis call failed (health follows)
    closing: Callable[[], bool]                            # the scheduler is shutting down
    ended: Callable[[RequestRun], None]                    # the run's task is over
    timing: RelayTiming = field(default_factory=RelayTiming)


def stored_finished(st: RequestState, saved: bytes | None) -> common_pb2.Finished:
    """The request's Finished message: as saved, else rebuilt from its status."""
    if saved:
        return common_pb2.Finished.FromString(saved)
    if st.status == FAILED:
        return common_pb2.Finished(reason=common_pb2.FINISH_REASON_ERROR, message=st.error or "")
    if st.status == CANCELLED:
        return common_pb2.Finished(reason=common_pb2.FINISH_REASON_CANCELLED)
    return common_pb2.Finished(reason=FINISH_REASON_BY_NAME.get(st.finish_reason or "",
                                                                common_pb2.FINISH_REASON_UNSPECIFIED))


# ---- fan-out ------------------------------------------------------------------------------------

@dataclass
class End:
    """The last item a subscriber gets: a Finished event, or a status to abort with."""
    finished: common_pb2.Finished | None = None
    code: grpc.StatusCode | None = None
    message: str = ""
    final: bool = True   # the request ended; False: a Redis outage interrupted it (recoverable)


class Subscriber:
    def __init__(self, steps: bool, attach_id: str = ""):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.steps = steps
        self.attach_id = attach_id   # the stream's `cde-attach-id` (what a Detach names); "" = none


class DeadlinePassed(Exception):
    pass


class Outcome(enum.Enum):
    DONE = 1      # the request reached an end (published)
    REPLACE = 2   # place it again (worker lost, or a transient refusal)


# ---- the run ------------------------------------------------------------------------------------

class RequestRun:
    def __init__(self, ctx: RunContext, request: scheduler_pb2.SubmitRequest, deadline: float | None):
        self.ctx = ctx
        self.request = request
        self.rid = request.request_id
        self.deadline = deadline
        self.subscribers: set[Subscriber] = set()
        self.task: asyncio.Task | None = None
        self.done = False
        self.started = time.monotonic()
        self._just_created = False
        self._placed_at_create: Reservation | None = None   # see start()
        self.worker: WorkerHandle | None = None
        self.has_slot = False
        self.first_block = first_block(request)
        self.next_block = 0            # next block Redis expects (numbered from 0 per request)
        self.published_upto = -1       # highest absolute block index published to subscribers
        self.avoid: set[str] = set()   # workers that failed this request (tried last)
        self._cancel_reason: str | None = None
        self._lost_worker: str | None = None
        self._call = None
        self._last_worker: WorkerHandle | None = None
        self._just_created = False   # set by start(): see there
        self._placed = False         # sent to a worker once (RelayTiming counts the first time)
        self._grace: asyncio.TimerHandle | None = None   # the detach grace running (no subscriber)
        stops = set(request.options.stop_ids)
        self.session = None
        if ctx.attribution is not None and request.attribution != common_pb2.ATTRIBUTION_NONE:
            self.session = AttributionSession(ctx.attribution, self.rid, request.model, request.attribution,
                                              request.attribution_top_k, stops, self._stored_blocks)

    # ---- subscribers --------------------------------------------------------------------------
    def subscribe(self, steps: bool, attach_id: str = "") -> Subscriber:
        sub = Subscriber(steps, attach_id)
        self.subscribers.add(sub)
        if self._grace is not None:   # reattached within the grace
            self._grace.cancel()
            self._grace = None
        return sub

    def unsubscribe(self, sub: Subscriber, client_gone: bool = True, left: bool = False) -> None:
        """A stream ended before the request did. ``client_gone=False``: it failed on our side
        (e.g. a Redis error while attaching), which must never cancel the request. ``left``: its
        client said it is gone for good (`detach`), so the last one leaving cancels at once;
        otherwise the stream just broke (a gateway process died, or an old gateway that never
        sends Detach) and the request waits the detach grace for a Resume before it is cancelled."""
        if sub not in self.subscribers:   # detached already
            return
        self.subscribers.discard(sub)
        if self.subscribers or self.done or self.ctx.closing() or not client_gone:
            return
        grace = self.ctx.limits.detach_grace_s
        if left or grace <= 0:
            self.cancel("client gone")
            return
        log.info("request %s: its last stream broke without a Detach; cancelling it in %gs unless a "
                 "stream reattaches", self.rid, grace)
        if self._grace is not None:
            self._grace.cancel()
        self._grace = asyncio.get_running_loop().call_later(grace, self._grace_over)

    def _grace_over(self) -> None:
        self._grace = None
        if not self.subscribers and not self.done and not self.ctx.closing():
            self.cancel("client gone (no stream reattached within the detach grace)")

    def detach(self, attach_id: str) -> bool:
        """The client of the stream ``attach_id`` left for good: that stream no longer counts, and
        with no other stream attached the request is cancelled now (also when the stream itself
        closed first and the grace is running). True when this cancelled the request."""
        if self.done:
            return False
        sub = next((s for s in self.subscribers if attach_id and s.attach_id == attach_id), None)
        if sub is not None:
            self.unsubscribe(sub, left=True)
            # its stream may still be open on our side (the Detach overtook its close): end it
            sub.queue.put_nowait(End(code=grpc.StatusCode.CANCELLED, message="detached"))
        elif not self.subscribers and not self.ctx.closing():
            self.cancel("client gone")
        if self.subscribers:
            return False
        if self._grace is not None:
            self._grace.cancel()
            self._grace = None
        return self._cancel_reason is not None

    def _publish(self, event: scheduler_pb2.SchedulerEvent, step: bool = False) -> None:
        for sub in self.subscribers:
            if sub.steps or not step:
                sub.queue.put_nowait(event)

    def _publish_block(self, block: common_pb2.BlockCommitted) -> None:
        if block.block_index > self.published_upto:
            self.published_upto = block.block_index
            self._publish(scheduler_pb2.SchedulerEvent(block=block))

    def _end(self, end: End) -> None:
        self.done = True
        for sub in self.subscribers:
            sub.queue.put_nowait(end)

    # ---- control ------------------------------------------------------------------------------
    async def place_now(self) -> Reservation | None:
        """A slot and the best worker's pages, taken now if both are free without waiting (the
        request can then be created running there: `RequestStore.create(worker=...)`), else None
        and the run waits for them itself. `unplace` gives them back if the create does not happen."""
        if self.ctx.slots.locked():
            return None
        worker = self.ctx.pool.pick(self.request.model, self.avoid)
        if worker is None:
            return None
        await self.ctx.slots.acquire()   # not locked: takes a slot at once, no suspension (no await above)
        self.has_slot = True
        return self.ctx.pool.reserve(worker, self.rid, pages_needed(self.request), self.worker_lost)

    def unplace(self, placed: Reservation | None) -> None:
        if placed is not None:
            self.ctx.pool.release(placed, placed=False)
            self.ctx.slots.release()
            self.has_slot = False

    def start(self, just_created: bool = False, placed: Reservation | None = None) -> None:
        """just_created: this instance created the request a moment ago (it is queued unless a
        cancel came since, which the claim then refuses), so its first placement skips reading it
        back: under a burst every Redis round trip of the way to the worker adds up. placed: it
        was created running on this reservation's worker (`place_now`), so it streams at once."""
        self._just_created = just_created
        self._placed_at_create = placed
        self.task = asyncio.get_running_loop().create_task(self._main(), name=f"run-{self.rid}")

    def cancel(self, reason: str) -> bool:
        """Cancel the request (Redis, worker, subscribers). False if it already ended."""
        if self.done:
            return False
        if self._cancel_reason is None and self.task is not None:
            self._cancel_reason = reason
            # Not task.cancel() right here: a task that has not taken its first step yet would
            # die without running _main's handlers. Callbacks run in order, so by the time this
            # one runs the task is parked at its first await.
            asyncio.get_running_loop().call_soon(self._cancel_task)
        return True

    def _cancel_task(self) -> None:
        if not self.done and self.task is not None:
            self.task.cancel()

    def worker_lost(self, worker_id: str) -> None:
        """The pool declared our worker dead: abandon its stream (the run re-places itself)."""
        if self.worker is not None and self.worker.worker_id == worker_id and self._call is not None:
            self._lost_worker = worker_id
            self._call.cancel()

    async def wait(self, timeout: float) -> None:
        if self.task is not None:
            await asyncio.wait({self.task}, timeout=timeout)

    # ---- the task -----------------------------------------------------------------------------
    async def _main(self) -> None:
        try:
            try:
                await self._drive_through_redis_outages()
            except DeadlinePassed:
                await self._cancelled("deadline exceeded")
        except asyncio.CancelledError:
            if self._cancel_reason is None:
                raise   # scheduler shutdown: Redis keeps the request for the next instance
            asyncio.current_task().uncancel()
            await asyncio.shield(self._cancelled(self._cancel_reason))
        except redis.exceptions.RedisError as e:
            log.error("request %s: Redis failed (%s); left for recovery", self.rid, e)
            await self.ctx.redis_failed(e)
            self._end(End(code=grpc.StatusCode.UNAVAILABLE, message=f"request state unavailable: {e}", final=False))
        except Exception as e:  # a bug: fail the request loudly rather than hang its clients
            log.exception("request %s failed in the scheduler", self.rid)
            await self._give_up(grpc.StatusCode.INTERNAL, f"scheduler error: {e!r}")
        finally:
            self.done = True
            if self._placed_at_create is not None:   # ended before streaming from it
                self.ctx.pool.release(self._placed_at_create, placed=False)
                self._placed_at_create = None
            if self.has_slot:
                self.ctx.slots.release()
                self.has_slot = False
            self.ctx.ended(self)
            if self.session is not None:
                await self.session.close()

    def _time_left(self) -> float | None:
        if self.deadline is None:
            return None
        left = self.deadline - time.time()
        if left <= 0:
            raise DeadlinePassed()
        return left

    async def _redis(self, op, what: str):
        """``await op()``, retried with backoff on transient Redis errors for up to
        REDIS_RETRY_S (within the deadline): a hiccup must not end a running request."""
        give_up_at = time.monotonic() + REDIS_RETRY_S
        delay = 0.05
        while True:
            try:
                return await op()
            except _TRANSIENT as e:
                if time.monotonic() + delay > give_up_at:
                    raise
                log.warning("request %s: %s failed (%s); retrying in %.2fs", self.rid, what, e, delay)
                await self.ctx.redis_failed(e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def _drive_through_redis_outages(self) -> None:
        """`_drive`, started again (it resumes from what Redis holds) after a transient Redis
        failure outside the retried calls, for up to REDIS_RETRY_S of consecutive failures."""
        give_up_at = time.monotonic() + REDIS_RETRY_S
        delay = 0.1
        while True:
            try:
                return await self._drive()
            except _TRANSIENT as e:
                if time.monotonic() + delay > give_up_at:
                    raise
                log.warning("request %s: Redis failed (%s); starting over from Redis in %.1fs", self.rid, e, delay)
                await self.ctx.redis_failed(e)
                await asyncio.sleep(delay)
                self._time_left()
                delay = min(delay * 2, 1.0)

    async def _acquire_slot(self) -> None:
        if self.has_slot:
            return
        try:
            await asyncio.wait_for(self.ctx.slots.acquire(), self._time_left())
        except asyncio.TimeoutError:
            raise DeadlinePassed() from None
        self.has_slot = True

    async def _drive(self) -> None:
        store, pool, limits = self.ctx.store, self.ctx.pool, self.ctx.limits
        await self._acquire_slot()
        pages = pages_needed(self.request)
        failures = 0
        while True:
            if self._placed_at_create is not None:   # created running there: claimed by the create
                reservation, self._placed_at_create = self._placed_at_create, None
                worker, self._just_created = reservation.worker, False
                claimed = Claimed(next_block=0, attempt=0)
            else:
                if self._just_created:
                    self._just_created = False
                else:
                    st = await store.get(self.rid)
                    if st is None or st.terminal:
                        await self._end_from_store(st)
                        return
                    if st.status == RUNNING:   # an attempt nobody streams any more (e.g. before a restart)
                        await store.requeue(self.rid)
                        failures += 1
                        if failures > limits.max_attempts:
                            await self._give_up(grpc.StatusCode.UNAVAILABLE, "could not take the request over")
                            return
                        continue
                wait = limits.queue_timeout_s
                left = self._time_left()
                worker = await pool.wait_for(self.request.model, self.avoid, wait if left is None else min(wait, left))
                if worker is None:
                    self._time_left()
                    if self.request.model and pool.live():
                        await self._give_up(grpc.StatusCode.NOT_FOUND, f"no worker serves model {self.request.model!r}")
                    else:
                        await self._give_up(grpc.StatusCode.UNAVAILABLE, f"no worker available within {wait:g}s")
                    return
                # Reserve the pages before the next await: the other runs of a burst pick meanwhile and
                # must see them, or they all land on the same worker.
                reservation = pool.reserve(worker, self.rid, pages, self.worker_lost)
                try:
                    claimed = await store.claim(self.rid, worker.worker_id)
                except BaseException:
                    pool.release(reservation, placed=False)
                    raise
                # not claimed: cancelled meanwhile (seen above next round) or claimed by another instance
                if claimed is None:
                    pool.release(reservation, placed=False)
                    continue
            outcome = await self._stream_reserved(reservation, claimed)
            if outcome is Outcome.DONE:
                return
            failures += 1
            if failures > limits.max_attempts:
                await self._give_up(grpc.StatusCode.UNAVAILABLE, f"gave up after {failures} lost or failed placements")
                return
            await store.requeue(self.rid, worker.worker_id)
            await asyncio.sleep(min(0.05 * failures, 1.0))

    # ---- one placement ----------------------------------------------------------------------------
    async def _stream_reserved(self, reservation: Reservation, st: Claimed) -> Outcome:
        """Stream from the reserved worker; the reservation ends with the stream."""
        worker = reservation.worker
        self.worker = self._last_worker = worker
        try:
            return await self._stream(worker, st)
        finally:
            self.ctx.pool.release(reservation)
            self.worker = None

    async def _stored_blocks(self) -> list[common_pb2.BlockCommitted]:
        return [common_pb2.BlockCommitted.FromString(p) for _, p in await self.ctx.store.blocks(self.rid)]

    async def _stream(self, worker: WorkerHandle, st: Claimed) -> Outcome:
        # blocks 0 .. next_block - 1 are stored (index CAS): a request with none skips the read
        blocks = await self._stored_blocks() if st.next_block else []
        self.next_block = st.next_block
        for b in blocks:   # a subscriber may have missed these if an earlier attempt was interrupted
            self._publish_block(b)
        # The attribution service must know which block is the generation's last: the worker
        # marks it (`last`), so blocks are attributed and published as soon as they arrive.
        r = self.request
        submit = worker_pb2.WorkerSubmit(
            request_id=self.rid, prompt_tokens=r.prompt_tokens,
            committed_tokens=[t for b in blocks for t in b.tokens],
            next_step=blocks[-1].next_step if blocks else 0, options=r.options, stream_steps=r.stream_steps,
            no_records=self.session is None)   # records feed attributions only
        if r.HasField("steering"):
            submit.steering.CopyFrom(r.steering)
        call = worker.stub.Submit(submit, timeout=self._time_left())
        issued_at = time.monotonic()
        timing = self.ctx.timing
        if not self._placed:
            self._placed = True
            timing.placed += 1
            timing.submit_to_worker_s += issued_at - self.started
        self._call, self._lost_worker = call, None
        try:
            while True:
                ev = await call.read()
                if ev is grpc.aio.EOF:
                    break
                kind = ev.WhichOneof("event")
                if kind == "step":
                    if r.stream_steps:
                        self._publish(scheduler_pb2.SchedulerEvent(step=ev.step), step=True)
                elif kind == "block":
                    read_at, first = time.monotonic(), self.published_upto < 0
                    if not await self._commit(ev.block, ev.block.last, st.attempt):
                        return await self._ownership_lost()
                    if first and self.published_upto >= 0:
                        timing.first_blocks += 1
                        timing.first_block_relay_s += time.monotonic() - read_at
                        if trace.enabled():
                            trace.record("scheduler", self.rid, sch_submit=trace.wall(self.started),
                                         sch_worker_submit=trace.wall(issued_at), sch_first_read=trace.wall(read_at),
                                         sch_first_published=time.time())
                elif kind == "finished":
                    return await self._finished(ev.finished, st.attempt)
            return await self._worker_failed(worker, "stream ended without Finished")
        except grpc.aio.AioRpcError as e:
            code = e.code()
            if code in REQUEST_FAULTS:
                await self._give_up(code, e.details() or code.name)
                return Outcome.DONE
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise DeadlinePassed() from None
            if code == grpc.StatusCode.ALREADY_EXISTS:   # its previous attempt is still winding down there
                self.avoid.add(worker.worker_id)
                return Outcome.REPLACE
            return await self._worker_failed(worker, f"{code.name}: {e.details()}")
        except asyncio.CancelledError:
            if self._lost_worker == worker.worker_id and not asyncio.current_task().cancelling():
                return Outcome.REPLACE   # declared dead by the pool, which requeued the request
            raise
        finally:
            self._call = None
            if not call.done():
                call.cancel()

    async def _worker_failed(self, worker: WorkerHandle, why: str) -> Outcome:
        log.warning("request %s: stream from worker %s failed: %s", self.rid, worker.worker_id, why)
        if await self.ctx.pool.probe(worker):
            self.avoid.add(worker.worker_id)
        else:
            await self.ctx.pool.declare_dead(worker.worker_id, why)
        return Outcome.REPLACE

    async def _ownership_lost(self) -> Outcome:
        """Redis refused our append: the request ended, or was requeued under us."""
        st = await self.ctx.store.get(self.rid)
        if st is None or st.terminal:
            await self._end_from_store(st)
            return Outcome.DONE
        return Outcome.REPLACE

    async def _commit(self, block: common_pb2.BlockCommitted, last: bool, attempt: int) -> bool:
        """Attribute, store exactly once, publish. False when the request is no longer ours."""
        stored_index = block.block_index - self.first_block
        if stored_index < self.next_block:
            return True   # already stored by an earlier attempt
        if self.session is not None:
            resp = await self.session.attribute(block, last)
            if resp is not None:
                block.token_attributions.extend(resp.token_attributions)
                block.chunk_attributions.extend(resp.chunk_attributions)
        payload = block.SerializeToString()
        result = await self._redis(lambda: self.ctx.store.append_block(self.rid, stored_index, payload,
                                                                       len(block.tokens), attempt),
                                   f"storing block {block.block_index}")
        if result == "stored":
            self.next_block = stored_index + 1
            self._publish_block(block)
            return True
        if result == "duplicate":
            if stored_index >= self.next_block:   # our own write, retried after its reply was lost
                self.next_block = stored_index + 1
                self._publish_block(block)
            return True
        if result == "not_running":
            return False
        raise RuntimeError(f"block {block.block_index} is out of order (Redis expects "
                           f"{self.first_block + self.next_block})")

    async def _finished(self, fin: common_pb2.Finished, attempt: int) -> Outcome:
        store = self.ctx.store
        if fin.reason == common_pb2.FINISH_REASON_CANCELLED:   # cancelled at the worker directly
            await self._cancelled(fin.message or "cancelled by the worker")
            return Outcome.DONE
        ending = fin.SerializeToString()   # saved with the transition, for replays
        if fin.reason == common_pb2.FINISH_REASON_ERROR:
            ok = await self._redis(lambda: store.fail(self.rid, fin.message or "worker error", attempt, ending), "fail")
        else:
            # stop or length; an unspecified reason reads as stop
            ok = await self._redis(lambda: store.finish(self.rid, FINISH_REASON_TEXT.get(fin.reason, "stop"), attempt,
                                                        ending), "finish")
        if not ok:
            return await self._ownership_lost()
        self._end(End(finished=fin))
        return Outcome.DONE

    # ---- endings (each terminal transition saves its Finished for replays in the same script) ----

    async def _flush_stored(self) -> None:
        """Publish stored blocks a subscriber has not had (an interrupted commit)."""
        for _, payload in await self.ctx.store.blocks(self.rid, stored_after(self.request, self.published_upto)):
            self._publish_block(common_pb2.BlockCommitted.FromString(payload))

    async def _end_from_store(self, st: RequestState | None) -> None:
        if st is None:   # a run exists only for a request it created: its state was lost, not the client's fault
            self._end(End(code=grpc.StatusCode.UNAVAILABLE,
                          message=f"request {self.rid!r} lost its state in Redis (restarted without persistence "
                                  "or flushed); send it again"))
            return
        await self._flush_stored()
        self._end(End(finished=stored_finished(st, await self.ctx.store.ending(self.rid))))

    async def _cancelled(self, reason: str) -> None:
        store = self.ctx.store
        fin = common_pb2.Finished(reason=common_pb2.FINISH_REASON_CANCELLED, message=reason)
        if not await self._redis(lambda: store.cancel(self.rid, fin.SerializeToString()), "cancel"):
            st = await store.get(self.rid)
            if st is not None and st.status in (FINISHED, FAILED):   # it ended first: report that
                await self._end_from_store(st)
                return
        w = self._last_worker
        if w is not None and not w.dead:   # the closed stream cancels too; this frees pages sooner
            try:
                await w.stub.Cancel(common_pb2.CancelRequest(request_id=self.rid), timeout=1.0)
            except grpc.aio.AioRpcError:
                pass
        log.info("request %s cancelled: %s", self.rid, reason)
        await self._flush_stored()
        self._end(End(finished=fin))

    async def _give_up(self, code: grpc.StatusCode, message: str) -> None:
        """End the request with an error status for live subscribers (Finished ERROR on replay)."""
        store = self.ctx.store
        log.warning("request %s failed: %s %s", self.rid, code.name, message)
        try:
            # still queued: cancelled is its only way out of the queue
            ending = common_pb2.Finished(reason=common_pb2.FINISH_REASON_ERROR, message=message).SerializeToString()
            if not await store.fail(self.rid, message, ending=ending):
                await store.cancel(self.rid, ending)
        except redis.exceptions.RedisError as e:
            log.error("request %s: could not record the failure: %s", self.rid, e)
        self._end(End(code=code, message=message))
