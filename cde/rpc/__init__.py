"""gRPC helpers shared by every service, plus the generated cde.v1 stubs (cde.rpc.v1).

    from cde.rpc import make_server, channel_options
    from cde.rpc.v1 import worker_pb2, worker_pb2_grpc

Every server gets the same message limits and keepalive, grpc.health.v1 (NOT_SERVING
until the service says it is warm; ``cde.liveness`` SERVING while the process serves),
reflection, and the internal-token check when $CDE_INTERNAL_TOKEN_FILE is set (`cde.rpc.internal_auth`; clients use `internal_channel`). Float vectors travel as little-endian
float32 bytes (never pickle). Stubs are regenerated with scripts/gen_protos.sh.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
import numpy as np

# Largest message any cde.v1 service sends or accepts. The biggest legitimate payloads are
# well under 1 MiB (a relu mask of the 8B model: 392 KiB; a committed block's raw concept
# records: ~80 KiB), so 8 MiB leaves room without letting one bad message eat the memory.
MAX_MESSAGE_BYTES = 8 * 1024 * 1024

# Clients ping every 30 s (also when idle, so a dead peer is noticed between requests);
# servers accept pings that often and ping back every 60 s.
_CLIENT_KEEPALIVE_MS = 30_000
_SERVER_KEEPALIVE_MS = 60_000
_KEEPALIVE_TIMEOUT_MS = 10_000


def _limits(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes)]


def server_options(max_message_bytes: int = MAX_MESSAGE_BYTES, share_port: bool = False) -> list[tuple[str, Any]]:
    """share_port: the processes of one multi-process gateway bind the same port (SO_REUSEPORT)."""
    return _limits(max_message_bytes) + [
        ("grpc.keepalive_time_ms", _SERVER_KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", _KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", _CLIENT_KEEPALIVE_MS // 2),
        ("grpc.http2.max_ping_strikes", 0),
        # a second server on the same port must fail, not share it (gRPC takes an option's first value)
        ("grpc.so_reuseport", int(share_port)),
    ]


# A grpc.health.v1 service name that answers SERVING for as long as the server runs, whatever the
# service reports: Kubernetes' liveness probe asks for it, so a worker that drains (NOT_SERVING
# for readiness) or a gateway whose backends are down is not restarted for it.
LIVENESS_SERVICE = "cde.liveness"

# Reconnect backoff between services: gRPC's default grows to 120 s, so a peer that was down
# for a minute is only dialled again seconds after it is back. Capped at 0.5 s (gRPC adds up to
# 20 % jitter), a restarted scheduler is seen by the gateway and the workers within 0.6 s plus
# the connect; dialling a dead loopback or cluster peer twice a second costs nothing.
_INITIAL_RECONNECT_BACKOFF_MS = 100
_MAX_RECONNECT_BACKOFF_MS = 500


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    return _limits(max_message_bytes) + [
        ("grpc.keepalive_time_ms", _CLIENT_KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", _KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.initial_reconnect_backoff_ms", _INITIAL_RECONNECT_BACKOFF_MS),
        ("grpc.max_reconnect_backoff_ms", _MAX_RECONNECT_BACKOFF_MS),
    ]


def _health_servicer_class():
    from grpc_health.v1 import health, health_pb2

    class ServiceHealth(health.aio.HealthServicer):
        """The aio HealthServicer that knows its services and starts NOT_SERVING."""

        def __init__(self, services: Sequence[str]) -> None:
            super().__init__()
            self.services = ("", *services)  # "" = the whole server

        async def set_serving(self, serving: bool) -> None:
            status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
            for name in self.services:
                await self.set(name, status)

    return ServiceHealth


async def make_server(service_names: Sequence[str], *, max_message_bytes: int = MAX_MESSAGE_BYTES,
                      interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                      options: Sequence[tuple[str, Any]] = (), share_port: bool = False):
    """A grpc.aio server with health (every service NOT_SERVING) and reflection registered.

    service_names are full names, e.g. worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name.
    The caller adds its servicers and a port, starts the server, and once warm calls
    `await health.set_serving(True)`. Must run inside the event loop that will serve.
    Returns (server, health).
    """
    try:
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc
        from grpc_reflection.v1alpha import reflection
    except ImportError as e:  # e.g. an image that brings its own grpcio but not these two
        raise ImportError(f"{e}: install grpcio-health-checking=={grpc.__version__} and "
                          f"grpcio-reflection=={grpc.__version__} (pure Python, match the grpcio)") from e

    from cde.rpc.internal_auth import server_interceptors
    from cde.rpc.malformed import MalformedRequestInterceptor

    # outermost first: a caller without the internal token is refused before anything else
    interceptors = [*server_interceptors(), MalformedRequestInterceptor(), *interceptors]
    server = grpc.aio.server(interceptors=interceptors,
                             options=server_options(max_message_bytes, share_port) + list(options))
    health_servicer = _health_servicer_class()(service_names)
    await health_servicer.set_serving(False)
    await health_servicer.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    return server, health_servicer


def service_name(pb2_module, service: str) -> str:
    """Full name of a service declared in a generated module, e.g. 'cde.v1.Worker'."""
    return pb2_module.DESCRIPTOR.services_by_name[service].full_name


def floats_to_bytes(values) -> bytes:
    """A 1-D float vector (torch tensor, numpy array or list) as little-endian float32 bytes."""
    if hasattr(values, "detach"):  # torch.Tensor of any dtype/device
        import torch
        values = values.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()
    arr = np.asarray(values, dtype="<f4")
    if arr.ndim != 1:
        raise ValueError(f"expected a 1-D vector, got shape {arr.shape}")
    return arr.tobytes()


def bytes_to_floats(data: bytes, expected_len: int | None = None) -> np.ndarray:
    """Little-endian float32 bytes as a writable float32 numpy vector (torch.from_numpy for a tensor).

    Raises ValueError when the byte count is not a whole number of floats or the length differs
    from expected_len: callers answer INVALID_ARGUMENT.
    """
    if len(data) % 4:
        raise ValueError(f"{len(data)} bytes is not a whole number of float32 values")
    arr = np.frombuffer(data, dtype="<f4").astype(np.float32)  # copies: native order, writable
    if expected_len is not None and arr.shape[0] != expected_len:
        raise ValueError(f"expected {expected_len} floats, got {arr.shape[0]}")
    return arr
