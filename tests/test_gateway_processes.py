"""Several gateway processes on one port (`python -m gateway --processes N`, gateway/processes.py):
one REST and one gRPC port for all, /metrics summed over the processes, API-key rate limits
shared, a killed process restarted without losing its counters, a port in use refused.

The stack tests run the real system (cde.launch.Stack) with a two-process gateway; the rest
start the gateway alone, against nothing (the routes they use need no backend)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import grpc
import httpx
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from cde.launch import ROOT, child_pids
from cde.redis_util import free_port
from cde.rpc.v1 import generate_pb2_grpc, scheduler_pb2
from gateway.auth import ApiKeyAuth, SharedBuckets
from gateway.errors import GatewayError
from gateway.metrics import GatewayMetrics, observe_many
from tests.stack_fixture import (FINISHED_OK, GrpcStream, chat_body, grpc_request, running_stack, service,
                                 stream_many, wait_until)

PROCESSES = 2


def sorted_children(supervisor_pid: int) -> list[int]:
    return sorted(child_pids(supervisor_pid))


def sample(text: str, name: str) -> float:
    """Sum of a metric's samples in Prometheus text (every label set)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def scrape(url: str) -> str:
    """/metrics on a new connection: the kernel hashes each one to any of the processes."""
    with httpx.Client(timeout=10) as c:
        return c.get(url + "/metrics").text


# ---- units ------------------------------------------------------------------------------------
def test_observe_many_equals_n_observations(seed) -> None:
    import random
    rng = random.Random(seed)
    buckets = (0.001, 0.01, 0.1, 1.0)
    one, many = CollectorRegistry(), CollectorRegistry()
    h1 = Histogram("h", "x", buckets=buckets, registry=one)
    hn = Histogram("h", "x", buckets=buckets, registry=many)
    for _ in range(20):
        v, n = rng.choice([rng.uniform(0, 2), 0.01, 1e-4]), rng.randrange(0, 70)
        for _ in range(n):
            h1.observe(v)
        observe_many(hn, v, n)
    a, b = generate_latest(one).decode(), generate_latest(many).decode()
    for line_a, line_b in zip(a.splitlines(), b.splitlines()):
        if line_a.startswith("h_created"):
            continue
        if line_a.startswith("h_sum"):   # n * v against v added n times
            assert float(line_a.split()[1]) == pytest.approx(float(line_b.split()[1]), rel=1e-9), f"seed {seed}"
        else:
            assert line_a == line_b, f"seed {seed}"


def test_shared_buckets_hold_every_process_to_one_rate(tmp_path) -> None:
    path = tmp_path / "buckets"
    SharedBuckets.create(path, ["k1", "k2"], 3)
    assert b"k1" not in path.read_bytes()   # digests only
    a, b = (ApiKeyAuth(["k1", "k2"], 3, SharedBuckets(path)) for _ in range(2))
    a.check("Bearer k1"), b.check("Bearer k1"), a.check("Bearer k1")
    for auth in (a, b):
        with pytest.raises(GatewayError) as e:
            auth.check("Bearer k1")
        assert e.value.http_status == 429
    assert b.check("Bearer k2") == "k2"   # another key, another bucket
    # a key the file does not know (added later) gets a bucket of this process's own
    late = ApiKeyAuth(["k1", "k3"], 1, SharedBuckets(path))
    assert late.check("Bearer k3") == "k3"
    with pytest.raises(GatewayError):
        late.check("Bearer k3")


def test_scheduler_gauges_follow_the_last_stats() -> None:
    m = GatewayMetrics("m")
    stats = scheduler_pb2.StatsResponse(running=3, waiting=1)
    for wid, free in (("w0", 4), ("w1", 10)):
        stats.workers.add(worker_id=wid, kv_pages_total=10, kv_pages_free=free, running=1)
    m.update_from_stats(stats)
    text = m.render().decode()
    assert sample(text, "cde:num_requests_running") == 3 and sample(text, "cde:num_workers") == 2
    assert sample(text, "cde:kv_cache_usage_perc") == pytest.approx(0.3)
    assert 'cde:worker_kv_cache_usage_perc{model_name="m",worker_id="w0"} 0.6' in text
    del stats.workers[0]
    m.update_from_stats(stats)
    text = m.render().decode()
    assert 'worker_id="w0"' not in text and 'worker_id="w1"' in text   # a worker that left has no sample
    m.update_from_stats(None)   # a failed Stats: down, the last figures kept
    text = m.render().decode()
    assert sample(text, "cde:scheduler_up") == 0 and sample(text, "cde:num_requests_running") == 3


# ---- the gateway alone ------------------------------------------------------------------------
def start_gateway(*flags: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gateway", "--scheduler", f"127.0.0.1:{free_port()}",
                             "--steering", f"127.0.0.1:{free_port()}", "--log-level", "warning", *flags],
                            cwd=ROOT, env=dict(os.environ, **(env or {})), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def stop_gateway(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out


def models_status(url: str, key: str) -> int:
    with httpx.Client(timeout=10) as c:   # a new connection: any of the processes
        return c.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code


@pytest.mark.e2e
def test_rate_limit_is_shared_by_the_processes() -> None:
    port = free_port()
    proc = start_gateway("--processes", "3", "--http-port", str(port), "--grpc-port", "-1",
                         "--rate-limit-rpm", "4", env={"CDE_API_KEYS": "k1,k2"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _answers(url), 60, what="gateway processes serving")
        assert len(sorted_children(proc.pid)) == 3
        codes = [models_status(url, "k1") for _ in range(9)]
        # 4 a minute per key, whichever process a connection lands on (a refill takes 15 s)
        assert codes.count(200) == 4 and codes.count(429) == 5, codes
        assert models_status(url, "k2") == 200 and models_status(url, "nope") == 401
    finally:
        out = stop_gateway(proc)
    assert proc.returncode == 0, out


def _answers(url: str) -> bool:
    try:
        with httpx.Client(timeout=2) as c:
            return c.get(url + "/health").status_code in (200, 503)
    except httpx.HTTPError:
        return False


@pytest.mark.e2e
def test_a_port_in_use_is_refused_not_shared() -> None:
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)   # even a socket that would share
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = start_gateway("--processes", "2", "--http-port", str(port), "--grpc-port", "-1")
        out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 1 and f"cannot bind the REST port 127.0.0.1:{port}" in out, out
    port = free_port()
    proc = start_gateway("--processes", "0", "--http-port", str(port))
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode != 0 and "processes must be 1 .. 64" in out, out


# ---- the whole stack --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with running_stack(tmp_path_factory.mktemp("stack"), gateway_args=["--processes", str(PROCESSES)]) as s:
        yield s


@pytest.mark.e2e
def test_processes_share_both_ports_and_report_together(stack) -> None:
    url = stack.base_url
    children = sorted_children(service(stack, "gateway").proc.pid)
    assert len(children) == PROCESSES, children
    before = scrape(url)
    results = asyncio.run(stream_many(url, [chat_body(100 + i, 24) for i in range(8)]))
    for r in results:
        assert r.status == 200 and r.finish in FINISHED_OK and r.done and not r.errors, vars(r)
    # public gRPC: every call on a new channel, so on any of the processes
    for i in range(4):
        with grpc.insecure_channel(f"127.0.0.1:{stack.ports['gateway_grpc']}") as ch:
            st = GrpcStream(grpc_request(200 + i, 16))
            for ev in generate_pb2_grpc.GenerationStub(ch).Generate(st.request, timeout=60):
                st.feed(ev)
        assert st.finished is not None and st.blocks, vars(st)
    # every scrape, whichever process answers it, counts every process's requests
    for _ in range(6):
        text = scrape(url)
        assert sample(text, "cde:request_success_total") - sample(before, "cde:request_success_total") == 12, text
        assert sample(text, "cde:time_to_first_block_seconds_count") \
            - sample(before, "cde:time_to_first_block_seconds_count") == 12
        assert sample(text, "cde:gateway_requests_in_flight") == 0
        assert sample(text, "cde:num_workers") == 1 and sample(text, "cde:scheduler_up") == 1


@pytest.mark.e2e
@pytest.mark.fault
def test_a_killed_process_is_restarted_and_its_counts_kept(stack, report) -> None:
    url = stack.base_url
    supervisor = service(stack, "gateway").proc.pid
    victim = sorted_children(supervisor)[0]
    before = sample(scrape(url), "cde:request_success_total")
    os.kill(victim, signal.SIGKILL)
    t_kill = time.monotonic()
    wait_until(lambda: len(c := sorted_children(supervisor)) == PROCESSES and victim not in c, 30,
               what="the supervisor restarting the killed gateway process")
    # The restarted process takes its listening socket back, and what was sent to that socket
    # meanwhile waited in its backlog: new requests all succeed, none refused.
    results = asyncio.run(stream_many(url, [chat_body(300 + i, 16) for i in range(8)]))
    assert all(r.status == 200 and r.finish in FINISHED_OK and r.done for r in results), [vars(r) for r in results]
    report(f"gateway process killed: all {len(results)} requests served again {time.monotonic() - t_kill:.1f} s later")
    text = scrape(url)
    # the dead process's counters stay in the sum (its files remain); its in-flight gauge went with it
    assert sample(text, "cde:request_success_total") - before == 8, text
    assert sample(text, "cde:gateway_requests_in_flight") == 0
