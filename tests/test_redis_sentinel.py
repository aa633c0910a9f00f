"""Redis HA: the scheduler on a Sentinel-managed master (master + replica + 3 sentinels, real
redis-server processes on loopback, AOF appendfsync always, tests/sentinel_fixture.py).

The promise tested (docs/deploy-ha.md): with ``--redis-wait-replicas 1`` a state write is
acknowledged only after ``WAIT 1`` confirmed a replica has it, so after the master is killed
(SIGKILL) and Sentinel promotes the replica, every acknowledged write is on the new master.
The scheduler (in-process, HA lease and fencing on) keeps its lease through the failover
and serves again; writers retry the transient errors of the failover like a RequestRun.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import redis.exceptions

from cde.redis_connect import RedisTarget
from scheduler_svc.service import SchedulerOptions, start_scheduler
from tests.sentinel_fixture import sentinel_group

SEED = 20
TRANSIENT = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


async def retried(op, budget_s: float = 30.0):
    """``await op()``, retrying transient failures (the failover) like the scheduler does (scheduler_svc/run_context.py: with_redis_retries)."""
    give_up = time.monotonic() + budget_s
    while True:
        try:
            return await op()
        except TRANSIENT:
            if time.monotonic() > give_up:
                raise
            await asyncio.sleep(0.05)


@pytest.mark.fault
def test_acknowledged_writes_survive_a_master_failover(tmp_path, report):
    with sentinel_group(tmp_path / "redis") as g:
        target = RedisTarget(sentinels=tuple(g.sentinels), master="mymaster", wait_replicas=1, wait_ms=500)
        old_master = g.current_master()

        async def body():
            sched = await start_scheduler(SchedulerOptions(host="127.0.0.1", port=0, redis=target, lease_ms=1500,
                                                           scheduler_id="s0", prefix="sn:"))
            await sched.wait_ready(15)
            store, token = sched.core.store, sched.core.leadership.token
            acked: dict[tuple[str, int], bytes] = {}
            stop = asyncio.Event()
            rng = random.Random(SEED)

            async def writer(w: int):
                i = 0
                while not stop.is_set():
                    rid = f"w{w}-{i}"
                    i += 1
                    assert await retried(lambda: store.create(rid, "{}", 64)) or \
                        (await store.get(rid)).status == "queued", f"seed {SEED}: {rid}"
                    await retried(lambda: store.claim(rid, f"wk{w}"))
                    for b in range(4):
                        payload = rng.randbytes(32)
                        got = await retried(lambda: store.append_block(rid, b, payload, 64, 0))
                        # "duplicate": our own write whose reply (or WAIT) was lost, retried
                        assert got in ("stored", "duplicate"), f"seed {SEED}: {rid} block {b}: {got}"
                        acked[(rid, b)] = payload if got == "stored" else acked.get((rid, b), payload)
                        await asyncio.sleep(0.005)

            tasks = [asyncio.create_task(writer(w)) for w in range(4)]
            await asyncio.sleep(1.0)
            before_kill = len(acked)
            old = g.master
            await asyncio.to_thread(old.kill)      # SIGKILL under load
            t_kill = time.monotonic()
            while g.current_master() == old_master:
                assert time.monotonic() - t_kill < 30, "Sentinel did not fail over"
                await asyncio.sleep(0.1)
            failover_s = time.monotonic() - t_kill
            # the old master comes back (as the launcher's supervision brings it back: a replica
            # of the new master), so WAIT 1 can be satisfied again
            restarted = await asyncio.to_thread(g.supervise)
            assert any("restarted as a replica" in line for line in restarted), restarted
            assert old.running() and g.replica is old, (restarted, g.current_master(), old.port)
            n_at_failover = len(acked)
            deadline = time.monotonic() + 30
            while len(acked) < n_at_failover + 40:
                assert time.monotonic() < deadline, f"seed {SEED}: writes did not resume after the failover"
                assert not any(t.done() for t in tasks), [t.exception() for t in tasks if t.done()]
                await asyncio.sleep(0.1)
            stop.set()
            await asyncio.wait_for(asyncio.gather(*tasks), 30)

            # every acknowledged write is on the new master
            lost = []
            for (rid, b), payload in acked.items():
                stored = dict(await store.blocks(rid))
                if stored.get(b) != payload:
                    lost.append((rid, b))
            assert not lost, f"seed {SEED}: {len(lost)} acknowledged writes lost: {lost[:5]}"
            assert sched.core.leadership.is_leader and sched.core.leadership.token == token, \
                "the scheduler lost its lease over the failover"
            assert sched.core.ready.is_set()
            await sched.stop(0)
            return before_kill, len(acked), failover_s

        before, total, failover_s = asyncio.run(asyncio.wait_for(body(), 80))
        assert before > 20, f"seed {SEED}: too little load before the kill ({before} writes)"
        report(f"Redis Sentinel failover under load (WAIT 1): {total} acknowledged block writes "
               f"({before} before the SIGKILL of the master), Sentinel promoted the replica in {failover_s:.1f}s, "
               f"none lost, the scheduler kept its lease and serves")
