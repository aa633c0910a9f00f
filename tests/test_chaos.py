"""Chaos in the stack users run (issue 33 items 6 and 7): ``python -m cde.launch --ha --workers 2``
as a real command line (Redis master + replica + 3 sentinels, two schedulers on one lease, two
attribution replicas, two CPU workers, the gateway; loopback only, the tiny model).

Twelve seeded requests stream through the gateway (8 REST with attributions, 4 public gRPC). An
undisturbed round gives each request's output. The same requests run again while, one after the
other, kill -9 hits the active scheduler, the Redis master (the node Sentinel names) and a
worker, each once the system has recovered from the previous kill (a block arrived since). Then
every request has finished with the undisturbed output, attributions included, every block came
once and in order, the Redis master Sentinel promoted holds exactly the delivered blocks, and the
launcher restarted every killed process (the old master as a replica). Bounded: stack start
included, about two minutes on an idle 2-core box; every wait has a deadline.

Seeds: base $CDE_TEST_SEED (default 5151), printed in every failure message.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import httpx
import pytest
import redis
from redis.sentinel import Sentinel

from cde.redis_connect import parse_hostports
from cde.redis_ha import MASTER_NAME
from cde.rpc.v1 import generate_pb2_grpc
from tests.launcher_fixture import Launched, launched
from tests.stack_fixture import (FINISHED_OK, GrpcStream, StreamResult, chat_body, contiguous, follow_grpc,
                                 grpc_request, stored_block_indices, stream_rest, wait_until)

REPORT_TAG = "chaos"
SEED = int(os.environ.get("CDE_TEST_SEED", 5151))
N_REST, N_GRPC = 8, 4
MAX_TOKENS = 384            # 6 blocks: long enough for three kills with recoveries between them
ROUND_BUDGET_S = 150


def master_client(st: Launched) -> redis.Redis:
    argv = st.argv("scheduler0")
    sentinels = parse_hostports(argv[argv.index("--redis-sentinels") + 1], "--redis-sentinels")
    return Sentinel(sentinels, socket_timeout=2).master_for(MASTER_NAME, socket_timeout=2)


def kill_pid(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


class Round:
    """One round of the twelve requests; ``blocks()`` counts what has arrived so far."""

    def __init__(self, url: str, grpc_port: int) -> None:
        self.url, self.grpc_port = url, grpc_port
        self.rest = [StreamResult() for _ in range(N_REST)]
        self.grpc = [GrpcStream(grpc_request(SEED + N_REST + i, MAX_TOKENS)) for i in range(N_GRPC)]

    def blocks(self) -> int:
        return sum(len(r.blocks) for r in self.rest) + sum(len(g.blocks) for g in self.grpc)

    def unfinished(self) -> int:
        return sum(r.finish is None for r in self.rest) + sum(g.finished is None for g in self.grpc)

    async def run(self, disturb=None) -> None:
        bodies = [chat_body(SEED + i, MAX_TOKENS, attribution="chunks" if i % 2 else "all", attribution_top_k=4)
                  for i in range(N_REST)]
        async with httpx.AsyncClient(timeout=ROUND_BUDGET_S) as c, \
                grpc.aio.insecure_channel(f"127.0.0.1:{self.grpc_port}") as ch:
            stub = generate_pb2_grpc.GenerationStub(ch)
            tasks = [asyncio.create_task(stream_rest(c, self.url, b, r)) for b, r in zip(bodies, self.rest)]
            tasks += [asyncio.create_task(follow_grpc(stub, g, ROUND_BUDGET_S)) for g in self.grpc]
            if disturb is not None:
                tasks.append(asyncio.create_task(asyncio.to_thread(disturb, self)))
            await asyncio.wait_for(asyncio.gather(*tasks), ROUND_BUDGET_S)


@pytest.mark.fault
@pytest.mark.e2e
def test_kills_of_scheduler_redis_master_and_worker_under_load_change_nothing(tmp_path, report):
    t0 = time.monotonic()
    with launched(tmp_path, "--ha", "--workers", "2") as st:
        started_s = time.monotonic() - t0
        grpc_port = int(st.argv("gateway")[st.argv("gateway").index("--grpc-port") + 1])
        ref = Round(st.base_url, grpc_port)
        asyncio.run(ref.run())
        for i, r in enumerate(ref.rest):
            assert r.status == 200 and r.finish in FINISHED_OK and not r.errors, (f"seed {SEED + i}", r.errors)
        for i, g in enumerate(ref.grpc):
            assert g.finished is not None and not g.errors, (f"seed {SEED + N_REST + i}", g.errors)
        ref_s = time.monotonic() - t0 - started_s

        kills: list[tuple[str, int, int]] = []   # (what, pid, unfinished requests at the kill)

        def progressed(rnd: Round, since: int, what: str) -> None:
            wait_until(lambda: rnd.blocks() >= since + 2, 60, 0.02, f"two more blocks after {what} (seed {SEED})")

        def disturb(rnd: Round) -> None:
            wait_until(lambda: rnd.blocks() >= 2, 60, 0.01, f"the first blocks (seed {SEED})")
            rds = master_client(st)
            leader = rds.get("cde:leader").decode().split("|")[1]           # "s0" / "s1"
            name = f"scheduler{leader[1:]}"
            kills.append((name, st.pid(name), rnd.unfinished()))
            kill_pid(kills[-1][1])
            progressed(rnd, rnd.blocks(), f"killing {name}")
            master_pid = int(rds.info("server")["process_id"])
            kills.append(("redis master", master_pid, rnd.unfinished()))
            kill_pid(master_pid)
            progressed(rnd, rnd.blocks(), "killing the Redis master")
            kills.append(("worker0", st.pid("worker0"), rnd.unfinished()))
            kill_pid(kills[-1][1])

        got = Round(st.base_url, grpc_port)
        asyncio.run(got.run(disturb))
        chaos_s = time.monotonic() - t0 - started_s - ref_s
        assert len(kills) == 3 and all(n >= 2 for _, _, n in kills), f"seed {SEED}: kills hit too little: {kills}"

        for i, (a, b) in enumerate(zip(ref.rest, got.rest)):
            tag = f"seed {SEED + i} (REST, kills {kills})"
            assert b.status == 200 and not b.errors and b.done and b.finish == a.finish, (tag, b.status, b.errors)
            assert contiguous(b.blocks) and b.blocks == a.blocks, (tag, a.blocks, b.blocks)
            assert b.tokens == a.tokens and b.text == a.text, tag
            strip = lambda cde: {k: v for k, v in cde.items() if k != "request_id"}   # noqa: E731
            assert [strip(x) for x in b.block_cde] == [strip(x) for x in a.block_cde], f"{tag}: attributions differ"
        for i, (a, b) in enumerate(zip(ref.grpc, got.grpc)):
            tag = f"seed {SEED + N_REST + i} (gRPC, kills {kills})"
            assert b.finished is not None and b.finished.reason == a.finished.reason, (tag, b.errors)
            assert contiguous(b.blocks) and b.blocks == a.blocks and b.tokens == a.tokens, (tag, a.blocks, b.blocks)

        rds = master_client(st)
        for r in got.rest + got.grpc:
            rid = r.request_id
            assert rds.hget(f"cde:req:{rid}", "status") == b"finished", f"seed {SEED}: {rid}"
            assert stored_block_indices(rds, rid) == r.blocks, f"seed {SEED}: {rid}: Redis != delivered"

        # the launcher's supervision brought every killed process back
        for what, pid, _ in kills:
            if what == "redis master":
                wait_until(lambda: st.out.find("restarted as a replica"), 30, 0.2, "the old master restarted")
            else:
                wait_until(lambda: st.pid(what) != pid, 30, 0.2, f"{what} restarted by the launcher")
        assert st.proc.poll() is None, st.out.text()[-3000:]
        reattaches = (st.run_dir / "gateway.log").read_text(errors="replace").count("reattaching")
        report(f"chaos (cde.launch --ha, 2 workers): {N_REST} REST + {N_GRPC} gRPC seeded streams, kill -9 of "
               + ", then ".join(f"{w} ({n} in flight)" for w, _, n in kills)
               + f": all 12 identical to the undisturbed run (attributions included), every block once in "
               f"Redis, {reattaches} gateway reattaches, everything restarted; start {started_s:.0f} s, "
               f"undisturbed round {ref_s:.0f} s, chaos round {chaos_s:.0f} s")


def test_ha_flag_refuses_an_outside_redis_and_bad_counts(tmp_path):
    """--ha runs its own Redis group: with REDIS_URL set it stops at once and says why; replica
    counts out of range likewise (no traceback, nothing started)."""
    import subprocess

    from cde.launch import ROOT
    from tests.launcher_fixture import launch_cmd

    cases = [(["--ha"], {"REDIS_URL": "redis://127.0.0.1:1/0"}, "unset REDIS_URL"),
             (["--schedulers", "9"], {}, "1 to 8 each")]
    for flags, env, needle in cases:
        out = subprocess.run(launch_cmd(tmp_path / "run", *flags, timeout=5), cwd=ROOT, capture_output=True,
                             text=True, timeout=60, env=dict(os.environ, **env))
        assert out.returncode != 0 and needle in out.stderr and "Traceback" not in out.stderr, \
            (flags, out.returncode, out.stderr[-2000:])
