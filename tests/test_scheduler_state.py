"""scheduler_svc.state.RequestStore against a real redis-server (see tests/redis_fixture.py)."""
from __future__ import annotations

import asyncio
import json
import os
import random

import pytest
import redis.asyncio as aioredis

from cde.redis_util import EmbeddedRedis, RedisServerError, redis_server_binary
from scheduler_svc.state import STATUSES, Claimed, RequestStore
from tests.redis_fixture import run

SPEC = json.dumps({"max_new_tokens": 256, "temperature": 0.0, "steering": []})


def payload(i: int, tag: str = "") -> bytes:
    return f"block-{i}-{tag}".encode() + bytes([i % 256, 0, 255])


async def assert_counts_consistent(store: RequestStore) -> dict:
    c = await store.counts()
    assert c == await store.scan_counts()
    return c


# ------------------------------------------------------------------ state machine

def test_happy_path(redis_client):
    async def body(r):
        s = RequestStore(r)
        assert await s.create("r1", SPEC, prompt_tokens=17)
        st = await s.get("r1")
        assert (st.status, st.worker, st.prompt_tokens, st.committed_tokens, st.next_block,
                st.attempt, st.spec, st.finish_reason, st.error) == \
            ("queued", None, 17, 0, 0, 0, SPEC, None, None)
        assert st.created_at > 0 and st.updated_at >= st.created_at
        assert await s.queued_ids() == ["r1"]

        assert await s.claim("r1", "w0")
        st = await s.get("r1")
        assert (st.status, st.worker) == ("running", "w0")
        assert await s.queued_ids() == []
        assert await s.running_ids("w0") == ["r1"]

        for i in range(3):
            assert await s.append_block("r1", i, payload(i), 64, attempt=0) == "stored"
        st = await s.get("r1")
        assert (st.next_block, st.committed_tokens) == (3, 192)
        assert await s.blocks("r1") == [(i, payload(i)) for i in range(3)]
        assert await s.blocks("r1", after=0) == [(1, payload(1)), (2, payload(2))]
        assert await s.blocks("r1", after=2) == []

        assert await s.finish("r1", "eos", attempt=0)
        st = await s.get("r1")
        assert (st.status, st.finish_reason, st.terminal) == ("finished", "eos", True)
        assert await s.running_ids("w0") == []
        assert await s.blocks("r1") == [(i, payload(i)) for i in range(3)]
        c = await assert_counts_consistent(s)
        assert c == {"queued": 0, "running": 0, "finished": 1, "failed": 0, "cancelled": 0}
    run(body, redis_client)


def test_fail_and_cancel_paths(redis_client):
    async def body(r):
        s = RequestStore(r)
        for rid in ("a", "b", "c"):
            assert await s.create(rid, SPEC, 4)
        assert await s.claim("a", "w")
        assert await s.claim("b", "w")
        assert await s.fail("a", "CUDA OOM")
        assert await s.cancel("b")      # running -> cancelled
        assert await s.cancel("c")      # queued -> cancelled
        a, b, c = [await s.get(x) for x in "abc"]
        assert (a.status, a.error) == ("failed", "CUDA OOM")
        assert (b.status, b.finish_reason) == ("cancelled", "cancelled")
        assert (c.status, c.worker) == ("cancelled", None)
        assert await s.queued_ids() == [] and await s.running_ids("w") == []
        assert await assert_counts_consistent(s) == {
            "queued": 0, "running": 0, "finished": 0, "failed": 1, "cancelled": 2}
    run(body, redis_client)


def test_claim_returns_where_the_attempt_resumes(redis_client):
    """claim reads next_block and attempt in its own script (the run streams from them without
    reading the request back): 0/0 when new, the stored blocks and the bumped attempt after a
    requeue."""
    async def body(r):
        s = RequestStore(r)
        assert await s.create("r", SPEC, 3)
        assert await s.claim("r", "w0") == Claimed(next_block=0, attempt=0)
        for i in range(2):
            assert await s.append_block("r", i, payload(i), 64, attempt=0) == "stored"
        assert await s.requeue("r", "w0")
        assert await s.claim("r", "w1") == Claimed(next_block=2, attempt=1)
        assert await s.claim("r", "w2") is None          # running: refused, nothing changes
        st = await s.get("r")
        assert (st.status, st.worker, st.next_block, st.attempt) == ("running", "w1", 2, 1)
        assert await s.claim("absent", "w1") is None
    run(body, redis_client)


def test_create_on_a_worker_equals_create_then_claim(redis_client):
    """create(worker=...) leaves what create + claim leave (the request hash, the queue, the
    running set and the counts), in one script; an existing id is refused the same way."""
    async def body(r):
        s = RequestStore(r)
        assert await s.create("two", SPEC, 3) and await s.claim("two", "w0") == Claimed(0, 0)
        assert await s.create("one", SPEC, 3, worker="w0")
        a, b = await s.get("two"), await s.get("one")
        same = ("status", "worker", "next_block", "attempt", "committed_tokens", "prompt_tokens", "spec")
        assert [getattr(a, f) for f in same] == [getattr(b, f) for f in same]
        assert await r.zscore(s.queue_key, "one") is None and await r.zscore(s.queue_key, "two") is None
        assert await r.smembers(s.running_key("w0")) == {b"one", b"two"}
        assert (await r.hgetall(s.counts_key))[b"running"] == b"2"
        assert int((await r.hgetall(s.counts_key)).get(b"queued", b"0")) == 0
        assert await s.claim("one", "w1") is None                      # running already
        assert not await s.create("one", SPEC, 3, worker="w1")          # exists: nothing changes
        assert (await s.get("one")).worker == "w0"
        assert await s.append_block("one", 0, payload(0), 64, attempt=0) == "stored"
        assert await s.finish("one", "eos", attempt=0)
    run(body, redis_client)


def test_terminal_transitions_save_the_ending_with_them(redis_client):
    """finish / fail / cancel store the ending in the same script when they succeed, never when
    refused, and the first ending wins (as save_ending's NX)."""
    async def body(r):
        s = RequestStore(r, finished_ttl_s=77)
        for rid in ("f", "x", "c", "q"):
            assert await s.create(rid, SPEC, 1)
        for rid in ("f", "x", "c"):
            assert await s.claim(rid, "w")
        assert not await s.finish("q", "eos", ending=b"never")     # queued: refused
        assert await s.ending("q") is None
        assert await s.finish("f", "eos", attempt=0, ending=b"fin-f")
        assert await s.fail("x", "boom", ending=b"fin-x")
        assert await s.cancel("c", ending=b"fin-c")
        assert await s.cancel("q")                                  # no ending given: none saved
        assert [await s.ending(k) for k in ("f", "x", "c", "q")] == [b"fin-f", b"fin-x", b"fin-c", None]
        assert 0 < await r.ttl(s.end_key("f")) <= 77
        assert not await s.save_ending("f", b"later")               # the first ending wins
        assert not await s.cancel("f", ending=b"late")              # terminal: refused, ending kept
        assert await s.ending("f") == b"fin-f"
        with pytest.raises(TypeError):
            await s.finish("f", "eos", ending=b"")
    run(body, redis_client)


def test_idempotent_create(redis_client):
    async def body(r):
        s = RequestStore(r)
        assert await s.create("dup", SPEC, 5)
        assert not await s.create("dup", json.dumps({"other": 1}), 99)
        st = await s.get("dup")
        assert (st.spec, st.prompt_tokens, st.status) == (SPEC, 5, "queued")
        assert await s.queued_ids() == ["dup"]
        # still refused once running (it exists)
        assert await s.claim("dup", "w")
        assert not await s.create("dup", SPEC, 5)
        assert (await s.get("dup")).status == "running"
        # concurrent submits of the same id: exactly one wins
        res = await asyncio.gather(*[s.create("same", SPEC, 1) for _ in range(20)])
        assert sum(res) == 1
        assert (await assert_counts_consistent(s))["queued"] == 1
    run(body, redis_client)


def test_illegal_transitions_refused(redis_client):
    async def body(r):
        s = RequestStore(r)
        assert await s.create("x", SPEC, 1)
        before = await s.get("x")
        assert not await s.finish("x", "eos")          # finish from queued
        assert not await s.fail("x", "boom")           # fail from queued
        assert not await s.requeue("x")                # requeue from queued
        assert await s.append_block("x", 0, b"p", 64) == "not_running"
        assert await s.get("x") == before

        assert await s.claim("x", "w1")
        assert not await s.claim("x", "w1")            # claim twice
        assert not await s.claim("x", "w2")
        assert (await s.get("x")).worker == "w1"
        assert await s.running_ids("w2") == []

        assert await s.append_block("x", 0, b"p0", 64) == "stored"
        assert await s.finish("x", "length")
        after = await s.get("x")
        assert await s.append_block("x", 1, b"p1", 64) == "not_running"  # append to finished
        assert await s.append_block("x", 0, b"p0", 64) == "not_running"
        assert not await s.finish("x", "eos")
        assert not await s.fail("x", "late")
        assert not await s.cancel("x")
        assert not await s.claim("x", "w1")
        assert not await s.requeue("x")
        assert await s.get("x") == after
        assert await s.blocks("x") == [(0, b"p0")]

        # unknown ids
        assert not await s.claim("nope", "w1")
        assert not await s.finish("nope", "eos")
        assert not await s.cancel("nope")
        assert await s.append_block("nope", 0, b"", 0) == "not_running"
        assert await s.get("nope") is None
        assert await s.blocks("nope") == []
        assert (await assert_counts_consistent(s))["finished"] == 1

        with pytest.raises(ValueError):
            await s.append_block("x", -1, b"", 0)
        with pytest.raises(ValueError):
            await s.create("has space", SPEC, 1)
    run(body, redis_client)


# ------------------------------------------------------------------ exactly-once blocks

def test_duplicate_and_out_of_order_refused(redis_client):
    async def body(r):
        s = RequestStore(r)
        await s.create("b", SPEC, 8)
        await s.claim("b", "w")
        assert await s.append_block("b", 1, b"one", 64) == "out_of_order"
        assert await s.append_block("b", 0, b"zero", 64) == "stored"
        assert await s.append_block("b", 0, b"zero-again", 64) == "duplicate"
        assert await s.append_block("b", 2, b"two", 64) == "out_of_order"
        assert await s.append_block("b", 1, b"one", 32) == "stored"
        assert await s.append_block("b", 0, b"zero-3", 64) == "duplicate"
        assert await s.append_block("b", 1, b"one-again", 64) == "duplicate"
        st = await s.get("b")
        assert (st.next_block, st.committed_tokens) == (2, 96)
        assert await s.blocks("b") == [(0, b"zero"), (1, b"one")]
    run(body, redis_client)


def test_concurrent_appends_store_each_block_once_in_order(redis_client):
    n_blocks, n_tasks = 24, 20

    async def body(r):
        s = RequestStore(r)
        await s.create("c", SPEC, 3)
        await s.claim("c", "w")
        stored_by: dict[int, list[int]] = {i: [] for i in range(n_blocks)}
        outcomes = {"stored": 0, "duplicate": 0, "out_of_order": 0}

        async def worker(t: int):
            rng = random.Random(t)
            pending = list(range(n_blocks))
            rng.shuffle(pending)
            while pending:
                i = pending.pop(0)
                res = await s.append_block("c", i, payload(i, f"t{t}"), 64, attempt=0)
                outcomes[res] += 1
                if res == "stored":
                    stored_by[i].append(t)
                elif res == "out_of_order":
                    pending.insert(rng.randrange(len(pending) + 1), i)
                    await asyncio.sleep(0)
                else:
                    assert res == "duplicate", res

        await asyncio.gather(*[worker(t) for t in range(n_tasks)])
        assert len(await r.client_list()) > 1       # several connections really raced
        assert outcomes["out_of_order"] > 0
        assert all(len(v) == 1 for v in stored_by.values()), stored_by
        assert outcomes["stored"] == n_blocks
        assert outcomes["duplicate"] == n_blocks * (n_tasks - 1)
        got = await s.blocks("c")
        assert [i for i, _ in got] == list(range(n_blocks))
        assert [p for _, p in got] == [payload(i, f"t{stored_by[i][0]}") for i in range(n_blocks)]
        st = await s.get("c")
        assert (st.next_block, st.committed_tokens) == (n_blocks, 64 * n_blocks)
        assert await r.hlen(s.blocks_key("c")) == n_blocks
    # redis.asyncio's pool opens one connection per in-flight command: the 20 tasks really
    # race on the server.
    run(body, redis_client)


def test_concurrent_claims_one_winner(redis_client):
    async def body(r):
        s = RequestStore(r)
        await s.create("q", SPEC, 1)
        res = await asyncio.gather(*[s.claim("q", f"w{i}") for i in range(20)])
        won = [i for i, c in enumerate(res) if c is not None]
        assert len(won) == 1 and res[won[0]] == Claimed(next_block=0, attempt=0)
        winner = f"w{won[0]}"
        assert (await s.get("q")).worker == winner
        for i in range(20):
            assert await s.running_ids(f"w{i}") == ([("q")] if f"w{i}" == winner else [])
        assert (await assert_counts_consistent(s))["running"] == 1
    run(body, redis_client)


# ------------------------------------------------------------------ worker loss

def test_worker_loss_requeue_and_zombie_refused(redis_client):
    async def body(r):
        s = RequestStore(r)
        for rid in ("r1", "r2", "r3"):
            await s.create(rid, SPEC, 10)
        await s.register_worker("dead", {"gpu": "H200", "slots": 8, "tags": []})
        await s.register_worker("live", {"gpu": "H200", "slots": 8})
        assert await s.claim("r1", "dead") and await s.claim("r2", "dead")
        assert await s.claim("r3", "live")
        assert await s.append_block("r1", 0, b"r1-b0", 64, attempt=0) == "stored"
        assert await s.append_block("r1", 1, b"r1-b1", 64, attempt=0) == "stored"

        assert await s.requeue_worker("dead") == ["r1", "r2"]
        assert await s.running_ids("dead") == []
        assert await s.running_ids("live") == ["r3"]
        assert await s.queued_ids() == ["r1", "r2"]    # original enqueue order kept
        st = await s.get("r1")
        assert (st.status, st.worker, st.attempt) == ("queued", None, 1)
        assert (st.next_block, st.committed_tokens) == (2, 128)   # committed blocks kept
        assert await s.requeue_worker("dead") == []    # idempotent
        c = await assert_counts_consistent(s)
        assert (c["queued"], c["running"]) == (2, 1)

        # zombie of attempt 0 while requeued: refused
        assert await s.append_block("r1", 2, b"zombie", 64, attempt=0) == "not_running"
        # new placement, attempt 1
        assert await s.claim("r1", "live")
        assert await s.append_block("r1", 2, b"zombie", 64, attempt=0) == "not_running"
        assert not await s.finish("r1", "eos", attempt=0)
        assert not await s.fail("r1", "zombie says so", attempt=0)
        assert await s.append_block("r1", 2, b"r1-b2", 64, attempt=1) == "stored"
        assert await s.finish("r1", "eos", attempt=1)
        assert await s.blocks("r1") == [(0, b"r1-b0"), (1, b"r1-b1"), (2, b"r1-b2")]

        # single-request requeue checks the worker
        assert await s.claim("r2", "live")
        assert not await s.requeue("r2", "dead")
        assert await s.requeue("r2", "live")
        assert (await s.get("r2")).attempt == 2
        await assert_counts_consistent(s)
    run(body, redis_client)


def test_workers_heartbeat_and_stale(redis_client):
    async def body(r):
        s = RequestStore(r)
        info = {"gpu": "H200", "mem": 141733920768, "models": [], "nested": {"a": [1, 2]}}
        await s.register_worker("w1", info)
        await s.register_worker("w2", {"gpu": "H200"})
        ws = await s.workers()
        assert set(ws) == {"w1", "w2"}
        assert ws["w1"]["info"] == info
        hb0 = ws["w1"]["heartbeat"]
        assert ws["w1"]["registered_at"] == hb0
        await asyncio.sleep(0.15)
        assert await s.stale_workers(0.1) == ["w1", "w2"]
        assert await s.heartbeat("w1")
        assert not await s.heartbeat("ghost")
        ws = await s.workers()
        assert ws["w1"]["heartbeat"] > hb0 and ws["w1"]["info"] == info   # info untouched
        assert ws["w1"]["registered_at"] == hb0
        assert await s.stale_workers(0.1) == ["w2"]
        assert await s.stale_workers(60) == []
        assert await s.remove_worker("w2")
        assert set(await s.workers()) == {"w1"}
    run(body, redis_client)


# ------------------------------------------------------------------ TTL, restart, counts

def test_ttl_on_terminal_states(redis_client):
    async def body(r):
        s = RequestStore(r, finished_ttl_s=120)
        for rid, end in (("f", "finish"), ("e", "fail"), ("k", "cancel")):
            await s.create(rid, SPEC, 1)
            await s.claim(rid, "w")
            assert await s.append_block(rid, 0, b"b0", 64) == "stored"
            assert await r.ttl(s.req_key(rid)) == -1         # no TTL while live
            assert await r.ttl(s.blocks_key(rid)) == -1
            assert await {"finish": lambda: s.finish(rid, "eos"),
                          "fail": lambda: s.fail(rid, "err"),
                          "cancel": lambda: s.cancel(rid)}[end]()
            for key in (s.req_key(rid), s.blocks_key(rid)):
                assert 0 < await r.ttl(key) <= 120, key
        # queued -> cancelled without blocks: the hash gets its TTL
        await s.create("q", SPEC, 1)
        assert await s.cancel("q")
        assert 0 < await r.ttl(s.req_key("q")) <= 120
        # expiry really happens (short TTL)
        s1 = RequestStore(r, prefix="short:", finished_ttl_s=1)
        await s1.create("z", SPEC, 1)
        await s1.claim("z", "w")
        await s1.append_block("z", 0, b"b", 64)
        await s1.finish("z", "eos")
        await asyncio.sleep(1.2)
        assert await s1.get("z") is None and await s1.blocks("z") == []
        assert not await r.exists(s1.req_key("z"), s1.blocks_key("z"))
        assert await s1.create("z", SPEC, 1)          # id reusable after expiry
        assert await s1.blocks("z") == []
    run(body, redis_client)


def test_fresh_store_sees_same_state(redis_client, redis_server):
    async def body(r):
        s = RequestStore(r)
        await s.create("a", SPEC, 3)
        await s.create("b", SPEC, 4)
        await s.claim("a", "w")
        await s.append_block("a", 0, b"x", 64)
        await s.register_worker("w", {"k": 1})
        snapshot = (await s.get("a"), await s.get("b"), await s.blocks("a"),
                    await s.queued_ids(), await s.running_ids("w"), await s.counts(),
                    await s.workers())
        # a new client and a new store (a restarted scheduler)
        r2 = aioredis.Redis.from_url(redis_server.url)
        try:
            s2 = RequestStore(r2)
            again = (await s2.get("a"), await s2.get("b"), await s2.blocks("a"),
                     await s2.queued_ids(), await s2.running_ids("w"), await s2.counts(),
                     await s2.workers())
            assert again == snapshot
            # and it can carry on where the old one stopped
            assert await s2.append_block("a", 0, b"x", 64) == "duplicate"
            assert await s2.append_block("a", 1, b"y", 64) == "stored"
            assert await s2.finish("a", "eos")
        finally:
            await r2.aclose()
        assert (await s.get("a")).status == "finished"
        await assert_counts_consistent(s)
    run(body, redis_client)


def test_prefixes_are_isolated(redis_client):
    async def body(r):
        a, b = RequestStore(r, prefix="a:"), RequestStore(r, prefix="b:")
        assert await a.create("r", SPEC, 1)
        assert await b.create("r", SPEC, 2)
        assert await a.claim("r", "w")
        assert (await b.get("r")).status == "queued"
        assert (await a.counts())["running"] == 1 and (await b.counts())["running"] == 0
        assert await a.scan_counts() == await a.counts()
    run(body, redis_client)


# ------------------------------------------------------------------ persistence
# AOF on (appendfsync always): every acknowledged write is on disk, so a restart, even
# after SIGKILL, brings back all state. Persistence off (--save "", no AOF): the server
# keeps nothing on disk and a restart starts from an empty database.

async def _populate(url: str) -> None:
    r = aioredis.Redis.from_url(url)
    try:
        s = RequestStore(r)
        await s.create("p1", SPEC, 9)
        await s.create("p2", SPEC, 9)
        await s.claim("p1", "w")
        for i in range(3):
            assert await s.append_block("p1", i, payload(i), 64) == "stored"
        await s.register_worker("w", {"gpu": 0})
    finally:
        await r.aclose()


async def _read(url: str):
    r = aioredis.Redis.from_url(url)
    try:
        s = RequestStore(r)
        return (await s.get("p1"), await s.blocks("p1"), await s.queued_ids(),
                await s.running_ids("w"), await s.counts(), sorted(await s.workers()))
    finally:
        await r.aclose()


@pytest.mark.parametrize("kill", [False, True], ids=["sigterm", "sigkill"])
def test_aof_restart_keeps_state(tmp_path, kill):
    with EmbeddedRedis(aof=True, appendfsync="always", data_dir=tmp_path) as srv:
        asyncio.run(_populate(srv.url))
        before = asyncio.run(_read(srv.url))
        port = srv.port
        srv.restart(kill=kill)
        assert srv.port == port
        after = asyncio.run(_read(srv.url))
        assert after == before
        st, blocks, queued, running, counts, workers = after
        assert (st.status, st.next_block, st.committed_tokens) == ("running", 3, 192)
        assert blocks == [(i, payload(i)) for i in range(3)]
        assert queued == ["p2"] and running == ["p1"] and workers == ["w"]
        assert (counts["queued"], counts["running"]) == (1, 1)
    assert (tmp_path / "appendonly.aof").exists() or (tmp_path / "appendonlydir").exists()


def test_no_persistence_restart_loses_state(tmp_path):
    with EmbeddedRedis(aof=False, data_dir=tmp_path) as srv:
        asyncio.run(_populate(srv.url))
        assert asyncio.run(_read(srv.url))[0] is not None
        srv.restart()
        st, blocks, queued, running, counts, workers = asyncio.run(_read(srv.url))
        assert st is None and blocks == [] and queued == [] and running == [] and workers == []
        assert counts == {k: 0 for k in STATUSES}


# ------------------------------------------------------------------ EmbeddedRedis itself

def test_embedded_redis_lifecycle_and_errors(tmp_path, monkeypatch):
    assert os.access(redis_server_binary(), os.X_OK)
    srv = EmbeddedRedis()
    with srv:
        assert srv.running() and srv.url.startswith("redis://127.0.0.1:")
        srv.kill()
        assert not srv.running()
    assert not srv.data_dir.exists()            # own temp dir removed
    with pytest.raises(RedisServerError, match="bogus-directive"):
        EmbeddedRedis(data_dir=tmp_path, extra_args=["--bogus-directive", "1"]).start()
    monkeypatch.setenv("REDIS_SERVER_BIN", str(tmp_path / "missing"))
    with pytest.raises(RedisServerError, match="REDIS_SERVER_BIN"):
        redis_server_binary()


def test_placement_counts_streaming_requests_even_after_a_heartbeat_reset():
    """A heartbeat can report pages as free that requests placed just before it will take
    (the engine allocates on admission): free pages are capped by total - pages of the requests
    streaming from the worker, so a burst still spreads."""
    from cde.rpc.v1 import scheduler_pb2
    from scheduler_svc.workers import WorkerHandle, WorkerPool

    pool = WorkerPool(store=None, heartbeat_ms=1000)
    for wid, free in (("a", 100), ("b", 90)):
        info = scheduler_pb2.WorkerInfo(worker_id=wid, address=f"{wid}:1", model="m", kv_pages_total=100,
                                        kv_pages_free=free)
        pool.workers[wid] = WorkerHandle(wid, info, channel=None, stub=None)
    a, b = pool.workers["a"], pool.workers["b"]

    def place() -> str:
        h = pool.pick("m", set())
        pool.reserve(h, "r", 30, on_lost=lambda _: None)
        return h.worker_id

    assert [place() for _ in range(3)] == ["a", "b", "a"]
    a.placed_pages = b.placed_pages = 0   # heartbeats sent before either engine allocated
    # reported: a 100 free, b 90; streaming: a 2 x 30, b 1 x 30 -> b has more room
    assert [place() for _ in range(3)] == ["b", "b", "a"]


def test_placement_prefers_the_worker_that_holds_a_prompts_first_block(seed):
    """Prompt affinity: requests starting with the same 64-token block (n > 1 choices, a shared
    system prompt) go to the worker that got the first of them, where its prefix cache holds the
    block, while it has the pages and at least half the emptiest worker's free pages; other
    prompts, and a worker that filled up, go by free pages."""
    import random

    from cde.rpc.v1 import scheduler_pb2
    from scheduler_svc.workers import WorkerHandle, WorkerPool, prompt_prefix

    rng = random.Random(seed)
    pool = WorkerPool(store=None, heartbeat_ms=1000)
    for wid in ("a", "b", "c"):
        info = scheduler_pb2.WorkerInfo(worker_id=wid, address=f"{wid}:1", model="m", kv_pages_total=100,
                                        kv_pages_free=100)
        pool.workers[wid] = WorkerHandle(wid, info, channel=None, stub=None)
    system = [rng.randrange(1000) for _ in range(64)]

    def place(prompt: list[int], pages: int = 5) -> str:
        prefix = prompt_prefix(prompt)
        h = pool.pick("m", set(), pages, prefix)
        pool.reserve(h, "r", pages, on_lost=lambda _: None, prefix=prefix)
        return h.worker_id

    first = place(system + [1, 2])
    # four more with the system prompt stay there; unrelated and short prompts spread by free pages
    assert [place(system + [rng.randrange(1000)]) for _ in range(4)] == [first] * 4, f"seed={seed}"
    others = {place([rng.randrange(1000) for _ in range(70)]) for _ in range(2)} | {place([7] * 10)}
    assert first not in others, f"seed={seed}: {others} (first {first})"
    # the affine worker fills up (less than half the emptiest one's free pages): the next goes elsewhere
    pool.workers[first].placed_pages += 60
    assert place(system) != first, f"seed={seed}"
    assert prompt_prefix(system[:63]) is None
