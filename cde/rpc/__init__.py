"""gRPC helpers shared by every service, plus the generated cde.v1 stubs (cde.rpc.v1).

    from cde.rpc import make_server, channel_options
    from cde.rpc.v1 import worker_pb2, worker_pb2_grpc

`make_server` gives every server the same message limits and keepalive (cde/rpc/transport.py),
grpc.health.v1 (NOT_SERVING until the service says it is warm; ``cde.liveness`` SERVING while
the process serves), reflection, and the internal-token check when $CDE_INTERNAL_TOKEN_FILE is
set (cde/rpc/internal_auth.py; clients use its `internal_channel`). Float vectors travel as
little-endian float32 bytes (never pickle). Stubs are regenerated with scripts/gen_protos.sh.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
import numpy as np

from cde.rpc.internal_auth import server_interceptors
from cde.rpc.malformed import MalformedRequestInterceptor
from cde.rpc.transport import MAX_MESSAGE_BYTES, channel_options, server_options

__all__ = ["LIVENESS_SERVICE", "MAX_MESSAGE_BYTES", "bytes_to_floats", "channel_options", "floats_to_bytes",
           "make_server", "server_options", "service_name"]

# A grpc.health.v1 service name that answers SERVING for as long as the server runs, whatever the
# service reports: Kubernetes' liveness probe asks for it, so a worker that drains (NOT_SERVING
# for readiness) or a gateway whose backends are down is not restarted for it.
LIVENESS_SERVICE = "cde.liveness"


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
