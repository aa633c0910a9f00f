"""The cde.v1.Attribution gRPC server: one bidirectional stream per generation request.

Each request message (one committed block) gets exactly one response, in order. The only
state is the stream's open chunk (`compute.StreamState`), created with the stream and
dropped with it, so replicas need no coordination. The model-side data is four
memory-mapped checkpoint tensors (`compute.AttributionTables`) and the concept catalog.
Like every cde service it binds first and reports health NOT_SERVING until loaded.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

from attribution_svc.inputs import InputAttributionError, InputAttributor
from attribution_svc.compute import (
    AttributionTables,
    RecordsError,
    StreamState,
    attribute_block,
)
from cde.rpc import make_server, service_name
from cde.rpc.serving import serve_until_signal, start_then_load
from cde.rpc.v1 import attribution_pb2, attribution_pb2_grpc
from cde.steerling.catalog import ConceptCatalog

log = logging.getLogger("attribution_svc")

SERVICE = service_name(attribution_pb2, "Attribution")
DEFAULT_PORT = 50071


@dataclass
class Loaded:
    model_name: str
    tables: AttributionTables
    catalog: ConceptCatalog

    @classmethod
    def load(cls, model_dir: str | Path) -> Loaded:
        model_dir = Path(model_dir).resolve()
        tables = AttributionTables.open(model_dir)
        return cls(model_dir.name, tables, ConceptCatalog.load(model_dir, tables.cfg.n_known, tables.cfg.n_discovered))


class _CallerGone(Exception):
    """Raised in the job's thread once its stream has ended."""


class AttributionServicer(attribution_pb2_grpc.AttributionServicer):
    def __init__(self) -> None:
        self.loaded: Loaded | None = None  # set once loaded
        self.inputs: InputAttributor | None = None   # input attribution: the model, loaded on first use

    async def AttributeInputs(self, request, context):
        """One job on a thread of its own; its events (progress, targets, summary) streamed as they come."""
        loaded, inputs = self.loaded, self.inputs
        if loaded is None or inputs is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "attribution service is still loading")
        if request.model and request.model != loaded.model_name:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model {request.model!r}; "
                                f"this service serves {loaded.model_name!r}")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        done, gone = object(), threading.Event()

        def emit(ev) -> None:
            if gone.is_set():   # the caller left: stop at the next target
                raise _CallerGone
            loop.call_soon_threadsafe(queue.put_nowait, ev)

        def work() -> None:
            try:
                inputs.run(request, emit)
                loop.call_soon_threadsafe(queue.put_nowait, done)
            except _CallerGone:
                pass
            except BaseException as e:   # noqa: BLE001 - handed to the stream
                loop.call_soon_threadsafe(queue.put_nowait, e)

        loop.run_in_executor(None, work)
        try:
            while True:
                item = await queue.get()
                if item is done:
                    break
                if isinstance(item, InputAttributionError):
                    await context.abort(getattr(grpc.StatusCode, item.code), f"request {request.request_id!r}: {item}")
                if isinstance(item, BaseException):
                    log.exception("input attribution of %r failed", request.request_id, exc_info=item)
                    await context.abort(grpc.StatusCode.INTERNAL, f"input attribution failed: {type(item).__name__}")
                yield item
        finally:
            gone.set()


    async def Attribute(self, request_iterator, context):
        loaded = self.loaded
        if loaded is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "attribution service is still loading")
        state = StreamState()
        async for request in request_iterator:
            if request.model and request.model != loaded.model_name:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model {request.model!r}; "
                                    f"this service serves {loaded.model_name!r}")
            try:
                # off the event loop: gathers (k x D) embedding rows per token; the stream's
                # messages are handled one at a time, so `state` is never shared between threads
                response = await asyncio.to_thread(attribute_block, loaded.tables, loaded.catalog, state, request)
            except RecordsError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"request {request.request_id!r} block {request.block_index}: {e}")
            yield response


@dataclass
class RunningServer:
    """A started server: `port` is the bound port (useful with port 0)."""

    server: grpc.aio.Server
    port: int
    health: object
    servicer: AttributionServicer

    async def stop(self, grace: float | None = 5.0) -> None:
        await self.health.set_serving(False)
        await self.server.stop(grace)


async def build_server(model_dir: str | Path, host: str = "127.0.0.1", port: int = 0) -> RunningServer:
    """Start an Attribution server on host:port, load the model directory, then report SERVING.

    Must run inside the event loop that will serve. Raises if the port cannot be bound or the
    model cannot be read (the server is stopped first).
    """
    server, health = await make_server([SERVICE])
    servicer = AttributionServicer()
    attribution_pb2_grpc.add_AttributionServicer_to_server(servicer, server)
    bound, servicer.loaded = await start_then_load(server, health, host, port, lambda: Loaded.load(model_dir))
    servicer.inputs = InputAttributor(str(Path(model_dir).resolve()))
    log.info("attribution: serving %s on %s:%d", servicer.loaded.model_name, host, bound)
    return RunningServer(server, bound, health, servicer)


async def serve(args: argparse.Namespace) -> None:
    """Run until SIGTERM/SIGINT, then go NOT_SERVING and drain in-flight streams (args.grace seconds)."""
    running = await build_server(args.model_dir, args.host, args.port)
    await serve_until_signal(running, "attribution", getattr(args, "grace", 5.0))
