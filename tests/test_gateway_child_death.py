"""A multi-process gateway losing a process (issue 33): its clients' connections die with it,
their requests do not.

The scheduler cannot tell a client that left from a gateway process that died: both are a
cancelled stream. The gateway says which (`Scheduler.Detach` when its client leaves, naming the
stream's `cde-attach-id`), and a stream that just breaks leaves its request running for the
scheduler's detach grace (default 30 s, the gateway's reattach window), so the client can
Resume on a live process. Through the real launcher stack (`--gateway-processes 2`, loopback):

1. the defaults agree: the grace is at least the gateway's reattach window in the scheduler's
   CLI, its options, the launcher, compose.yaml and the Kubernetes ConfigMap;
2. SIGKILL the gateway process that holds several streamed gRPC Generates (one channel: one
   connection, one process) and a few non-streamed REST requests: every gRPC stream finishes
   by Resume on its reconnected channel, every REST request by sending it again, all with the
   output of an undisturbed run with the same seed, and the scheduler cancelled none;
3. where connections go: the kernel spreads connections, not streams, over the processes, and
   the gRPC channels of one client process share one connection unless each has its own
   subchannel pool;
4. a client that leaves (gRPC call cancelled, REST stream closed) is still cancelled at once,
   far inside the grace.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid
from pathlib import Path

import grpc
import httpx
import pytest
import redis
import yaml

from cde import launch
from cde.launch import ROOT, child_pids
from cde.rpc.v1 import generate_pb2, generate_pb2_grpc
from gateway.server import GatewaySettings
from scheduler_svc import __main__ as scheduler_cli
from scheduler_svc.service import DETACH_GRACE_S, SchedulerOptions
from tests.stack_fixture import (FINISHED_OK, GrpcStream, chat_body, contiguous, follow_grpc, grpc_request,
                                 running_stack, service, wait_until)

PROCESSES = 2
REPORT_TAG = "fault"
GRPC_STREAMS = 3
REST_REQUESTS = 2
MAX_TOKENS = 192          # 3 blocks: cut after the first
TEST_BUDGET_S = 55        # every test stays under a minute


# ---- 1. the defaults ----------------------------------------------------------------------------
def test_detach_grace_defaults_cover_the_gateway_reattach_window() -> None:
    reattach = GatewaySettings().reattach_s
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["scheduler"]["command"]
    config = yaml.safe_load((ROOT / "deploy/kubernetes/base/config.yaml").read_text())["data"]
    found = {
        "scheduler CLI": scheduler_cli.parse_args([]).detach_grace if "CDE_DETACH_GRACE" not in os.environ else None,
        "SchedulerOptions": SchedulerOptions().detach_grace_s,
        "DETACH_GRACE_S": DETACH_GRACE_S,
        "launcher": launch.DETACH_GRACE_S,
        "compose.yaml": float(compose[compose.index("--detach-grace") + 1]),
        "kubernetes ConfigMap": float(config["CDE_DETACH_GRACE"]),
    }
    found = {k: v for k, v in found.items() if v is not None}
    assert all(v >= reattach for v in found.values()), f"reattach window {reattach} s, grace: {found}"
    assert len(set(found.values())) == 1, f"the defaults disagree: {found}"


# ---- helpers: who holds which TCP connection (Linux /proc) ---------------------------------------
def _tcp_table() -> dict[int, tuple[int, int, str]]:
    """socket inode -> (local port, remote port, state) over this network namespace."""
    out: dict[int, tuple[int, int, str]] = {}
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(path).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            out[int(f[9])] = (int(f[1].rsplit(":", 1)[1], 16), int(f[2].rsplit(":", 1)[1], 16), f[3])
    return out


def _socket_inodes(pid: int) -> set[int]:
    out = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out.add(int(link[8:-1]))
    return out


def established(pid: int) -> list[tuple[int, int]]:
    """(local port, remote port) of the process's established TCP connections."""
    table = _tcp_table()
    return [table[i][:2] for i in _socket_inodes(pid) if i in table and table[i][2] == "01"]


def holders(children: list[int], server_port: int) -> dict[int, int]:
    """client port -> the gateway process holding that client's connection to ``server_port``."""
    return {remote: pid for pid in children for local, remote in established(pid) if local == server_port}


def my_ports_to(server_port: int) -> list[int]:
    """This process's local ports of its connections to ``server_port``."""
    return sorted(local for local, remote in established(os.getpid()) if remote == server_port)


def gateway_children(stack) -> list[int]:
    return sorted(child_pids(service(stack, "gateway").proc.pid))


# ---- helpers: clients ------------------------------------------------------------------------------
def rest_result(body: dict) -> tuple:
    """What must not change between runs: text, tokens, finish reason, completion tokens."""
    choice = body["choices"][0]
    tokens = [t for b in body["cde"]["blocks"] for t in b["tokens"]]
    return choice["message"]["content"], tokens, choice["finish_reason"], body["usage"]["completion_tokens"]


async def raw_post(reader, writer, path: str, body: dict) -> tuple[int | None, dict | None]:
    """POST over an open connection (HTTP/1.1, Connection: close); (None, None) when the
    connection broke before a response."""
    data = json.dumps(body).encode()
    writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
    await writer.drain()
    try:
        raw = await reader.read()
    except (ConnectionError, OSError):
        raw = b""
    finally:
        writer.close()
    if not raw:
        return None, None
    head, _, payload = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload) if payload else None


async def post_until_ok(client: httpx.AsyncClient, url: str, body: dict, deadline: float) -> dict:
    while True:
        try:
            r = await client.post(url + "/v1/chat/completions", json=body)
            if r.status_code == 200:
                return r.json()
            status = r.status_code
        except httpx.HTTPError as e:
            status = repr(e)
        assert time.monotonic() < deadline, f"REST request seed {body['seed']} never answered 200 (last: {status})"
        await asyncio.sleep(0.2)


def with_blocks(rds: redis.Redis) -> set[str]:
    """Ids of the requests Redis holds at least one stored block of."""
    return {k.decode()[len("cde:req:"):-len(":blocks")] for k in rds.scan_iter("cde:req:*:blocks")}


def request_status(rds: redis.Redis, request_id: str) -> str | None:
    v = rds.hget(f"cde:req:{request_id}", "status")
    return v.decode() if v else None


# ---- the stack ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    # the launcher's defaults otherwise: the scheduler gets the default detach grace
    with running_stack(tmp_path_factory.mktemp("stack"), gateway_args=["--processes", str(PROCESSES)]) as s:
        yield s


# ---- 2. SIGKILL the process holding the requests ----------------------------------------------
async def connection_on(children: list[int], port: int, want, tries: int = 200):
    """An open (reader, writer) to ``port`` that the kernel gave to a gateway process for which
    ``want(pid)`` holds (a new connection lands on either process), and that pid."""
    for _ in range(tries):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        mine = writer.get_extra_info("sockname")[1]
        t0 = time.monotonic()
        while mine not in (owners := holders(children, port)) and time.monotonic() - t0 < 2:
            await asyncio.sleep(0.01)
        if want(owners.get(mine)):
            return reader, writer, owners[mine]
        writer.close()
    raise AssertionError(f"no connection to {port} landed on the wanted process in {tries} tries")


async def channel_on(children: list[int], port: int, want, tries: int = 200) -> tuple[grpc.aio.Channel, int]:
    """A gRPC channel of its own connection (own subchannel pool) held by a process ``want`` accepts."""
    for _ in range(tries):
        before = set(my_ports_to(port))
        ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
        await generate_pb2_grpc.GenerationStub(ch).ListModels(generate_pb2.ListModelsRequest(), timeout=10)
        new = set(my_ports_to(port)) - before
        owners = holders(children, port)
        pid = owners.get(next(iter(new))) if len(new) == 1 else None
        if want(pid):
            return ch, pid
        await ch.close()
    raise AssertionError(f"no gRPC channel to {port} landed on the wanted process in {tries} tries")


@pytest.mark.e2e
@pytest.mark.fault
def test_killed_gateway_process_loses_no_request(stack, report) -> None:
    """All in one batch: the requests to cut go to the victim (one default gRPC channel, REST
    connections the kernel gave it), the same seeds undisturbed to the other process; SIGKILL
    the victim once each request to cut has a block."""
    url, grpc_port, http_port = stack.base_url, stack.ports["gateway_grpc"], stack.ports["gateway_http"]
    rds = redis.Redis.from_url(stack.redis.url)
    deadline = time.monotonic() + TEST_BUDGET_S
    grpc_seeds = [700 + i for i in range(GRPC_STREAMS)]
    rest_seeds = [800 + i for i in range(REST_REQUESTS)]
    children = gateway_children(stack)
    assert len(children) == PROCESSES, children

    def grpc_streams(tag: str) -> list[GrpcStream]:
        return [GrpcStream(grpc_request(s, MAX_TOKENS, request_id=f"{tag}-{uuid.uuid4().hex}")) for s in grpc_seeds]

    async def scenario():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as ch, httpx.AsyncClient(timeout=60) as c:
            stub = generate_pb2_grpc.GenerationStub(ch)
            await stub.ListModels(generate_pb2.ListModelsRequest(), timeout=10)
            mine, held = my_ports_to(grpc_port), holders(children, grpc_port)
            assert len(mine) == 1 and mine[0] in held, f"one default channel: connections {mine}, held {held}"
            victim = held[mine[0]]
            base_ch, _ = await channel_on(children, grpc_port, lambda pid: pid is not None and pid != victim)
            cut_rest = [await connection_on(children, http_port, lambda pid: pid == victim) for _ in rest_seeds]
            base_rest = [await connection_on(children, http_port, lambda pid: pid is not None and pid != victim)
                         for _ in rest_seeds]
            try:
                t_start = time.monotonic()
                before = with_blocks(rds)
                cut, base = grpc_streams("cut"), grpc_streams("base")
                base_stub = generate_pb2_grpc.GenerationStub(base_ch)
                tasks = [asyncio.create_task(follow_grpc(stub, st, deadline - time.monotonic())) for st in cut] + \
                        [asyncio.create_task(follow_grpc(base_stub, st, deadline - time.monotonic())) for st in base]
                posts = [asyncio.create_task(raw_post(r, w, "/v1/chat/completions",
                                                      chat_body(s, MAX_TOKENS, stream=False)))
                         for conns in (cut_rest, base_rest) for (r, w, _), s in zip(conns, rest_seeds)]
                # the kill: once every request has a block stored (the REST ones' ids are the new ones)
                while not (all(st.blocks for st in cut)
                           and len(with_blocks(rds) - before - {st.request_id for st in cut + base})
                           >= 2 * REST_REQUESTS):
                    assert time.monotonic() < deadline - 25 and not any(t.done() for t in tasks + posts), \
                        (f"before the kill: gRPC {[(st.blocks, st.finished, st.errors) for st in cut]}, REST "
                         f"answers {[p.result()[0] if p.done() else None for p in posts]}")
                    await asyncio.sleep(0.005)
                running = [st.request_id for st in cut if st.finished is None]
                os.kill(victim, signal.SIGKILL)
                t_kill = time.monotonic()
                before_kill = t_kill - t_start
                answers = await asyncio.gather(*posts)
                cut_answers, base_answers = answers[:REST_REQUESTS], answers[REST_REQUESTS:]
                assert all(a[0] == 200 for a in base_answers), f"undisturbed REST: {[a[0] for a in base_answers]}"
                t_posts = time.monotonic() - t_kill

                async def again(status, body, s):
                    if status is None:   # cut by the kill: the client sends it again
                        body = await post_until_ok(c, url, chat_body(s, MAX_TOKENS, stream=False), deadline)
                    return rest_result(body), status is None

                grpc_done = asyncio.gather(*tasks)
                retried = await asyncio.gather(*(again(st, b, s) for (st, b), s in zip(cut_answers, rest_seeds)))
                t_rest = time.monotonic() - t_kill
                await grpc_done
                took = {"first blocks (before the kill)": before_kill, "REST answers": t_posts, "REST resent": t_rest, "gRPC": time.monotonic() - t_kill}
                return cut, base, retried, [rest_result(a[1]) for a in base_answers], running, victim, took
            finally:
                await base_ch.close()

    cut, base, rest, base_rest, running, victim, recovered_s = asyncio.run(scenario())
    assert len(running) == GRPC_STREAMS, f"gRPC streams finished before the kill: {GRPC_STREAMS - len(running)}"
    for st, b in zip(cut, base):
        seed = st.request.decode.seed
        assert b.finished is not None and not b.errors and contiguous(b.blocks), \
            f"undisturbed seed {seed}: {b.finished}, errors {b.errors}, blocks {b.blocks}"
        assert st.finished is not None and st.finished.reason == b.finished.reason, \
            (st.request_id, st.finished, b.finished, st.errors)
        assert st.resumes >= 1 and "UNAVAILABLE" in st.errors, \
            f"{st.request_id} was not on the killed process: resumes {st.resumes}, errors {st.errors}"
        assert contiguous(st.blocks) and st.blocks == b.blocks, (st.request_id, st.blocks, b.blocks)
        assert st.tokens == b.tokens and st.text == b.text, \
            f"seed {seed}: {st.text!r} after the kill != undisturbed {b.text!r}"
        status = request_status(rds, st.request_id)
        assert status == "finished", f"{st.request_id} is {status} in Redis, not finished"
    n_cut = sum(1 for _, again in rest if again)
    assert n_cut >= 1, f"no REST request on the killed process was cut by the kill: {[again for _, again in rest]}"
    for (got, _), want, s in zip(rest, base_rest, rest_seeds):
        assert got == want, f"REST seed {s}: {got[0]!r} ({got[2]}, {got[3]} tokens) != undisturbed {want[0]!r}"
    sched_log = service(stack, "scheduler").log.read_text(errors="replace")
    cancelled = [rid for rid in running if f"request {rid} cancelled" in sched_log]
    assert not cancelled, f"the scheduler cancelled streams of the killed process: {cancelled}"
    wait_until(lambda: len(c := gateway_children(stack)) == PROCESSES and victim not in c, 30,
               what="the supervisor restarting the killed gateway process")
    report(f"gateway process {victim} SIGKILLed holding {GRPC_STREAMS} streamed gRPC Generates (one channel, one "
           f"connection) and {REST_REQUESTS} non-streamed REST requests: all {GRPC_STREAMS} resumed "
           f"({sum(st.resumes for st in cut)} Resumes), the REST ones sent again, every output identical to the "
           f"same seeds undisturbed on the other process, none cancelled; done after the kill: "
           + ", ".join(f"{k} {v:.1f} s" for k, v in recovered_s.items()))


# ---- 3. where connections go ------------------------------------------------------------------------
@pytest.mark.e2e
def test_connections_not_streams_spread_over_the_processes(stack, report) -> None:
    grpc_port = stack.ports["gateway_grpc"]
    children = gateway_children(stack)
    assert len(children) == PROCESSES, children

    async def channels(n: int, options: list) -> tuple[list[int], dict[int, int]]:
        chans = [grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}", options=options) for _ in range(n)]
        try:
            for ch in chans:
                await generate_pb2_grpc.GenerationStub(ch).ListModels(generate_pb2.ListModelsRequest(),
                                                                      timeout=10)
            mine = my_ports_to(grpc_port)
            return mine, {p: pid for p, pid in holders(children, grpc_port).items() if p in mine}
        finally:
            for ch in chans:
                await ch.close()

    n = 16
    shared_ports, _ = asyncio.run(channels(n, []))
    assert len(shared_ports) == 1, f"{n} default channels of one process: {len(shared_ports)} connections"
    time.sleep(0.2)
    own_ports, held = asyncio.run(channels(n, [("grpc.use_local_subchannel_pool", 1)]))
    assert len(own_ports) == n, f"{n} channels with their own subchannel pools: {len(own_ports)} connections"
    per_process = {pid: sum(1 for v in held.values() if v == pid) for pid in children}
    assert sum(per_process.values()) == n and all(per_process.values()), \
        f"{n} connections were not spread over the gateway processes: {per_process}"
    report(f"gRPC: {n} default channels of one client process share 1 connection (one gateway process); "
           f"with grpc.use_local_subchannel_pool they are {n} connections, per process {sorted(per_process.values())}")


# ---- 4. a client that leaves is cancelled at once ----------------------------------------------------
@pytest.mark.e2e
@pytest.mark.fault
def test_a_client_that_leaves_is_cancelled_at_once(stack, report) -> None:
    grpc_port, url = stack.ports["gateway_grpc"], stack.base_url
    rds = redis.Redis.from_url(stack.redis.url)
    bound = 5.0   # far inside the 30 s grace

    async def grpc_leaves() -> tuple[str, float]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
            st = GrpcStream(grpc_request(901, 900, request_id=f"leave-{uuid.uuid4().hex}"))
            call = generate_pb2_grpc.GenerationStub(ch).Generate(st.request, timeout=60)
            async for ev in call:
                st.feed(ev)
                if st.blocks:
                    break
            assert st.finished is None, "the request finished before the client left"
            call.cancel()
            return st.request_id, time.monotonic()

    async def rest_leaves() -> tuple[str, float]:
        async with httpx.AsyncClient(timeout=60) as c:
            rid = None
            async with c.stream("POST", url + "/v1/chat/completions", json=chat_body(902, 900)) as r:
                assert r.status_code == 200, r.status_code
                async for line in r.aiter_lines():
                    if line.startswith("data:") and '"request_id"' in line:
                        rid = json.loads(line[5:])["cde"]["request_id"]
                    if '"block_index"' in line:
                        break
            return rid, time.monotonic()

    took = {}
    for name, leave in (("gRPC call cancelled", grpc_leaves), ("REST stream closed", rest_leaves)):
        rid, t_left = asyncio.run(leave())
        assert rid, name
        wait_until(lambda: request_status(rds, rid) == "cancelled", bound, 0.02,
                   f"{name}: request {rid} cancelled (status {request_status(rds, rid)})")
        took[name] = time.monotonic() - t_left
    assert max(took.values()) < bound < DETACH_GRACE_S, took
    report("client left, request cancelled after: " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in took.items())
           + f" (detach grace {DETACH_GRACE_S:g} s applies only to streams cut without a Detach)")
