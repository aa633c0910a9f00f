"""Graceful drain on SIGTERM: take no new work, let the running requests finish, then exit.

Kubernetes (and compose, and the launcher) stop a worker with SIGTERM and kill it after a grace
period. Draining turns that period into finished requests instead of interrupted ones:

1. `DrainGate` (a server interceptor) refuses new ``Worker.Submit`` calls with UNAVAILABLE; the
   scheduler treats that like any failed placement on a live worker and places the request on
   another one;
2. health goes NOT_SERVING (a readiness probe sees it) and the heartbeat carries
   ``draining = true``, sent at once, so the scheduler places nothing here any more;
3. the Submit streams already running finish, for up to the drain timeout. Whatever still runs
   then is cut off when the worker stops: the scheduler sees the worker gone and resumes those
   requests on another worker from their last committed block (the usual worker-death path).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc

from cde.rpc.internal_auth import internal_channel
from cde.rpc.v1 import scheduler_pb2_grpc

log = logging.getLogger("worker_svc.drain")

SUBMIT_METHOD = "/cde.v1.Worker/Submit"
ANNOUNCE_TIMEOUT_S = 2.0


class DrainGate(grpc.aio.ServerInterceptor):
    """Counts the running Submit streams; once `close()` is called, refuses new ones."""

    def __init__(self) -> None:
        self.draining = False
        self.active = 0
        self.refused = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def close(self) -> None:
        self.draining = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """True when no Submit stream runs (within ``timeout_s``)."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    def _enter(self) -> None:
        self.active += 1
        self._idle.clear()

    def _leave(self) -> None:
        self.active -= 1
        if self.active == 0:
            self._idle.set()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method != SUBMIT_METHOD or handler.unary_stream is None:
            return handler
        inner, gate = handler.unary_stream, self

        async def submit(request, context):
            if gate.draining:
                gate.refused += 1
                await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is draining (shutting down): place elsewhere")
            gate._enter()   # no await between the check and the count: drain sees every stream it let in
            try:
                async for event in inner(request, context):
                    yield event
            finally:
                gate._leave()

        return grpc.unary_stream_rpc_method_handler(submit, handler.request_deserializer, handler.response_serializer)


async def announce_draining(registrar) -> None:
    """One heartbeat with draining = true now, rather than at the next interval (the scheduler
    would keep placing here meanwhile). Best effort: the regular heartbeats carry it too."""
    registrar.draining = True
    async with internal_channel(registrar.scheduler) as channel:
        with contextlib.suppress(grpc.aio.AioRpcError):
            await scheduler_pb2_grpc.SchedulerStub(channel).Heartbeat(registrar.info(), timeout=ANNOUNCE_TIMEOUT_S)


async def drain(gate: DrainGate, health, registrar, timeout_s: float) -> bool:
    """Steps 1-3 of the module docstring; True when every running request finished in time."""
    t0 = time.monotonic()
    gate.close()
    await health.set_serving(False)
    if registrar is not None:
        await announce_draining(registrar)
    running = gate.active
    log.info("draining: %d running request(s), waiting up to %.0fs for them", running, timeout_s)
    done = await gate.wait_idle(timeout_s)
    if done:
        log.info("drained: %d request(s) finished in %.1fs (%d new ones refused)", running,
                 time.monotonic() - t0, gate.refused)
    else:
        log.warning("drain timeout (%.0fs): %d request(s) still running are cut off; the scheduler resumes "
                    "them elsewhere", timeout_s, gate.active)
    return done
