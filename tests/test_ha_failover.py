"""Replicated services losing a process under load, as real processes on loopback (tiny model,
CPU; tests/ha_stack.py):

1. two schedulers (one lease), two workers, the gateway, Redis: kill -9 the active scheduler
   while 12 seeded requests stream; the standby takes over, every request finishes, every
   block arrives once, in order, as stored in Redis, and the text equals an undisturbed run;
2. two attribution replicas: kill one while requests with attribution stream; every block's
   attributions arrive exactly once and equal the undisturbed values.

Seeds: base $CDE_TEST_SEED (default 4242), printed in every failure message.
"""

from __future__ import annotations

import asyncio
import os
import time

import httpx
import pytest
import redis

from tests.ha_stack import active_scheduler, ha_stack
from tests.stack_fixture import StreamResult, all_alive, chat_body, kill, service
from tests.stack_fixture import FINISHED_OK, contiguous, stored_block_indices

REPORT_TAG = "fault"
SEED = int(os.environ.get("CDE_TEST_SEED", 4242))


async def _stream(c: httpx.AsyncClient, url: str, body: dict, res: StreamResult) -> StreamResult:
    async with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
        res.status = r.status_code
        if r.status_code != 200:
            res.errors.append((await r.aread()).decode(errors="replace"))
            return res
        async for line in r.aiter_lines():
            res.feed(line)
    return res


async def run_round(url: str, bodies: list[dict], disturb=None, budget_s: float = 300) -> tuple[list[StreamResult], int]:
    """Stream every body at once; ``disturb()`` runs (in a thread) once two streams have
    blocks. Returns the results and how many were unfinished when it ran."""
    results = [StreamResult() for _ in bodies]
    in_flight = 0
    async with httpx.AsyncClient(timeout=budget_s) as c:
        tasks = [asyncio.create_task(_stream(c, url, b, r)) for b, r in zip(bodies, results)]
        if disturb is not None:
            deadline = time.monotonic() + 120
            while sum(1 for r in results if r.blocks) < 2:
                assert time.monotonic() < deadline and not all(t.done() for t in tasks), f"seed {SEED}: no blocks"
                await asyncio.sleep(0.005)
            in_flight = sum(1 for r in results if r.finish is None)
            await asyncio.to_thread(disturb)
        await asyncio.wait_for(asyncio.gather(*tasks), budget_s)
    return results, in_flight


def assert_same(ref: list[StreamResult], got: list[StreamResult], what: str) -> None:
    for i, (a, b) in enumerate(zip(ref, got)):
        tag = f"seed {SEED + i} ({what})"
        assert b.status == 200 and not b.errors and b.done, (tag, b.status, b.errors)
        assert contiguous(b.blocks) and b.blocks == a.blocks, (tag, a.blocks, b.blocks)
        assert b.tokens == a.tokens and b.text == a.text and b.finish == a.finish, tag


@pytest.mark.fault
def test_killing_the_active_scheduler_under_load_loses_and_duplicates_nothing(tmp_path, report):
    with ha_stack(tmp_path / "stack", schedulers=2, workers=2, lease_ms=1500) as stack:
        bodies = [chat_body(SEED + i, 160) for i in range(12)]
        ref, _ = asyncio.run(run_round(stack.base_url, bodies))
        assert all(r.finish in FINISHED_OK and not r.errors for r in ref), f"seed {SEED}: undisturbed run failed"
        active, token = active_scheduler(stack)
        killed_at = []

        def disturb():
            killed_at.append(time.monotonic())
            kill(active)

        got, in_flight = asyncio.run(run_round(stack.base_url, bodies, disturb))
        assert in_flight >= 2, f"seed {SEED}: the kill hit only {in_flight} unfinished requests"
        assert_same(ref, got, "active scheduler killed")
        new, new_token = active_scheduler(stack)
        assert new is not active and new_token > token, (active.name, new.name, token, new_token)
        rds = redis.Redis.from_url(stack.redis_url)
        for i, r in enumerate(got):
            assert rds.hget(f"cde:req:{r.request_id}", "status") == b"finished", f"seed {SEED + i}"
            assert stored_block_indices(rds, r.request_id) == r.blocks, f"seed {SEED + i}: Redis != delivered"
        gw = service(stack, "gateway").log.read_text(errors="replace")
        assert gw.count("reattaching") >= 1, "no gateway stream broke: the kill hit nothing"
        took_over = [s for s in stack.services if s.name.startswith("scheduler") and s is not active]
        log = took_over[0].log.read_text(errors="replace")
        assert "active scheduler s" in log and "took over request" in log, log[-3000:]
        dead = {n for n, _ in all_alive(stack).items()}
        assert dead == {active.name}, dead
        report(f"scheduler HA: kill -9 of the active scheduler ({active.name}, token {token}) with {in_flight} of "
               f"12 seeded requests in flight: {new.name} took over (token {new_token}), all 12 identical to the "
               f"undisturbed run, every block once in Redis, {gw.count('reattaching')} gateway reattaches")


@pytest.mark.fault
def test_an_attribution_replica_dying_mid_request_attributes_every_block_once(tmp_path, report):
    with ha_stack(tmp_path / "stack", schedulers=1, workers=2, attributions=2) as stack:
        bodies = [chat_body(SEED + 100 + i, 190, attribution="all", attribution_top_k=4) for i in range(6)]
        ref, _ = asyncio.run(run_round(stack.base_url, bodies))
        assert all(r.finish in FINISHED_OK and not r.errors for r in ref), f"seed {SEED}: undisturbed run failed"
        assert all(b["token_attributions"] for r in ref for b in r.block_cde), "the reference has no attributions"
        got, in_flight = asyncio.run(run_round(stack.base_url, bodies, lambda: kill(service(stack, "attribution0"))))
        assert in_flight >= 2, f"seed {SEED}: the kill hit only {in_flight} unfinished requests"
        assert_same(ref, got, "attribution replica killed")
        for i, (a, b) in enumerate(zip(ref, got)):
            idx = [blk["block_index"] for blk in b.block_cde]
            assert len(idx) == len(set(idx)) == len(b.blocks), f"seed {SEED + 100 + i}: a block came twice: {idx}"
            assert b.block_cde == a.block_cde, f"seed {SEED + 100 + i}: attributions differ from the undisturbed run"
        sched = service(stack, "scheduler").log.read_text(errors="replace")
        broke = sched.count("attribution for ")
        assert broke >= 1, "no attribution stream broke: the kill hit nothing"
        assert "without attributions" not in sched, sched[-3000:]
        report(f"attribution HA: one of 2 replicas killed with {in_flight} of 6 requests in flight: {broke} "
               f"streams moved to the other replica, every block attributed once, values equal the undisturbed run")
