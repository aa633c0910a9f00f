"""CLI: python -m scheduler_svc [--host H] [--port P] [--redis-url URL] [--attribution A[,B...]]
[--max-running N] [--max-queue N] [--finished-ttl S].

Environment fallbacks: CDE_SCHEDULER_HOST, CDE_SCHEDULER_PORT, REDIS_URL, CDE_ATTRIBUTION,
CDE_MAX_RUNNING, CDE_MAX_QUEUE, CDE_FINISHED_TTL, CDE_HEARTBEAT_MS, CDE_QUEUE_TIMEOUT,
CDE_DETACH_GRACE, CDE_REDIS_PREFIX, CDE_LOG_LEVEL.
"""

from __future__ import annotations

import argparse
import os

from cde.rpc.serving import run_main
from scheduler_svc.service import DEFAULT_PORT, serve


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    ap = argparse.ArgumentParser(prog="python -m scheduler_svc",
                                 description="cde.v1.Scheduler: admission, placement, block state in Redis")
    ap.add_argument("--host", default=env("CDE_SCHEDULER_HOST", "127.0.0.1"))
    ap.add_argument("--port", type=int, default=int(env("CDE_SCHEDULER_PORT", DEFAULT_PORT)))
    ap.add_argument("--redis-url", default=env("REDIS_URL", "redis://127.0.0.1:6379/0"))
    ap.add_argument("--attribution", default=env("CDE_ATTRIBUTION", ""),
                    help="attribution_svc replicas, comma-separated host:port (empty: no attributions)")
    ap.add_argument("--max-running", type=int, default=int(env("CDE_MAX_RUNNING", 64)))
    ap.add_argument("--max-queue", type=int, default=int(env("CDE_MAX_QUEUE", 64)))
    ap.add_argument("--finished-ttl", type=int, default=int(env("CDE_FINISHED_TTL", 3600)),
                    help="seconds a finished request stays resumable in Redis")
    ap.add_argument("--heartbeat-ms", type=int, default=int(env("CDE_HEARTBEAT_MS", 1000)))
    ap.add_argument("--queue-timeout", type=float, default=float(env("CDE_QUEUE_TIMEOUT", 30)),
                    help="seconds a request waits for any worker before UNAVAILABLE")
    ap.add_argument("--detach-grace", type=float, default=float(env("CDE_DETACH_GRACE", 0)),
                    help="seconds a request outlives its last client stream (0: cancel at once)")
    ap.add_argument("--redis-connections", type=int, default=int(env("CDE_REDIS_CONNECTIONS", 256)),
                    help="Redis connection pool size (callers wait for a free one, bounded)")
    ap.add_argument("--prefix", default=env("CDE_REDIS_PREFIX", "cde:"), help="Redis key prefix")
    ap.add_argument("--grace", type=float, default=5.0, help="seconds to drain calls on SIGTERM/SIGINT")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    run_main(serve, parse_args(argv))


if __name__ == "__main__":
    main()
