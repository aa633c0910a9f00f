"""The set of workers, discovered at run time: registration, heartbeats, placement, death.

Redis (``RequestStore`` workers hash) is the record: a restarted scheduler reads the
workers back from it and keeps dialling them; memory only holds channels and the latest
heartbeat figures. A worker is dead when its heartbeat is older than ``dead_after``
intervals, or when a request stream to it fails and a cheap Info probe cannot reach it.
Death removes it from Redis (if it is in fact alive its next heartbeat is answered
NOT_FOUND and it registers again), interrupts the streams of its requests here and moves
every request recorded on it back to the queue.

Placement: among live workers serving the request's model, the one with the most free KV
pages, where "free" is the last heartbeat's figure minus the pages of the requests placed
on it since that heartbeat (so a burst does not all land on the same worker), capped by the
total minus the pages of the requests streaming from it (a heartbeat may predate the
engine's allocation for them). A worker whose heartbeat says ``draining`` (it got SIGTERM and
finishes its running requests before exiting, worker_svc/drain.py) gets no new requests.

Prompt affinity: a request whose prompt's first 64-token block is the same as a recent
request's (n > 1 choices, a shared system prompt) goes to that request's worker, where the
prefix cache holds the block's K/V, while that worker has the pages for it and at least half the
free pages of the emptiest one (so affinity never piles a burst onto one worker). The map is
this instance's memory only, the last `AFFINITY_ENTRIES` prefixes.

Reservations: the pool owns that bookkeeping. A run calls ``reserve`` when it picks a worker
(before its next await, so the other runs of a burst see the pages), and ``release`` when its
stream there ends, or with ``placed=False`` when the placement did not happen after all.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field

import grpc
from google.protobuf import json_format

from cde.blocks import BLOCK
from cde.rpc.internal_auth import internal_channel
from cde.rpc.v1 import scheduler_pb2, worker_pb2, worker_pb2_grpc
from scheduler_svc.state import RequestStore

log = logging.getLogger("scheduler_svc.workers")

PROBE_TIMEOUT_S = 1.0


class WorkerIdTaken(Exception):
    """A registration or heartbeat names a live worker's id from another address."""


@dataclass(eq=False)
class Reservation:
    """KV pages a request holds on a worker, from placement until its stream there ends."""
    worker: WorkerHandle
    request_id: str
    pages: int
    on_lost: Callable[[str], None]   # called with the worker id when the pool declares it dead


@dataclass(eq=False)
class WorkerHandle:
    worker_id: str
    info: scheduler_pb2.WorkerInfo
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerStub
    placed_pages: int = 0              # pages placed here since the last heartbeat
    reservations: set[Reservation] = field(default_factory=set)  # requests streaming from it (this instance)
    dead: bool = False
    probe_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    probed_at: float = 0.0
    probe_ok: bool = True

    @property
    def free_pages(self) -> int:
        """The heartbeat's free pages minus what was placed since, and never more than the
        total minus the pages of the requests this scheduler streams from it: a heartbeat can
        arrive before the engine has allocated for requests just placed (its figure then
        still counts their pages as free)."""
        reported = int(self.info.kv_pages_free) - self.placed_pages
        streaming = int(self.info.kv_pages_total) - sum(r.pages for r in self.reservations)
        return min(reported, streaming)


AFFINITY_ENTRIES = 4096   # prompt prefixes remembered for placement


def prompt_prefix(prompt_tokens) -> tuple[int, ...] | None:
    """A prompt's first full 64-token block (the prefix cache's first key), or None when shorter."""
    return tuple(prompt_tokens[:BLOCK]) if len(prompt_tokens) >= BLOCK else None


class WorkerPool:
    def __init__(self, store: RequestStore, heartbeat_ms: int, dead_after: float = 3.0):
        self.store = store
        self.heartbeat_ms = heartbeat_ms
        self.dead_after_s = dead_after * heartbeat_ms / 1000
        self.workers: dict[str, WorkerHandle] = {}
        self.changed = asyncio.Condition()
        self._affinity: OrderedDict[Hashable, str] = OrderedDict()   # prompt prefix -> worker id (`pick`)
        # called with the ids moved back to the queue from a dead worker (adopt orphans)
        self.on_requeued: Callable[[list[str]], Awaitable[None]] | None = None

    # ---- registry ---------------------------------------------------------------------------
    def _handle(self, info: scheduler_pb2.WorkerInfo) -> WorkerHandle:
        h = self.workers.get(info.worker_id)
        if h is not None and h.info.address == info.address and not h.dead:
            h.info = info
            return h
        if h is not None:
            asyncio.get_running_loop().create_task(h.channel.close(grace=None))
        channel = internal_channel(info.address)
        h = WorkerHandle(info.worker_id, info, channel, worker_pb2_grpc.WorkerStub(channel))
        self.workers[info.worker_id] = h
        return h

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def _check_owner(self, info: scheduler_pb2.WorkerInfo) -> None:
        """Refuse ``info`` when its id belongs to a worker that still answers at another address
        (a rogue or misconfigured worker would otherwise receive that worker's requests). A
        worker that restarted elsewhere is accepted: its old address no longer answers."""
        h = self.workers.get(info.worker_id)
        if h is None:
            rec = (await self.store.workers()).get(info.worker_id)
            address = ((rec or {}).get("info") or {}).get("address", "")
            if not address or address == info.address:
                return
            h = self._handle(json_format.ParseDict(rec["info"], scheduler_pb2.WorkerInfo(), ignore_unknown_fields=True))
        if h.dead or h.info.address == info.address:
            return
        try:
            await h.stub.Info(worker_pb2.WorkerStatusRequest(), timeout=PROBE_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            log.warning("worker %s moved from %s to %s (the old address does not answer)", info.worker_id,
                        h.info.address, info.address)
            return
        log.warning("refused worker id %s from %s: a live worker at %s has it", info.worker_id, info.address,
                    h.info.address)
        raise WorkerIdTaken(f"worker id {info.worker_id!r} belongs to a live worker at another address")

    async def register(self, info: scheduler_pb2.WorkerInfo) -> None:
        """Raises WorkerIdTaken (see _check_owner)."""
        await self._check_owner(info)
        await self.store.register_worker(info.worker_id, json_format.MessageToDict(
            info, preserving_proto_field_name=True))
        self._handle(info).placed_pages = 0
        log.info("worker %s registered at %s (%s, %d pages free)", info.worker_id, info.address, info.model,
                 info.kv_pages_free)
        await self._notify()

    async def heartbeat(self, info: scheduler_pb2.WorkerInfo) -> bool:
        """False when the worker is unknown (dropped as dead, or Redis lost it): it must register.
        Raises WorkerIdTaken for a beat under a live worker's id from another address."""
        h = self.workers.get(info.worker_id)
        if h is not None and not h.dead and h.info.address != info.address:
            await self._check_owner(info)
        if not await self.store.heartbeat(info.worker_id):
            return False
        self._handle(info).placed_pages = 0
        await self._notify()
        return True

    async def refresh_from_redis(self) -> None:
        """Pick up workers registered in Redis that this instance has not heard from (after a
        restart): their heartbeats go to Redis through any scheduler."""
        for wid, rec in (await self.store.workers()).items():
            if wid in self.workers:
                continue
            info = json_format.ParseDict(rec.get("info", {}), scheduler_pb2.WorkerInfo(), ignore_unknown_fields=True)
            if info.address:
                self._handle(info)
        await self._notify()

    def live(self, model: str = "") -> list[WorkerHandle]:
        return [h for h in self.workers.values() if not h.dead and (not model or h.info.model == model)]

    # ---- placement ------------------------------------------------------------------------------
    def pick(self, model: str, avoid: set[str], pages: int = 0, prefix: Hashable | None = None) -> WorkerHandle | None:
        """The worker for a request of ``pages`` pages whose prompt starts with ``prefix``
        (`prompt_prefix`; None: no affinity)."""
        # a draining worker (SIGTERM) finishes what it runs and takes nothing new
        cands = [h for h in self.live(model) if not h.info.draining]
        preferred = [h for h in cands if h.worker_id not in avoid] or cands
        if not preferred:
            return None
        best = max(preferred, key=lambda h: (h.free_pages, -len(h.reservations), h.worker_id))
        near = self.workers.get(self._affinity.get(prefix, "")) if prefix is not None else None
        if (near is not None and near is not best and near in preferred
                and near.free_pages >= max(pages, best.free_pages // 2)):
            return near
        return best

    def reserve(self, worker: WorkerHandle, request_id: str, pages: int,
                on_lost: Callable[[str], None], prefix: Hashable | None = None) -> Reservation:
        """Count ``pages`` on ``worker`` for a request placed there (free pages drop at once);
        later requests with the same ``prefix`` prefer it."""
        if prefix is not None:
            self._affinity[prefix] = worker.worker_id
            self._affinity.move_to_end(prefix)
            while len(self._affinity) > AFFINITY_ENTRIES:
                self._affinity.popitem(last=False)
        res = Reservation(worker, request_id, pages, on_lost)
        worker.placed_pages += pages
        worker.reservations.add(res)
        return res

    def release(self, res: Reservation, placed: bool = True) -> None:
        """The request's stream from the worker ended. ``placed=False``: the placement did not
        happen (the claim was refused or failed), so its pages no longer count as placed either;
        otherwise the next heartbeat's figure accounts for them."""
        res.worker.reservations.discard(res)
        if not placed:
            res.worker.placed_pages = max(0, res.worker.placed_pages - res.pages)

    async def wait_for(self, model: str, avoid: set[str], timeout_s: float, pages: int = 0,
                       prefix: Hashable | None = None) -> WorkerHandle | None:
        """The best worker for ``model`` (`pick`), waiting up to ``timeout_s`` for one to appear."""
        deadline = time.monotonic() + timeout_s
        while True:
            h = self.pick(model, avoid, pages, prefix)
            left = deadline - time.monotonic()
            if h is not None or left <= 0:
                return h
            async with self.changed:
                try:
                    await asyncio.wait_for(self.changed.wait(), min(left, 1.0))
                except asyncio.TimeoutError:
                    pass
            if not self.live(model):   # restarted scheduler, workers only in Redis so far
                await self.refresh_from_redis()

    # ---- death ----------------------------------------------------------------------------------
    async def probe(self, h: WorkerHandle) -> bool:
        """Is the worker reachable? One Info call, shared by everyone asking within a second."""
        async with h.probe_lock:
            if h.dead:
                return False
            if time.monotonic() - h.probed_at < 1.0:
                return h.probe_ok
            try:
                await h.stub.Info(worker_pb2.WorkerStatusRequest(), timeout=PROBE_TIMEOUT_S)
                h.probe_ok = True
            except grpc.aio.AioRpcError:
                h.probe_ok = False
            h.probed_at = time.monotonic()
            return h.probe_ok

    async def declare_dead(self, worker_id: str, why: str) -> None:
        h = self.workers.pop(worker_id, None)
        if h is not None:
            h.dead = True
            for res in list(h.reservations):
                res.on_lost(worker_id)
        if not await self.store.remove_worker(worker_id) and h is None:
            return   # someone got here first
        log.warning("worker %s is dead (%s): re-placing its requests", worker_id, why)
        moved = await self.store.requeue_worker(worker_id)
        if moved and self.on_requeued is not None:
            await self.on_requeued(moved)
        if h is not None:
            asyncio.get_running_loop().call_later(5.0, lambda: asyncio.ensure_future(h.channel.close(grace=None)))
        await self._notify()

    async def check_stale(self) -> None:
        for wid in await self.store.stale_workers(self.dead_after_s):
            await self.declare_dead(wid, f"no heartbeat for {self.dead_after_s:.1f}s")

    def stats(self) -> list[scheduler_pb2.WorkerInfo]:
        return [h.info for h in sorted(self.workers.values(), key=lambda h: h.worker_id)]

    async def close(self) -> None:
        for h in self.workers.values():
            await h.channel.close(grace=None)
        self.workers.clear()
