"""The worker's gRPC face: cde.v1.Worker over the engine, plus registration with the scheduler.

One `Worker.Submit` stream per request, written once for both model families: the family
(block_diffusion.py for Steerling, causal.py for causal ISD models; family.py) validates the
request into engine types, so a bad request is INVALID_ARGUMENT before it costs a step, and
translates engine events into WorkerEvents. The step loop runs inside the engine thread. The
stream ends with Finished; closing it early (scheduler gone, client cancel, deadline) closes
the engine stream, which cancels the request and frees its KV pages at the next step boundary.

`start_worker()` returns a running `WorkerServer` (gRPC server, engine front, registrar), so
tests and launchers can run several in one process; `serve()` is the CLI's blocking loop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from cde import limits as L
from cde import trace
from cde.model_family import CAUSAL, model_family
from cde.rpc import make_server, service_name
from cde.rpc.leader_channel import scheduler_channel
from cde.rpc.serving import wait_for_shutdown_signal
from cde.rpc.v1 import (
    common_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from worker_svc.drain import DrainGate, drain
from worker_svc.engine.async_engine import AsyncEngine
from worker_svc.engine.events import FinishEvent
from worker_svc.engine.runtime import EngineRuntime
from worker_svc.family import ModelFamily
from worker_svc.scoring import Scorer
from worker_svc.validation import BadRequest

log = logging.getLogger("worker_svc")

DEFAULT_PORT = 50081


# ---- the servicer -----------------------------------------------------------------------------

class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, front: AsyncEngine, family: ModelFamily, model_name: str, token_limit: int, dtype: str,
                 device: str, scorer: Scorer):
        self.front = front
        self.scorer = scorer
        self.family = family
        self.engine: EngineRuntime = front.engine
        self.model_name = model_name
        self.token_limit = token_limit
        self.dtype = dtype
        self.device = device
        self.wire_jobs = False              # --tensor-parallel: jobs carry their WorkerSubmit bytes
        self.first_blocks = 0               # requests whose first block this servicer sent
        self.first_block_s_sum = 0.0        # their times from Submit to that block, summed

    async def Submit(self, request, context):
        received = time.perf_counter()
        try:
            job = self.family.parse(request)
            if self.wire_jobs:   # --tensor-parallel: the followers parse the same bytes
                job = dataclasses.replace(job, wire=request.SerializeToString())
        except BadRequest as e:
            await context.abort(e.code, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline already passed")
        done = self.family.already_finished(job)
        if done is not None:
            yield worker_pb2.WorkerEvent(finished=done)
            return
        if job.request_id in self.engine.requests:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {job.request_id!r} is running here")
        if self.front.error is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine failed: {self.front.error!r}")
        translate = self.family.translator(job)
        stream = self.front.generate(job)
        # aclosing: leaving early for any reason (cancel, deadline, error) cancels the request.
        async with contextlib.aclosing(stream):
            try:
                async for ev in stream:
                    for out in translate(ev):
                        if received is not None and out.WhichOneof("event") == "block":
                            self.first_blocks += 1
                            self.first_block_s_sum += time.perf_counter() - received
                            if trace.enabled():
                                trace.record("worker", job.request_id, wk_submit=trace.wall(received, time.perf_counter),
                                             wk_first_block=time.time())
                            received = None
                        yield out
                    if isinstance(ev, FinishEvent):
                        return
                    left = context.time_remaining()
                    if left is not None and left <= 0:
                        break
            except ValueError as e:   # engine.submit's own checks (raced duplicate, shapes)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except RuntimeError as e:  # the step thread died
                await context.abort(grpc.StatusCode.INTERNAL, str(e))
        await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")

    async def Cancel(self, request, context):
        if request.request_id not in self.engine.requests:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"request {request.request_id!r} is not on this worker")
        return common_pb2.CancelResponse(cancelled=self.front.cancel(request.request_id))

    async def Score(self, request, context):
        if request.model and request.model != self.model_name:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"model {request.model!r} is not served here")
        try:
            return await self.scorer.score(request)
        except BadRequest as e:
            await context.abort(e.code, str(e))

    async def Info(self, request, context):
        stats = self.front.stats()
        status = self.family.status(stats, self.model_name, self.dtype, self.device)
        # where a request's time goes inside the worker (the same for both families)
        status.admitted, status.queue_seconds_sum = stats.admitted, stats.queue_s_sum
        status.first_blocks, status.first_block_seconds_sum = self.first_blocks, self.first_block_s_sum
        status.late_plans, status.late_plan_misses = stats.late_plans, stats.late_plan_misses
        status.prefix_cache_queries, status.prefix_cache_hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        return status


# ---- registration -------------------------------------------------------------------------------

class Registrar:
    """Registers with the scheduler, then heartbeats at the interval it asks for. A heartbeat
    answered NOT_FOUND (the scheduler dropped us, or its Redis was wiped) registers again; an
    unreachable scheduler is retried with backoff, forever: the worker keeps serving."""

    def __init__(self, scheduler: str, worker_id: str, address: str, model: str, front: AsyncEngine):
        self.scheduler = scheduler
        self.worker_id = worker_id
        self.address = address
        self.model = model
        self.front = front
        self.registered = asyncio.Event()
        self.draining = False   # set by worker_svc.drain: the scheduler places nothing here then

    def info(self) -> scheduler_pb2.WorkerInfo:
        s = self.front.stats()
        return scheduler_pb2.WorkerInfo(worker_id=self.worker_id, address=self.address, model=self.model,
                                        kv_pages_total=s.pages_total, kv_pages_free=s.pages_free,
                                        running=s.running, waiting=s.waiting, draining=self.draining,
                                        prefix_cache_queries=s.prefix_cache_queries,
                                        prefix_cache_hits=s.prefix_cache_hits)

    async def run(self) -> None:
        async with scheduler_channel(self.scheduler) as channel:   # "a:p,b:p": follows the active one
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            backoff = 0.2
            while True:
                try:
                    ack = await stub.RegisterWorker(self.info(), timeout=5)
                    self.registered.set()
                    backoff = 0.2
                    log.info("registered %s at %s with scheduler %s", self.worker_id, self.address, self.scheduler)
                    await self._heartbeats(stub, max(ack.heartbeat_interval_ms, 50) / 1000)
                except grpc.aio.AioRpcError as e:
                    log.warning("scheduler %s: %s %s; retrying in %.1fs", self.scheduler, e.code().name,
                                e.details(), backoff)
                except Exception:   # never stop registering: a worker nobody knows serves nothing
                    log.exception("registration with scheduler %s failed; retrying in %.1fs", self.scheduler, backoff)
                self.registered.clear()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)   # a restarted scheduler is found within a second

    async def _heartbeats(self, stub, interval: float) -> None:
        """Returns when the scheduler no longer knows us; raises on other errors."""
        while True:
            await asyncio.sleep(interval)
            if self.front.error is not None:   # the step thread died: let the scheduler declare us dead
                log.error("engine failed (%r): not heartbeating", self.front.error)
                continue
            try:
                ack = await stub.Heartbeat(self.info(), timeout=max(interval, 2.0))
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    return
                if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    continue   # scheduler restarting: keep beating, it reads us back from Redis
                raise
            interval = max(ack.heartbeat_interval_ms, 50) / 1000 or interval


# ---- server ---------------------------------------------------------------------------------------

@dataclass
class WorkerOptions:
    model_dir: str
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    scheduler: str | None = None        # host:port; None = don't register (tests, bench)
    worker_id: str = ""
    advertise: str | None = None        # address the scheduler dials; default host:port
    model_name: str | None = None       # default: the model directory's name
    device: str = "cpu"
    dtype: str = "float32"
    compile: bool = False
    cuda_graphs: bool = False
    kv_pages: int | None = None
    max_slots: int = 64
    capture_rows: int = 48              # block diffusion + CUDA graphs: largest step (rows) run from a graph
    max_stride: int = L.MAX_STRIDE      # causal models: the largest decode.isd_stride served
    threads: int = 0                    # CPU: torch intra-op threads (0 = torch's default)
    prefix_caching: bool = True         # reuse the K/V pages of cached prompt prefixes (64-token blocks)
    warmup: bool = True
    random_weights: int | None = None   # BENCHMARK ONLY: seed of random weights (cde.steerling.random_weights)
    weights: str = "dense"              # "fp8": the trunk's projections in e4m3 (cde/fp8.py; both families)
    tensor_parallel: int = 1            # ranks the model is split over (worker_svc/tensor_parallel.py)
    tp_argv: tuple[str, ...] = ()       # this worker's command line, which rank 0 gives its followers


@dataclass
class WorkerServer:
    server: grpc.aio.Server
    health: object
    front: AsyncEngine
    servicer: WorkerServicer
    port: int
    address: str
    registrar: Registrar | None
    registrar_task: asyncio.Task | None
    gate: DrainGate | None = None
    lockstep: object | None = None     # --tensor-parallel: rank 0's LockstepEngine (stops the followers)

    async def drain(self, timeout_s: float) -> bool:
        """SIGTERM: take no new requests, finish the running ones (worker_svc/drain.py)."""
        return await drain(self.gate, self.health, self.registrar, timeout_s)

    async def stop(self, grace: float | None = 5.0) -> None:
        """Stop registering, stop serving (grace=0: abruptly, like a crash), stop the engine."""
        if self.registrar_task is not None:
            self.registrar_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.registrar_task
        await self.health.set_serving(False)
        await self.server.stop(grace)
        self.servicer.scorer.close()
        await asyncio.to_thread(self.front.stop)
        if self.lockstep is not None:
            await asyncio.to_thread(self.lockstep.close)


def _advertised(host: str, port: int, advertise: str | None) -> str:
    if advertise:
        return advertise
    if host in ("0.0.0.0", "::", "[::]", ""):
        host = socket.gethostname()
    return f"{host}:{port}"


def _convert_to_fp8(model, dtype_name: str) -> None:
    from cde.fp8 import to_fp8
    n = to_fp8(model)
    log.info("FP8 (e4m3) weights: %d trunk projections; LM head, embeddings (and any concept heads) in %s",
             n, dtype_name)


@dataclass
class Serving:
    """A loaded model behind its engine, family and scorer: what a worker (any rank) serves."""

    engine: EngineRuntime
    family: ModelFamily
    scorer: Scorer
    model_name: str
    token_limit: int
    dtype_name: str


def load_serving(opts: WorkerOptions, tp_rank: int | None = None) -> Serving:
    """Load the model (this rank's shard with --tensor-parallel: the process group is joined) and
    build its engine. Blocking: call it from a thread in an event loop."""
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[opts.dtype]
    model_dir = Path(opts.model_dir)
    model_name = opts.model_name or model_dir.resolve().name
    device = opts.device
    if tp_rank is not None:
        from worker_svc.tensor_parallel import rank_device
        device = rank_device(opts.device, tp_rank)
        if opts.weights != "dense":
            raise ValueError("--weights fp8 with --tensor-parallel is not supported yet (the shards split dense weights)")
    if opts.device == "cpu" and opts.threads > 0:
        torch.set_num_threads(opts.threads)
    causal = model_family(model_dir) == CAUSAL
    if causal:   # a Qwen3 / I-DLM model: AR and ISD (decode.isd_stride)
        if opts.random_weights is not None:
            raise ValueError("--random-weights serves Steerling benchmark model directories only")
        from cde.qwen3.chat import load_chat_tokenizer
        from cde.qwen3.loading import load_qwen3
        from worker_svc.causal import CausalFamily
        from worker_svc.engine.isd_engine import IsdEngine

        model = load_qwen3(model_dir, dtype=dtype, device=device)
        _shard_or_convert(model, opts, tp_rank, causal)
        chat_tokenizer = load_chat_tokenizer(model_dir, model.cfg)
        token_limit = chat_tokenizer.vocab_size
        # never sampled: ids past the tokenizer and its holes (the gateway could not decode them)
        engine: EngineRuntime = IsdEngine(model, max_slots=opts.max_slots, n_pages=opts.kv_pages,
                                          max_stride=opts.max_stride, cuda_graphs=opts.cuda_graphs,
                                          compile=opts.compile, tokenizer_vocab_size=token_limit,
                                          never_output_ids=tuple(chat_tokenizer.unassigned_ids()),
                                          prefix_caching=opts.prefix_caching)
        family: ModelFamily = CausalFamily(engine, token_limit, chat_tokenizer.tok)
        scorer = Scorer(model, True, token_limit, model.cfg.max_positions)
    else:
        from cde.steerling.loading import load_model
        from cde.steerling.tokenizer import load_model_tokenizer
        from worker_svc.block_diffusion import BlockDiffusionFamily
        from worker_svc.engine.steerling_engine import SteerlingEngine

        if opts.random_weights is None:
            model = load_model(model_dir, dtype=dtype, device=device)
        else:
            from cde.steerling.random_weights import load_random_model
            log.warning("BENCHMARK MODE: random weights (seed %d), not a trained model", opts.random_weights)
            model = load_random_model(model_dir, opts.random_weights, dtype=dtype, device=device)
        _shard_or_convert(model, opts, tp_rank, causal)
        tokenizer = load_model_tokenizer(model.cfg, model_dir)
        token_limit = tokenizer.vocab_size
        engine = SteerlingEngine(model, tokenizer_vocab_size=token_limit, max_slots=opts.max_slots,
                                 never_output_ids=tuple(tokenizer.unassigned_ids()),
                                 n_pages=opts.kv_pages, compile=opts.compile, cuda_graphs=opts.cuda_graphs,
                                 capture_rows=opts.capture_rows, prefix_caching=opts.prefix_caching)
        family = BlockDiffusionFamily(engine, token_limit, model_name, tokenizer)
        scorer = Scorer(model, False, token_limit, model.cfg.block_size)
    dtype_name = opts.dtype if opts.weights == "dense" else f"{opts.dtype}+{opts.weights}"
    return Serving(engine, family, scorer, model_name, token_limit, dtype_name)


def _shard_or_convert(model, opts: WorkerOptions, tp_rank: int | None, causal: bool) -> None:
    if tp_rank is not None:
        from worker_svc.tensor_parallel import shard
        shard(model, causal)
        log.info("tensor parallel: rank %d holds its shard", tp_rank)
    elif opts.weights == "fp8":   # after load_qwen3 merged the listed adapters; fused by the engine
        _convert_to_fp8(model, opts.dtype)


def warm_up(engine: EngineRuntime, opts: WorkerOptions) -> None:
    """Compile/capture every shape before SERVING; on the CPU (eager) keep it a smoke run. Every
    rank of a tensor-parallel worker runs the same warm-up (the same forwards, in order)."""
    cheap = opts.device == "cpu" and not opts.compile
    engine.warmup(2 if cheap else 4, 8 if cheap else 70)


async def start_worker(opts: WorkerOptions) -> WorkerServer:
    """Load, warm up, serve, then (SERVING) register with the scheduler. Returns when SERVING.
    With --tensor-parallel N: start ranks 1..N-1 first, then serve as rank 0 in lockstep with them."""
    followers = lockstep = None
    tp_rank = None
    if opts.tensor_parallel > 1:
        from cde.redis_util import free_port
        from worker_svc import tensor_parallel as tp
        port = free_port()
        followers = tp.start_followers(list(opts.tp_argv), opts.tensor_parallel, port)
        tp.watch_followers(followers)
        group = await asyncio.to_thread(tp.init_ranks, tp.RankInfo(0, opts.tensor_parallel, port), opts.device)
        tp_rank = 0
    loaded = await asyncio.to_thread(load_serving, opts, tp_rank)
    engine, family, scorer = loaded.engine, loaded.family, loaded.scorer
    model_name, token_limit, dtype_name = loaded.model_name, loaded.token_limit, loaded.dtype_name
    if followers is not None:
        lockstep = tp.LockstepEngine(engine, tp.Commands(group))
        front = AsyncEngine(lockstep)
        lockstep.wake = front.notify
        scorer.lockstep = lockstep
    else:
        front = AsyncEngine(engine)
    servicer = WorkerServicer(front, family, model_name, token_limit, dtype_name, opts.device, scorer)
    servicer.wire_jobs = lockstep is not None
    gate = DrainGate()
    server, health = await make_server([service_name(worker_pb2, "Worker")], interceptors=[gate])
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"{opts.host}:{opts.port}")
    if port == 0:
        raise RuntimeError(f"could not bind {opts.host}:{opts.port}")
    await server.start()   # health answers NOT_SERVING while we warm up
    if opts.warmup:   # with --tensor-parallel the followers run the same warm-up in step
        await asyncio.to_thread(warm_up, engine, opts)
    front.start()
    await health.set_serving(True)
    address = _advertised(opts.host, port, opts.advertise)
    registrar = task = None
    if opts.scheduler:
        registrar = Registrar(opts.scheduler, opts.worker_id or f"{socket.gethostname()}-{port}", address,
                              model_name, front)
        task = asyncio.create_task(registrar.run(), name="worker-registrar")
    log.info("worker %s serving %s (%s, %s%s) on %s, %d KV pages", opts.worker_id, model_name, opts.device,
             opts.dtype, f", tensor parallel over {opts.tensor_parallel} ranks" if followers else "", address,
             engine.kv.pool.usable)
    return WorkerServer(server, health, front, servicer, port, address, registrar, task, gate, lockstep)


def run_follower(opts: WorkerOptions, rank: int, port: int) -> None:
    """Rank `rank` of a tensor-parallel worker: its shard and engine, warmed up as rank 0 does,
    then rank 0's commands until it says stop (worker_svc/tensor_parallel.py)."""
    from worker_svc import tensor_parallel as tp
    tp.die_with_parent()
    group = tp.init_ranks(tp.RankInfo(rank, opts.tensor_parallel, port), opts.device)
    loaded = load_serving(opts, rank)
    if opts.warmup:
        warm_up(loaded.engine, opts)
    tp.follow(loaded.engine, loaded.family.parse, loaded.scorer.compute, tp.Commands(group))
    log.info("tensor-parallel rank %d: stopped by rank 0", rank)


def options_from_args(args: argparse.Namespace) -> WorkerOptions:
    return WorkerOptions(model_dir=args.model_dir, host=args.host, port=args.port, scheduler=args.scheduler or None,
                         worker_id=args.worker_id, advertise=args.advertise or None, model_name=args.model_name or None,
                         device=args.device, dtype=args.dtype, compile=args.compile, cuda_graphs=args.cuda_graphs,
                         kv_pages=args.kv_pages, max_slots=args.max_slots,
                         capture_rows=getattr(args, "capture_rows", 48),
                         max_stride=getattr(args, "max_stride", 8), threads=getattr(args, "threads", 0),
                         random_weights=getattr(args, "random_weights", None),
                         prefix_caching=getattr(args, "prefix_caching", True),
                         weights=getattr(args, "weights", "dense"),
                         tensor_parallel=getattr(args, "tensor_parallel", 1),
                         tp_argv=tuple(getattr(args, "argv", ())))


async def serve(args: argparse.Namespace) -> None:
    """Run until SIGTERM/SIGINT, let running requests finish (up to `args.drain_timeout` s), then
    stop, giving calls still open `args.grace` seconds."""
    worker = await start_worker(options_from_args(args))
    try:
        await wait_for_shutdown_signal()
        await worker.drain(getattr(args, "drain_timeout", 0.0))
    finally:
        log.info("shutting down")
        await worker.stop(args.grace)
