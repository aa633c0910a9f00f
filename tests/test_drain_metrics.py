"""What a Kubernetes deployment relies on, against the whole system as real processes (issue 20):

0. every service answers the gRPC health checks the Kubernetes probes make;
1. the operator metrics on the gateway's /metrics (docs/deploy.md lists them next to vLLM's)
   appear and move: a request raises the counters and the latency histograms' counts, a busy
   stack shows running requests and KV use per worker, and they fall back when it is idle;
2. graceful drain: SIGTERM to one of two workers while it streams requests; it reports
   NOT_SERVING, the scheduler places no new request on it (metrics show it draining), every
   request finishes, the worker's own ones on it, and it exits 0.

Both tests share one 2-worker stack (tiny model, CPU); the drain test runs last (it stops w0).
"""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from cde.rpc import LIVENESS_SERVICE
from tests.stack_fixture import (MODEL, StreamResult, chat_body, running_stack, service, wait_until,
                                 worker_info)
from tests.stack_fixture import FINISHED_OK, contiguous, stream_rest

REPORT_TAG = "k8s"

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with running_stack(tmp_path_factory.mktemp("drain") / "run", workers=2) as s:
        yield s


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of the gateway's Prometheus text."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: dict, name: str, **labels) -> float:
    """The sample's value (0 when absent); labels not given match anything (summed)."""
    want = set(labels.items())
    return sum(v for (n, lbl), v in samples.items() if n == name and want <= set(lbl))


def has(samples: dict, name: str, **labels) -> bool:
    want = set(labels.items())
    return any(n == name and want <= set(lbl) for (n, lbl) in samples)


def health(port: int, service_name: str = "") -> str:
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service_name), timeout=2)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    except grpc.RpcError as e:
        return e.code().name


def test_every_service_answers_the_probes_the_manifests_use(stack):
    """deploy/kubernetes probes readiness with the server's own status and liveness with
    cde.liveness, on each service's gRPC port: every service must answer both."""
    for svc in stack.services:
        # the gateway's own status follows its backends' readiness, re-checked every 2 s: right
        # after start-up the second worker may register a moment after the stack reports healthy
        deadline = time.monotonic() + 15
        while health(svc.grpc_port) != "SERVING" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert health(svc.grpc_port) == "SERVING", svc.name
        assert health(svc.grpc_port, LIVENESS_SERVICE) == "SERVING", svc.name
        assert health(svc.grpc_port, "no.such.Service") == "NOT_FOUND", svc.name


def test_operator_metrics_appear_and_move(stack, report):
    url = stack.base_url
    before = scrape(url)
    for name in ("cde:num_requests_waiting", "cde:num_requests_running", "cde:kv_cache_usage_perc",
                 "cde:num_workers"):
        assert has(before, name, model_name=MODEL), name
    for wid in ("w0", "w1"):
        for name in ("cde:worker_kv_cache_usage_perc", "cde:worker_num_requests_running",
                     "cde:worker_num_requests_waiting", "cde:worker_draining"):
            assert has(before, name, worker_id=wid), (name, wid)
    assert value(before, "cde:num_workers") == 2
    for name in ("cde:prefix_cache_queries_total", "cde:prefix_cache_hits_total"):
        assert has(before, name, model_name=MODEL), name
        for wid in ("w0", "w1"):
            assert has(before, name.replace("cde:", "cde:worker_"), worker_id=wid), (name, wid)

    # busy: 4 long streamed requests; running requests and KV use show up, per worker too
    async def busy():
        results = [StreamResult() for _ in range(4)]
        seen: dict[str, float] = {}
        async with httpx.AsyncClient(timeout=180) as c:
            tasks = [asyncio.create_task(stream_rest(c, url, chat_body(40 + i, 400), r)) for i, r in enumerate(results)]
            while not all(t.done() for t in tasks):
                s = await asyncio.to_thread(scrape, url)
                for name in ("cde:num_requests_running", "cde:kv_cache_usage_perc",
                             "cde:worker_num_requests_running", "cde:worker_kv_cache_usage_perc"):
                    seen[name] = max(seen.get(name, 0.0), value(s, name))
                await asyncio.sleep(0.2)
            await asyncio.gather(*tasks)
        return results, seen

    results, seen = asyncio.run(busy())
    for r in results:
        assert r.status == 200 and not r.errors and r.finish in FINISHED_OK, r.errors
    for name, peak in seen.items():
        assert peak > 0, f"{name} never rose above 0 while 4 requests ran: {seen}"

    plain = httpx.post(f"{url}/v1/chat/completions", json=chat_body(9, 64, stream=False), timeout=120)
    assert plain.status_code == 200, plain.text
    bad = httpx.post(f"{url}/v1/chat/completions", json=chat_body(9, 0, stream=False), timeout=30)
    assert 400 <= bad.status_code < 500, bad.text

    after = scrape(url)
    finished = 5   # 4 streamed + 1 plain
    for name in ("cde:time_to_first_token_seconds_count", "cde:time_to_first_block_seconds_count",
                 "cde:e2e_request_latency_seconds_count", "cde:request_success_total"):
        assert value(after, name) - value(before, name) == finished, (name, value(before, name), value(after, name))
    status = str(bad.status_code)
    assert (value(after, "cde:request_failure_total", status=status)
            - value(before, "cde:request_failure_total", status=status)) == 1
    tokens = sum(len(r.tokens) for r in results) + plain.json()["usage"]["completion_tokens"]
    grown = value(after, "cde:generation_tokens_total") - value(before, "cde:generation_tokens_total")
    assert grown >= tokens > 0, (grown, tokens)

    # idle again: the gauges fall back (the per-worker ones with the next heartbeat)
    def idle():
        s = scrape(url)
        return all(value(s, n) == 0 for n in ("cde:num_requests_running", "cde:num_requests_waiting",
                                                "cde:worker_num_requests_running", "cde:kv_cache_usage_perc",
                                                "cde:worker_kv_cache_usage_perc"))
    wait_until(idle, 20, 0.3, "running/KV gauges back to 0 after the requests")
    # the prefix cache's counters (the workers' heartbeats): every admitted prompt token is a query
    prompt_tokens = value(after, "cde:prompt_tokens_total") - value(before, "cde:prompt_tokens_total")
    q = "cde:prefix_cache_queries_total"
    wait_until(lambda: value(scrape(url), q) - value(before, q) >= prompt_tokens > 0, 20, 0.3,
               f"prefix cache queries up by the {prompt_tokens:.0f} prompt tokens")
    last = scrape(url)
    assert value(last, q) == value(last, "cde:worker_prefix_cache_queries_total")
    assert 0 <= value(last, "cde:prefix_cache_hits_total") <= value(last, q)
    report(f"metrics: peaks while 4 requests ran {seen}; +{finished} TTFT/TTFB/e2e/success, +1 failure({status}), "
           f"+{grown:.0f} generation tokens; gauges back to 0 when idle")


def test_sigterm_drains_a_worker_and_every_request_finishes(stack, report):
    url = stack.base_url
    w0 = service(stack, "worker0")
    port = w0.grpc_port
    assert health(port) == "SERVING" and health(port, LIVENESS_SERVICE) == "SERVING"

    async def run():
        early = [StreamResult() for _ in range(6)]
        late = [StreamResult() for _ in range(3)]
        async with httpx.AsyncClient(timeout=240) as c:
            tasks = [asyncio.create_task(stream_rest(c, url, chat_body(70 + i, 320), r)) for i, r in enumerate(early)]
            deadline = time.monotonic() + 120
            while True:   # SIGTERM once w0 decodes some of them and blocks are flowing
                info = await asyncio.to_thread(worker_info, stack, port)
                if info.running >= 1 and any(r.blocks for r in early):
                    break
                assert time.monotonic() < deadline and not all(t.done() for t in tasks), "w0 never ran a request"
                await asyncio.sleep(0.02)
            on_w0 = info.running + info.waiting
            w0.proc.send_signal(signal.SIGTERM)   # a process this test's stack started
            # draining: readiness NOT_SERVING, liveness still SERVING, the scheduler knows
            await asyncio.to_thread(wait_until, lambda: health(port) == "NOT_SERVING", 10, 0.02, "w0 NOT_SERVING")
            if w0.proc.poll() is None:
                assert health(port, LIVENESS_SERVICE) == "SERVING"
            s = await asyncio.to_thread(scrape, url)
            draining_seen = value(s, "cde:worker_draining", worker_id="w0") == 1
            # requests arriving now all go to w1
            tasks += [asyncio.create_task(stream_rest(c, url, chat_body(90 + i, 128), r)) for i, r in enumerate(late)]
            await asyncio.wait_for(asyncio.gather(*tasks), 240)
        return early, late, on_w0, draining_seen

    early, late, on_w0, draining_seen = asyncio.run(run())
    for r in early + late:
        assert r.status == 200 and not r.errors and r.done and r.finish in FINISHED_OK, (r.status, r.errors)
        assert contiguous(r.blocks), r.blocks
    assert draining_seen, "the scheduler's Stats never showed w0 draining"
    code = wait_until(lambda: w0.proc.poll() is not None and ("exit", w0.proc.returncode), 60, 0.1, "w0 exits")
    assert code == ("exit", 0), code
    w0_log = w0.log.read_text(errors="replace")
    assert "drained:" in w0_log and "drain timeout" not in w0_log, w0_log[-2000:]
    sched_log = service(stack, "scheduler").log.read_text(errors="replace")
    # the only failed placements on w0 allowed are the refusals of the drain itself (a request
    # placed before the draining heartbeat arrived): nothing that ran there was cut off
    failed = [line for line in sched_log.splitlines() if "stream from worker w0 failed" in line]
    assert all("draining" in line for line in failed), failed
    assert on_w0 >= 1
    report(f"drain: SIGTERM w0 with {on_w0} request(s) on it among 6; w0 NOT_SERVING at once, "
           f"3 later requests went elsewhere, all 9 finished (blocks contiguous), w0 exited 0 after finishing "
           f"its own; {len(failed)} placement(s) refused while draining")
