"""scheduler_svc + worker_svc end to end: real gRPC servers on loopback, real Redis, the bundled
tiny model on the CPU (fp32), all in this process (asyncio) for speed.

Covered: a request streams Accepted, its blocks in order and Finished, with exactly the
tokens of the reference decoder; concurrent requests each store every block exactly once;
overload is RESOURCE_EXHAUSTED with a retry hint; Resume replays exactly; a worker that dies
mid-generation loses nothing (the request continues on the other worker, same tokens); a
scheduler restart loses nothing; client disconnect and deadlines cancel; bad input is
INVALID_ARGUMENT / FAILED_PRECONDITION; attributions come from an Attribute stream with the
last block flagged.

TODO(lead): the attribution test uses a stand-in Attribution servicer defined here; point
it at attribution_svc once that service lands.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import redis.asyncio as aioredis
import torch

from cde.rpc import floats_to_bytes, make_server, resolved, service_name
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cde.redis_util import free_port
from cde.rpc.v1 import (attribution_pb2, attribution_pb2_grpc, common_pb2, resolved_pb2, scheduler_pb2,
                        scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc)
from cde.steerling.loading import load_model
from cde.steerling.reference_decoder import clean_output, generate, terminal_ids
from cde.steerling.sampling import SamplingParams
from scheduler_svc.service import ATTACH_MD, SchedulerOptions, start_scheduler
from scheduler_svc.state import RequestStore
from tests.options import decode_options
from tests.redis_fixture import flush
from worker_svc.engine.job import Job
from worker_svc.engine.steerling_engine import BlockEvent, SteerlingEngine
from worker_svc.service import WorkerOptions, start_worker

pytestmark = pytest.mark.e2e

MODEL_DIR = str(Path(__file__).resolve().parents[1] / "models" / "steerling-tiny")
VOCAB = 264          # the byte tokenizer's ids (the embedding table is padded to 320)
TEST_TIMEOUT_S = 60


@functools.lru_cache(maxsize=1)
def model():
    return load_model(MODEL_DIR)


@functools.lru_cache(maxsize=None)
def reference(prompt: tuple[int, ...], max_new: int, k: int, seed: int):
    return generate(model(), list(prompt),
                    decode_options(max_new, sampling=SamplingParams(), tokens_per_step=k, seed=seed),
                    tokenizer_vocab_size=VOCAB)


def prompt_of(n: int, offset: int = 1) -> list[int]:
    return [(offset + i) % 250 + 1 for i in range(n)]


def submit_request(rid: str, prompt: list[int], max_new: int, seed: int, k: int = 1, **kw) -> scheduler_pb2.SubmitRequest:
    return scheduler_pb2.SubmitRequest(
        request_id=rid, model="steerling-tiny", prompt_tokens=prompt,
        options=resolved.block_diffusion(seed=seed, max_new_tokens=max_new, tokens_per_step=k,
                                         sampling_options=resolved_pb2.ResolvedSampling(
                                             use_entropy_sampling=True, temperature=1.2, top_p=0.8,
                                             repetition_penalty=1.1)), **kw)


@contextlib.contextmanager
def one_intra_op_thread():
    """One intra-op thread, as the test bodies run: two engine threads, the servers and the
    reference share a small CI box, and oversubscribed OpenMP spinning makes run times erratic."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run(coro_fn, *args, refs=()):
    """Run a test body in a fresh event loop. ``refs``: reference runs to compute first, so the
    (blocking) reference decoder never stalls the servers' loop (heartbeats would lapse)."""
    with one_intra_op_thread():
        for r in refs:
            reference(*r)

        async def main():
            return await asyncio.wait_for(coro_fn(*args), TEST_TIMEOUT_S)
        return asyncio.run(main())


@dataclass
class Cluster:
    sched: object
    workers: list
    stub: scheduler_pb2_grpc.SchedulerStub
    store: RequestStore
    redis: aioredis.Redis


@contextlib.asynccontextmanager
async def cluster(redis_url: str, n_workers: int = 1, **sched_kw):
    """A scheduler and ``n_workers`` workers (tiny model, CPU) registered with it; the test may
    replace ``c.sched`` or drop stopped workers from ``c.workers``: teardown stops what is left."""
    flush(redis_url)
    opts = dict(host="127.0.0.1", port=0, redis_url=redis_url, heartbeat_ms=250, dead_after=4.0, queue_timeout_s=10.0)
    opts.update(sched_kw)
    sched = await start_scheduler(SchedulerOptions(**opts))
    client = aioredis.Redis.from_url(redis_url)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{sched.port}")
    c = Cluster(sched, [], scheduler_pb2_grpc.SchedulerStub(channel), RequestStore(client), client)
    try:
        await sched.wait_ready(10)
        for i in range(n_workers):
            c.workers.append(await start_worker(WorkerOptions(
                model_dir=MODEL_DIR, host="127.0.0.1", port=0, scheduler=f"127.0.0.1:{sched.port}",
                worker_id=f"w{i}", kv_pages=64)))
        for _ in range(200):
            if len(sched.core.pool.live()) == n_workers:
                break
            await asyncio.sleep(0.05)
        assert len(sched.core.pool.live()) == n_workers
        yield c
    finally:
        await channel.close()
        await c.sched.stop(0)
        for w in c.workers:
            await w.stop(0)
        await client.aclose()


async def collect(call) -> list[scheduler_pb2.SchedulerEvent]:
    """The rest of a stream (read(), so it may follow earlier read() calls on the same call)."""
    out = []
    while (ev := await call.read()) is not grpc.aio.EOF:
        out.append(ev)
    return out


def blocks_of(events) -> list[common_pb2.BlockCommitted]:
    return [e.block for e in events if e.HasField("block")]


def assert_matches_reference(events, prompt, max_new, k, seed):
    ref = reference(tuple(prompt), max_new, k, seed)
    assert events[0].HasField("accepted") and events[0].accepted.seed == seed
    assert events[0].accepted.prompt_tokens == len(prompt)
    blocks = blocks_of(events)
    assert [b.block_index for b in blocks] == [b.block for b in ref.blocks]
    assert [list(b.tokens) for b in blocks] == [b.tokens for b in ref.blocks]
    assert [b.start for b in blocks] == [b.start for b in ref.blocks]
    fin = events[-1].finished
    assert events[-1].HasField("finished")
    want = common_pb2.FINISH_REASON_STOP if ref.finish_reason == "stop" else common_pb2.FINISH_REASON_LENGTH
    assert fin.reason == want
    cfg = model().cfg
    out = clean_output([t for b in blocks for t in b.tokens], cfg,
                       terminal_ids(cfg, decode_options(max_new, seed=seed)))
    assert out == ref.output_tokens
    assert fin.usage.completion_tokens == len(ref.output_tokens)
    assert fin.usage.steps == len(ref.steps)
    assert fin.usage.prompt_tokens == len(prompt)


async def stored_indices(c: Cluster, rid: str) -> list[int]:
    """Absolute indices of the blocks stored in Redis (numbered from 0 there), in order."""
    stored = await c.redis.hgetall(c.store.blocks_key(rid))
    rows = sorted((int(k), common_pb2.BlockCommitted.FromString(v).block_index) for k, v in stored.items())
    assert [k for k, _ in rows] == list(range(len(rows)))
    return [i for _, i in rows]


# ---- tests -------------------------------------------------------------------------------------

def long_job(i: int, max_new: int = 300) -> tuple[list[int], int, int, int]:
    """The i-th (prompt, max_new, tokens_per_step, seed) that the tiny model runs for at least 4
    blocks (no early <|eot_id|>), found with the reference decoder so the tests do not depend on
    which seeds happen to run long, and whose tokens the engine alone (fp32, as the workers run)
    reproduces: in fp32 the two sum in different orders, so a sampled run can flip at a near-tie
    of confidences on one CPU and not on another (long_job(2) did at 48 prompt tokens on a 2-core
    box, seed 3: block 1 differed at 9 positions, equal in float64). These tests are about what
    the services do with an exact engine, not about fp32 ties."""
    return _long_jobs(max_new)[i]


def _engine_reproduces(prompt: list[int], max_new: int, k: int, seed: int) -> bool:
    with one_intra_op_thread():   # as `run` gives the workers
        engine = SteerlingEngine(model(), tokenizer_vocab_size=VOCAB, max_slots=2, n_pages=64)
        opts = decode_options(max_new, sampling=SamplingParams(), tokens_per_step=k, seed=seed)
        handle = engine.submit(Job("probe", prompt, opts))
        engine.run_until_idle()
    got = [ev.tokens for ev in engine.drain(handle) if isinstance(ev, BlockEvent)]
    return got == [b.tokens for b in reference(tuple(prompt), max_new, k, seed).blocks]


@functools.lru_cache(maxsize=None)
def _long_jobs(max_new: int) -> list[tuple[list[int], int, int, int]]:
    found = []
    for seed in range(1, 200):
        prompt = prompt_of(20 + 7 * (seed % 9), offset=seed % 5 + 1)
        if len(reference(tuple(prompt), max_new, 4, seed).blocks) >= 4 and _engine_reproduces(prompt, max_new, 4, seed):
            found.append((prompt, max_new, 4, seed))
            if len(found) == 5:
                return found
    raise AssertionError("no seeds run the tiny model for 4 blocks")


def test_submit_streams_blocks_in_order_matching_reference(redis_server):
    prompt, max_new, k, seed = prompt_of(19), 100, 2, 0

    async def body():
        async with cluster(redis_server.url) as c:
            events = await collect(c.stub.Submit(submit_request("r1", prompt, max_new, seed, k, stream_steps=True)))
            assert_matches_reference(events, prompt, max_new, k, seed)
            kinds = [e.WhichOneof("event") for e in events]
            assert kinds[0] == "accepted" and kinds[-1] == "finished" and "step" in kinds
            steps = [e.step for e in events if e.HasField("step")]
            assert [s.step for s in steps] == list(range(len(steps)))
            # no attributions asked: the worker sends (and Redis stores) no concept records
            assert all(not b.records.tokens and not b.records.known_idx for b in blocks_of(events))
            st = await c.store.get("r1")
            assert st.status == "finished" and st.finish_reason == reference(tuple(prompt), max_new, k, seed).finish_reason
            assert await stored_indices(c, "r1") == [b.block_index for b in blocks_of(events)]
            # idempotent submit: the same id attaches and replays the same blocks
            stats = await c.stub.Stats(scheduler_pb2.StatsRequest())
            assert stats.running == 0 and [w.worker_id for w in stats.workers] == ["w0"]
            async with grpc.aio.insecure_channel(c.workers[0].address) as ch:
                info = await worker_pb2_grpc.WorkerStub(ch).Info(worker_pb2.WorkerStatusRequest())
                assert (info.model, info.preset, info.device, info.vocab_size) == ("steerling-tiny", "tiny", "cpu", VOCAB)
                assert info.kv_pages_free == info.kv_pages_total > 0 and info.running == 0 and info.steps > 0
                # r1 is the one request this worker served (warm-up requests are admitted, never sent)
                assert info.first_blocks == 1 and 0 < info.first_block_seconds_sum < 60, info
                assert info.admitted > 1 and info.queue_seconds_sum >= 0, info
                # prefix caching (on by default) looked up r1's 19 prompt tokens: no whole 64-token block to hit
                assert (info.prefix_cache_queries, info.prefix_cache_hits) == (len(prompt), 0), info
                health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
                assert health.status == health_pb2.HealthCheckResponse.SERVING
            again = await collect(c.stub.Submit(submit_request("r1", prompt, max_new, seed, k)))
            assert [b.SerializeToString() for b in blocks_of(again)] == \
                [b.SerializeToString() for b in blocks_of(events)]
            assert again[-1].finished == events[-1].finished
    run(body, refs=[(tuple(prompt), max_new, k, seed)])


def test_concurrent_requests_finish_and_store_each_block_once(redis_server):
    jobs = [(f"c{i}", prompt_of(10 + 13 * i, offset=i), 80 + 10 * i, i, 4) for i in range(8)]

    async def body():
        async with cluster(redis_server.url, n_workers=2) as c:
            results = await asyncio.gather(*[collect(c.stub.Submit(submit_request(rid, p, n, s, k)))
                                             for rid, p, n, s, k in jobs])
            for (rid, p, n, s, k), events in zip(jobs, results):
                assert_matches_reference(events, p, n, k, s)
                idx = [b.block_index for b in blocks_of(events)]
                assert idx == sorted(set(idx))
                assert await stored_indices(c, rid) == idx
                st = await c.store.get(rid)
                assert st.terminal and st.next_block == len(idx)
            counts = await c.store.counts()
            assert counts["running"] == 0 and counts["queued"] == 0 and counts["finished"] == 8
    run(body, refs=[(tuple(p), n, k, s) for _, p, n, s, k in jobs])


def test_overload_is_resource_exhausted_with_retry_hint(redis_server):
    async def body():
        # no workers: admitted requests wait in the queue, so the limit is reached at once
        async with cluster(redis_server.url, n_workers=0, max_running=1, max_queue=1) as c:
            calls = [c.stub.Submit(submit_request(f"q{i}", [1, 2, 3], 8, i)) for i in range(2)]
            for call in calls:
                assert (await call.read()).HasField("accepted")
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await collect(c.stub.Submit(submit_request("q2", [1, 2, 3], 8, 2)))
            assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            hint = dict(list(exc.value.trailing_metadata() or ()))
            assert int(hint["retry-after-ms"]) > 0
            assert f"retry after {hint['retry-after-ms']} ms" in exc.value.details()
            assert await c.store.get("q2") is None
            for i in range(2):
                assert (await c.stub.Cancel(common_pb2.CancelRequest(request_id=f"q{i}"))).cancelled
                assert (await c.store.get(f"q{i}")).status == "cancelled"
                rest = await collect(calls[i])
                assert rest[-1].finished.reason == common_pb2.FINISH_REASON_CANCELLED
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await c.stub.Cancel(common_pb2.CancelRequest(request_id="nope"))
            assert exc.value.code() == grpc.StatusCode.NOT_FOUND
    run(body)


def test_scheduler_is_not_serving_until_redis_answers():
    async def body():
        sched = await start_scheduler(SchedulerOptions(host="127.0.0.1", port=0,
                                                       redis_url=f"redis://127.0.0.1:{free_port()}/0"))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{sched.port}") as ch:
                await asyncio.sleep(0.3)
                health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
                assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await collect(scheduler_pb2_grpc.SchedulerStub(ch).Submit(submit_request("x", [1], 8, 0)))
                assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            await sched.stop(0)
    run(body)


def test_resume_replays_the_rest_exactly(redis_server):
    prompt, max_new, k, seed = long_job(1)

    async def body():
        async with cluster(redis_server.url) as c:
            call = c.stub.Submit(submit_request("res", prompt, max_new, seed, k))
            head = [await call.read(), await call.read()]
            assert head[0].HasField("accepted") and head[1].HasField("block")
            first = head[1].block.block_index
            resumed, rest = await asyncio.gather(
                collect(c.stub.Resume(common_pb2.ResumeRequest(request_id="res", after_block=first))),
                collect(call))
            assert resumed[0].accepted == head[0].accepted
            assert [e.SerializeToString() for e in resumed[1:]] == [e.SerializeToString() for e in rest]
            events = head + rest
            assert_matches_reference(events, prompt, max_new, k, seed)
            # after the end: a Resume from the start replays everything, identically
            replay = await collect(c.stub.Resume(common_pb2.ResumeRequest(request_id="res")))
            assert [e.SerializeToString() for e in replay] == [e.SerializeToString() for e in events]
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await collect(c.stub.Resume(common_pb2.ResumeRequest(request_id="unknown")))
            assert exc.value.code() == grpc.StatusCode.NOT_FOUND
    run(body, refs=[(tuple(prompt), max_new, k, seed)])


def test_worker_loss_mid_generation_continues_elsewhere_without_loss(redis_server):
    jobs = [(f"wl{i}", *long_job(i)) for i in range(4)]

    async def body():
        async with cluster(redis_server.url, n_workers=2) as c:
            calls = {rid: c.stub.Submit(submit_request(rid, p, n, s, k)) for rid, p, n, k, s in jobs}
            first = jobs[0][0]
            head = {first: [await calls[first].read(), await calls[first].read()]}
            assert head[first][1].HasField("block")
            victim_id = (await c.store.get(first)).worker
            victim = next(w for w in c.workers if w.registrar.worker_id == victim_id)
            await victim.stop(0)   # abrupt, mid-generation: streams cut, no more heartbeats
            c.workers.remove(victim)
            rests = await asyncio.gather(*[collect(call) for call in calls.values()])
            for (rid, p, n, k, s), rest in zip(jobs, rests):
                evs = head.get(rid, []) + rest
                assert_matches_reference(evs, p, n, k, s)
                idx = [b.block_index for b in blocks_of(evs)]
                assert idx == list(range(idx[0], idx[0] + len(idx)))   # none missing, none twice
                assert await stored_indices(c, rid) == idx
            st = await c.store.get(first)   # it was cut after its first block and finished elsewhere
            assert st.attempt >= 1 and st.worker != victim_id
            assert victim_id not in await c.store.workers()
    run(body, refs=[(tuple(p), n, k, s) for _, p, n, k, s in jobs])


def test_scheduler_restart_resumes_from_redis(redis_server):
    prompt, max_new, k, seed = long_job(3)

    async def body():
        async with cluster(redis_server.url) as c:
            call = c.stub.Submit(submit_request("sr", prompt, max_new, seed, k))
            head = [await call.read(), await call.read()]
            assert head[1].HasField("block")
            port = c.sched.port
            await c.sched.stop(0)   # the client stream breaks; the request stays in Redis
            with pytest.raises(grpc.aio.AioRpcError):
                await collect(call)
            c.sched = await start_scheduler(SchedulerOptions(host="127.0.0.1", port=port, redis_url=redis_server.url,
                                                             heartbeat_ms=250, dead_after=4.0,
                                                             queue_timeout_s=10.0))
            await c.sched.wait_ready(10)
            resumed = None
            for _ in range(50):   # the client reconnects until the new instance answers
                try:
                    resumed = await collect(c.stub.Resume(common_pb2.ResumeRequest(
                        request_id="sr", after_block=head[1].block.block_index)))
                    break
                except grpc.aio.AioRpcError as e:
                    assert e.code() == grpc.StatusCode.UNAVAILABLE
                    await asyncio.sleep(0.1)
            assert resumed is not None and resumed[0].accepted == head[0].accepted
            assert_matches_reference(head + resumed[1:], prompt, max_new, k, seed)
            st = await c.store.get("sr")
            assert st.status == "finished" and st.attempt >= 1
    run(body, refs=[(tuple(prompt), max_new, k, seed)])


def test_client_disconnect_and_deadline_cancel(redis_server):
    async def body():
        async with cluster(redis_server.url) as c:
            # the gateway's way: the stream names itself, and Detach says its client left
            call = c.stub.Submit(submit_request("gone", prompt_of(20), 500, 0), metadata=((ATTACH_MD, "s1"),))
            assert (await call.read()).HasField("accepted")
            assert (await call.read()).HasField("block")
            call.cancel()
            await c.stub.Detach(scheduler_pb2.DetachRequest(request_id="gone", attach_id="s1"))
            engine = c.workers[0].front.engine
            for _ in range(100):
                st = await c.store.get("gone")
                if st.status == "cancelled" and engine.stats().running == 0 and engine.stats().pages_used == 0:
                    break
                await asyncio.sleep(0.05)
            assert st.status == "cancelled"
            assert engine.stats().running == 0 and engine.stats().pages_used == 0
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await collect(c.stub.Submit(submit_request("late", prompt_of(20), 900, 4), timeout=0.3))
            assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            for _ in range(100):
                if (await c.store.get("late")).status == "cancelled":
                    break
                await asyncio.sleep(0.05)
            assert (await c.store.get("late")).status == "cancelled"
    run(body)


async def wait_status(store: RequestStore, rid: str, want: str, timeout: float) -> str:
    st = None
    for _ in range(int(timeout / 0.05)):
        st = (await store.get(rid)).status
        if st == want:
            break
        await asyncio.sleep(0.05)
    return st


def test_a_stream_that_breaks_without_detach_waits_the_grace_for_a_resume(redis_server):
    """A stream that just breaks (its gateway process died: no Detach) leaves the request running
    for the detach grace: a Resume within it gets the rest, identical to the reference; with no
    Resume it is cancelled once the grace is over. A Detach cancels at once, but only when no
    other stream is attached."""
    grace, prompt, max_new, k, seed = 2.0, prompt_of(20), 320, 1, 5

    async def body():
        async with cluster(redis_server.url, detach_grace_s=grace) as c:
            call = c.stub.Submit(submit_request("orphan", prompt, max_new, seed, k), metadata=((ATTACH_MD, "a"),))
            head = [await call.read(), await call.read()]
            assert head[1].HasField("block"), head
            call.cancel()   # no Detach
            await asyncio.sleep(grace / 2)
            st = (await c.store.get("orphan")).status
            assert st in ("running", "finished"), st
            rest = await collect(c.stub.Resume(common_pb2.ResumeRequest(
                request_id="orphan", after_block=head[1].block.block_index), metadata=((ATTACH_MD, "b"),)))
            assert_matches_reference(head + rest[1:], prompt, max_new, k, seed)
            assert (await c.store.get("orphan")).status == "finished"

            # nobody reattaches: cancelled after the grace, not before
            call = c.stub.Submit(submit_request("left", prompt_of(20, 7), 900, 1), metadata=((ATTACH_MD, "c"),))
            assert (await call.read()).HasField("accepted") and (await call.read()).HasField("block")
            call.cancel()
            t0 = asyncio.get_running_loop().time()
            await asyncio.sleep(grace * 0.6)
            assert (await c.store.get("left")).status == "running", "cancelled before the detach grace was over"
            assert await wait_status(c.store, "left", "cancelled", grace + 5) == "cancelled"
            waited = asyncio.get_running_loop().time() - t0
            assert grace * 0.9 <= waited < grace + 5, waited

            # two streams: the first one's Detach leaves the request to the second; the second's cancels it
            call = c.stub.Submit(submit_request("two", prompt_of(20, 7), 900, 1), metadata=((ATTACH_MD, "x"),))
            assert (await call.read()).HasField("accepted") and (await call.read()).HasField("block")
            other = c.stub.Resume(common_pb2.ResumeRequest(request_id="two"), metadata=((ATTACH_MD, "y"),))
            assert (await other.read()).HasField("accepted")
            call.cancel()
            got = await c.stub.Detach(scheduler_pb2.DetachRequest(request_id="two", attach_id="x"))
            assert not got.cancelled
            await asyncio.sleep(0.3)
            st = (await c.store.get("two")).status
            assert st == "running", f"after the first stream's Detach, with another attached: {st}"
            got = await c.stub.Detach(scheduler_pb2.DetachRequest(request_id="two", attach_id="y"))
            assert got.cancelled
            assert await wait_status(c.store, "two", "cancelled", 5) == "cancelled"
            with pytest.raises(grpc.aio.AioRpcError):   # the detached stream was ended by the scheduler
                await asyncio.wait_for(collect(other), 5)
            other.cancel()
    run(body, refs=[(tuple(prompt), max_new, k, seed)])


def test_bad_input_is_invalid_argument(redis_server):
    cfg = model().cfg

    def steering(n: int, model_name: str = "steerling-tiny") -> common_pb2.PreparedSteering:
        return common_pb2.PreparedSteering(direction_f32=floats_to_bytes([0.1] * n), base_alpha=1.0, inject_layer=1,
                                           schedule=common_pb2.STEERING_SCHEDULE_FIXED, model=model_name)

    cases = [
        (submit_request("b1", [1, 2, 5000], 8, 0), grpc.StatusCode.INVALID_ARGUMENT),        # id >= vocab
        (submit_request("b2", [], 8, 0), grpc.StatusCode.INVALID_ARGUMENT),                  # empty prompt
        (submit_request("b3", [1, 2], 0, 0), grpc.StatusCode.INVALID_ARGUMENT),              # no tokens asked
        (submit_request("b4", [1] * 1000, 100, 0), grpc.StatusCode.INVALID_ARGUMENT),        # past the context
        (submit_request("b5", [1, 2], 8, 0, steering=steering(cfg.n_embd + 1)), grpc.StatusCode.INVALID_ARGUMENT),
        (submit_request("b6", [1, 2], 8, 0, steering=steering(cfg.n_embd, "other")),
         grpc.StatusCode.FAILED_PRECONDITION),
        (submit_request("bad id", [1, 2], 8, 0), grpc.StatusCode.INVALID_ARGUMENT),
    ]

    async def body():
        async with cluster(redis_server.url) as c:
            for req, code in cases:
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await collect(c.stub.Submit(req))
                assert exc.value.code() == code, (req.request_id, exc.value.details())
            st = await c.store.get("b1")
            assert st.status == "failed" and "vocabulary" in st.error
            # a good steered request still goes through
            ok = await collect(c.stub.Submit(submit_request("good", [1, 2, 3], 8, 0, steering=steering(cfg.n_embd))))
            assert ok[-1].finished.reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
    run(body)


class EchoAttribution(attribution_pb2_grpc.AttributionServicer):
    """Stand-in for attribution_svc: one token attribution per committed record, one chunk
    attribution closing the generation on the block flagged last."""

    def __init__(self):
        self.requests: list[attribution_pb2.AttributeRequest] = []

    async def Attribute(self, request_iterator, context):
        async for req in request_iterator:
            self.requests.append(req)
            r = req.records
            resp = attribution_pb2.AttributeResponse(request_id=req.request_id, block_index=req.block_index)
            for pos, tok, logit in zip(r.positions, r.tokens, r.target_logits):
                resp.token_attributions.add(position=pos, token=tok, target_logit=logit)
            if req.last:
                resp.chunk_attributions.add(start=req.start, end=req.start + len(req.context_tokens))
            yield resp


def test_attributions_come_from_the_attribution_stream(redis_server):
    prompt, max_new, k, seed = long_job(4, 200)

    async def body():
        echo = EchoAttribution()
        server, health = await make_server([service_name(attribution_pb2, "Attribution")])
        attribution_pb2_grpc.add_AttributionServicer_to_server(echo, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with cluster(redis_server.url, attribution=[f"127.0.0.1:{port}"]) as c:
                req = submit_request("att", prompt, max_new, seed, k, attribution=common_pb2.ATTRIBUTION_ALL,
                                     attribution_top_k=4)
                events = await collect(c.stub.Submit(req))
                assert_matches_reference(events, prompt, max_new, k, seed)
                assert not any(e.HasField("step") for e in events)   # asked of the worker, not shown
                blocks = blocks_of(events)
                assert [r.block_index for r in echo.requests] == [b.block_index for b in blocks]
                assert [r.last for r in echo.requests] == [False] * (len(blocks) - 1) + [True]
                assert all(r.top_k == 4 and r.mode == common_pb2.ATTRIBUTION_ALL for r in echo.requests)
                for b in blocks:   # raw records: one row per committed token, row-major top-k
                    r = b.records
                    assert len(r.tokens) == len(r.positions) > 0 and r.k_known > 0 and r.k_disc > 0
                    assert len(r.known_idx) == len(r.tokens) * r.k_known
                    assert len(r.disc_logits) == len(r.tokens) * r.k_disc
                    assert [a.position for a in b.token_attributions] == list(r.positions)
                assert [len(b.chunk_attributions) for b in blocks] == [0] * (len(blocks) - 1) + [1]
                # stored with their attributions: a replay is identical
                replay = await collect(c.stub.Resume(common_pb2.ResumeRequest(request_id="att")))
                assert [e.SerializeToString() for e in replay] == [e.SerializeToString() for e in events]
        finally:
            await server.stop(0)
    run(body, refs=[(tuple(prompt), max_new, k, seed)])
