"""The cde.v1.Steering gRPC server: catalog search, listing and lookup (with a concept's top
tokens), prepared steering vectors.

The server binds and starts before the model is read, answering health NOT_SERVING (and
UNAVAILABLE to calls) until the catalog and tensors are loaded, so an orchestrator sees a
live but not yet ready process. Prepared steering is cached by request bytes: a chat's
every turn asks for the same steering, and a build reads the whole LM head.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import grpc

from cde.rpc import make_server, service_name
from cde.rpc.serving import serve_until_signal, start_then_load
from cde.rpc.v1 import common_pb2, steering_pb2, steering_pb2_grpc
from steering_svc.backend import PARAM_TRAILER, RequestError, SteeringBackend

log = logging.getLogger("steering_svc")

SERVICE = service_name(steering_pb2, "Steering")
DEFAULT_PORT = 50061
CACHE_ENTRIES = 256


class PreparedCache:
    """A bounded LRU of PreparedSteering by (model, serialized SteeringRequest).

    Used from the event loop thread only, so it needs no lock. Messages are shared, never mutated.
    """

    def __init__(self, capacity: int = CACHE_ENTRIES):
        self.capacity = capacity
        self._items: OrderedDict[bytes, common_pb2.PreparedSteering] = OrderedDict()

    @staticmethod
    def key(model: str, steering: common_pb2.SteeringRequest) -> bytes:
        return model.encode() + b"\0" + steering.SerializeToString(deterministic=True)

    def get(self, key: bytes) -> common_pb2.PreparedSteering | None:
        hit = self._items.get(key)
        if hit is not None:
            self._items.move_to_end(key)
        return hit

    def put(self, key: bytes, value: common_pb2.PreparedSteering) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


async def _refuse(context, e: RequestError) -> None:
    """Abort the call with the error's status; the offending field travels as a trailer."""
    trailer = ((PARAM_TRAILER, e.field),) if e.field else ()
    await context.abort(e.code, e.message, trailing_metadata=trailer)


class SteeringServicer(steering_pb2_grpc.SteeringServicer):
    def __init__(self, cache_entries: int = CACHE_ENTRIES):
        self.backend: SteeringBackend | None = None  # set once loaded
        self.cache = PreparedCache(cache_entries)

    async def _ready(self, context) -> SteeringBackend:
        if self.backend is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "steering service is still loading")
        return self.backend

    async def SearchConcepts(self, request, context):
        backend = await self._ready(context)
        try:
            return backend.search(request)
        except RequestError as e:
            await _refuse(context, e)

    async def GetConcept(self, request, context):
        backend = await self._ready(context)
        try:
            return backend.get_concept(request)
        except RequestError as e:
            await _refuse(context, e)

    async def ListConcepts(self, request, context):
        backend = await self._ready(context)
        try:
            return backend.list_concepts(request)
        except RequestError as e:
            await _refuse(context, e)

    async def DescribeConcept(self, request, context):
        backend = await self._ready(context)
        try:
            # off the event loop: the top tokens read the whole (V, D) LM head
            return await asyncio.to_thread(backend.describe, request)
        except RequestError as e:
            await _refuse(context, e)

    async def BuildSteering(self, request, context):
        backend = await self._ready(context)
        key = PreparedCache.key(request.model or backend.model_name, request.steering)
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        try:
            # off the event loop: the alpha and relu mask read the whole (V, D) LM head
            prepared = await asyncio.to_thread(backend.build, request)
        except RequestError as e:
            await _refuse(context, e)
        self.cache.put(key, prepared)
        return prepared


@dataclass
class RunningServer:
    """A started server: `port` is the bound port (useful with port 0)."""

    server: grpc.aio.Server
    port: int
    health: object
    servicer: SteeringServicer

    async def stop(self, grace: float | None = 5.0) -> None:
        await self.health.set_serving(False)
        await self.server.stop(grace)


async def build_server(model_dir: str | Path, host: str = "127.0.0.1", port: int = 0, *,
                       cache_entries: int = CACHE_ENTRIES) -> RunningServer:
    """Start a Steering server on host:port, load the model directory, then report SERVING.

    Must run inside the event loop that will serve. Raises if the port cannot be bound or the
    model cannot be read (the server is stopped first).
    """
    server, health = await make_server([SERVICE])
    servicer = SteeringServicer(cache_entries)
    steering_pb2_grpc.add_SteeringServicer_to_server(servicer, server)
    bound, servicer.backend = await start_then_load(server, health, host, port,
                                                    lambda: SteeringBackend(model_dir))
    log.info("steering: serving %s on %s:%d", servicer.backend.model_name, host, bound)
    return RunningServer(server, bound, health, servicer)


async def serve(args: argparse.Namespace) -> None:
    """Run until SIGTERM/SIGINT, then go NOT_SERVING and drain in-flight calls (args.grace seconds)."""
    running = await build_server(args.model_dir, args.host, args.port)
    await serve_until_signal(running, "steering", getattr(args, "grace", 5.0))
