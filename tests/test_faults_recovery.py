"""Faults that used to reach users (issue 13), against the whole system as real processes on
loopback (cde.launch.Stack, tiny model on the CPU):

1. a burst far over the default admission limits gets only 200s and 429s (never a 503 from
   an exhausted Redis pool);
2. a Resume while Redis is away (after a scheduler restart left the request without
   subscribers) fails without cancelling the request, whose block writes wait for Redis;
   /health turns 503 as soon as a call failed on Redis (item 9);
3. a scheduler restart under load is latency, not an error, for streamed and non-streamed REST
   and for gRPC clients that never call Resume; after a longer outage the gateway sees the
   scheduler again within about a second and no worker is declared dead;
4. with the internal token on, calls without it are refused, a registration reusing a live
   worker's id from another address is refused, and malformed bytes on attribution's stream
   are INVALID_ARGUMENT;
5. two runs of the same seeded request (one alone, one among others) give identical JSON,
   attributions included.

Each test starts its own stack (or shares the token stack) and stops it; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter

import grpc
import httpx
import pytest
import redis

from cde.launch import TINY_MODEL as DEFAULT_MODEL, grpc_serving
from cde.rpc.internal_auth import TOKEN_FILE_ENV, TOKEN_MD
from cde.rpc.v1 import (attribution_pb2, common_pb2, generate_pb2, generate_pb2_grpc, scheduler_pb2,
                        scheduler_pb2_grpc, steering_pb2_grpc, worker_pb2, worker_pb2_grpc)
from gateway.metrics import GatewayMetrics
from gateway.pipeline import Limits, ModelCard, Pipeline
from tests.launcher_fixture import stop_launcher
from tests.stack_fixture import (FINISHED_OK, MODEL, GrpcStream, LauncherOutput, StreamResult, all_alive, chat_body,
                                 contiguous, grpc_request, internal_aio_channel, kill, restart_service, running_stack,
                                 service, stream_rest, wait_until, workers)

REPORT_TAG = "fault"


def health_status(url: str) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=3).status_code
    except httpx.HTTPError:
        return 0


def scheduler_serving(stack, timeout: float = 60.0) -> float:
    """Seconds until the scheduler's own gRPC health says SERVING."""
    t0 = time.monotonic()
    wait_until(lambda: grpc_serving(stack.ports["scheduler"], timeout=0.5), timeout, 0.05, "scheduler SERVING")
    return time.monotonic() - t0


def log_text(svc) -> str:
    return svc.log.read_text(errors="replace")


# =========================================================================================
# 1. overload: 429, never 503
# =========================================================================================

@pytest.mark.fault
def test_burst_at_default_limits_gets_only_200s_and_429s(tmp_path, report):
    burst = 768   # 6x the default live set (--max-running 64 + --max-queue 64)
    with running_stack(tmp_path / "stack", workers=1) as stack:
        url = stack.base_url

        async def one(c: httpx.AsyncClient, i: int):
            body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 32, "seed": 900 + i}
            r = await c.post(f"{url}/v1/completions", json=body)
            return r.status_code, r.headers.get("retry-after"), r.json()

        async def run():
            limits = httpx.Limits(max_connections=burst, max_keepalive_connections=burst)
            async with httpx.AsyncClient(timeout=300, limits=limits) as c:
                return await asyncio.wait_for(asyncio.gather(*(one(c, i) for i in range(burst))), 400)

        t0 = time.monotonic()
        out = asyncio.run(run())
        wall = time.monotonic() - t0
        statuses = Counter(s for s, *_ in out)
        others = [(s, body) for s, _, body in out if s not in (200, 429)]
        assert not others, f"{statuses}; first: {others[:3]}"
        assert statuses[429] >= 1 and statuses[200] >= 128, statuses
        for s, ra, body in out:
            if s == 429:
                assert ra is not None and int(ra) >= 1 and body["error"]["type"] == "rate_limit_error", (ra, body)
            else:
                assert body["choices"][0]["finish_reason"] in FINISHED_OK, body
        assert "Too many connections" not in log_text(service(stack, "scheduler"))
        assert all_alive(stack) == {}
        report(f"burst of {burst} at default limits: {statuses[200]} x 200, {statuses[429]} x 429 "
               f"(Retry-After), no other status, {wall:.1f}s")


@pytest.mark.fault
def test_burst_straight_at_the_scheduler_is_refused_by_admission_not_by_redis(tmp_path, report):
    """The REST burst above is paced by the gateway; this one opens 1,280 Submit streams on the
    scheduler at once, far past redis-py's default pool of 100 connections: admission must refuse
    the excess (RESOURCE_EXHAUSTED) before any per-request Redis work, and nothing may fail with
    UNAVAILABLE ("Too many connections")."""
    burst = 1280
    with running_stack(tmp_path / "stack", workers=1) as stack:
        sport = stack.ports["scheduler"]

        async def run():
            template = await _submit_request(4242, 8)
            async with internal_aio_channel(stack, sport) as ch:
                stub = scheduler_pb2_grpc.SchedulerStub(ch)

                async def one(i: int) -> str:
                    req = scheduler_pb2.SubmitRequest()
                    req.CopyFrom(template)
                    req.request_id = f"burst-{i}-{uuid.uuid4().hex[:8]}"
                    try:
                        async for ev in stub.Submit(req, timeout=300):
                            if ev.WhichOneof("event") == "finished":
                                return "finished"
                        return "eof"
                    except grpc.aio.AioRpcError as e:
                        return e.code().name

                return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(burst))), 400)

        t0 = time.monotonic()
        codes = Counter(asyncio.run(run()))
        wall = time.monotonic() - t0
        assert set(codes) <= {"finished", "RESOURCE_EXHAUSTED"}, codes
        assert codes["finished"] >= 128 and codes["RESOURCE_EXHAUSTED"] >= 1, codes
        assert "Too many connections" not in log_text(service(stack, "scheduler"))
        report(f"burst of {burst} Submit streams straight at the scheduler: {codes['finished']} finished, "
               f"{codes['RESOURCE_EXHAUSTED']} x RESOURCE_EXHAUSTED, nothing else, {wall:.1f}s")


# =========================================================================================
# 2. Resume while Redis is away: the request keeps running; /health follows Redis (item 9)
# =========================================================================================

async def _submit_request(seed: int, max_new: int) -> scheduler_pb2.SubmitRequest:
    """What the gateway would send the scheduler (its own Pipeline.prepare, no backends needed)."""
    pipeline = Pipeline(ModelCard.load(DEFAULT_MODEL), None, Limits(max_tokens_limit=1024), GatewayMetrics(MODEL))
    req = generate_pb2.GenerateRequest(
        request_id=f"rd-{uuid.uuid4().hex}", model=MODEL, prompt="Once upon a time",
        decode=common_pb2.DecodeOptions(max_new_tokens=max_new, seed=seed),
        attribution=common_pb2.ATTRIBUTION_CHUNKS)
    return (await pipeline.prepare(req)).submit


async def _read_blocks(call, st: GrpcStream, until_blocks: int | None = None) -> None:
    async for ev in call:
        kind = ev.WhichOneof("event")
        if kind == "block":
            st.blocks.append(ev.block.block_index)
            st.tokens += list(ev.block.tokens)
            if until_blocks is not None and len(st.blocks) >= until_blocks:
                return
        elif kind == "finished":
            st.finished = ev.finished
            return


@pytest.mark.fault
def test_resume_during_a_redis_outage_leaves_the_request_running_and_health_follows_redis(tmp_path, report):
    with running_stack(tmp_path / "stack", workers=1) as stack:
        url, sport = stack.base_url, stack.ports["scheduler"]
        sched = service(stack, "scheduler")
        rds = redis.Redis.from_url(stack.redis.url)

        async def scenario(seed: int):
            submit = await _submit_request(seed, 900)
            rid = submit.request_id
            async with internal_aio_channel(stack, sport) as ch:
                first = GrpcStream(request_id=rid)
                call = scheduler_pb2_grpc.SchedulerStub(ch).Submit(submit, timeout=120)
                await asyncio.wait_for(_read_blocks(call, first, until_blocks=1), 60)
                if first.finished is not None:
                    return None
                # scheduler restart (closing our stream would cancel the request): the new
                # instance takes the request over, with no subscriber
                await asyncio.to_thread(kill, sched)
            await asyncio.to_thread(restart_service, stack, sched)
            await asyncio.to_thread(scheduler_serving, stack)

            def placed():
                h = rds.hgetall(f"cde:req:{rid}")
                return h if h.get(b"status") == b"running" and h.get(b"worker") else None
            h = await asyncio.to_thread(wait_until, placed, 30, 0.02, "request running again")
            attempt = int(h[b"attempt"])
            # Redis goes away (graceful: the AOF keeps every acknowledged write)
            await asyncio.to_thread(stack.redis.stop)
            t_down = time.monotonic()
            async with internal_aio_channel(stack, sport) as ch:
                stub = scheduler_pb2_grpc.SchedulerStub(ch)
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await asyncio.wait_for(_read_blocks(stub.Resume(common_pb2.ResumeRequest(request_id=rid),
                                                                    timeout=30), GrpcStream()), 40)
                assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value
                health_after_failure = await asyncio.to_thread(health_status, url)
                await asyncio.to_thread(wait_until, lambda: health_status(url) == 503, 5, 0.05, "/health 503")
                unhealthy_s = time.monotonic() - t_down
                await asyncio.to_thread(stack.redis.start)
                await asyncio.to_thread(wait_until, lambda: health_status(url) == 200, 30, 0.1, "/health 200")
                rest = GrpcStream(request_id=rid)
                await asyncio.wait_for(_read_blocks(stub.Resume(common_pb2.ResumeRequest(request_id=rid),
                                                                timeout=120), rest), 130)
            return rid, attempt, health_after_failure, unhealthy_s, rest

        for seed in range(40, 46):   # a seed whose request is still running after its first block
            got = asyncio.run(scenario(seed))
            if got is not None:
                break
        else:
            raise AssertionError("no seed kept a request running")
        rid, attempt, health_after_failure, unhealthy_s, rest = got
        assert health_after_failure == 503, "a call had just failed on Redis, yet /health said ready"
        assert rest.finished is not None and rest.finished.reason in (common_pb2.FINISH_REASON_STOP,
                                                                       common_pb2.FINISH_REASON_LENGTH), (
            seed, rest.finished)
        assert contiguous(rest.blocks), (seed, rest.blocks)
        assert int(rds.hget(f"cde:req:{rid}", "attempt")) == attempt, \
            f"seed {seed}: the request was interrupted and re-placed during the outage"
        assert b"client gone" not in sched.log.read_bytes()
        assert all_alive(stack) == {}
        report(f"Resume during a Redis outage: UNAVAILABLE, request {rid} kept running (attempt {attempt} "
               f"unchanged) and finished with {len(rest.blocks)} blocks; /health 503 {unhealthy_s:.2f}s after "
               f"Redis stopped and at once after a failed call")


# =========================================================================================
# 3. scheduler restart under load: latency only; recovery after an outage
# =========================================================================================

async def _generate_once(stub, req: generate_pb2.GenerateRequest, budget_s: float) -> GrpcStream:
    """One public Generate call, never resumed by the client."""
    st = GrpcStream(req)
    try:
        async for ev in stub.Generate(req, timeout=budget_s):
            st.feed(ev)
    except grpc.aio.AioRpcError as e:
        st.errors.append(f"{e.code().name}: {e.details()}")
    return st


async def _post(c: httpx.AsyncClient, url: str, body: dict) -> tuple[int, dict]:
    r = await c.post(f"{url}/v1/chat/completions", json=body)
    return r.status_code, r.json()


@pytest.mark.fault
def test_scheduler_restart_is_only_latency_for_rest_and_grpc_clients(tmp_path, report):
    with running_stack(tmp_path / "stack", workers=1) as stack:
        url, gport = stack.base_url, stack.ports["gateway_grpc"]
        sched, [worker] = service(stack, "scheduler"), workers(stack)
        seeds = [1, 2, 3]
        streamed = [chat_body(s, 190) for s in seeds]
        plain = [chat_body(s + 10, 190, stream=False) for s in seeds]
        grpc_reqs = [grpc_request(s + 20, 190) for s in seeds[:2]]

        async def run_all(disturb: bool):
            results = [StreamResult() for _ in streamed]
            async with httpx.AsyncClient(timeout=180) as c, grpc.aio.insecure_channel(f"127.0.0.1:{gport}") as ch:
                stub = generate_pb2_grpc.GenerationStub(ch)
                tasks = [asyncio.create_task(stream_rest(c, url, b, r)) for b, r in zip(streamed, results)]
                plain_tasks = [asyncio.create_task(_post(c, url, b)) for b in plain]
                grpc_tasks = [asyncio.create_task(_generate_once(stub, r, 180)) for r in grpc_reqs]
                if disturb:
                    deadline = time.monotonic() + 60
                    while sum(1 for r in results if r.blocks) < 2:
                        assert time.monotonic() < deadline and not all(t.done() for t in tasks), "no blocks arrived"
                        await asyncio.sleep(0.005)
                    await asyncio.to_thread(kill, sched)
                    await asyncio.to_thread(restart_service, stack, sched)
                await asyncio.wait_for(asyncio.gather(*tasks, *plain_tasks, *grpc_tasks), 200)
                in_flight_at_kill = sum(1 for r in results if r.finish is None)
                return results, [t.result() for t in plain_tasks], [t.result() for t in grpc_tasks], in_flight_at_kill

        ref_s, ref_p, ref_g, _ = asyncio.run(run_all(False))
        assert all(r.finish in FINISHED_OK and not r.errors for r in ref_s)
        t0 = time.monotonic()
        got_s, got_p, got_g, _ = asyncio.run(run_all(True))
        disturbed_s = time.monotonic() - t0
        for i, (ref, got) in enumerate(zip(ref_s, got_s)):
            assert got.status == 200 and not got.errors and got.done, (i, got.errors)
            assert contiguous(got.blocks) and got.blocks == ref.blocks and got.tokens == ref.tokens, (i, got.blocks)
            assert got.text == ref.text and got.finish == ref.finish, i
        for i, ((rs, rb), (gs, gb)) in enumerate(zip(ref_p, got_p)):
            assert gs == 200, (i, gb)
            assert gb["choices"][0]["message"]["content"] == rb["choices"][0]["message"]["content"], i
            assert gb["usage"] == rb["usage"], i
        for i, (ref, got) in enumerate(zip(ref_g, got_g)):
            assert not got.errors and got.finished is not None, (i, got.errors)
            assert got.blocks == ref.blocks and got.text == ref.text, i
        resumed = log_text(service(stack, "gateway")).count("reattaching")
        assert resumed >= 1, "no scheduler stream broke: the kill hit nothing"

        # a longer outage: gRPC's default reconnect backoff would leave the gateway blind for seconds
        kill(sched)
        time.sleep(8)
        mark = len(log_text(sched))
        restart_service(stack, sched)
        up_s = scheduler_serving(stack)
        t_up = time.monotonic()
        wait_until(lambda: health_status(url) == 200, 30, 0.02, "gateway /health 200")
        seen_s = time.monotonic() - t_up
        t1 = time.monotonic()
        r = httpx.post(f"{url}/v1/chat/completions", json=chat_body(5, 64, stream=False), timeout=60)
        first_s = time.monotonic() - t1
        assert r.status_code == 200, r.text
        assert seen_s < 1.0, f"the gateway saw the restarted scheduler only {seen_s:.2f}s after it was SERVING"
        time.sleep(4)   # past the restarted scheduler's 3-heartbeat grace: the worker must still be known
        after = log_text(sched)[mark:]
        assert "is dead" not in after, after[-2000:]
        assert log_text(worker).count("registered w0") == 1, "the worker had to register again"
        assert all_alive(stack) == {}
        report(f"scheduler restart under load: {len(got_s)} SSE + {len(got_p)} plain REST + {len(got_g)} gRPC "
               f"requests identical to undisturbed runs, no client error, {resumed} gateway reattaches "
               f"({disturbed_s:.1f}s for the disturbed round); after 8 s down: SERVING {up_s:.1f}s after start, "
               f"gateway /health 200 {seen_s:.2f}s later, first request {first_s:.2f}s, worker kept")


# =========================================================================================
# 4 + 5. internal token, forged registrations, malformed attribution bytes, determinism
# =========================================================================================

@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    """A stack whose internal token is ours (a file named by CDE_INTERNAL_TOKEN_FILE in the
    launcher's environment, which the launcher uses instead of generating one): (stack, token)."""
    root = tmp_path_factory.mktemp("secured")
    token_file = root / "internal_token"
    token = uuid.uuid4().hex + uuid.uuid4().hex
    token_file.write_text(token + "\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(TOKEN_FILE_ENV, str(token_file))
        with running_stack(root / "stack", workers=1) as stack:
            assert stack.internal_token == token, "the launcher did not take the named token file"
            yield stack, token


def _code(fn) -> grpc.StatusCode:
    try:
        fn()
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


@pytest.mark.fault
def test_internal_token_refuses_strangers_and_forged_registrations(secured, report):
    stack, token = secured
    p = stack.ports
    [w0] = workers(stack)
    good, bad = ((TOKEN_MD, token),), ((TOKEN_MD, "x" * 64),)
    body = chat_body(3, 70, stream=False, attribution="chunks",
                     steering={"concepts": [{"name": "ocean"}], "mode": "amplify"})
    ok = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=60)
    assert ok.status_code == 200 and ok.json()["cde"]["chunk_attributions"], ok.text[:300]
    real = f"127.0.0.1:{w0.grpc_port}"
    codes = {}
    with grpc.insecure_channel(f"127.0.0.1:{p['scheduler']}") as ch:
        sched = scheduler_pb2_grpc.SchedulerStub(ch)
        forged = scheduler_pb2.WorkerInfo(worker_id="w0", address="127.0.0.1:9", model=MODEL,
                                          kv_pages_total=64, kv_pages_free=64)
        codes["register, no token"] = _code(lambda: sched.RegisterWorker(forged, timeout=10))
        codes["register, wrong token"] = _code(lambda: sched.RegisterWorker(forged, timeout=10, metadata=bad))
        codes["register live id, other address"] = _code(lambda: sched.RegisterWorker(forged, timeout=10,
                                                                                      metadata=good))
        codes["heartbeat live id, other address"] = _code(lambda: sched.Heartbeat(forged, timeout=10, metadata=good))
        codes["stats, no token"] = _code(lambda: sched.Stats(scheduler_pb2.StatsRequest(), timeout=10))
        stats = sched.Stats(scheduler_pb2.StatsRequest(), timeout=10, metadata=good)
    with grpc.insecure_channel(real) as ch:
        codes["worker info, no token"] = _code(lambda: worker_pb2_grpc.WorkerStub(ch).Info(
            worker_pb2.WorkerStatusRequest(), timeout=10))
    with grpc.insecure_channel(f"127.0.0.1:{p['steering']}") as ch:
        codes["steering search, no token"] = _code(lambda: steering_pb2_grpc.SteeringStub(ch).SearchConcepts(
            common_pb2.SearchConceptsRequest(query="ocean", limit=3), timeout=10))
    with grpc.insecure_channel(f"127.0.0.1:{p['attribution']}") as ch:
        codes["attribution, no token"] = _code(lambda: list(ch.stream_stream("/cde.v1.Attribution/Attribute")(
            iter([attribution_pb2.AttributeRequest().SerializeToString()]), timeout=10)))
    want = {k: grpc.StatusCode.UNAUTHENTICATED for k in codes}
    want["register live id, other address"] = want["heartbeat live id, other address"] = grpc.StatusCode.ALREADY_EXISTS
    assert codes == want, codes
    assert [(w.worker_id, w.address) for w in stats.workers] == [("w0", real)], stats
    for port in (p["scheduler"], p["steering"], p["attribution"], w0.grpc_port):   # probes stay open
        assert grpc_serving(port), port
    again = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=60)
    assert again.status_code == 200 and again.json()["choices"] == ok.json()["choices"]
    assert all_alive(stack) == {}
    report("internal token: " + ", ".join(f"{k} -> {v.name}" for k, v in codes.items())
           + "; health probes open; requests unaffected")


@pytest.mark.fault
def test_malformed_bytes_on_the_attribution_stream_are_invalid_argument(secured, report):
    stack, token = secured
    md = ((TOKEN_MD, token),)
    with grpc.insecure_channel(f"127.0.0.1:{stack.ports['attribution']}") as ch:
        attribute = ch.stream_stream("/cde.v1.Attribution/Attribute")
        got = []
        for payloads in ([b"\xff\xff\xff"], [b"\x0a\x05ab"], [attribution_pb2.AttributeRequest(
                request_id="x", mode=common_pb2.ATTRIBUTION_NONE).SerializeToString(), b"\x08"]):
            got.append(_code(lambda: list(attribute(iter(payloads), timeout=30, metadata=md))))
    assert got == [grpc.StatusCode.INVALID_ARGUMENT] * 3, got
    assert grpc_serving(stack.ports["attribution"]) and all_alive(stack) == {}
    report(f"attribution stream, malformed bytes: {[c.name for c in got]}")


def _stable(body: dict) -> str:
    """The response without what differs by construction (id, creation time, request id)."""
    body = dict(body)
    body.pop("id", None)
    body.pop("created", None)
    body["cde"] = {k: v for k, v in body["cde"].items() if k != "request_id"}
    return json.dumps(body, sort_keys=True, ensure_ascii=False)


@pytest.mark.fault
def test_two_runs_of_the_same_seeded_request_give_identical_json(secured, report):
    stack, _ = secured
    url = stack.base_url
    body = chat_body(11, 200, stream=False, attribution="all", attribution_top_k=8)
    alone = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert alone.status_code == 200, alone.text[:300]

    async def among_others():   # the same request again, batched with other requests on the worker
        async with httpx.AsyncClient(timeout=120) as c:
            others = [asyncio.create_task(_post(c, url, chat_body(60 + i, 150, stream=False))) for i in range(3)]
            await asyncio.sleep(0.2)
            mine = await c.post(f"{url}/v1/chat/completions", json=body)
            await asyncio.gather(*others)
            return mine

    busy = asyncio.run(among_others())
    assert busy.status_code == 200, busy.text[:300]
    a, b = alone.json(), busy.json()
    assert a["cde"]["chunk_attributions"] and a["cde"]["token_attributions"]
    assert _stable(a) == _stable(b), "same seeded request, different JSON (attributions?)"
    report(f"determinism: seeded request with attribution 'all' twice (alone, then among 3 others): identical "
           f"JSON, {len(a['cde']['token_attributions'])} token and {len(a['cde']['chunk_attributions'])} chunk "
           f"attributions")


# =========================================================================================
# 6. the local launcher supervises: a dead worker is restarted, its requests finish elsewhere
# =========================================================================================

@pytest.mark.fault
def test_launcher_restarts_a_killed_worker_and_its_requests_finish_elsewhere(tmp_path, report):
    import os
    import signal
    import subprocess
    import sys

    from cde.launch import ROOT
    from cde.redis_util import free_port

    http_port = free_port()
    cmd = [sys.executable, "-m", "cde.launch", "--model-dir", str(DEFAULT_MODEL), "--workers", "2",
           "--http-port", str(http_port),
           "--run-dir", str(tmp_path / "run"), "--timeout", "240"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out = LauncherOutput(proc)
    url = f"http://127.0.0.1:{http_port}"
    try:
        wait_until(lambda: out.find("ready: REST") or proc.poll() is not None, 300, 0.2, "launcher ready")
        assert proc.poll() is None, out.text()[-3000:]
        pid = int(out.find("worker0    pid").split()[2])

        async def run_with_kill():
            results = [StreamResult() for _ in range(6)]
            async with httpx.AsyncClient(timeout=180) as c:
                tasks = [asyncio.create_task(stream_rest(c, url, chat_body(70 + i, 190), r))
                         for i, r in enumerate(results)]
                deadline = time.monotonic() + 90
                while sum(1 for r in results if r.blocks) < 3:
                    assert time.monotonic() < deadline and not all(t.done() for t in tasks), "no blocks arrived"
                    await asyncio.sleep(0.01)
                os.kill(pid, signal.SIGKILL)   # a worker this test's launcher started, by its pid
                await asyncio.wait_for(asyncio.gather(*tasks), 180)
            return results

        results = asyncio.run(run_with_kill())
        for r in results:
            assert r.status == 200 and not r.errors and r.done and r.finish in FINISHED_OK, r.errors
            assert contiguous(r.blocks), r.blocks
        wait_until(lambda: out.find("worker0    restarted, pid"), 60, 0.2, "worker0 restarted")
        assert out.find("worker0    exited with -9; restarting"), out.text()[-2000:]
        new_pid = int(out.find("worker0    restarted, pid").split()[-1])
        assert new_pid != pid
        log = (tmp_path / "run" / "worker0.log").read_text(errors="replace")
        assert "cde.launch: worker0 exited with -9; restarting it" in log
        wait_until(lambda: log_text_path(tmp_path / "run" / "worker0.log").count("registered w0") >= 2, 240, 0.5,
                   "the restarted worker0 registered")
        again = httpx.post(f"{url}/v1/chat/completions", json=chat_body(5, 64, stream=False), timeout=60)
        assert again.status_code == 200 and proc.poll() is None
    finally:
        stop_launcher(proc)
    assert out.find("stopping"), out.text()[-2000:]
    report(f"launcher: SIGKILL worker0 (pid {pid}) under 6 streamed requests: all finished, each block once; "
           f"worker0 restarted as pid {new_pid} and registered again; Ctrl-C stopped the stack")


def log_text_path(path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def test_compose_turns_the_internal_token_on_for_every_cde_service():
    import yaml

    from cde.launch import ROOT

    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    for name, svc in compose["services"].items():
        if name == "redis":
            continue
        assert svc["environment"][TOKEN_FILE_ENV] == "/run/secrets/internal_token", name
        assert "internal_token" in svc["secrets"], name
    assert compose["secrets"]["internal_token"]["file"] == "./secrets/internal_token"
