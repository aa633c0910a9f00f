"""A client channel over several scheduler replicas that follows the active one (scheduler HA).

    channel = scheduler_channel("h1:50051,h2:50051")   # one address: a plain internal_channel
    stub = scheduler_pb2_grpc.SchedulerStub(channel)

Only the active scheduler reports ``cde.v1.Scheduler`` SERVING on grpc.health.v1; standbys
answer NOT_SERVING there and UNAVAILABLE to every RPC (scheduler_svc/leadership.py). So
`LeaderChannel`:

* sends each call to the replica it believes active (``current``);
* retries a unary call answered UNAVAILABLE once on another replica, if the health probe
  of all replicas finds another one SERVING (workers' RegisterWorker/Heartbeat, the
  gateway's Cancel/Stats);
* returns streaming calls as they are: a broken stream is the caller's to reattach (the
  gateway does, gateway/stream.py), and its wait for the channel, ``channel_ready()``,
  here waits until some replica is SERVING and makes it ``current``;
* re-checks ``current`` every ``watch_s`` in the background, so health checks made through
  the channel (the gateway's /health) move to the new leader by themselves.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cde.rpc.internal_auth import internal_channel

__all__ = ["LeaderChannel", "scheduler_channel", "SCHEDULER_SERVICE"]

log = logging.getLogger("cde.rpc.leader_channel")

SCHEDULER_SERVICE = "cde.v1.Scheduler"
PROBE_TIMEOUT_S = 0.5
WATCH_S = 0.5
_SERVING = health_pb2.HealthCheckResponse.SERVING


def split_addresses(target: str) -> list[str]:
    return [a.strip() for a in (target or "").split(",") if a.strip()]


def scheduler_channel(target: str) -> grpc.aio.Channel | LeaderChannel:
    """``target`` with one address: an ordinary channel; with several (comma-separated): a
    `LeaderChannel`. Must be called inside the event loop that uses it."""
    addresses = split_addresses(target)
    if len(addresses) <= 1:
        return internal_channel(target)
    return LeaderChannel(addresses)


class LeaderChannel:
    """Quacks like a grpc.aio.Channel for generated stubs (see the module docstring)."""

    def __init__(self, addresses: Sequence[str], service: str = SCHEDULER_SERVICE,
                 channel_factory: Callable[[str], grpc.aio.Channel] = internal_channel, watch_s: float = WATCH_S):
        if len(addresses) < 2:
            raise ValueError("LeaderChannel needs at least two addresses")
        self.addresses = list(addresses)
        self.service = service
        self.channels = [channel_factory(a) for a in self.addresses]
        self._health = [health_pb2_grpc.HealthStub(c) for c in self.channels]
        self.current = 0
        self.watch_s = watch_s
        self._lock: asyncio.Lock | None = None
        self._watch: asyncio.Task | None = None
        self._closed = False

    # ---- leader discovery -------------------------------------------------------------------------
    async def _serving(self, i: int) -> bool:
        try:
            resp = await self._health[i].Check(health_pb2.HealthCheckRequest(service=self.service),
                                               timeout=PROBE_TIMEOUT_S)
            return resp.status == _SERVING
        except grpc.aio.AioRpcError:
            return False

    async def find_leader(self) -> bool:
        """Probe every replica; make a SERVING one ``current`` (the current one if it still
        is). False when none is SERVING right now."""
        self._ensure_watch()
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            ok = await asyncio.gather(*(self._serving(i) for i in range(len(self.channels))))
            if ok[self.current]:
                return True
            for i, good in enumerate(ok):
                if good:
                    log.info("active scheduler is now %s (was %s)", self.addresses[i], self.addresses[self.current])
                    self.current = i
                    return True
            return False

    async def _watch_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.watch_s)
            if not await self._serving(self.current):
                await self.find_leader()

    def _ensure_watch(self) -> None:
        if self._watch is None and not self._closed:
            self._watch = asyncio.get_running_loop().create_task(self._watch_loop(), name="leader-watch")

    async def channel_ready(self) -> None:
        """Wait until some replica is SERVING (the caller bounds the wait)."""
        while not await self.find_leader():
            await asyncio.sleep(0.1)

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self.channels[self.current].get_state(try_to_connect)

    # ---- grpc.aio.Channel's face for stubs ---------------------------------------------------------
    def unary_unary(self, method, request_serializer=None, response_deserializer=None, **kw):
        return _UnaryUnary(self, (method, request_serializer, response_deserializer), kw)

    def unary_stream(self, method, request_serializer=None, response_deserializer=None, **kw):
        return _Passthrough(self, "unary_stream", (method, request_serializer, response_deserializer), kw)

    def stream_unary(self, method, request_serializer=None, response_deserializer=None, **kw):
        return _Passthrough(self, "stream_unary", (method, request_serializer, response_deserializer), kw)

    def stream_stream(self, method, request_serializer=None, response_deserializer=None, **kw):
        return _Passthrough(self, "stream_stream", (method, request_serializer, response_deserializer), kw)

    async def close(self, grace: float | None = None) -> None:
        self._closed = True
        if self._watch is not None:
            self._watch.cancel()
        for c in self.channels:
            await c.close(grace)

    async def __aenter__(self) -> LeaderChannel:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class _Passthrough:
    """A streaming multicallable: the call goes to the current replica as it is."""

    def __init__(self, owner: LeaderChannel, kind: str, args: tuple, kw: dict):
        self.owner, self.kind, self.args, self.kw = owner, kind, args, kw

    def __call__(self, *a, **kw):
        self.owner._ensure_watch()
        ch = self.owner.channels[self.owner.current]
        return getattr(ch, self.kind)(*self.args, **self.kw)(*a, **kw)


class _UnaryUnary:
    """A unary multicallable that moves to the active replica when answered UNAVAILABLE."""

    def __init__(self, owner: LeaderChannel, args: tuple, kw: dict):
        self.owner, self.args, self.kw = owner, args, kw

    def __call__(self, request, *, timeout: float | None = None, **kw):
        return self._call(request, timeout, kw)

    async def _call(self, request, timeout: float | None, kw: dict):
        owner = self.owner
        owner._ensure_watch()
        deadline = None if timeout is None else time.monotonic() + timeout
        tried: set[int] = set()
        while True:
            i = owner.current
            tried.add(i)
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                return await owner.channels[i].unary_unary(*self.args, **self.kw)(request, timeout=left, **kw)
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or len(tried) == len(owner.channels):
                    raise
                if not await owner.find_leader() or owner.current in tried:
                    raise
