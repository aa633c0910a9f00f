"""The worker's causal-model family: cde.v1.Worker over the ISD engine (I-DLM / Qwen3 layout).

Same service and `Submit` (service.py), same stream shape as the Steerling family
(block_diffusion.py), different translation:

* options (request_options.isd_options): the resolved `options.isd` (stride N: 1 = plain AR,
  >= 2 = introspective strided decoding; the LoRA adapter gated (R-ISD) or not), temperature,
  top_p and top_k (T = 0: greedy); block diffusion, entropy sampling, a repetition penalty and
  steering are refused with INVALID_ARGUMENT: a causal model has no concepts, and a penalty
  would break ISD's lossless acceptance rule;
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


import grpc

from cde.blocks import BLOCK, pages_for
from cde.grammar import GrammarVocabulary
from cde.qwen3.config import IDLM_8B, TINY, Qwen3Config
from cde.rpc.finish import finish_reason_value
from cde.rpc.v1 import common_pb2, worker_pb2
from worker_svc.engine.events import IsdCommitEvent, IsdFinishEvent
from worker_svc.engine.isd_engine import IsdEngine
from worker_svc.engine.runtime import EngineStats
from worker_svc.engine.job import Job
from worker_svc.family import EventTranslator
from worker_svc.request_options import isd_options
from worker_svc.structured import Grammars
from worker_svc.validation import BadRequest, checked_prompt

CHUNK_TOKENS = 16   # tokens per streamed chunk: latency vs one Redis write per chunk


def causal_preset_name(cfg: Qwen3Config) -> str:
    for name, p in (("idlm-8b", IDLM_8B), ("tiny", TINY)):
        if p == cfg:
            return name
    return "custom"


def parse_causal_submit(req: worker_pb2.WorkerSubmit, cfg: Qwen3Config, token_limit: int, max_stride: int,
                        pages_usable: int) -> Job:
    prompt = checked_prompt(req, token_limit, cfg.mask_token_id)
    if req.HasField("steering"):
        raise BadRequest("steering is not available for a causal model (it has no concepts)")
    options = isd_options(req, max_stride, token_limit)
    if len(prompt) + options.max_new_tokens > cfg.max_positions:
        raise BadRequest(f"prompt ({len(prompt)}) + max_new_tokens ({options.max_new_tokens}) exceeds the "
                               f"context of {cfg.max_positions}")
    committed = list(req.committed_tokens)
    if any(t >= cfg.vocab_size for t in committed) or len(committed) >= options.max_new_tokens:
        raise BadRequest("committed_tokens must be vocabulary ids, fewer than max_new_tokens")
    pages = pages_for(len(prompt) + options.max_new_tokens + 2 * options.stride)
    if pages > pages_usable:
        raise BadRequest(f"the request needs {pages} KV pages; this worker has {pages_usable}",
                               grpc.StatusCode.RESOURCE_EXHAUSTED)
    return Job(request_id=req.request_id, prompt=prompt, options=options, committed=committed,
               next_step=req.next_step, stream_steps=req.stream_steps,
               stop_ids=frozenset(cfg.eos_token_ids) | frozenset(req.options.stop_ids))


def completion_length(tokens: list[int], stops: frozenset[int]) -> int:
    """Tokens before the first stop id (the stop itself is not part of the completion)."""
    return next((i for i, t in enumerate(tokens) if t in stops), len(tokens))


class ChunkWriter:
    """Accepted tokens -> `BlockCommitted` chunks of exactly `chunk_tokens` tokens (the last may
    be shorter), so chunk i of a request always holds the same tokens and a resumed request
    (committed = the stored chunks) knows its next index: prompt // 64 + committed // chunk."""

    def __init__(self, job: Job, chunk_tokens: int = CHUNK_TOKENS):
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


def forward_step(job: Job, ev: IsdCommitEvent, chunk_tokens: int = CHUNK_TOKENS) -> common_pb2.StepEvent:
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


class CausalFamily:
    """family.ModelFamily for a causal (Qwen3 / I-DLM) worker."""

    def __init__(self, engine: IsdEngine, token_limit: int, tokenizer=None):
        self.engine = engine
        self.token_limit = token_limit
        cfg = engine.strategy.cfg
        # structured output over the model's byte-level tokenizer (cde.qwen3.tokenizer), ending on its EOS ids
        self.grammars = Grammars(None if tokenizer is None or not cfg.eos_token_ids else (
            lambda: GrammarVocabulary.of_byte_level(tokenizer, cfg.vocab_size, cfg.eos_token_ids)))

    def parse(self, request: worker_pb2.WorkerSubmit) -> Job:
        e = self.engine
        job = parse_causal_submit(request, e.strategy.cfg, self.token_limit, e.strategy.max_stride, e.kv.pool.usable)
        return self.grammars.attach(job, request.grammar)

    def already_finished(self, job: Job) -> common_pb2.Finished | None:
        writer = ChunkWriter(job)
        if not writer.stopped:
            return None
        # resumed after the stop was stored: nothing left to generate
        return common_pb2.Finished(reason=finish_reason_value("stop"),
                                   usage=isd_usage(len(job.prompt), writer.completion_tokens(), job.next_step, 0.0))

    def translator(self, job: Job) -> EventTranslator:
        writer = ChunkWriter(job)

        def translate(ev) -> list[worker_pb2.WorkerEvent]:
            out = []
            if isinstance(ev, IsdCommitEvent):
                if job.stream_steps:
                    out.append(worker_pb2.WorkerEvent(step=forward_step(job, ev)))
                writer.add(ev.tokens)
                out += [worker_pb2.WorkerEvent(block=block) for block in writer.chunks(ev.step, final=False)]
            elif isinstance(ev, IsdFinishEvent):
                out += [worker_pb2.WorkerEvent(block=block) for block in writer.chunks(ev.stats.forwards, final=True)]
                out.append(worker_pb2.WorkerEvent(finished=common_pb2.Finished(
                    reason=finish_reason_value(ev.reason),
                    usage=isd_usage(len(job.prompt), writer.completion_tokens(), ev.stats.forwards,
                                    ev.stats.acceptance), message=ev.error)))
            return out

        return translate

    def status(self, stats: EngineStats, model_name: str, dtype: str, device: str) -> worker_pb2.WorkerStatus:
        cfg: Qwen3Config = self.engine.strategy.cfg
        return worker_pb2.WorkerStatus(
            model=model_name, preset=causal_preset_name(cfg), dtype=dtype, device=device,
            kv_pages_total=stats.pages_total, kv_pages_free=stats.pages_free, running=stats.running,
            waiting=stats.waiting, steps=stats.steps, compiles=stats.compiles, graphs=stats.graphs,
            overlapped_steps=stats.overlapped_steps, vocab_size=self.token_limit,
            max_context=cfg.max_positions)
