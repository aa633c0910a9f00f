"""The worker's causal-model path: cde.v1.Worker over the ISD engine (I-DLM / Qwen3 layout).

Same service, same stream shape as the Steerling path (worker_svc/service.py), different
translation:

* options: the resolved `options.isd` (stride N: 1 = plain AR, >= 2 = introspective strided
  decoding; the LoRA adapter gated (R-ISD) or not), temperature, top_p and top_k (T = 0:
  greedy); block diffusion, entropy sampling, a repetition penalty and steering are refused
  with INVALID_ARGUMENT: a causal model has no concepts, and a penalty would break ISD's
  lossless acceptance rule;
* events: the engine accepts a few tokens per step (it stops at the model's EOS and the
  request's stop ids, keeping the stop token); they are streamed as `BlockCommitted`
  chunks with consecutive `block_index` (the first = prompt length // 64, as for Steerling,
  so the scheduler's exactly-once storage and resume work unchanged) once `CHUNK_TOKENS`
  have gathered, and at the end. `next_step` is the request's logical forward count, which
  the engine needs to continue a resumed request (greedy: token-identical; sampled: the same
  distribution, draw-identical when the chunk ended at a cold step);
* usage: forwards, tokens per forward and the ISD acceptance (accepted / proposed drafts).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import grpc

from cde.qwen3.config import IDLM_8B, TINY, Qwen3Config
from cde.rpc.v1 import common_pb2, resolved_pb2, worker_pb2
from worker_svc.engine.isd_engine import (
    IsdCommitEvent,
    IsdEngine,
    IsdFinishEvent,
    IsdOptions,
)
from worker_svc.validation import (
    BadRequest,
    check_sampling,
    check_stop_ids,
    checked_options,
    checked_prompt,
    signed_seed,
)

BLOCK = 64
CHUNK_TOKENS = 16   # tokens per streamed chunk: latency vs one Redis write per chunk
_FINISH = {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH,
           "cancelled": common_pb2.FINISH_REASON_CANCELLED, "error": common_pb2.FINISH_REASON_ERROR}


@dataclass
class CausalJob:
    request_id: str
    prompt: list[int]
    options: IsdOptions
    committed: list[int]
    next_step: int
    stop_ids: frozenset[int]
    stream_steps: bool = False   # one StepEvent per forward (accepted drafts, bonus / correction)


def causal_preset_name(cfg: Qwen3Config) -> str:
    for name, p in (("idlm-8b", IDLM_8B), ("tiny", TINY)):
        if p == cfg:
            return name
    return "custom"


_ADAPTER_GATED = {resolved_pb2.ISD_ADAPTER_GATED: True, resolved_pb2.ISD_ADAPTER_UNGATED: False}


def isd_options(req: worker_pb2.WorkerSubmit, max_stride: int, token_limit: int) -> IsdOptions:
    """The request's resolved options as engine options, checked (nothing defaulted here)."""
    o = checked_options(req, "isd")
    stride = o.isd.stride
    if not 1 <= stride <= max_stride:
        raise BadRequest(f"options.isd.stride must be in [1, {max_stride}] on this worker, got {stride}")
    if o.isd.adapter not in _ADAPTER_GATED:
        raise BadRequest("options.isd.adapter must be ISD_ADAPTER_GATED or ISD_ADAPTER_UNGATED")
    sp = o.sampling
    if sp.use_entropy_sampling:
        raise BadRequest("options.sampling.use_entropy_sampling applies to block-diffusion models only")
    if sp.repetition_penalty != 1.0:
        raise BadRequest("options.sampling.repetition_penalty must be 1 for causal (ISD) decoding")
    if sp.top_k > token_limit:
        raise BadRequest(f"options.sampling.top_k must be in [0, {token_limit}] (0 = off)")
    check_sampling(sp.temperature, sp.top_p, sp.repetition_penalty)
    temperature, top_p = sp.temperature, sp.top_p
    if top_p == 0.0:   # the nucleus of mass 0 is the most likely token alone: greedy (as Steerling reads it)
        temperature, top_p = 0.0, 1.0
    return IsdOptions(max_new_tokens=o.max_new_tokens, stride=stride, temperature=float(temperature),
                      top_k=sp.top_k, top_p=float(top_p), seed=signed_seed(o.seed),
                      lora_gated=_ADAPTER_GATED[o.isd.adapter], stop_ids=tuple(o.stop_ids))


def parse_causal_submit(req: worker_pb2.WorkerSubmit, cfg: Qwen3Config, token_limit: int, max_stride: int,
                        pages_usable: int) -> CausalJob:
    prompt = checked_prompt(req, token_limit, cfg.mask_token_id)
    if req.HasField("steering"):
        raise BadRequest("steering is not available for a causal model (it has no concepts)")
    options = isd_options(req, max_stride, token_limit)
    if len(prompt) + options.max_new_tokens > cfg.max_positions:
        raise BadRequest(f"prompt ({len(prompt)}) + max_new_tokens ({options.max_new_tokens}) exceeds the "
                               f"context of {cfg.max_positions}")
    check_stop_ids(list(req.options.stop_ids), token_limit)
    committed = list(req.committed_tokens)
    if any(t >= cfg.vocab_size for t in committed) or len(committed) >= options.max_new_tokens:
        raise BadRequest("committed_tokens must be vocabulary ids, fewer than max_new_tokens")
    pages = -(-(len(prompt) + options.max_new_tokens + 2 * options.stride) // BLOCK)
    if pages > pages_usable:
        raise BadRequest(f"the request needs {pages} KV pages; this worker has {pages_usable}",
                               grpc.StatusCode.RESOURCE_EXHAUSTED)
    return CausalJob(req.request_id, prompt, options, committed, req.next_step,
                     frozenset(cfg.eos_token_ids) | frozenset(req.options.stop_ids), req.stream_steps)


def completion_length(tokens: list[int], stops: frozenset[int]) -> int:
    """Tokens before the first stop id (the stop itself is not part of the completion)."""
    return next((i for i, t in enumerate(tokens) if t in stops), len(tokens))


class ChunkWriter:
    """Accepted tokens -> `BlockCommitted` chunks of exactly `chunk_tokens` tokens (the last may
    be shorter), so chunk i of a request always holds the same tokens and a resumed request
    (committed = the stored chunks) knows its next index: prompt // 64 + committed // chunk."""

    def __init__(self, job: CausalJob, chunk_tokens: int = CHUNK_TOKENS):
        self.job = job
        self.chunk_tokens = chunk_tokens
        self.tokens = list(job.committed)          # the completion so far (committed included)
        self.sent = len(job.committed)             # tokens already in chunks
        self.index = len(job.prompt) // BLOCK + len(job.committed) // chunk_tokens
        self.stopped = completion_length(self.tokens, job.stop_ids) < len(self.tokens)

    def add(self, tokens: list[int]) -> None:
        """Keep tokens up to and including the first stop id (request or model stop)."""
        for t in tokens:
            if self.stopped:
                return
            self.tokens.append(t)
            self.stopped = t in self.job.stop_ids

    def chunks(self, next_step: int, final: bool) -> list[common_pb2.BlockCommitted]:
        out = []
        while len(self.tokens) - self.sent >= self.chunk_tokens or (final and len(self.tokens) > self.sent):
            n = min(self.chunk_tokens, len(self.tokens) - self.sent)
            start = len(self.job.prompt) + self.sent
            piece = self.tokens[self.sent:self.sent + n]
            self.sent += n
            out.append(common_pb2.BlockCommitted(block_index=self.index, start=start, tokens=piece,
                                                 next_step=next_step, last=final and self.sent == len(self.tokens)))
            self.index += 1
        return out

    def completion_tokens(self) -> int:
        return completion_length(self.tokens, self.job.stop_ids)


def forward_step(job: CausalJob, ev: IsdCommitEvent, chunk_tokens: int = CHUNK_TOKENS) -> common_pb2.StepEvent:
    """One forward's tokens at their absolute positions, with what it verified: the first
    `drafts_accepted` are accepted drafts, the next the bonus or the correction of `rejected_token`.
    block_index is the chunk the forward's first token lands in (ChunkWriter's numbering)."""
    first = len(job.prompt) + ev.start
    out = common_pb2.StepEvent(step=ev.step, block_index=len(job.prompt) // BLOCK + ev.start // chunk_tokens,
                               positions=range(first, first + len(ev.tokens)), tokens=ev.tokens,
                               drafts_proposed=ev.proposed, drafts_accepted=ev.accepted)
    if ev.rejected is not None:
        out.rejected_token = ev.rejected
    return out


def isd_usage(prompt_tokens: int, completion_tokens: int, forwards: int, acceptance: float) -> common_pb2.Usage:
    return common_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, steps=forwards,
                            forwards=forwards, tokens_per_forward=completion_tokens / forwards if forwards else 0.0,
                            isd_acceptance=acceptance)


async def causal_submit(servicer, request, context):
    """`Worker.Submit` for a causal model: the events of one request, ending with Finished."""
    engine: IsdEngine = servicer.engine
    try:
        job = parse_causal_submit(request, engine.cfg, servicer.token_limit, engine.max_stride,
                                  engine.kv.pool.usable)
    except BadRequest as e:
        await context.abort(e.code, str(e))
    if job.request_id in engine.requests:
        await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {job.request_id!r} is running here")
    if servicer.front.error is not None:
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine failed: {servicer.front.error!r}")
    writer = ChunkWriter(job)
    if writer.stopped:   # resumed after the stop was stored: nothing left to generate
        yield worker_pb2.WorkerEvent(finished=common_pb2.Finished(
            reason=common_pb2.FINISH_REASON_STOP,
            usage=isd_usage(len(job.prompt), writer.completion_tokens(), job.next_step, 0.0)))
        return
    stream = servicer.front.generate(job.request_id, job.prompt, job.options, None, job.committed, job.next_step)
    async with contextlib.aclosing(stream):   # leaving early cancels the request in the engine
        try:
            async for ev in stream:
                if isinstance(ev, IsdCommitEvent):
                    if job.stream_steps:
                        yield worker_pb2.WorkerEvent(step=forward_step(job, ev))
                    writer.add(ev.tokens)
                    for block in writer.chunks(ev.step, final=False):
                        yield worker_pb2.WorkerEvent(block=block)
                elif isinstance(ev, IsdFinishEvent):
                    for block in writer.chunks(ev.stats.forwards, final=True):
                        yield worker_pb2.WorkerEvent(block=block)
                    yield worker_pb2.WorkerEvent(finished=common_pb2.Finished(
                        reason=_FINISH.get(ev.reason, common_pb2.FINISH_REASON_ERROR),
                        usage=isd_usage(len(job.prompt), writer.completion_tokens(), ev.stats.forwards,
                                        ev.stats.acceptance), message=ev.error))
                    return
                left = context.time_remaining()
                if left is not None and left <= 0:
                    break
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RuntimeError as e:
            await context.abort(grpc.StatusCode.INTERNAL, str(e))
    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")


def causal_status(servicer) -> worker_pb2.WorkerStatus:
    s = servicer.front.stats()
    cfg: Qwen3Config = servicer.engine.cfg
    return worker_pb2.WorkerStatus(
        model=servicer.model_name, preset=causal_preset_name(cfg), dtype=servicer.dtype, device=servicer.device,
        kv_pages_total=s.pages_total, kv_pages_free=s.pages_free, running=s.running, waiting=s.waiting,
        steps=s.steps, compiles=s.compiles, vocab_size=servicer.token_limit, max_context=cfg.max_positions)
