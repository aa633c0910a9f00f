"""Where a service's Redis is: a plain URL, or a Sentinel-managed master (Redis HA).

    cfg = RedisTarget.from_args(args)              # --redis-url / --redis-sentinels / ... and env
    client = cfg.client(max_connections=256, wait_s=10)   # redis.asyncio.Redis, blocking pool

Configuration (flag, then environment, then default):

* ``--redis-url`` / ``CDE_REDIS_URL`` (or the older ``REDIS_URL``): one server,
  default ``redis://127.0.0.1:6379/0``. With Sentinel the URL still gives the db number,
  password and TLS (``rediss://``); its host and port are ignored.
* ``--redis-sentinels h1:p1,h2:p2`` / ``CDE_REDIS_SENTINELS``: Sentinel addresses; when
  set, every connection goes to the master those sentinels name, and after a failover new
  connections follow the promoted replica (redis-py's ``redis.asyncio.sentinel``).
* ``--redis-sentinel-master NAME`` / ``CDE_REDIS_SENTINEL_MASTER``: the monitored master's
  name, default ``mymaster``.
* ``--redis-wait-replicas N`` / ``CDE_REDIS_WAIT_REPLICAS`` and ``--redis-wait-ms MS`` /
  ``CDE_REDIS_WAIT_MS``: after each state write the scheduler runs ``WAIT N MS`` on the
  same connection and treats fewer acknowledgements as a failed write (see
  docs/deploy-ha.md for what that promises). 0 (default): no WAIT.

During a failover calls fail with ``redis.exceptions.ConnectionError`` (MasterNotFoundError,
"previous master is now a slave"), which the scheduler already retries as transient.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from urllib.parse import urlparse

import redis.asyncio as aioredis
from redis.asyncio.connection import BlockingConnectionPool
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool

__all__ = ["RedisTarget", "add_redis_args", "parse_hostports"]

DEFAULT_URL = "redis://127.0.0.1:6379/0"
DEFAULT_MASTER = "mymaster"
MAX_SENTINELS = 16
MAX_WAIT_MS = 60_000


def parse_hostports(text: str, what: str) -> list[tuple[str, int]]:
    """``"h1:p1,h2:p2"`` -> [(h1, p1), (h2, p2)]; ValueError naming ``what`` otherwise."""
    out = []
    for item in (p.strip() for p in (text or "").split(",")):
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        host = host.strip("[]")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{what}: expected host:port, got {item!r}")
        out.append((host, int(port)))
    return out


class _BlockingSentinelPool(SentinelConnectionPool, BlockingConnectionPool):
    """Sentinel's master lookup with the blocking pool's wait for a free connection (a burst
    waits, bounded, instead of failing with "Too many connections")."""


@dataclass(frozen=True)
class RedisTarget:
    url: str = DEFAULT_URL
    sentinels: tuple[tuple[str, int], ...] = ()
    master: str = DEFAULT_MASTER
    wait_replicas: int = 0
    wait_ms: int = 1000
    socket_timeout_s: float = 10.0
    connect_timeout_s: float = 5.0

    def __post_init__(self):
        if urlparse(self.url).scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"redis url: expected redis://, rediss:// or unix://, got {self.url!r}")
        if len(self.sentinels) > MAX_SENTINELS:
            raise ValueError(f"redis sentinels: at most {MAX_SENTINELS}, got {len(self.sentinels)}")
        if self.sentinels and not self.master:
            raise ValueError("redis sentinel master: a name is required with sentinels")
        if not 0 <= self.wait_replicas <= 16:
            raise ValueError(f"redis wait replicas: expected 0..16, got {self.wait_replicas}")
        if not 0 < self.wait_ms <= MAX_WAIT_MS:
            raise ValueError(f"redis wait ms: expected 1..{MAX_WAIT_MS}, got {self.wait_ms}")

    # ---- configuration ----------------------------------------------------------------------------
    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RedisTarget:
        return cls(url=args.redis_url, sentinels=tuple(parse_hostports(args.redis_sentinels, "--redis-sentinels")),
                   master=args.redis_sentinel_master, wait_replicas=args.redis_wait_replicas,
                   wait_ms=args.redis_wait_ms)

    def describe(self) -> str:
        if self.sentinels:
            where = ",".join(f"{h}:{p}" for h, p in self.sentinels)
            return f"sentinel master {self.master!r} via {where}"
        return self.url

    # ---- clients ----------------------------------------------------------------------------------
    def client(self, max_connections: int = 256, wait_s: float = 10.0) -> aioredis.Redis:
        """An asyncio client (bytes replies) on a bounded pool that makes callers wait up to
        ``wait_s`` for a free connection."""
        if not self.sentinels:
            pool = BlockingConnectionPool.from_url(self.url, max_connections=max_connections, timeout=wait_s,
                                                   socket_timeout=self.socket_timeout_s,
                                                   socket_connect_timeout=self.connect_timeout_s)
            return aioredis.Redis.from_pool(pool)
        # host/port come from the sentinels; db, credentials and TLS still come from the URL
        kw = {k: v for k, v in BlockingConnectionPool.from_url(self.url).connection_kwargs.items()
              if k in ("db", "username", "password", "ssl", "ssl_cert_reqs", "ssl_ca_certs")}
        sentinel = Sentinel(list(self.sentinels), socket_timeout=min(self.socket_timeout_s, 2.0),
                            socket_connect_timeout=min(self.connect_timeout_s, 2.0))
        return sentinel.master_for(self.master, connection_pool_class=_BlockingSentinelPool,
                                   max_connections=max_connections, timeout=wait_s,
                                   socket_timeout=self.socket_timeout_s,
                                   socket_connect_timeout=self.connect_timeout_s, **kw)


def add_redis_args(ap: argparse.ArgumentParser) -> None:
    """The Redis flags every service that uses Redis takes (see the module docstring)."""
    env = os.environ.get
    ap.add_argument("--redis-url", default=env("CDE_REDIS_URL") or env("REDIS_URL") or DEFAULT_URL,
                    help="Redis URL (env CDE_REDIS_URL or REDIS_URL); with sentinels only its db/auth/TLS count")
    ap.add_argument("--redis-sentinels", default=env("CDE_REDIS_SENTINELS", ""),
                    help="Redis Sentinel addresses, comma-separated host:port (env CDE_REDIS_SENTINELS)")
    ap.add_argument("--redis-sentinel-master", default=env("CDE_REDIS_SENTINEL_MASTER", DEFAULT_MASTER),
                    help="the master's name in Sentinel (env CDE_REDIS_SENTINEL_MASTER)")
    ap.add_argument("--redis-wait-replicas", type=int, default=int(env("CDE_REDIS_WAIT_REPLICAS", 0)),
                    help="replicas that must acknowledge each state write (WAIT; env CDE_REDIS_WAIT_REPLICAS)")
    ap.add_argument("--redis-wait-ms", type=int, default=int(env("CDE_REDIS_WAIT_MS", 1000)),
                    help="how long WAIT waits for them (env CDE_REDIS_WAIT_MS)")
