"""The scheduler's gRPC face: cde.v1.Scheduler.

Submit: admit or refuse (RESOURCE_EXHAUSTED, trailing metadata ``retry-after-ms``), record
the request in Redis, start its `RequestRun` (scheduler_svc/run.py) and stream its events.
A request id that already exists attaches to it instead (idempotent submit = Resume from
the first block). Resume replays from Redis and then follows the live run. Workers
register and heartbeat here (scheduler_svc/workers.py).

Detach: a stream names itself with ``cde-attach-id`` metadata; when its client leaves for good
the gateway sends Detach with that id, and the request is cancelled at once unless another
stream is attached. A stream that ends without one (its gateway process died) leaves the
request running for ``detach_grace_s`` (default DETACH_GRACE_S, the gateway's reattach window),
so a client can Resume on another gateway process and lose nothing.

Restart: the scheduler holds nothing Redis cannot rebuild. At start, and every
``sweep_s`` after, every queued request and every running one that no run of this
instance streams is taken over (running ones go back to the queue first: their worker
stream died with the previous instance) and re-placed from its last stored block. Several
instances on one Redis prefix elect one active scheduler (scheduler_svc/leadership.py);
the others stand by and take over the same way.

`start_scheduler()` returns a running `SchedulerServer`; health is NOT_SERVING until Redis
answers and the takeover sweep ran. `serve()` is the CLI's blocking loop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import time
from dataclasses import dataclass, field

import grpc
import redis.asyncio as aioredis
import redis.exceptions

from cde.redis_connect import RedisTarget
from cde.rpc import make_server, service_name
from cde.rpc.serving import serve_until_signal
from cde.rpc.v1 import attribution_pb2, common_pb2, scheduler_pb2, scheduler_pb2_grpc
from scheduler_svc.admission import Admission
from scheduler_svc.attribution_pool import attribution_pool
from scheduler_svc.endings import stored_finished
from scheduler_svc.fanout import End, Subscriber
from scheduler_svc.fencing import WriteGuard
from scheduler_svc.leadership import LeaderLoop, Leadership, default_instance_id
from scheduler_svc.run import RequestRun
from scheduler_svc.run_context import RunContext, RunLimits
from scheduler_svc.spec import accepted, check_submit, decode_spec, encode_spec, stored_after
from scheduler_svc.state import FINISHED, RequestStore, check_request_id
from scheduler_svc.workers import WorkerIdTaken, WorkerPool

log = logging.getLogger("scheduler_svc")

DEFAULT_PORT = 50051
POLL_S = 0.1   # Resume of a request no run here streams: how often to look at Redis
REDIS_WATCH_S = 0.25        # how often health pings Redis
REDIS_PING_TIMEOUT_S = 1.0
SCORE_ATTEMPTS = 3          # Score: workers tried before UNAVAILABLE
# Trailing metadata on an error that ended the request itself (not a transport or Redis
# hiccup): a client reattaching by itself must report it instead of retrying.
REQUEST_ENDED_MD = "cde-request-ended"
# Submit / Resume metadata: the stream's id, which a Detach names (gateway/stream.py sends both).
ATTACH_MD = "cde-attach-id"
# Seconds a request outlives its last stream when that stream broke without a Detach: at least
# the gateway's reattach window (gateway --reattach-s, 30 s), so a client of a gateway process
# that died, or the gateway itself, can Resume in time.
DETACH_GRACE_S = 30.0


@dataclass
class SchedulerOptions:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    redis_url: str = "redis://127.0.0.1:6379/0"
    attribution: list[str] = field(default_factory=list)   # host:port of each replica
    max_running: int = 64
    max_queue: int = 64
    finished_ttl_s: int = 3600
    heartbeat_ms: int = 1000
    dead_after: float = 3.0          # heartbeat intervals without a beat before a worker is dead
    queue_timeout_s: float = 30.0    # how long a request waits for any worker before UNAVAILABLE
    max_attempts: int = 8            # lost/failed placements before a request fails
    detach_grace_s: float = DETACH_GRACE_S   # after the last stream breaks without a Detach, before cancelling
    # Redis connections: a bounded pool that makes a caller wait (up to redis_wait_s) for a
    # free connection instead of failing at once when a burst has them all in use
    redis_connections: int = 256
    redis_wait_s: float = 10.0
    prefix: str = "cde:"
    sweep_s: float = 10.0
    redis: RedisTarget | None = None   # Sentinel and WAIT settings; None: just redis_url
    attribution_dns: str = ""          # host:port resolved to every A record (attribution_pool.py)
    # HA (scheduler_svc/leadership.py): lease TTL (0: no lease, a single scheduler per prefix),
    # this replica's id (default hostname-port) and the address standbys name as the leader's
    lease_ms: int = 3000
    scheduler_id: str = ""
    advertise: str = ""


class SchedulerCore:
    """What the servicer and the runs share. Only caches: Redis holds the truth."""

    def __init__(self, opts: SchedulerOptions, redis_client: aioredis.Redis, guard: WriteGuard | None = None):
        self.opts = opts
        self.redis = redis_client
        self.store = RequestStore(redis_client, prefix=opts.prefix, finished_ttl_s=opts.finished_ttl_s, guard=guard)
        self.leadership: Leadership | None = None   # set by start_scheduler when HA is on
        self.pool = WorkerPool(self.store, opts.heartbeat_ms, opts.dead_after)
        self.pool.on_requeued = self.adopt_many
        self.attribution = attribution_pool(opts.attribution, opts.attribution_dns)
        self.admission = Admission(opts.max_running, opts.max_queue)
        self.slots = asyncio.Semaphore(opts.max_running)
        self.runs: dict[str, RequestRun] = {}
        self.ready = asyncio.Event()
        self.health = None      # the grpc health servicer, once run_background has it
        self.serving = False    # what health says now
        self.closing = False
        self.started = time.monotonic()
        self.run_context = RunContext(
            store=self.store, pool=self.pool, attribution=self.attribution, slots=self.slots,
            limits=RunLimits(opts.queue_timeout_s, opts.max_attempts, opts.detach_grace_s),
            redis_failed=self.redis_failed, closing=lambda: self.closing, ended=self._run_ended)

    def new_run(self, request: scheduler_pb2.SubmitRequest, deadline: float | None) -> RequestRun:
        return RequestRun(self.run_context, request, deadline)

    def _run_ended(self, run: RequestRun) -> None:
        if self.runs.get(run.rid) is run:
            del self.runs[run.rid]
        self.admission.observe(time.monotonic() - run.started)

    # ---- takeover -----------------------------------------------------------------------------------
    async def adopt(self, request_id: str) -> RequestRun | None:
        """Start a run for a request in Redis that no run of this instance streams."""
        if request_id in self.runs or self.closing:
            return self.runs.get(request_id)
        st = await self.store.get(request_id)
        if st is None or st.terminal or request_id in self.runs:
            return self.runs.get(request_id)
        try:
            request, deadline = decode_spec(st.spec)
        except ValueError as e:
            log.error("request %s has an unreadable spec (%s): cancelling it", request_id, e)
            await self.store.cancel(request_id)
            return None
        run = self.new_run(request, deadline)
        self.runs[request_id] = run
        run.start()
        log.info("took over request %s (%s, block %d)", request_id, st.status, st.next_block)
        return run

    async def adopt_many(self, ids: list[str]) -> None:
        for rid in ids:
            await self.adopt(rid)

    async def sweep(self) -> None:
        """Take over queued requests and running ones nobody here streams."""
        for rid in await self.store.all_running_ids():
            if rid not in self.runs:
                await self.store.requeue(rid)
                await self.adopt(rid)
        for rid in await self.store.queued_ids():
            if rid not in self.runs:
                await self.adopt(rid)

    # ---- background ---------------------------------------------------------------------------------
    async def redis_failed(self, error: Exception) -> None:
        """A Redis call failed: report NOT_SERVING now, not at the next periodic check, so the
        gateway's /health follows the real state of the dependency (the watch turns it back)."""
        if self.health is not None and self.serving:
            self.serving = False
            log.warning("Redis failed (%s): NOT_SERVING until it answers again", error)
            await self.health.set_serving(False)

    async def _redis_ok(self) -> bool:
        try:
            await asyncio.wait_for(self.redis.ping(), REDIS_PING_TIMEOUT_S)
            return True
        except (redis.exceptions.RedisError, OSError, asyncio.TimeoutError) as e:
            await self.redis_failed(e)
            return False

    async def run_background(self, health) -> None:
        """Wait for Redis, take over, go SERVING; then watch Redis (every REDIS_WATCH_S) and the
        workers (every heartbeat interval)."""
        self.health = health
        backoff = 0.1
        while True:
            try:
                await self.redis.ping()
                await self.pool.refresh_from_redis()
                await self.sweep()
                break
            except (redis.exceptions.RedisError, OSError) as e:
                log.warning("Redis not reachable (%s); retrying in %.1fs", e, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
        self.ready.set()
        self.serving = True
        await health.set_serving(True)
        log.info("scheduler ready")
        interval = self.opts.heartbeat_ms / 1000
        last_check = last_sweep = time.monotonic()
        while True:
            await asyncio.sleep(min(REDIS_WATCH_S, interval))
            if not await self._redis_ok():
                continue
            try:
                if not self.serving:
                    # Workers' heartbeats failed while Redis was away (they kept beating): give
                    # them one more round before judging them by Redis's timestamps.
                    self.started = time.monotonic()
                    self.serving = True
                    log.info("Redis answers again: SERVING")
                    await health.set_serving(True)
                now = time.monotonic()
                if now - last_check < interval:
                    continue
                last_check = now
                # let workers beat once more after our own restart before judging them
                if now - self.started > self.opts.dead_after * interval:
                    await self.pool.check_stale()
                if now - last_sweep > self.opts.sweep_s:
                    last_sweep = now
                    await self.pool.refresh_from_redis()
                    await self.sweep()
            except (redis.exceptions.RedisError, OSError) as e:
                await self.redis_failed(e)

    async def shutdown(self) -> None:
        """Stop streaming; requests stay in Redis for the next instance."""
        self.closing = True
        runs = [r.task for r in self.runs.values() if r.task is not None]
        for t in runs:
            t.cancel()
        if runs:
            await asyncio.wait(runs, timeout=5)
        await self.pool.close()
        if self.attribution is not None:
            await self.attribution.close()


def _redis_guard(method):
    """Redis down -> UNAVAILABLE (not UNKNOWN) for a unary RPC handler, and health follows."""
    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except redis.exceptions.RedisError as e:
            await self.core.redis_failed(e)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"request state unavailable: {e}")
    return wrapper


def _redis_guard_stream(method):
    """Redis down -> UNAVAILABLE for a server-streaming RPC handler, and health follows."""
    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            async for ev in method(self, request, context):
                yield ev
        except redis.exceptions.RedisError as e:
            await self.core.redis_failed(e)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"request state unavailable: {e}")
    return wrapper


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, core: SchedulerCore):
        self.core = core

    async def _ready(self, context) -> None:
        if not self.core.ready.is_set():
            lead = self.core.leadership
            await context.abort(grpc.StatusCode.UNAVAILABLE, lead.standby_reason() if lead and not lead.is_leader
                                else "scheduler is starting (waiting for Redis)")

    @staticmethod
    def _attach_id(context) -> str:
        for k, v in context.invocation_metadata() or ():
            if k == ATTACH_MD:
                return v if isinstance(v, str) else v.decode(errors="replace")
        return ""

    @staticmethod
    async def _check_request_id(context, request_id: str) -> None:
        try:
            check_request_id(request_id)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    # ---- requests -----------------------------------------------------------------------------------
    @_redis_guard_stream
    async def Submit(self, request, context):
        await self._ready(context)
        core = self.core
        rid = request.request_id
        await self._check_request_id(context, rid)
        problem = check_submit(request)
        if problem is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        if rid not in core.runs:
            # Admission before any Redis work: under a burst the excess is refused from memory
            # (429 + retry hint) instead of queueing on, and exhausting, the Redis pool. An id
            # that already exists in Redis is found by create() below (it then attaches).
            retry_ms = core.admission.retry_after_ms(len(core.runs))
            if retry_ms is not None:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"scheduler is full ({len(core.runs)} requests); retry after {retry_ms} ms",
                                    trailing_metadata=(("retry-after-ms", str(retry_ms)),))
            req = scheduler_pb2.SubmitRequest()
            req.CopyFrom(request)
            remaining = context.time_remaining()
            deadline = time.time() + remaining if remaining is not None else None
            run = core.new_run(req, deadline)
            core.runs[rid] = run   # no await since the admission check: the count stays exact
            sub = run.subscribe(req.stream_steps, self._attach_id(context))
            # A slot and a worker free now: create the request running there (one Redis round trip
            # to the worker instead of two: under a burst each one queues behind the others).
            placed = await run.place_now()
            try:
                created = await core.store.create(rid, encode_spec(req, deadline), len(req.prompt_tokens),
                                                  worker=placed.worker.worker_id if placed is not None else None)
            except BaseException:
                core.runs.pop(rid, None)
                run.unplace(placed)
                raise
            if created:
                run.start(just_created=True, placed=placed)
                try:
                    yield accepted(req)
                    async for ev in self._follow(sub, -1, context):
                        yield ev
                finally:
                    run.unsubscribe(sub)
                return
            run.unplace(placed)
            if core.runs.get(rid) is run:   # raced with another Submit of the same id
                del core.runs[rid]
        async for ev in self._attach(rid, None, request.stream_steps, context):
            yield ev

    @_redis_guard_stream
    async def Resume(self, request, context):
        await self._ready(context)
        await self._check_request_id(context, request.request_id)
        after = request.after_block if request.HasField("after_block") else None
        async for ev in self._attach(request.request_id, after, False, context):
            yield ev

    async def _follow(self, sub: Subscriber, last: int, context):
        """A subscriber's live events; blocks up to ``last`` were already sent."""
        while True:
            item = await sub.queue.get()
            if isinstance(item, End):
                if item.code is not None:
                    # "final": the request itself ended with this status, so a client that
                    # reattaches by itself (the gateway) must not retry it
                    await context.abort(item.code, item.message,
                                        trailing_metadata=((REQUEST_ENDED_MD, "1"),) if item.final else ())
                yield scheduler_pb2.SchedulerEvent(finished=item.finished)
                return
            if item.HasField("block"):
                if item.block.block_index <= last:
                    continue
                last = item.block.block_index
            yield item

    async def _attach(self, rid: str, after: int | None, steps: bool, context):
        """Accepted, stored blocks after ``after``, then live ones until the end."""
        core = self.core
        run = core.runs.get(rid)
        attach_id = self._attach_id(context)
        sub = run.subscribe(steps, attach_id) if run is not None and not run.done else None   # before reading Redis
        client_gone = False
        try:
            st = await core.store.get(rid)
            if st is None and run is None:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown request {rid!r}")
            request = run.request if run is not None else decode_spec(st.spec)[0]
            yield accepted(request)
            last = -1 if after is None else after   # absolute block index
            while True:
                for _, payload in await core.store.blocks(rid, stored_after(request, last)):
                    block = common_pb2.BlockCommitted.FromString(payload)
                    last = block.block_index
                    yield scheduler_pb2.SchedulerEvent(block=block)
                if sub is not None:
                    async for ev in self._follow(sub, last, context):
                        yield ev
                    return
                if st is not None and st.terminal:
                    yield scheduler_pb2.SchedulerEvent(finished=await self._stored_finished(st))
                    return
                await asyncio.sleep(POLL_S)   # streamed elsewhere (another instance): follow Redis
                run = core.runs.get(rid)
                if run is not None and not run.done:
                    sub = run.subscribe(steps, attach_id)
                st = await core.store.get(rid)
                if st is None:
                    await context.abort(grpc.StatusCode.NOT_FOUND, f"request {rid!r} expired")
        except (asyncio.CancelledError, GeneratorExit):
            client_gone = True   # the client closed the stream: the only exit that may cancel
            raise
        finally:
            if sub is not None:
                # A failed attach (Redis error, abort) leaves the request running: with no
                # other subscriber it would otherwise be cancelled as "client gone".
                run.unsubscribe(sub, client_gone=client_gone)

    async def _stored_finished(self, st) -> common_pb2.Finished:
        saved = None
        for _ in range(10):   # the end record follows the terminal transition by one round trip
            saved = await self.core.store.ending(st.id)
            if saved:
                break
            await asyncio.sleep(0.05)
        return stored_finished(st, saved)

    @_redis_guard
    async def Cancel(self, request, context):
        await self._ready(context)
        rid = request.request_id
        await self._check_request_id(context, rid)
        run = self.core.runs.get(rid)
        if run is not None and not run.done:
            ok = run.cancel("cancelled by request")
            await run.wait(5.0)
            return common_pb2.CancelResponse(cancelled=ok)
        if await self.core.store.get(rid) is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown request {rid!r}")
        return common_pb2.CancelResponse(cancelled=await self.core.store.cancel(rid))

    async def Detach(self, request, context):
        """The client of the stream ``attach_id`` left: cancel now unless another stream is attached."""
        await self._ready(context)
        rid = request.request_id
        await self._check_request_id(context, rid)
        run = self.core.runs.get(rid)
        if run is None or run.done:   # ended, or streamed by no run here: nothing waits on this stream
            return common_pb2.CancelResponse(cancelled=False)
        return common_pb2.CancelResponse(cancelled=run.detach(request.attach_id))

    # ---- workers ------------------------------------------------------------------------------------
    @_redis_guard
    async def RegisterWorker(self, request, context):
        await self._ready(context)
        if not request.worker_id or not request.address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "worker_id and address are required")
        try:
            await self.core.pool.register(request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except WorkerIdTaken as e:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        return scheduler_pb2.WorkerAck(heartbeat_interval_ms=self.core.opts.heartbeat_ms)

    @_redis_guard
    async def Heartbeat(self, request, context):
        await self._ready(context)
        try:
            known = await self.core.pool.heartbeat(request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except WorkerIdTaken as e:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        if not known:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"worker {request.worker_id!r} is not registered")
        return scheduler_pb2.WorkerAck(heartbeat_interval_ms=self.core.opts.heartbeat_ms)

    async def Score(self, request, context):
        """Relayed to a live worker of the model (the one with the most free pages: scoring takes
        none, but it shares the worker's GPU); a worker that does not answer is left for another."""
        await self._ready(context)
        tried: set[str] = set()
        last = "no worker serves it"
        for _ in range(SCORE_ATTEMPTS):
            left = context.time_remaining()
            worker = await self.core.pool.wait_for(request.model, tried, min(left or 5.0, 5.0))
            if worker is None or worker.worker_id in tried:
                break
            tried.add(worker.worker_id)
            try:
                return await worker.stub.Score(request, timeout=context.time_remaining())
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    await context.abort(e.code(), e.details() or "scoring failed")
                last = f"worker {worker.worker_id}: {e.details()}"
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"no worker scored the tokens ({last})")

    @_redis_guard_stream
    async def AttributeInputs(self, request, context):
        """Input attribution of a finished request: its stored spec and blocks go to an attribution
        replica (which replays it and computes the integrated gradients); its events are relayed."""
        await self._ready(context)
        rid = request.request_id
        await self._check_request_id(context, rid)
        st = await self.core.store.get(rid)
        if st is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown request {rid!r} (finished requests are kept "
                                f"{self.core.opts.finished_ttl_s} s)")
        if st.status != FINISHED:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"request {rid!r} is {st.status}: input attribution explains finished requests")
        spec, _ = decode_spec(st.spec)
        if spec.options.WhichOneof("decoder") != "block_diffusion":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "input attribution explains block-diffusion (Steerling) generations")
        if self.core.attribution is None or not len(self.core.attribution):
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no attribution service is configured")
        blocks = [common_pb2.BlockCommitted.FromString(p) for _, p in await self.core.store.blocks(rid)]
        job = attribution_pb2.InputAttributionJob(
            request_id=rid, model=spec.model, prompt_tokens=spec.prompt_tokens, options=spec.options,
            generated=[t for b in blocks for t in b.tokens], positions=request.positions,
            chunk_start=request.chunk_start, chunk_end=request.chunk_end, n_steps=request.n_steps)
        if spec.HasField("steering"):
            job.steering.CopyFrom(spec.steering)
        try:
            async for ev in self.core.attribution.next_stub().AttributeInputs(job, timeout=context.time_remaining()):
                yield ev
        except grpc.aio.AioRpcError as e:
            await context.abort(e.code(), e.details() or "input attribution failed")

    async def Stats(self, request, context):
        runs = list(self.core.runs.values())
        running = sum(1 for r in runs if r.worker is not None)
        t = self.core.run_context.timing
        return scheduler_pb2.StatsResponse(running=running, waiting=len(runs) - running,
                                           workers=self.core.pool.stats(), placed=t.placed,
                                           submit_to_worker_seconds_sum=t.submit_to_worker_s,
                                           first_blocks=t.first_blocks,
                                           first_block_relay_seconds_sum=t.first_block_relay_s)


# ---- server -------------------------------------------------------------------------------------------

@dataclass
class SchedulerServer:
    server: grpc.aio.Server
    health: object
    core: SchedulerCore
    port: int
    background: asyncio.Task

    async def wait_ready(self, timeout: float = 30.0) -> None:
        await asyncio.wait_for(self.core.ready.wait(), timeout)

    async def stop(self, grace: float | None = 5.0) -> None:
        """Stop serving; running requests stay in Redis and a new instance takes them over."""
        if self.core.closing:
            return
        self.core.closing = True
        self.background.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self.background
        await self.health.set_serving(False)
        await self.server.stop(grace)
        await self.core.shutdown()
        await self.core.redis.aclose()


async def start_scheduler(opts: SchedulerOptions) -> SchedulerServer:
    target = opts.redis or RedisTarget(url=opts.redis_url)
    client = target.client(max_connections=opts.redis_connections, wait_s=opts.redis_wait_s)
    guard = WriteGuard(wait_replicas=target.wait_replicas, wait_ms=target.wait_ms) \
        if opts.lease_ms > 0 or target.wait_replicas > 0 else None
    core = SchedulerCore(opts, client, guard)
    server, health = await make_server([service_name(scheduler_pb2, "Scheduler")])
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(SchedulerServicer(core), server)
    port = server.add_insecure_port(f"{opts.host}:{opts.port}")
    if port == 0:
        raise RuntimeError(f"could not bind {opts.host}:{opts.port}")
    if opts.lease_ms > 0:
        core.leadership = Leadership(client, opts.prefix, opts.scheduler_id or default_instance_id(port),
                                     opts.advertise or f"{opts.host}:{port}", opts.lease_ms, guard)
    await server.start()
    main = LeaderLoop(core, core.leadership).run(health) if core.leadership else core.run_background(health)
    background = asyncio.get_running_loop().create_task(main, name="scheduler-background")
    log.info("scheduler on %s:%d (Redis %s, attribution %s, %s)", opts.host, port, target.describe(),
             ",".join(opts.attribution) or opts.attribution_dns or "none",
             f"HA lease {opts.lease_ms} ms as {core.leadership.instance}" if core.leadership else "no lease")
    return SchedulerServer(server, health, core, port, background)


def options_from_args(args: argparse.Namespace) -> SchedulerOptions:
    return SchedulerOptions(
        host=args.host, port=args.port, redis_url=args.redis_url, redis=RedisTarget.from_args(args),
        attribution_dns=args.attribution_dns, lease_ms=args.lease_ms, scheduler_id=args.scheduler_id,
        advertise=args.advertise,
        attribution=[a.strip() for a in (args.attribution or "").split(",") if a.strip()],
        max_running=args.max_running, max_queue=args.max_queue, finished_ttl_s=args.finished_ttl,
        heartbeat_ms=args.heartbeat_ms, queue_timeout_s=args.queue_timeout, detach_grace_s=args.detach_grace,
        prefix=args.prefix, redis_connections=getattr(args, "redis_connections", 256))


async def serve(args: argparse.Namespace) -> None:
    """Run until SIGTERM/SIGINT."""
    sched = await start_scheduler(options_from_args(args))
    await serve_until_signal(sched, "scheduler", args.grace)
