"""gRPC channels to the scheduler and steering_svc, and the readiness check built on them.

Channels are grpc.aio, so they must be created inside the event loop that serves (Backends.open).
Readiness is three stages - scheduler, steering, at least one worker known to the scheduler -
each asked through grpc.health.v1 / Stats with a short deadline, so /health stays cheap and
says which stage is missing.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cde.rpc.internal_auth import internal_channel
from cde.rpc.leader_channel import scheduler_channel
from cde.rpc.v1 import scheduler_pb2, scheduler_pb2_grpc, steering_pb2_grpc

SCHEDULER_SERVICE = "cde.v1.Scheduler"
STEERING_SERVICE = "cde.v1.Steering"


@dataclass
class Readiness:
    ready: bool
    stages: dict[str, str]                       # stage -> "SERVING" or why not
    stats: scheduler_pb2.StatsResponse | None = None


async def _not_used() -> None:
    return None


@dataclass
class Backends:
    scheduler_addr: str
    steering_addr: str
    scheduler: scheduler_pb2_grpc.SchedulerStub = field(init=False)
    scheduler_channel: grpc.aio.Channel | None = field(init=False, default=None)
    steering: steering_pb2_grpc.SteeringStub | None = field(init=False, default=None)
    _channels: list[grpc.aio.Channel] = field(init=False, default_factory=list)
    _health: dict[str, tuple[health_pb2_grpc.HealthStub, str]] = field(init=False, default_factory=dict)

    @classmethod
    def open(cls, scheduler_addr: str, steering_addr: str) -> Backends:
        """Create the channels (lazy: nothing connects until the first call)."""
        b = cls(scheduler_addr, steering_addr)
        sched = scheduler_channel(scheduler_addr)   # several addresses: follows the active replica
        b._channels = [sched]
        b.scheduler_channel = sched
        b.scheduler = scheduler_pb2_grpc.SchedulerStub(sched)
        b._health = {"scheduler": (health_pb2_grpc.HealthStub(sched), SCHEDULER_SERVICE)}
        if steering_addr:   # "" for a causal model: it has no concepts to steer
            steer = internal_channel(steering_addr)
            b._channels.append(steer)
            b.steering = steering_pb2_grpc.SteeringStub(steer)
            b._health["steering"] = (health_pb2_grpc.HealthStub(steer), STEERING_SERVICE)
        return b

    async def close(self) -> None:
        for ch in self._channels:
            await ch.close()

    async def _check(self, stage: str, timeout: float) -> str:
        stub, service = self._health[stage]
        try:
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            return f"unreachable ({e.code().name})"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    async def stats(self, timeout: float = 1.0) -> scheduler_pb2.StatsResponse | None:
        try:
            return await self.scheduler.Stats(scheduler_pb2.StatsRequest(), timeout=timeout)
        except grpc.aio.AioRpcError:
            return None

    async def readiness(self, timeout: float = 1.0) -> Readiness:
        steering = self._check("steering", timeout) if "steering" in self._health else _not_used()
        sched, steer, stats = await asyncio.gather(self._check("scheduler", timeout), steering, self.stats(timeout))
        if stats is None:
            workers = "unknown (scheduler Stats failed)"
        elif not stats.workers:
            workers = "no workers registered"
        else:
            workers = "SERVING"
        stages = {"scheduler": sched, "steering": steer, "workers": workers}
        if steer is None:
            del stages["steering"]
        return Readiness(all(v == "SERVING" for v in stages.values()), stages, stats)
