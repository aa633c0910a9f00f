"""Scheduler HA at the unit level, against a real redis-server: the lease, the fencing token
every RequestStore script carries (a deposed leader's writes are refused by Redis), and the
client channel that follows the active scheduler among in-process replicas."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cde.rpc.leader_channel import LeaderChannel
from cde.rpc.v1 import common_pb2, scheduler_pb2_grpc
from scheduler_svc.fencing import Fenced, WriteGuard
from scheduler_svc.leadership import Leadership
from scheduler_svc.service import SchedulerOptions, start_scheduler
from scheduler_svc.state import RequestStore
from tests.redis_fixture import run


def _leader(client, instance: str, ttl_ms: int = 1000) -> tuple[Leadership, RequestStore]:
    guard = WriteGuard()
    lead = Leadership(client, "ha:", instance, f"{instance}:1", ttl_ms, guard)
    return lead, RequestStore(client, prefix="ha:", guard=guard)


def test_a_deposed_leaders_writes_are_refused_by_redis(redis_client):  # noqa: F811
    async def body(client):
        a, store_a = _leader(client, "a")
        b, store_b = _leader(client, "b")
        assert await a.try_acquire() and a.token == 1
        assert not await b.try_acquire(), "a second scheduler must not get a held lease"
        assert b.leader_address() == "a:1" and "a:1" in b.standby_reason()
        with pytest.raises(Fenced):   # a standby refuses locally, before Redis
            await store_b.create("r1", "{}", 3)
        assert await store_a.create("r1", "{}", 3)
        assert await store_a.claim("r1", "w0")
        assert await store_a.append_block("r1", 0, b"block0", 64, 0) == "stored"

        await client.delete(a.lease_key)   # a's lease ran out (a paused process, a partition)
        assert await b.try_acquire() and b.token == 2
        # a has not noticed: its token is still set, so the refusal must come from Redis
        assert a.is_leader
        before = await client.hgetall(store_a.req_key("r1"))
        for write in (lambda: store_a.append_block("r1", 1, b"zombie", 64, 0),
                      lambda: store_a.finish("r1", "stop", 0),
                      lambda: store_a.requeue("r1"),
                      lambda: store_a.create("r2", "{}", 3),
                      lambda: store_a.register_worker("w9", {"address": "x:1"}),
                      lambda: store_a.remove_worker("w0")):
            a.guard.token = 1   # still believing it leads: each refusal must come from Redis
            with pytest.raises(Fenced, match="token 1 is stale"):
                await write()
            assert not a.is_leader and a.lost.is_set(), "a refused write deposes the old leader at once"
        assert await client.hgetall(store_a.req_key("r1")) == before
        assert await store_b.get("r2") is None
        assert [i for i, _ in await store_b.blocks("r1")] == [0]
        # the new leader writes normally
        assert await store_b.append_block("r1", 1, b"block1", 64, 0) == "stored"
        assert not await a.renew(), "the old leader's renewal must fail"
    run(body, redis_client)


def test_lease_renewal_and_same_instance_reclaim(redis_client):  # noqa: F811
    async def body(client):
        a, _ = _leader(client, "a", ttl_ms=400)
        assert await a.try_acquire()
        assert await a.renew()
        # Redis dropped the lease (outage longer than the TTL) but nobody was elected: a keeps it
        await client.delete(a.lease_key)
        assert await a.renew() and await client.pttl(a.lease_key) > 0
        # a restart of the same replica (same id) retakes its lease at once, with a new token
        a2, store2 = _leader(client, "a", ttl_ms=400)
        assert await a2.try_acquire() and a2.token == 2
        assert not await a.renew() and not a.is_leader
        assert await store2.create("r", "{}", 1)
        # expiry: another replica gets it once the TTL passes
        b, _ = _leader(client, "b", ttl_ms=400)
        assert not await b.try_acquire()
        await asyncio.sleep(0.5)
        assert await b.try_acquire() and b.token == 3
        await b.release()
        assert await client.get(b.lease_key) is None
    run(body, redis_client)


def test_clients_follow_the_active_scheduler(redis_server):  # noqa: F811
    """Two in-process schedulers on one Redis: one SERVING, the other a standby answering
    UNAVAILABLE with the leader's address; a LeaderChannel moves to the standby when the
    leader stops, and the standby takes over within the lease."""
    from tests.redis_fixture import flush
    flush(redis_server.url)

    async def body():
        opts = dict(host="127.0.0.1", port=0, redis_url=redis_server.url, lease_ms=600, prefix="hac:")
        s1 = await start_scheduler(SchedulerOptions(**opts, scheduler_id="s1"))
        await s1.wait_ready(10)
        s2 = await start_scheduler(SchedulerOptions(**opts, scheduler_id="s2"))
        chan = LeaderChannel([f"127.0.0.1:{s2.port}", f"127.0.0.1:{s1.port}"])   # standby listed first
        try:
            await asyncio.sleep(0.5)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{s2.port}") as direct:
                h = health_pb2_grpc.HealthStub(direct)
                svc = await h.Check(health_pb2.HealthCheckRequest(service="cde.v1.Scheduler"))
                whole = await h.Check(health_pb2.HealthCheckRequest(service=""))
                assert svc.status == health_pb2.HealthCheckResponse.NOT_SERVING
                assert whole.status == health_pb2.HealthCheckResponse.SERVING, "a standby is alive (liveness)"
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await scheduler_pb2_grpc.SchedulerStub(direct).Cancel(common_pb2.CancelRequest(
                        request_id="x"))
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                assert f"127.0.0.1:{s1.port}" in e.value.details(), e.value.details()
            stub = scheduler_pb2_grpc.SchedulerStub(chan)
            # a unary call answered UNAVAILABLE by the standby moves to the leader
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Cancel(common_pb2.CancelRequest(request_id="nope"), timeout=5)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND, e.value
            assert chan.current == 1
            await s1.stop(0)   # graceful: releases the lease, s2 takes over at its next campaign
            await asyncio.wait_for(s2.wait_ready(), 5)
            await asyncio.wait_for(chan.channel_ready(), 5)
            assert chan.current == 0
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Cancel(common_pb2.CancelRequest(request_id="nope"), timeout=5)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND, e.value
            assert s2.core.leadership.token == 2
        finally:
            await chan.close()
            await s2.stop(0)
            await s1.stop(0)
    asyncio.run(body())


def test_attribution_replicas_from_dns_and_skipping_dead_ones():
    """DNS: a name resolves to every address (real getaddrinfo of localhost), re-resolving adds
    and drops replicas; next_stub skips a replica whose channel cannot connect."""
    from cde.redis_util import free_port
    from scheduler_svc.attribution_pool import DiscoveredAttributionPool, resolve_all

    async def body():
        port = free_port()
        assert f"127.0.0.1:{port}" in resolve_all("localhost", port)
        live = grpc.aio.server()
        live_port = live.add_insecure_port("127.0.0.1:0")
        await live.start()
        names = {"now": [f"127.0.0.1:{live_port}"]}
        pool = DiscoveredAttributionPool(dns=f"attr.example:{live_port}", refresh_s=3600,
                                         resolver=lambda host, p: names["now"])
        try:
            assert pool.addresses() == [f"127.0.0.1:{live_port}"]
            dead = f"127.0.0.2:{free_port()}"
            names["now"] = [f"127.0.0.1:{live_port}", dead]
            await pool.refresh()
            assert sorted(pool.addresses()) == sorted(names["now"])
            live_stub = pool.replicas[f"127.0.0.1:{live_port}"].stub
            for _ in range(50):   # let both channels try to connect
                if pool.replicas[dead].broken():
                    break
                await asyncio.sleep(0.1)
            assert pool.replicas[dead].broken()
            assert all(pool.next_stub() is live_stub for _ in range(6)), "a dead replica was handed out"
            names["now"] = [dead]
            await pool.refresh()
            assert pool.addresses() == [dead]
            assert pool.next_stub() is pool.replicas[dead].stub   # all broken: still try one
        finally:
            await pool.close()
            await live.stop(0)
    asyncio.run(body())
