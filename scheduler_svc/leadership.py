"""Which of several scheduler processes is the active one: a lease in Redis plus a fencing
token (scheduler HA).

Keys (``P`` = prefix)::

    P leader         string  "<token>|<instance id>|<address>", with a TTL (the lease)
    P leader:token   string  the fencing token: INCR on every acquisition, never reset

* acquire (one Lua script = SET NX PX + INCR): when no lease exists, or when it names our
  own instance id (this replica restarted: its predecessor is gone, so no wait for the TTL).
* renew every ``ttl/3``: PEXPIRE when the lease is still ours; also re-SET it when it
  expired (e.g. Redis was away longer than the TTL) but the token counter still holds our
  token, i.e. nobody was elected meanwhile. Otherwise the lease is lost.
* every state write carries the token (scheduler_svc/fencing.py), so a deposed leader that
  has not noticed yet is refused by Redis itself; a refused write deposes it at once.

`LeaderLoop.run` is the scheduler's background task when HA is on: campaign (standby:
gRPC health of ``cde.v1.Scheduler`` NOT_SERVING, ``""`` SERVING so liveness probes pass;
every RPC answers UNAVAILABLE naming the active scheduler), then, as leader, the usual
`SchedulerCore.run_background` (take over every request from Redis, go SERVING) next to
the renewal; when the lease is lost, step down (stop every run without touching Redis,
their client streams end UNAVAILABLE so clients move on) and campaign again.

A standby takes over within about ``ttl + ttl/4`` of the leader's death.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import redis.asyncio as aioredis
import redis.exceptions
from grpc_health.v1 import health_pb2

from scheduler_svc.fencing import WriteGuard

log = logging.getLogger("scheduler_svc.leadership")

SCHEDULER_SERVICE = "cde.v1.Scheduler"

# KEYS: lease, token   ARGV: instance, address, ttl_ms   -> {token, value} or {0, current value}
_ACQUIRE = """
local cur = redis.call('GET', KEYS[1])
if cur then
  local holder = string.match(cur, '^[^|]*|([^|]*)|')
  if holder ~= ARGV[1] then return {0, cur} end
end
local t = redis.call('INCR', KEYS[2])
local v = t .. '|' .. ARGV[1] .. '|' .. ARGV[2]
redis.call('SET', KEYS[1], v, 'PX', tonumber(ARGV[3]))
return {t, v}
"""

# KEYS: lease, token   ARGV: value, token, ttl_ms   -> 1 kept, 0 lost
_RENEW = """
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] or (not cur and redis.call('GET', KEYS[2]) == ARGV[2]) then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', tonumber(ARGV[3]))
  return 1
end
return 0
"""

# KEYS: lease   ARGV: value
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def default_instance_id(port: int) -> str:
    return f"{socket.gethostname()}-{port}"


def _s(v) -> str:
    return v.decode() if isinstance(v, (bytes, bytearray)) else str(v)


class Leadership:
    """The lease of one scheduler process. ``guard`` goes to its RequestStore."""

    def __init__(self, client: aioredis.Redis, prefix: str, instance: str, address: str, ttl_ms: int = 3000,
                 guard: WriteGuard | None = None):
        if ttl_ms < 300:
            raise ValueError(f"lease ttl must be >= 300 ms, got {ttl_ms}")
        if "|" in instance or "|" in address:
            raise ValueError("scheduler id and address must not contain '|'")
        self.redis = client
        self.lease_key = f"{prefix}leader"
        self.token_key = f"{prefix}leader:token"
        self.instance = instance
        self.address = address
        self.ttl_ms = ttl_ms
        self.guard = guard or WriteGuard()
        self.guard.fence_key = self.token_key
        self.guard.on_fenced = self._fenced
        self.value: str | None = None
        self.leader_value: str | None = None    # the lease as last seen (for standby answers)
        self.lost = asyncio.Event()
        self._acquire = client.register_script(_ACQUIRE)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)

    @property
    def token(self) -> int | None:
        return self.guard.token

    @property
    def is_leader(self) -> bool:
        return self.guard.token is not None

    def leader_address(self) -> str:
        parts = (self.leader_value or "").split("|")
        return parts[2] if len(parts) == 3 else ""

    def standby_reason(self) -> str:
        where = self.leader_address()
        return (f"standby scheduler: the active one is {where}" if where
                else "standby scheduler: no active scheduler yet (election in progress)")

    def _fenced(self, why: str) -> None:
        if self.is_leader:
            log.error("deposed: %s", why)
            self._lose()

    def _lose(self) -> None:
        self.guard.token = None
        self.value = None
        self.lost.set()

    async def try_acquire(self) -> bool:
        token, value = await self._acquire(keys=[self.lease_key, self.token_key],
                                           args=[self.instance, self.address, self.ttl_ms])
        self.leader_value = _s(value)
        if int(token) == 0:
            return False
        self.value = self.leader_value
        self.lost.clear()
        self.guard.token = int(token)
        return True

    async def renew(self) -> bool:
        if self.value is None:
            return False
        kept = await self._renew(keys=[self.lease_key, self.token_key],
                                 args=[self.value, str(self.guard.token), self.ttl_ms])
        if not kept and self.is_leader:
            log.error("lease lost (another scheduler holds it, or Redis lost it)")
            self._lose()
        return bool(kept)

    async def release(self) -> None:
        """Give the lease up (graceful stop): a standby takes over without waiting for the TTL."""
        value, self.value = self.value, None
        self.guard.token = None
        if value is not None:
            try:
                await asyncio.wait_for(self._release(keys=[self.lease_key], args=[value]), 2.0)
            except (redis.exceptions.RedisError, OSError, asyncio.TimeoutError) as e:
                log.warning("could not release the lease (%s): it expires in %d ms", e, self.ttl_ms)

    async def keep(self) -> None:
        """Renew until the lease is lost (returns then). A Redis that does not answer is no
        reason to step down: nobody else can be elected through it, and fencing refuses our
        writes if someone was."""
        period = self.ttl_ms / 3000
        while not self.lost.is_set():
            try:
                await asyncio.wait_for(self.lost.wait(), period)
                return
            except asyncio.TimeoutError:
                pass
            try:
                await asyncio.wait_for(self.renew(), period)
            except (redis.exceptions.RedisError, OSError, asyncio.TimeoutError) as e:
                log.warning("lease renewal failed (%s); retrying", e)


class LeaderLoop:
    """The scheduler's background task with HA on (see the module docstring)."""

    def __init__(self, core, leadership: Leadership):
        self.core = core
        self.leadership = leadership

    async def _standby_health(self, health) -> None:
        await health.set("", health_pb2.HealthCheckResponse.SERVING)
        await health.set(SCHEDULER_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def run(self, health) -> None:
        core, lead = self.core, self.leadership
        core.health = health
        try:
            while True:
                await self._campaign(health)
                log.info("active scheduler %s (fencing token %d)", lead.instance, lead.token)
                # judge workers by heartbeats from now on: they were beating to the old leader
                core.started = time.monotonic()
                background = asyncio.create_task(core.run_background(health), name="scheduler-background")
                keeper = asyncio.create_task(lead.keep(), name="scheduler-lease")
                try:
                    await asyncio.wait({background, keeper}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for t in (background, keeper):
                        t.cancel()
                    await asyncio.gather(background, keeper, return_exceptions=True)
                if background.done() and not background.cancelled() and background.exception() is not None:
                    log.error("scheduler background failed: %r", background.exception())
                await self.step_down(health, "lease lost")
        finally:
            await lead.release()

    async def _campaign(self, health) -> None:
        lead = self.leadership
        announced = False
        while True:
            try:
                if await lead.try_acquire():
                    return
                if not announced:
                    log.info("standby: %s", lead.standby_reason())
                    announced = True
                await self._standby_health(health)
            except (redis.exceptions.RedisError, OSError) as e:
                log.warning("campaign: Redis unavailable (%s)", e)
                await health.set_serving(False)
            await asyncio.sleep(lead.ttl_ms / 4000)

    async def step_down(self, health, why: str) -> None:
        """Stop every run here without writing to Redis (the new leader owns the requests);
        their client streams end UNAVAILABLE (not final), so clients reattach elsewhere."""
        core = self.core
        core.ready.clear()
        core.serving = False
        await self._standby_health(health)
        runs = list(core.runs.values())
        for run in runs:
            run.hand_over(f"scheduler {self.leadership.instance} stepped down ({why}); retry")
        tasks = [r.task for r in runs if r.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        core.runs.clear()
        await core.pool.close()
        log.warning("stepped down (%s): %d runs handed over", why, len(runs))

