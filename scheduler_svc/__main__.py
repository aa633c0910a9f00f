"""CLI: python -m scheduler_svc [--host H] [--port P] [--redis-url URL | --redis-sentinels H:P,...
--redis-sentinel-master NAME] [--attribution A[,B...] | --attribution-dns NAME:PORT] [--lease-ms MS]
[--max-running N] [--max-queue N] [--finished-ttl S] [--detach-grace S].

Environment fallbacks: CDE_SCHEDULER_HOST, CDE_SCHEDULER_PORT, CDE_REDIS_URL (or REDIS_URL),
CDE_REDIS_SENTINELS, CDE_REDIS_SENTINEL_MASTER, CDE_REDIS_WAIT_REPLICAS, CDE_REDIS_WAIT_MS,
CDE_ATTRIBUTION, CDE_ATTRIBUTION_DNS, CDE_SCHEDULER_LEASE_MS, CDE_SCHEDULER_ID, CDE_SCHEDULER_ADVERTISE,
CDE_MAX_RUNNING, CDE_MAX_QUEUE, CDE_FINISHED_TTL, CDE_HEARTBEAT_MS, CDE_QUEUE_TIMEOUT,
CDE_DETACH_GRACE, CDE_REDIS_PREFIX, CDE_LOG_LEVEL.
"""

from __future__ import annotations

import argparse
import os

from cde.redis_connect import add_redis_args
from cde.rpc.serving import run_main
from scheduler_svc.service import DEFAULT_PORT, DETACH_GRACE_S, serve


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    ap = argparse.ArgumentParser(prog="python -m scheduler_svc",
                                 description="cde.v1.Scheduler: admission, placement, block state in Redis")
    ap.add_argument("--host", default=env("CDE_SCHEDULER_HOST", "127.0.0.1"))
    ap.add_argument("--port", type=int, default=int(env("CDE_SCHEDULER_PORT", DEFAULT_PORT)))
    add_redis_args(ap)
    ap.add_argument("--attribution", default=env("CDE_ATTRIBUTION", ""),
                    help="attribution_svc replicas, comma-separated host:port (empty: no attributions)")
    ap.add_argument("--attribution-dns", default=env("CDE_ATTRIBUTION_DNS", ""),
                    help="host:port whose name resolves to every attribution replica (re-resolved periodically)")
    ap.add_argument("--lease-ms", type=int, default=int(env("CDE_SCHEDULER_LEASE_MS", 3000)),
                    help="HA: the active scheduler's lease in Redis (0: no lease, one scheduler only)")
    ap.add_argument("--scheduler-id", default=env("CDE_SCHEDULER_ID", ""),
                    help="HA: this replica's id (default hostname-port; a restart with it retakes its lease)")
    ap.add_argument("--advertise", default=env("CDE_SCHEDULER_ADVERTISE", ""),
                    help="HA: host:port standbys name as the active scheduler (default --host:--port)")
    ap.add_argument("--max-running", type=int, default=int(env("CDE_MAX_RUNNING", 64)))
    ap.add_argument("--max-queue", type=int, default=int(env("CDE_MAX_QUEUE", 64)))
    ap.add_argument("--finished-ttl", type=int, default=int(env("CDE_FINISHED_TTL", 3600)),
                    help="seconds a finished request stays resumable in Redis")
    ap.add_argument("--heartbeat-ms", type=int, default=int(env("CDE_HEARTBEAT_MS", 1000)))
    ap.add_argument("--queue-timeout", type=float, default=float(env("CDE_QUEUE_TIMEOUT", 30)),
                    help="seconds a request waits for any worker before UNAVAILABLE")
    ap.add_argument("--detach-grace", type=float, default=float(env("CDE_DETACH_GRACE", DETACH_GRACE_S)),
                    help="seconds a request outlives its last stream when that stream broke without the gateway's "
                         f"Detach (a gateway process died), so its client can Resume; keep it >= the gateway's "
                         f"--reattach-s (default {DETACH_GRACE_S:g}; 0: cancel at once). A client that left is "
                         "cancelled at once either way")
    ap.add_argument("--redis-connections", type=int, default=int(env("CDE_REDIS_CONNECTIONS", 256)),
                    help="Redis connection pool size (callers wait for a free one, bounded)")
    ap.add_argument("--prefix", default=env("CDE_REDIS_PREFIX", "cde:"), help="Redis key prefix")
    ap.add_argument("--grace", type=float, default=5.0, help="seconds to drain calls on SIGTERM/SIGINT")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    run_main(serve, parse_args(argv))


if __name__ == "__main__":
    main()
