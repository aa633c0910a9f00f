"""What a request's run is given by the scheduler, and the two limits it lives within: the
request's deadline, and how long a transient Redis failure may last before the run gives up.

The run never reaches into the scheduler itself: everything it uses comes in a `RunContext`
(store, worker pool, attribution pool, slots, limits and three callbacks).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis.exceptions

from scheduler_svc.attribution import AttributionPool
from scheduler_svc.state import RequestStore
from scheduler_svc.workers import WorkerPool

log = logging.getLogger("scheduler_svc.run")

# A transient Redis failure (pool wait ran out, dropped connection, a restart) while a request
# runs: retry the call with backoff for this long before the run gives up on Redis.
REDIS_RETRY_S = 30.0
TRANSIENT_REDIS_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)

T = TypeVar("T")


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
    ended: Callable[[Any], None]                           # called with the RequestRun whose task is over
    timing: RelayTiming = field(default_factory=RelayTiming)


class DeadlinePassed(Exception):
    pass


class Deadline:
    """The request's absolute deadline (``time.time()`` seconds; None: none)."""

    def __init__(self, at: float | None):
        self.at = at

    def left(self) -> float | None:
        """Seconds left (None: no deadline); DeadlinePassed once there are none."""
        if self.at is None:
            return None
        left = self.at - time.time()
        if left <= 0:
            raise DeadlinePassed()
        return left


async def with_redis_retries(ctx: RunContext, request_id: str, op: Callable[[], Awaitable[T]], what: str) -> T:
    """``await op()``, retried with backoff on transient Redis errors for up to REDIS_RETRY_S:
    a hiccup must not end a running request."""
    give_up_at = time.monotonic() + REDIS_RETRY_S
    delay = 0.05
    while True:
        try:
            return await op()
        except TRANSIENT_REDIS_ERRORS as e:
            if time.monotonic() + delay > give_up_at:
                raise
            log.warning("request %s: %s failed (%s); retrying in %.2fs", request_id, what, e, delay)
            await ctx.redis_failed(e)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)
