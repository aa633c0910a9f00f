"""The attribution replicas the scheduler balances over, found at run time.

Either a fixed list (``--attribution a:p,b:p``) or a DNS name (``--attribution-dns
name:port`` / ``CDE_ATTRIBUTION_DNS``) resolved to ALL its addresses (a Kubernetes headless
Service gives one A record per ready pod) and re-resolved every ``refresh_s``: new
replicas get a channel, vanished ones are closed once no stream is left on them.

`next_stub()` hands replicas out round-robin, skipping those whose channel is in
TRANSIENT_FAILURE (a replica that died or is unreachable), unless all are. A replica dying
mid-block is handled by `scheduler_svc.attribution.AttributionSession`: the stream breaks,
it reopens on the next replica, replays the request's stored blocks (answers dropped) to
rebuild the open chunk, and asks for the block again; the block is stored, with its
attributions, exactly once (RequestStore.append_block).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
from collections.abc import Callable, Sequence

import grpc

from cde.redis_connect import parse_hostports
from cde.rpc.internal_auth import internal_channel
from cde.rpc.v1 import attribution_pb2_grpc

log = logging.getLogger("scheduler_svc.attribution_pool")

DNS_REFRESH_S = 10.0
MAX_REPLICAS = 256
_BROKEN = (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN)

Resolver = Callable[[str, int], list[str]]   # (name, port) -> ["ip:port", ...]


def resolve_all(name: str, port: int) -> list[str]:
    """Every address ``name`` resolves to (IPv4 and IPv6), as sorted host:port strings."""
    out = set()
    for family, _, _, _, addr in socket.getaddrinfo(name, port, type=socket.SOCK_STREAM):
        host = addr[0]
        out.add(f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}")
    return sorted(out)[:MAX_REPLICAS]


class _Replica:
    def __init__(self, address: str):
        self.address = address
        self.channel = internal_channel(address)
        self.stub = attribution_pb2_grpc.AttributionStub(self.channel)

    def broken(self) -> bool:
        return self.channel.get_state(try_to_connect=True) in _BROKEN


class DiscoveredAttributionPool:
    """Same face as `scheduler_svc.attribution.AttributionPool` (len, next_stub, close)."""

    def __init__(self, addresses: Sequence[str] = (), dns: str = "", refresh_s: float = DNS_REFRESH_S,
                 resolver: Resolver = resolve_all):
        self.dns = parse_hostports(dns, "--attribution-dns")[0] if dns else None
        self.refresh_s = refresh_s
        self.resolver = resolver
        self.replicas: dict[str, _Replica] = {}
        self._next = itertools.count()
        self._task: asyncio.Task | None = None
        self._set([a.strip() for a in addresses if a.strip()] or self._resolve())
        if self.dns is not None:
            self._task = asyncio.get_running_loop().create_task(self._refresh_loop(), name="attribution-dns")

    def _resolve(self) -> list[str]:
        if self.dns is None:
            return []
        try:
            return self.resolver(*self.dns)
        except OSError as e:   # keep what we have: DNS hiccups must not drop live replicas
            log.warning("attribution DNS %s:%d did not resolve (%s)", *self.dns, e)
            return list(self.replicas)

    def _set(self, addresses: Sequence[str]) -> None:
        wanted = list(dict.fromkeys(addresses))[:MAX_REPLICAS]
        for a in wanted:
            if a not in self.replicas:
                self.replicas[a] = _Replica(a)
                log.info("attribution replica %s added", a)
        for a in [a for a in self.replicas if a not in wanted]:
            gone = self.replicas.pop(a)
            log.info("attribution replica %s removed", a)
            # streams open on it finish or break by themselves; close after they had time
            asyncio.get_running_loop().call_later(60.0, lambda ch=gone.channel: asyncio.ensure_future(ch.close()))

    async def refresh(self) -> None:
        self._set(await asyncio.to_thread(self._resolve))

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            await self.refresh()

    def __len__(self) -> int:
        return len(self.replicas)

    def addresses(self) -> list[str]:
        return list(self.replicas)

    def next_stub(self) -> attribution_pb2_grpc.AttributionStub:
        reps = list(self.replicas.values())
        if not reps:
            raise RuntimeError("no attribution replica known (yet)")
        start = next(self._next)
        for i in range(len(reps)):
            r = reps[(start + i) % len(reps)]
            if not r.broken():
                return r.stub
        return reps[start % len(reps)].stub   # all look broken: try anyway (one may be back)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for r in self.replicas.values():
            await r.channel.close()
        self.replicas.clear()


def attribution_pool(addresses: Sequence[str], dns: str = "") -> DiscoveredAttributionPool | None:
    """The scheduler's pool: None when neither a list nor a DNS name is configured."""
    if not any(a.strip() for a in addresses) and not dns:
        return None
    return DiscoveredAttributionPool(addresses, dns)
