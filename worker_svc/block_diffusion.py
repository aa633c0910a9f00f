"""The Steerling (block diffusion) family of the worker: WorkerSubmit -> engine job (prepared
steering checked against this model, so a bad request is INVALID_ARGUMENT before it costs a
step), engine events -> WorkerEvents.

BlockCommitted carries `next_step`, the request's step counter after the block: with the
committed blocks' tokens it is all another worker needs to continue a seeded request with
the very same randomness (randomness is a function of (seed, position, step) only).
"""

from __future__ import annotations

import math

import grpc
import torch

from cde.blocks import BLOCK, pages_for
from cde.grammar import GrammarVocabulary
from cde import limits as L
from cde.rpc import bytes_to_floats
from cde.rpc.finish import finish_reason_value
from cde.rpc.v1 import common_pb2, worker_pb2
from cde.steerling.attribution import RawRecords
from cde.steerling.config import PRESETS, SteerlingConfig
from cde.steerling.reference_decoder import clean_output, terminal_ids
from cde.steerling.steering import PreparedSteering
from worker_svc.engine.events import BlockEvent, FinishEvent, StepEvent, TokenLogprob
from worker_svc.engine.runtime import EngineStats
from worker_svc.engine.steerling_engine import SteerlingEngine
from worker_svc.engine.job import Job
from worker_svc.family import EventTranslator
from worker_svc.request_options import block_diffusion_options
from worker_svc.structured import Grammars
from worker_svc.validation import BadRequest, check_inject_layer, checked_prompt

_SCHEDULES = {common_pb2.STEERING_SCHEDULE_FIXED: "fixed", common_pb2.STEERING_SCHEDULE_HARD_CUTOFF: "hard_cutoff"}


def preset_name(cfg: SteerlingConfig) -> str:
    for name, p in PRESETS.items():
        if p.replace(tokenizer=cfg.tokenizer) == cfg:
            return name
    return "custom"


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
        raise BadRequest("steering.schedule must be FIXED or HARD_CUTOFF (the gateway resolves DEFAULT)")
    return PreparedSteering(torch.from_numpy(direction), float(st.base_alpha), int(st.inject_layer),
                            _SCHEDULES[st.schedule], int(st.cutoff_tokens),  # type: ignore[arg-type]
                            None if relu is None else torch.from_numpy(relu))


def parse_submit(req: worker_pb2.WorkerSubmit, cfg: SteerlingConfig, token_limit: int, model_name: str,
                 pages_usable: int) -> Job:
    """Validate a WorkerSubmit; raises BadRequest with the status code to answer."""
    prompt = checked_prompt(req, token_limit, cfg.mask_id)
    options = block_diffusion_options(req, cfg, token_limit)
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
    pages = pages_for(len(prompt) + options.max_new_tokens)
    if pages > pages_usable:
        raise BadRequest(f"the request needs {pages} KV pages; this worker has {pages_usable}",
                         grpc.StatusCode.RESOURCE_EXHAUSTED)
    logprobs = None
    if req.HasField("top_logprobs"):
        if req.top_logprobs > L.TOP_LOGPROBS_MAX:
            raise BadRequest(f"top_logprobs must be in [0, {L.TOP_LOGPROBS_MAX}], got {req.top_logprobs}")
        logprobs = req.top_logprobs
    return Job(request_id=req.request_id, prompt=prompt, options=options, committed=committed,
               next_step=req.next_step, stream_steps=req.stream_steps, steering=steering,
               records=not req.no_records, logprobs=logprobs)


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


def token_scores(logprobs: list[TokenLogprob | None] | None) -> list[common_pb2.TokenScore]:
    """A block's logprobs as TokenScores (a position never sampled: NaN, no alternatives)."""
    if logprobs is None:
        return []
    return [common_pb2.TokenScore(logprob=float("nan")) if lp is None else
            common_pb2.TokenScore(logprob=lp.logprob, greedy=bool(lp.top_ids) and lp.logprob >= lp.top_logprobs[0],
                                  top_ids=lp.top_ids, top_logprobs=lp.top_logprobs)
            for lp in logprobs]


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
        reason = finish_reason_value("stop")
    elif len(job.committed) >= job.options.max_new_tokens:
        reason = finish_reason_value("length")
    else:
        return None
    return common_pb2.Finished(reason=reason, usage=usage(len(job.prompt), len(out), job.next_step))


class BlockDiffusionFamily:
    """family.ModelFamily for a Steerling (block diffusion) worker."""

    def __init__(self, engine: SteerlingEngine, token_limit: int, model_name: str, tokenizer=None):
        self.engine = engine
        self.cfg = engine.strategy.cfg
        self.token_limit = token_limit
        self.model_name = model_name
        # structured output over the model's tokenizer (cde.steerling.tokenizer), ending on <|eot_id|>
        self.grammars = Grammars(None if tokenizer is None or self.cfg.eot_id is None else (
            lambda: GrammarVocabulary.of_steerling(tokenizer, self.cfg.vocab_size, self.cfg.eot_id)))

    def parse(self, request: worker_pb2.WorkerSubmit) -> Job:
        job = parse_submit(request, self.cfg, self.token_limit, self.model_name, self.engine.kv.pool.usable)
        return self.grammars.attach(job, request.grammar)

    def already_finished(self, job: Job) -> common_pb2.Finished | None:
        return already_finished(job, self.cfg)

    def translator(self, job: Job) -> EventTranslator:
        strategy = self.engine.strategy

        def translate(ev) -> list[worker_pb2.WorkerEvent]:
            if isinstance(ev, StepEvent):   # only a request with stream_steps gets them (Job.stream_steps)
                return [worker_pb2.WorkerEvent(step=common_pb2.StepEvent(
                    step=ev.step, block_index=ev.positions[0] // BLOCK, positions=ev.positions, tokens=ev.tokens))]
            if isinstance(ev, BlockEvent):
                return [worker_pb2.WorkerEvent(block=common_pb2.BlockCommitted(
                    block_index=ev.block, start=ev.start, tokens=ev.tokens, next_step=ev.next_step, last=ev.last,
                    records=raw_records(ev.records, strategy.topk_known, strategy.topk_discovered),
                    logprobs=token_scores(ev.logprobs)))]
            if isinstance(ev, FinishEvent):
                return [worker_pb2.WorkerEvent(finished=common_pb2.Finished(
                    reason=finish_reason_value(ev.reason), usage=usage(ev.prompt_tokens, ev.completion_tokens, ev.steps),
                    message=ev.error))]
            return []

        return translate

    def status(self, stats: EngineStats, model_name: str, dtype: str, device: str) -> worker_pb2.WorkerStatus:
        cfg = self.cfg
        return worker_pb2.WorkerStatus(
            model=model_name, preset=preset_name(cfg), dtype=dtype, device=device,
            kv_pages_total=stats.pages_total, kv_pages_free=stats.pages_free, running=stats.running,
            waiting=stats.waiting, steps=stats.steps, compiles=stats.compiles, graphs=stats.graphs,
            overlapped_steps=stats.overlapped_steps,
            diffusion_block_size=cfg.diff_block_size,
            vocab_size=self.token_limit, n_known=cfg.n_known, n_discovered=cfg.n_discovered,
            max_context=cfg.block_size)
