"""Run REST (uvicorn) and the public gRPC server in one process, on one asyncio loop.

`serve(settings)` starts both and returns a `GatewayHandle` (ports, app, `stop()`), so a
launcher or a test can run the gateway in-process; `python -m gateway` wraps it with signals.
With `--processes N` (N > 1) `python -m gateway` is a supervisor instead (gateway/processes.py)
and each of its N children calls `serve` with the listening socket it was handed.
A background task polls the backends and flips the gateway's own grpc.health.v1 status, so a
compose health check on the gateway means "the whole chain can serve".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import grpc
import uvicorn
from fastapi import FastAPI

from cde import limits as L
from cde.rpc import MAX_MESSAGE_BYTES, make_server, service_name
from cde.rpc.v1 import generate_pb2, generate_pb2_grpc
from gateway.app import build_app
from gateway.auth import ApiKeyAuth, SharedBuckets, load_api_keys
from gateway.backends import Backends
from gateway.grpc_api import GenerationService
from gateway.metrics import GatewayMetrics
from gateway.pipeline import Limits, ModelCard, Pipeline

log = logging.getLogger("gateway")


@dataclass
class GatewaySettings:
    """Every knob, with its CLI flag (`--http-port`) and env fallback (`CDE_HTTP_PORT`)."""

    model_dir: str = "models/steerling-tiny"
    model_name: str = ""                  # "" = the model directory's name
    host: str = "127.0.0.1"
    http_port: int = 8000                 # 0 = any free port (tests)
    grpc_port: int = 50050                # 0 = any free port; -1 = no public gRPC server
    scheduler: str = "127.0.0.1:50051"
    steering: str = "127.0.0.1:50061"
    api_keys_file: str = ""
    api_keys: str = ""                    # comma-separated (CDE_API_KEYS)
    rate_limit_rpm: float = 0.0           # per API key; 0 = unlimited
    max_tokens_limit: int = L.MAX_TOKENS_LIMIT
    default_max_tokens: int = L.DEFAULT_MAX_TOKENS
    max_body_bytes: int = L.MAX_BODY_BYTES
    request_timeout_s: float = 600.0      # whole generation; 0 = none
    reattach_s: float = 30.0              # a broken scheduler stream is retried this long without progress
    health_interval_s: float = 2.0
    log_level: str = "info"
    processes: int = 1                    # > 1: that many gateway processes share both ports (SO_REUSEPORT)
    http_read_timeout_s: float = 30.0     # a request's headers and body must arrive within this (slow clients)
    max_connections: int = 4096           # open HTTP connections + requests in flight; past it new ones get 503

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], env: Mapping[str, str] | None = None) -> GatewaySettings:
        """CLI values win, then CDE_<FIELD> environment variables, then the defaults."""
        env = os.environ if env is None else env
        kw: dict[str, Any] = {}
        for f in fields(cls):
            v = values.get(f.name)
            if v is None and f"CDE_{f.name.upper()}" in env:
                v = env[f"CDE_{f.name.upper()}"]
            if v is not None:
                kw[f.name] = type(f.default)(v)
        return cls(**kw)


@dataclass
class GatewayHandle:
    settings: GatewaySettings
    app: FastAPI
    pipeline: Pipeline
    http_port: int
    grpc_port: int | None
    _uvicorn: uvicorn.Server
    _uvicorn_task: asyncio.Task[None]
    _grpc: grpc.aio.Server | None
    _monitor: asyncio.Task[None] | None
    _stopped: bool = field(default=False)

    @property
    def base_url(self) -> str:
        return f"http://{self.settings.host}:{self.http_port}"

    async def stop(self, grace_s: float = 2.0) -> None:
        if self._stopped:
            return
        self._stopped = True
        # streams cut by the stop send no Detach: the scheduler's grace lets their clients Resume elsewhere
        self.pipeline.closing = True
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
        self._uvicorn.should_exit = True  # uvicorn drains its connections (up to 5 s) meanwhile

        async def http_done() -> None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._uvicorn_task

        await asyncio.gather(http_done(), *([self._grpc.stop(grace_s)] if self._grpc is not None else []))
        await self.pipeline.flush_detaches(1.0)   # clients that left before the stop
        await self.pipeline.backends.close()

    async def wait(self) -> None:
        """Until uvicorn exits (e.g. stop() from elsewhere)."""
        await asyncio.shield(self._uvicorn_task)


def with_read_timeout(protocol: type, timeout_s: float) -> type:
    """uvicorn's HTTP protocol (h11 or httptools) with a deadline for reading each request: a
    connection whose request headers and body have not all arrived `timeout_s` after it opened,
    or after its previous response, is closed. uvicorn has no such timeout of its own, so a
    client that sends headers a byte at a time (or never finishes a body) held its socket forever.
    Reads the protocol's `cycle` (the request being served), as both implementations keep it."""

    class ReadTimeoutProtocol(protocol):
        _read_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_read_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_read_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
            super().connection_lost(exc)

        def _arm_read_timer(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
            self._read_timer = self.loop.call_later(timeout_s, self._read_timed_out)

        def _read_timed_out(self) -> None:
            cycle = self.cycle
            # no request yet, only the previous (finished) one, or a body still arriving
            if cycle is None or cycle.response_complete or cycle.more_body:
                self.transport.close()

    ReadTimeoutProtocol.__name__ = f"ReadTimeout{protocol.__name__}"
    return ReadTimeoutProtocol


def http_protocol(timeout_s: float) -> type:
    """uvicorn's "auto" protocol class (httptools when installed, else h11) with the read timeout."""
    from uvicorn.config import HTTP_PROTOCOLS
    from uvicorn.importer import import_from_string
    return with_read_timeout(import_from_string(HTTP_PROTOCOLS["auto"]), timeout_s)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the process owner (launcher, __main__) decides."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def build_pipeline(s: GatewaySettings, backends: Backends, model: ModelCard | None = None) -> Pipeline:
    model = model or ModelCard.load(s.model_dir, s.model_name or None)
    limits = Limits(max_tokens_limit=s.max_tokens_limit, default_max_tokens=s.default_max_tokens,
                    request_timeout_s=s.request_timeout_s or None, reattach_s=s.reattach_s)
    return Pipeline(model, backends, limits, GatewayMetrics(model.id))


async def _monitor(pipeline: Pipeline, health: Any, interval_s: float) -> None:
    last: bool | None = None
    while True:
        try:
            r = await pipeline.backends.readiness()
            pipeline.metrics.update_from_stats(r.stats)
            if r.ready != last:
                await health.set_serving(r.ready)
                log.info("backends %s: %s", "ready" if r.ready else "not ready", r.stages)
                last = r.ready
        except Exception:  # noqa: BLE001 - keep monitoring; a dead monitor would freeze health
            log.exception("readiness check failed")
        await asyncio.sleep(interval_s)


MAX_PROCESSES = 64


def check_settings(s: GatewaySettings) -> None:
    if s.max_tokens_limit < 1 or s.max_body_bytes < L.MIN_BODY_BYTES:
        raise ValueError(f"max_tokens_limit must be >= 1 and max_body_bytes >= {L.MIN_BODY_BYTES}")
    if not 1 <= s.processes <= MAX_PROCESSES:
        raise ValueError(f"processes must be 1 .. {MAX_PROCESSES}, got {s.processes}")
    if not s.http_read_timeout_s > 0 or s.max_connections < 1:
        raise ValueError("http_read_timeout_s must be > 0 and max_connections >= 1")


async def serve(settings: GatewaySettings | Any, *, http_socket: socket.socket | None = None,
                share_grpc_port: bool = False, rate_buckets: SharedBuckets | None = None) -> GatewayHandle:
    """Start REST + gRPC on the running loop; returns once both accept connections.

    One process of several (gateway/processes.py): `http_socket` is its listening socket (bound
    by the supervisor with SO_REUSEPORT), `share_grpc_port` binds the gRPC port with SO_REUSEPORT
    too, and `rate_buckets` are the API keys' buckets all the processes share."""
    s = settings if isinstance(settings, GatewaySettings) else GatewaySettings.from_mapping(vars(settings))
    check_settings(s)
    auth = ApiKeyAuth(load_api_keys(s.api_keys_file or None, s.api_keys or None), s.rate_limit_rpm, rate_buckets)
    model = ModelCard.load(s.model_dir, s.model_name or None)
    # A causal model has no concepts: no steering service to reach or wait for.
    backends = Backends.open(s.scheduler, "" if model.causal else s.steering)
    pipeline = build_pipeline(s, backends, model)
    app = build_app(pipeline, auth=auth, max_body_bytes=s.max_body_bytes)

    grpc_server, grpc_port, monitor = None, None, None
    if s.grpc_port >= 0:
        name = service_name(generate_pb2, "Generation")
        grpc_server, health = await make_server([name], max_message_bytes=max(s.max_body_bytes, MAX_MESSAGE_BYTES),
                                                share_port=share_grpc_port)
        generate_pb2_grpc.add_GenerationServicer_to_server(GenerationService(pipeline, auth), grpc_server)
        grpc_port = grpc_server.add_insecure_port(f"{s.host}:{s.grpc_port}")
        if grpc_port == 0:
            raise OSError(f"cannot bind the gRPC port {s.host}:{s.grpc_port}")
        await grpc_server.start()
        monitor = asyncio.create_task(_monitor(pipeline, health, s.health_interval_s))

    config = uvicorn.Config(app, host=s.host, port=s.http_port, lifespan="off", log_level=s.log_level,
                            timeout_graceful_shutdown=5, access_log=False,
                            http=http_protocol(s.http_read_timeout_s), limit_concurrency=s.max_connections)
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[http_socket] if http_socket is not None else None))
    while not server.started:
        if task.done():  # bind failure etc.
            if grpc_server is not None:
                await grpc_server.stop(0)
            if monitor is not None:
                monitor.cancel()
            await backends.close()
            exc = task.exception() if not task.cancelled() else None
            raise RuntimeError(f"HTTP server failed to start on {s.host}:{s.http_port}") from exc
        await asyncio.sleep(0.01)
    http_port = server.servers[0].sockets[0].getsockname()[1]
    log.info("gateway for %s: REST http://%s:%d, gRPC %s:%s", pipeline.model.id, s.host, http_port, s.host, grpc_port)
    return GatewayHandle(s, app, pipeline, http_port, grpc_port, server, task, grpc_server, monitor)


async def serve_until_signalled(settings: GatewaySettings, *, on_ready: Callable[[], None] | None = None,
                                stop_when: Awaitable[None] | None = None, **serve_kw: Any) -> None:
    """`serve`, then run until SIGINT / SIGTERM, the server's own exit or `stop_when`; then stop."""
    handle = await serve(settings, **serve_kw)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if on_ready is not None:
        on_ready()
    waits = {asyncio.ensure_future(stop.wait()), asyncio.ensure_future(handle.wait())}
    if stop_when is not None:
        waits.add(asyncio.ensure_future(stop_when))
    _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    await handle.stop()
