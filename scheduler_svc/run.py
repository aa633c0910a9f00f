"""One request's life in the scheduler, as a task of its own, independent of any client stream.

`RequestRun` coordinates it: wait for a slot and a worker and claim the request there
(scheduler_svc/placement.py), stream from that worker and commit each block exactly once
(worker_stream.py, block_log.py), end it (endings.py), and place it again from its last
stored block when the worker is lost. Submit and Resume streams subscribe to the run
(fanout.py). When the last subscriber leaves early the request is cancelled: at once when
its client said it left (`detach`: the gateway's HTTP or gRPC client is gone), else after the
detach grace, so that a client whose stream merely broke (its gateway process died) can
Resume first.

Everything needed to pick the request up again lives in Redis (scheduler_svc/state.py): the
spec (spec.py), the stored blocks and the saved ending. A task cancelled without a cancel
request (scheduler shutdown) or handed over (`hand_over`: this scheduler stepped down) leaves
Redis untouched for the next active scheduler.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import redis.exceptions

from cde.rpc.v1 import scheduler_pb2
from scheduler_svc.block_log import BlockLog
from scheduler_svc.endings import Endings
from scheduler_svc.fanout import End, Fanout, Subscriber
from scheduler_svc.placement import Placement
from scheduler_svc.run_context import REDIS_RETRY_S, TRANSIENT_REDIS_ERRORS, Deadline, DeadlinePassed, RunContext
from scheduler_svc.worker_stream import Outcome, WorkerStream
from scheduler_svc.workers import Reservation, WorkerHandle

log = logging.getLogger("scheduler_svc.run")


class RequestRun:
    def __init__(self, ctx: RunContext, request: scheduler_pb2.SubmitRequest, deadline: float | None):
        self.ctx = ctx
        self.request = request
        self.rid = request.request_id
        self.started = time.monotonic()
        self.task: asyncio.Task | None = None
        self.deadline = Deadline(deadline)
        self.fanout = Fanout()
        self.blocks = BlockLog(ctx, request, self.fanout)
        self.endings = Endings(ctx, self.rid, self.blocks, self.fanout)
        self.placement = Placement(ctx, request, self.deadline, self.endings, self.worker_lost)
        self.stream = WorkerStream(ctx, request, self.deadline, self.started, self.fanout, self.blocks,
                                   self.endings, self.placement.avoid)
        self._task_over = False
        self._cancel_reason: str | None = None
        self._grace: asyncio.TimerHandle | None = None   # the detach grace running (no subscriber)

    @property
    def done(self) -> bool:
        """The request's End went out, or the task is over."""
        return self._task_over or self.fanout.ended

    @property
    def worker(self) -> WorkerHandle | None:
        """The worker streaming the request now (None: waiting for one)."""
        return self.stream.worker

    # ---- subscribers --------------------------------------------------------------------------
    def subscribe(self, steps: bool, attach_id: str = "") -> Subscriber:
        sub = Subscriber(steps, attach_id)
        self.fanout.subscribers.add(sub)
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
        subscribers = self.fanout.subscribers
        if sub not in subscribers:   # detached already
            return
        subscribers.discard(sub)
        if subscribers or self.done or self.ctx.closing() or not client_gone:
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
        if not self.fanout.subscribers and not self.done and not self.ctx.closing():
            self.cancel("client gone (no stream reattached within the detach grace)")

    def detach(self, attach_id: str) -> bool:
        """The client of the stream ``attach_id`` left for good: that stream no longer counts, and
        with no other stream attached the request is cancelled now (also when the stream itself
        closed first and the grace is running). True when this cancelled the request."""
        if self.done:
            return False
        subscribers = self.fanout.subscribers
        sub = next((s for s in subscribers if attach_id and s.attach_id == attach_id), None)
        if sub is not None:
            self.unsubscribe(sub, left=True)
            # its stream may still be open on our side (the Detach overtook its close): end it
            sub.queue.put_nowait(End(code=grpc.StatusCode.CANCELLED, message="detached"))
        elif not subscribers and not self.ctx.closing():
            self.cancel("client gone")
        if subscribers:
            return False
        if self._grace is not None:
            self._grace.cancel()
            self._grace = None
        return self._cancel_reason is not None

    # ---- control ------------------------------------------------------------------------------
    async def place_now(self) -> Reservation | None:
        """A slot and a worker taken now if free (`Placement.place_now`), for creating the request
        running there: `RequestStore.create(worker=...)`."""
        return await self.placement.place_now()

    def unplace(self, placed: Reservation | None) -> None:
        """Give back what `place_now` took, when the create did not happen."""
        self.placement.unplace(placed)

    def start(self, just_created: bool = False, placed: Reservation | None = None) -> None:
        """just_created: this instance created the request a moment ago (it is queued unless a
        cancel came since, which the claim then refuses), so its first placement skips reading it
        back: under a burst every Redis round trip of the way to the worker adds up. placed: it
        was created running on this reservation's worker (`place_now`), so it streams at once."""
        self.placement.created(just_created, placed)
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

    def hand_over(self, message: str) -> None:
        """Another scheduler takes the request over: end every stream UNAVAILABLE (not final, so
        clients reattach there) and stop the task without writing to Redis."""
        self.fanout.end(End(code=grpc.StatusCode.UNAVAILABLE, final=False, message=message))
        if self.task is not None:
            self.task.cancel()

    def worker_lost(self, worker_id: str) -> None:
        """The pool declared a worker dead: if it is ours, its stream is abandoned and the request
        placed again."""
        self.stream.worker_lost(worker_id)

    async def wait(self, timeout: float) -> None:
        if self.task is not None:
            await asyncio.wait({self.task}, timeout=timeout)

    # ---- the task -----------------------------------------------------------------------------
    async def _main(self) -> None:
        try:
            try:
                await self._drive_through_redis_outages()
            except DeadlinePassed:
                await self.endings.cancelled("deadline exceeded", self.stream.last_worker)
        except asyncio.CancelledError:
            if self._cancel_reason is None:
                raise   # scheduler shutdown or hand-over: Redis keeps the request for the next one
            asyncio.current_task().uncancel()
            await asyncio.shield(self.endings.cancelled(self._cancel_reason, self.stream.last_worker))
        except redis.exceptions.RedisError as e:
            log.error("request %s: Redis failed (%s); left for recovery", self.rid, e)
            await self.ctx.redis_failed(e)
            self.fanout.end(End(code=grpc.StatusCode.UNAVAILABLE, message=f"request state unavailable: {e}",
                                final=False))
        except Exception as e:  # a bug: fail the request loudly rather than hang its clients
            log.exception("request %s failed in the scheduler", self.rid)
            await self.endings.give_up(grpc.StatusCode.INTERNAL, f"scheduler error: {e!r}")
        finally:
            self._task_over = True
            self.placement.release()
            self.ctx.ended(self)
            await self.blocks.close()

    async def _drive_through_redis_outages(self) -> None:
        """`_drive`, started again (it resumes from what Redis holds) after a transient Redis
        failure outside the retried calls, for up to REDIS_RETRY_S of consecutive failures."""
        give_up_at = time.monotonic() + REDIS_RETRY_S
        delay = 0.1
        while True:
            try:
                return await self._drive()
            except TRANSIENT_REDIS_ERRORS as e:
                if time.monotonic() + delay > give_up_at:
                    raise
                log.warning("request %s: Redis failed (%s); starting over from Redis in %.1fs", self.rid, e, delay)
                await self.ctx.redis_failed(e)
                await asyncio.sleep(delay)
                self.deadline.left()
                delay = min(delay * 2, 1.0)

    async def _drive(self) -> None:
        """Place the request and stream it, again after each lost attempt, until it ends."""
        await self.placement.take_slot()
        self.placement.failures = 0   # each drive counts its own, like the Redis state it starts from
        while True:
            placed = await self.placement.claim()
            if placed is None:
                return
            reservation, claimed = placed
            if await self.stream.run(reservation, claimed) is Outcome.DONE:
                return
            if not self.placement.count_failure():
                await self.endings.give_up(grpc.StatusCode.UNAVAILABLE,
                                           f"gave up after {self.placement.failures} lost or failed placements")
                return
            await self.placement.requeue(reservation.worker.worker_id)
