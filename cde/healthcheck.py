"""Exit 0 when a gRPC server reports SERVING on grpc.health.v1 (used by compose health checks).

    python -m cde.healthcheck 127.0.0.1:50061 [service-name]
"""

from __future__ import annotations

import sys


def main() -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if len(sys.argv) < 2:
        sys.exit("usage: python -m cde.healthcheck HOST:PORT [SERVICE]")
    target, service = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "")
    try:
        with grpc.insecure_channel(target) as channel:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=3)
    except grpc.RpcError as exc:
        sys.exit(f"{target}: {exc.code().name}")
    if resp.status != health_pb2.HealthCheckResponse.SERVING:
        sys.exit(f"{target}: {health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)}")


if __name__ == "__main__":
    main()
