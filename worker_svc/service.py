"""The worker's gRPC face: cde.v1.Worker over the engine, plus registration with the scheduler.

One `Worker.Submit` stream per request. The step loop runs inside the engine thread; this
module only translates: proto options -> engine types (validated here, so a bad request is
INVALID_ARGUMENT before it costs a step), engine events -> WorkerEvents. The stream ends
with Finished; closing it early (scheduler gone, client cancel, deadline) closes the engine
stream, which cancels the request and frees its KV pages at the next step boundary.

BlockCommitted carries `next_step`, the request's step counter after the block: with the
committed blocks' tokens it is all another worker needs to continue a seeded request with
the very same randomness (randomness is a function of (seed, position, step) only).

`start_worker()` returns a running `WorkerServer` (gRPC server, engine front, registrar), so
tests and launchers can run several in one process; `serve()` is the CLI's blocking loop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from cde import limits as L
from cde.model_family import CAUSAL, model_family
from cde.rpc import bytes_to_floats, make_server, service_name
from cde.rpc.leader_channel import scheduler_channel
from cde.rpc.serving import serve_until_signal
from cde.rpc.v1 import (
    common_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from cde.steerling.attribution import RawRecords
from cde.steerling.config import PRESETS, SteerlingConfig
from cde.steerling.loading import load_model
from cde.steerling.reference_decoder import DecodeOptions, clean_output, terminal_ids
from cde.steerling.sampling import SamplingParams
from cde.steerling.steering import PreparedSteering
from cde.steerling.tokenizer import load_model_tokenizer
from worker_svc.causal import causal_status, causal_submit
from worker_svc.engine.async_engine import AsyncEngine
from worker_svc.engine.engine import (
    K_BUCKETS,
    BlockEvent,
    Engine,
    FinishEvent,
    StepEvent,
)
from worker_svc.validation import (
    BadRequest,
    check_cutoff,
    check_inject_layer,
    check_sampling,
    check_stop_ids,
    checked_prompt,
    signed_seed,
)

log = logging.getLogger("worker_svc")

DEFAULT_PORT = 50081
_FINISH = {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH,
           "cancelled": common_pb2.FINISH_REASON_CANCELLED, "error": common_pb2.FINISH_REASON_ERROR}
_SCHEDULES = {common_pb2.STEERING_SCHEDULE_FIXED: "fixed", common_pb2.STEERING_SCHEDULE_HARD_CUTOFF: "hard_cutoff"}



@dataclass(frozen=True)
class Job:
    """A validated WorkerSubmit in engine types."""
    request_id: str
    prompt: list[int]
    options: DecodeOptions
    steering: PreparedSteering | None
    committed: list[int]
    next_step: int
    stream_steps: bool


# ---- proto -> engine ------------------------------------------------------------------------

def preset_name(cfg: SteerlingConfig) -> str:
    for name, p in PRESETS.items():
        if p.replace(tokenizer=cfg.tokenizer) == cfg:
            return name
    return "custom"


def _sampling(sp: common_pb2.SamplingOptions) -> SamplingParams:
    d = SamplingParams()
    params = SamplingParams(
        use_entropy_sampling=sp.use_entropy_sampling if sp.HasField("use_entropy_sampling") else d.use_entropy_sampling,
        temperature=sp.temperature if sp.HasField("temperature") else d.temperature,
        top_p=sp.top_p if sp.HasField("top_p") else d.top_p,
        repetition_penalty=sp.repetition_penalty if sp.HasField("repetition_penalty") else d.repetition_penalty)
    check_sampling(params.temperature, params.top_p, params.repetition_penalty)
    return params


def decode_options(d: common_pb2.DecodeOptions, sp: common_pb2.SamplingOptions, cfg: SteerlingConfig,
                   token_limit: int) -> DecodeOptions:
    if d.max_new_tokens < 1:
        raise BadRequest("decode.max_new_tokens must be >= 1 (the gateway resolves the default)")
    if d.isd_stride:
        raise BadRequest("decode.isd_stride is not supported by a block-diffusion model (use 0)")
    k = d.tokens_per_step or L.DEFAULT_TOKENS_PER_STEP
    lo, hi = L.tokens_per_step_bounds(cfg.diff_block_size)
    hi = min(hi, K_BUCKETS[-1])   # the engine's largest bucket (64, the 8B block size)
    if not lo <= k <= hi:
        raise BadRequest(f"decode.tokens_per_step must be in [{lo}, {hi}]")
    threshold = d.confidence_threshold if d.HasField("confidence_threshold") else None
    if threshold is not None and not L.THRESHOLD_MIN_EXCLUSIVE < threshold <= L.THRESHOLD_MAX:
        raise BadRequest(f"decode.confidence_threshold must be in ({L.THRESHOLD_MIN_EXCLUSIVE:g}, {L.THRESHOLD_MAX:g}]")
    check_stop_ids(list(d.stop_ids), token_limit)
    seed = d.seed if d.HasField("seed") else int.from_bytes(os.urandom(8), "little") >> 1
    return DecodeOptions(d.max_new_tokens, _sampling(sp), k, threshold, signed_seed(seed), tuple(d.stop_ids))


def prepared_steering(st: common_pb2.PreparedSteering, cfg: SteerlingConfig, model_name: str) -> PreparedSteering:
    if st.model and st.model != model_name:
        raise BadRequest(f"steering was prepared for model {st.model!r}; this worker serves {model_name!r}",
                         grpc.StatusCode.FAILED_PRECONDITION)
    try:
        direction = bytes_to_floats(st.direction_f32, cfg.n_embd)
        relu = bytes_to_floats(st.relu_mask_f32, cfg.vocab_size) if st.relu_mask_f32 else None
    except ValueError as e:
        raise BadRequest(f"steering: {e} (direction: n_embd = {cfg.n_embd}; relu mask: empty or "
                         f"vocab_size = {cfg.vocab_size})") from None
    if not direction.size or not bool(torch.isfinite(torch.from_numpy(direction)).all()):
        raise BadRequest("steering.direction_f32 must be finite")
    if relu is not None and not bool(torch.isfinite(torch.from_numpy(relu)).all()):
        raise BadRequest("steering.relu_mask_f32 must be finite")
    if not math.isfinite(st.base_alpha):
        raise BadRequest("steering.base_alpha must be finite")
    check_inject_layer(st.inject_layer, cfg.n_layers)
    if st.schedule not in _SCHEDULES:
        raise BadRequest("steering.schedule must be FIXED or HARD_CUTOFF (steering_svc resolves DEFAULT)")
    if st.schedule == common_pb2.STEERING_SCHEDULE_HARD_CUTOFF:   # a fixed schedule ignores the cutoff
        check_cutoff(st.cutoff_tokens)
    return PreparedSteering(torch.from_numpy(direction), float(st.base_alpha), int(st.inject_layer),
                            _SCHEDULES[st.schedule], int(st.cutoff_tokens),  # type: ignore[arg-type]
                            None if relu is None else torch.from_numpy(relu))


def parse_submit(req: worker_pb2.WorkerSubmit, cfg: SteerlingConfig, token_limit: int, model_name: str,
                 pages_usable: int) -> Job:
    """Validate a WorkerSubmit; raises BadRequest with the status code to answer."""
    prompt = checked_prompt(req, token_limit, cfg.mask_id)
    options = decode_options(req.decode, req.sampling, cfg, token_limit)
    if len(prompt) + options.max_new_tokens > cfg.block_size:
        raise BadRequest(f"prompt ({len(prompt)}) + max_new_tokens ({options.max_new_tokens}) exceeds the "
                         f"context of {cfg.block_size}")
    committed = list(req.committed_tokens)
    if any(t >= cfg.vocab_size for t in committed):
        raise BadRequest("committed_tokens has ids outside the model's vocabulary")
    if committed and (len(committed) > options.max_new_tokens
                      or ((len(prompt) + len(committed)) % cfg.diff_block_size
                          and len(committed) != options.max_new_tokens)):
        raise BadRequest("committed_tokens must be whole blocks from the first generated position")
    steering = prepared_steering(req.steering, cfg, model_name) if req.HasField("steering") else None
    pages = -(-(len(prompt) + options.max_new_tokens) // cfg.diff_block_size)
    if pages > pages_usable:
        raise BadRequest(f"the request needs {pages} KV pages; this worker has {pages_usable}",
                         grpc.StatusCode.RESOURCE_EXHAUSTED)
    return Job(req.request_id, prompt, options, steering, committed, req.next_step, req.stream_steps)


# ---- engine -> proto ------------------------------------------------------------------------

def raw_records(rec: RawRecords | None, k_known: int, k_disc: int) -> common_pb2.RawConceptRecords:
    """Row-major flattening: row i of an index matrix is [i*k, (i+1)*k)."""
    if rec is None or len(rec) == 0:
        return common_pb2.RawConceptRecords(k_known=k_known, k_disc=k_disc)
    return common_pb2.RawConceptRecords(
        positions=rec.positions.reshape(-1).tolist(), tokens=rec.tokens.reshape(-1).tolist(),
        target_logits=rec.target_logits.float().reshape(-1).tolist(),
        k_known=int(rec.known_idx.shape[1]), known_idx=rec.known_idx.reshape(-1).tolist(),
        known_logits=rec.known_logits.float().reshape(-1).tolist(),
        k_disc=int(rec.disc_idx.shape[1]), disc_idx=rec.disc_idx.reshape(-1).tolist(),
        disc_logits=rec.disc_logits.float().reshape(-1).tolist())


def usage(prompt_tokens: int, completion_tokens: int, steps: int) -> common_pb2.Usage:
    # One engine forward per decode step of the request (commit rows ride along in the batch).
    return common_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, steps=steps,
                            forwards=steps, tokens_per_forward=completion_tokens / steps if steps else 0.0)


def already_finished(job: Job, cfg: SteerlingConfig) -> common_pb2.Finished | None:
    """A resumed request whose committed blocks already end it (its worker died between the
    last block and Finished): answer Finished without touching the engine."""
    if not job.committed:
        return None
    stops = terminal_ids(cfg, job.options)
    out = clean_output(job.committed, cfg, stops)
    if any(t in stops for t in job.committed):
        reason = common_pb2.FINISH_REASON_STOP
    elif len(job.committed) >= job.options.max_new_tokens:
        reason = common_pb2.FINISH_REASON_LENGTH
    else:
        return None
    return common_pb2.Finished(reason=reason, usage=usage(len(job.prompt), len(out), job.next_step))


# ---- the servicer -----------------------------------------------------------------------------

class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, front: AsyncEngine, model_name: str, token_limit: int, dtype: str, device: str):
        self.front = front
        self.engine: Engine = front.engine
        self.cfg = self.engine.cfg
        self.model_name = model_name
        self.token_limit = token_limit
        self.dtype = dtype
        self.device = device

    async def Submit(self, request, context):
        try:
            job = parse_submit(request, self.cfg, self.token_limit, self.model_name, self.engine.kv.pool.usable)
        except BadRequest as e:
            await context.abort(e.code, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline already passed")
        done = already_finished(job, self.cfg)
        if done is not None:
            yield worker_pb2.WorkerEvent(finished=done)
            return
        if job.request_id in self.engine.requests:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {job.request_id!r} is running here")
        if self.front.error is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine failed: {self.front.error!r}")
        next_step = job.next_step
        stream = self.front.generate(job.request_id, job.prompt, job.options, job.steering, job.committed,
                                     job.next_step)
        # aclosing: leaving early for any reason (cancel, deadline, error) cancels the request.
        async with contextlib.aclosing(stream):
            try:
                async for ev in stream:
                    if isinstance(ev, StepEvent):
                        next_step = ev.step + 1
                        if job.stream_steps:
                            yield worker_pb2.WorkerEvent(step=common_pb2.StepEvent(
                                step=ev.step, block_index=ev.positions[0] // self.cfg.diff_block_size,
                                positions=ev.positions, tokens=ev.tokens))
                    elif isinstance(ev, BlockEvent):
                        yield worker_pb2.WorkerEvent(block=common_pb2.BlockCommitted(
                            block_index=ev.block, start=ev.start, tokens=ev.tokens, next_step=next_step, last=ev.last,
                            records=raw_records(ev.records, self.engine.k_known, self.engine.k_disc)))
                    elif isinstance(ev, FinishEvent):
                        yield worker_pb2.WorkerEvent(finished=common_pb2.Finished(
                            reason=_FINISH.get(ev.reason, common_pb2.FINISH_REASON_ERROR),
                            usage=usage(ev.prompt_tokens, ev.completion_tokens, ev.steps), message=ev.error))
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

    async def Info(self, request, context):
        s = self.front.stats()
        cfg = self.cfg
        return worker_pb2.WorkerStatus(
            model=self.model_name, preset=preset_name(cfg), dtype=self.dtype, device=self.device,
            kv_pages_total=s.pages_total, kv_pages_free=s.pages_free, running=s.running, waiting=s.waiting,
            steps=s.steps, compiles=s.compiles, diffusion_block_size=cfg.diff_block_size,
            vocab_size=self.token_limit, n_known=cfg.n_known, n_discovered=cfg.n_discovered,
            max_context=cfg.block_size)


class CausalWorkerServicer(WorkerServicer):
    """The same service over the ISD engine (worker_svc/causal.py translates)."""

    async def Submit(self, request, context):
        async for ev in causal_submit(self, request, context):
            yield ev

    async def Info(self, request, context):
        return causal_status(self)


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

    def info(self) -> scheduler_pb2.WorkerInfo:
        s = self.front.stats()
        return scheduler_pb2.WorkerInfo(worker_id=self.worker_id, address=self.address, model=self.model,
                                        kv_pages_total=s.pages_total, kv_pages_free=s.pages_free,
                                        running=s.running, waiting=s.waiting)

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
    max_stride: int = L.MAX_STRIDE      # causal models: the largest decode.isd_stride served
    threads: int = 0                    # CPU: torch intra-op threads (0 = torch's default)
    warmup: bool = True


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

    async def stop(self, grace: float | None = 5.0) -> None:
        """Stop registering, stop serving (grace=0: abruptly, like a crash), stop the engine."""
        if self.registrar_task is not None:
            self.registrar_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.registrar_task
        await self.health.set_serving(False)
        await self.server.stop(grace)
        await asyncio.to_thread(self.front.stop)


def _advertised(host: str, port: int, advertise: str | None) -> str:
    if advertise:
        return advertise
    if host in ("0.0.0.0", "::", "[::]", ""):
        host = socket.gethostname()
    return f"{host}:{port}"


async def start_worker(opts: WorkerOptions) -> WorkerServer:
    """Load, warm up, serve, then (SERVING) register with the scheduler. Returns when SERVING."""
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[opts.dtype]
    model_dir = Path(opts.model_dir)
    model_name = opts.model_name or model_dir.resolve().name
    if opts.device == "cpu" and opts.threads > 0:
        torch.set_num_threads(opts.threads)
    if model_family(model_dir) == CAUSAL:   # a Qwen3 / I-DLM model: AR and ISD (decode.isd_stride)
        from cde.qwen3.chat import load_chat_tokenizer
        from cde.qwen3.loading import load_qwen3
        from worker_svc.engine.isd_engine import IsdEngine

        model = await asyncio.to_thread(load_qwen3, model_dir, dtype=dtype, device=opts.device)
        token_limit = load_chat_tokenizer(model_dir, model.cfg).vocab_size
        engine = IsdEngine(model, max_slots=opts.max_slots, n_pages=opts.kv_pages, max_stride=opts.max_stride,
                           cuda_graphs=opts.cuda_graphs, compile=opts.compile, tokenizer_vocab_size=token_limit)
        front = AsyncEngine(engine)
        servicer: WorkerServicer = CausalWorkerServicer(front, model_name, token_limit, opts.dtype, opts.device)
    else:
        model = await asyncio.to_thread(load_model, model_dir, dtype=dtype, device=opts.device)
        token_limit = load_model_tokenizer(model.cfg, model_dir).vocab_size
        engine = Engine(model, tokenizer_vocab_size=token_limit, max_slots=opts.max_slots, n_pages=opts.kv_pages,
                        compile=opts.compile, cuda_graphs=opts.cuda_graphs)
        front = AsyncEngine(engine)
        servicer = WorkerServicer(front, model_name, token_limit, opts.dtype, opts.device)
    server, health = await make_server([service_name(worker_pb2, "Worker")])
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"{opts.host}:{opts.port}")
    if port == 0:
        raise RuntimeError(f"could not bind {opts.host}:{opts.port}")
    await server.start()   # health answers NOT_SERVING while we warm up
    if opts.warmup:
        # Compile/capture every shape before SERVING; on the CPU (eager) keep it a smoke run.
        cheap = opts.device == "cpu" and not opts.compile
        await asyncio.to_thread(engine.warmup, 2 if cheap else 4, 8 if cheap else 70)
    front.start()
    await health.set_serving(True)
    address = _advertised(opts.host, port, opts.advertise)
    registrar = task = None
    if opts.scheduler:
        registrar = Registrar(opts.scheduler, opts.worker_id or f"{socket.gethostname()}-{port}", address,
                              model_name, front)
        task = asyncio.create_task(registrar.run(), name="worker-registrar")
    log.info("worker %s serving %s (%s, %s) on %s, %d KV pages", opts.worker_id, model_name, opts.device,
             opts.dtype, address, engine.kv.pool.usable)
    return WorkerServer(server, health, front, servicer, port, address, registrar, task)


def options_from_args(args: argparse.Namespace) -> WorkerOptions:
    return WorkerOptions(model_dir=args.model_dir, host=args.host, port=args.port, scheduler=args.scheduler or None,
                         worker_id=args.worker_id, advertise=args.advertise or None, model_name=args.model_name or None,
                         device=args.device, dtype=args.dtype, compile=args.compile, cuda_graphs=args.cuda_graphs,
                         kv_pages=args.kv_pages, max_slots=args.max_slots,
                         max_stride=getattr(args, "max_stride", 8), threads=getattr(args, "threads", 0))


async def serve(args: argparse.Namespace) -> None:
    """Run until SIGTERM/SIGINT, then drain for `args.grace` seconds."""
    worker = await start_worker(options_from_args(args))
    await serve_until_signal(worker, "worker", args.grace)
