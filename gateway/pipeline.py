"""The generation path shared by REST and the public gRPC API.

Both front ends build a `generate_pb2.GenerateRequest` (REST translates its JSON into one), so
validation, tokenization, steering resolution and the SchedulerEvent -> GenerateResponse
translation exist once and the two APIs stream the same blocks by construction.

`Pipeline.prepare` turns a public request into a scheduler `SubmitRequest` carrying the internal
contract, `ResolvedOptions` (resolved.proto): the seed (drawn here when the client gave none),
max_new_tokens, stop ids, every sampling value and the decoder (block diffusion or ISD), all final.
This is the only place a default is chosen; the scheduler stores the options and the workers
apply them as they are. `Pipeline.open` starts the scheduler stream and returns a
`GenerationStream`; closing it before the request ended (the client disconnected, a stop string
matched) cancels the scheduler call and tells the scheduler the client left (`Scheduler.Detach`
with the stream's `cde-attach-id`), which cancels the request at once and frees its KV pages.
A scheduler stream that merely breaks, without that Detach (this gateway process died), leaves
the request running for the scheduler's detach grace, so the client can Resume it on another
gateway process.

The gateway holds the request id, so a broken scheduler stream (scheduler restart, a Redis
hiccup there) is reattached here, not by the client: `GenerationStream` re-Submits the same
request (idempotent) when it was not accepted yet, else Resumes after the last block it has,
with bounded retries and backoff inside the request's deadline. A client sees a scheduler
restart as latency. An error that ended the request itself (the scheduler marks it with
`cde-request-ended` trailing metadata) is reported, never retried.
"""

from __future__ import annotations

import asyncio
import bisect
import codecs
import dataclasses
import logging
import math
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from cde import limits as L
from cde import trace
from cde.model_family import CAUSAL, STEERLING, model_family
from cde.qwen3.chat import ChatTokenizer, load_chat_tokenizer
from cde.qwen3.config import Qwen3Config
from cde.rpc import resolved
from cde.rpc.finish import FINISH_REASON_TEXT
from cde.rpc.v1 import common_pb2, generate_pb2, resolved_pb2, scheduler_pb2, steering_pb2
from cde.steerling.config import SteerlingConfig
from cde.steerling.tokenizer import Tokenizer, load_model_tokenizer
from gateway.backends import Backends
from gateway.detok import BlockDetokenizer
from gateway.errors import PARAM_MD, GatewayError, from_rpc_error, invalid
from gateway.metrics import GatewayMetrics, RequestTimer

log = logging.getLogger("gateway.pipeline")

# The model's sampler defaults (a test keeps them equal to cde.steerling.sampling.SamplingParams);
# from cde.limits so the gateway never imports torch.
DEFAULT_SAMPLING = dataclasses.asdict(L.STEERLING_SAMPLING)
# Causal (I-DLM) models: plain temperature sampling, and ISD with stride 4 unless asked otherwise
# (greedy output equals plain AR's token for token; sampled output keeps AR's distribution).
DEFAULT_CAUSAL_SAMPLING = dataclasses.asdict(L.CAUSAL_SAMPLING)


@dataclass(frozen=True)
class ModelCard:
    """The one model this gateway fronts: its id, family, config and tokenizer.

    family "steerling" (block diffusion: concepts, attribution, steering) or "causal" (a
    Qwen3 / I-DLM model: autoregressive or introspective strided decoding, `decode.stride`)."""

    id: str
    config: SteerlingConfig | Qwen3Config
    tokenizer: Tokenizer | ChatTokenizer
    created: int
    family: str = STEERLING

    @classmethod
    def load(cls, model_dir: str | Path, name: str | None = None) -> ModelCard:
        path = Path(model_dir)
        family = model_family(path)
        if family == CAUSAL:
            qcfg = Qwen3Config.load(path)
            return cls(name or path.resolve().name, qcfg, load_chat_tokenizer(path, qcfg), int(path.stat().st_mtime),
                       CAUSAL)
        cfg = SteerlingConfig.load(path)
        tok = load_model_tokenizer(cfg, path)
        return cls(name or path.resolve().name, cfg, tok, int(path.stat().st_mtime))

    @property
    def causal(self) -> bool:
        return self.family == CAUSAL

    @property
    def max_context(self) -> int:
        return self.config.max_positions if self.causal else self.config.block_size

    def info(self) -> generate_pb2.ModelInfo:
        c = self.config
        if self.causal:
            return generate_pb2.ModelInfo(id=self.id, max_context=c.max_positions, family=self.family)
        return generate_pb2.ModelInfo(id=self.id, diffusion_block_size=c.diff_block_size, max_context=c.block_size,
                                      n_known_concepts=c.n_known, n_discovered_concepts=c.n_discovered,
                                      family=self.family)


@dataclass(frozen=True)
class Limits:
    max_tokens_limit: int = L.MAX_TOKENS_LIMIT
    default_max_tokens: int = L.DEFAULT_MAX_TOKENS
    request_timeout_s: float | None = 600.0   # whole generation; None = no deadline
    backend_timeout_s: float = 10.0           # unary calls (steering, search, cancel)
    reattach_s: float = 30.0                  # how long a broken scheduler stream is retried without progress


@dataclass
class Prepared:
    submit: scheduler_pb2.SubmitRequest
    prompt_tokens: int

    @property
    def seed(self) -> int:
        return self.submit.options.seed


def _finite_in(x: float, lo: float, hi: float, *, lo_open: bool = False) -> bool:
    return math.isfinite(x) and (x > lo if lo_open else x >= lo) and x <= hi


class Pipeline:
    def __init__(self, model: ModelCard, backends: Backends, limits: Limits, metrics: GatewayMetrics) -> None:
        self.model = model
        self.backends = backends
        self.limits = limits
        self.metrics = metrics
        # Stopping (SIGTERM): streams cut now did not lose their client by its own doing, so they
        # send no Detach; the scheduler's grace leaves their clients time to Resume elsewhere.
        self.closing = False
        self._detaching: set[asyncio.Task] = set()

    # ---- validation + resolution ----------------------------------------------------------
    def check_model(self, name: str) -> None:
        if name and name != self.model.id:
            raise GatewayError(grpc.StatusCode.NOT_FOUND,
                               f"model '{name}' does not exist; this server serves '{self.model.id}'",
                               param="model", err_code="model_not_found")

    def tokenize(self, req: generate_pb2.GenerateRequest) -> list[int]:
        tok = self.model.tokenizer
        kind = req.WhichOneof("input")
        if kind == "prompt":
            if not req.prompt:
                raise invalid("prompt must not be empty", "prompt")
            return tok.encode(req.prompt)
        if kind == "chat":
            if not req.chat.messages:
                raise invalid("messages must not be empty", "messages")
            msgs = [{"role": m.role, "content": m.content} for m in req.chat.messages]
            try:
                return tok.apply_chat_template(msgs, add_generation_prompt=True)
            except ValueError as e:
                raise invalid(str(e), "messages") from None
        if kind == "token_ids":
            ids = list(req.token_ids.ids)
            if not ids:
                raise invalid("token_ids must not be empty", "prompt")
            bad = next((i for i in ids if i >= tok.vocab_size or i == tok.mask_id), None)
            if bad is not None:
                raise invalid(f"token id {bad} is not a valid prompt token (vocabulary has {tok.vocab_size} ids, "
                              f"{tok.mask_id} is the mask id)", "prompt")
            return ids
        raise invalid("one of prompt, chat or token_ids is required", "prompt")

    def resolve_options(self, d: common_pb2.DecodeOptions, s: common_pb2.SamplingOptions,
                        n_prompt: int) -> resolved_pb2.ResolvedOptions:
        """The request's internal options, every value final."""
        options = self.resolve_decode(d, n_prompt)
        options.sampling.CopyFrom(self.resolve_sampling(s))
        return options

    def resolve_decode(self, d: common_pb2.DecodeOptions, n_prompt: int) -> resolved_pb2.ResolvedOptions:
        """Length, seed, stops and decoder resolved (sampling: `resolve_sampling`, joined by
        `resolve_options`)."""
        lim, ctx = self.limits, self.model.max_context
        room = ctx - n_prompt
        if d.max_new_tokens:
            max_new = d.max_new_tokens
            if max_new > lim.max_tokens_limit:
                raise invalid(f"max_tokens {max_new} exceeds this server's limit of {lim.max_tokens_limit}", "max_tokens")
            if max_new > room:
                raise invalid(f"this model's maximum context length is {ctx} tokens; the request asks for "
                              f"{n_prompt + max_new} ({n_prompt} in the prompt, {max_new} for the completion)",
                              "max_tokens", "context_length_exceeded")
        else:  # unset: the default, shrunk to what the context still holds
            max_new = min(lim.default_max_tokens, lim.max_tokens_limit, room)
            if max_new <= 0:
                raise invalid(f"the prompt ({n_prompt} tokens) fills this model's maximum context of {ctx} tokens",
                              "prompt", "context_length_exceeded")
        stride = 0
        if self.model.causal:
            tps = 1
            if d.tokens_per_step > 1 or d.HasField("confidence_threshold"):
                raise invalid("decode.tokens_per_step and decode.threshold apply to block-diffusion models; "
                              f"this causal model decodes {L.DEFAULT_STRIDE} tokens per forward with decode.stride "
                              "(1 = plain autoregressive)", "decode.tokens_per_step" if d.tokens_per_step > 1
                              else "decode.threshold")
            stride = d.isd_stride or L.DEFAULT_STRIDE
            if stride > L.MAX_STRIDE:
                raise invalid(f"decode.stride must be in [1, {L.MAX_STRIDE}] (1 = plain autoregressive)", "decode.stride")
        else:
            lo, hi = L.tokens_per_step_bounds(self.model.config.diff_block_size)
            tps = d.tokens_per_step or L.DEFAULT_TOKENS_PER_STEP
            if not lo <= tps <= hi:
                raise invalid(f"tokens_per_step must be in [{lo}, {hi}] (the diffusion block size)",
                              "decode.tokens_per_step")
            if d.isd_stride:
                raise invalid("decode.stride (introspective strided decoding) is not supported by this model: "
                              "Steerling is a block-diffusion model", "decode.stride")
            if d.HasField("confidence_threshold") and not _finite_in(
                    d.confidence_threshold, L.THRESHOLD_MIN_EXCLUSIVE, L.THRESHOLD_MAX, lo_open=True):
                raise invalid(f"decode.threshold must be in ({L.THRESHOLD_MIN_EXCLUSIVE:g}, {L.THRESHOLD_MAX:g}]",
                              "decode.threshold")
        if len(d.stop_ids) > L.MAX_STOP_IDS:
            raise invalid(f"at most {L.MAX_STOP_IDS} stop ids", "stop_token_ids")
        vocab = self.model.tokenizer.vocab_size
        bad = next((i for i in d.stop_ids if i >= vocab), None)
        if bad is not None:
            raise invalid(f"stop token id {bad} is outside the vocabulary (size {vocab})", "stop_token_ids")
        # The one place a seed is drawn: the scheduler stores it, so a resumed request draws the same.
        seed = d.seed if d.HasField("seed") else secrets.randbits(63)
        if self.model.causal:
            out = resolved.isd(seed=seed, max_new_tokens=max_new, stride=stride, stop_ids=d.stop_ids)
        else:
            threshold = d.confidence_threshold if d.HasField("confidence_threshold") else None
            out = resolved.block_diffusion(seed=seed, max_new_tokens=max_new, tokens_per_step=tps,
                                           confidence_threshold=threshold, stop_ids=d.stop_ids)
        out.ClearField("sampling")   # the request's own: resolve_sampling
        return out

    def resolve_sampling(self, s: common_pb2.SamplingOptions) -> resolved_pb2.ResolvedSampling:
        """Every field set. A client that sets a temperature wants it used, so temperature
        without an explicit use_entropy_sampling turns the entropy-adaptive temperature off.
        Causal models sample with temperature and top_p only (T = 0: greedy)."""
        if self.model.causal:
            if s.use_entropy_sampling:
                raise invalid("use_entropy_sampling applies to block-diffusion models only", "use_entropy_sampling")
            if s.HasField("repetition_penalty") and s.repetition_penalty != 1.0:
                raise invalid("repetition_penalty is not supported by causal (ISD) decoding: it would break "
                              "the lossless acceptance rule; leave it at 1", "repetition_penalty")
            d = DEFAULT_CAUSAL_SAMPLING
        else:
            d = DEFAULT_SAMPLING
        entropy = s.use_entropy_sampling if s.HasField("use_entropy_sampling") else (
            False if s.HasField("temperature") else d["use_entropy_sampling"])
        out = resolved.sampling(L.SamplingDefaults(
            use_entropy_sampling=entropy,
            temperature=s.temperature if s.HasField("temperature") else d["temperature"],
            top_p=s.top_p if s.HasField("top_p") else d["top_p"],
            repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else d["repetition_penalty"]))
        if not _finite_in(out.temperature, L.TEMPERATURE_MIN, L.TEMPERATURE_MAX):
            raise invalid(f"temperature must be in [{L.TEMPERATURE_MIN:g}, {L.TEMPERATURE_MAX:g}]", "temperature")
        if not _finite_in(out.top_p, L.TOP_P_MIN, L.TOP_P_MAX):
            raise invalid(f"top_p must be in [{L.TOP_P_MIN:g}, {L.TOP_P_MAX:g}]", "top_p")
        if not _finite_in(out.repetition_penalty, 0.0, L.REPETITION_PENALTY_MAX, lo_open=True):
            raise invalid(f"repetition_penalty must be in (0, {L.REPETITION_PENALTY_MAX:g}]", "repetition_penalty")
        return out

    def check_steering(self, s: common_pb2.SteeringRequest) -> None:
        if len(s.concepts) > L.MAX_CONCEPTS:
            raise invalid(f"at most {L.MAX_CONCEPTS} steering concepts", "steering.concepts")
        for i, c in enumerate(s.concepts):
            p = f"steering.concepts[{i}]"
            ref = c.WhichOneof("ref")
            if ref is None or (ref == "name" and not c.name.strip()):
                raise invalid(f"{p} needs an 'id' or a non-empty 'name'", p)
            if len(c.name) > L.CONCEPT_NAME_MAX:
                raise invalid(f"{p}.name is longer than {L.CONCEPT_NAME_MAX} characters", f"{p}.name")
            if c.strength != 0.0 and not _finite_in(c.strength, 0.0, L.STRENGTH_MAX, lo_open=True):
                raise invalid(f"{p}.strength must be in (0, {L.STRENGTH_MAX:g}]", f"{p}.strength")
        if s.mode not in common_pb2.SteeringMode.values():
            raise invalid("steering.mode must be amplify or suppress", "steering.mode")
        if s.schedule not in common_pb2.SteeringSchedule.values():
            raise invalid("steering.schedule must be default, fixed or hard_cutoff", "steering.schedule")
        if s.HasField("target") and not _finite_in(s.target, -L.TARGET_ABS_MAX, L.TARGET_ABS_MAX):
            raise invalid(f"steering.target must be in [-{L.TARGET_ABS_MAX:g}, {L.TARGET_ABS_MAX:g}]", "steering.target")
        lo, hi = L.inject_layer_bounds(self.model.config.n_layers)
        if s.HasField("inject_layer") and not lo <= s.inject_layer <= hi:
            raise invalid(f"steering.inject_layer must be in [{lo}, {hi}] for this model", "steering.inject_layer")
        if s.HasField("cutoff_tokens"):
            if not L.CUTOFF_MIN <= s.cutoff_tokens <= L.CUTOFF_MAX:
                raise invalid(f"steering.cutoff must be in [{L.CUTOFF_MIN}, {L.CUTOFF_MAX}]", "steering.cutoff")
            if s.schedule == common_pb2.STEERING_SCHEDULE_FIXED:
                raise invalid("steering.cutoff only applies to schedule 'hard_cutoff'", "steering.cutoff")

    async def resolve_steering(self, s: common_pb2.SteeringRequest) -> common_pb2.PreparedSteering | None:
        if not s.concepts:
            return None
        self.check_steering(s)
        try:
            return await self.backends.steering.BuildSteering(
                steering_pb2.BuildSteeringRequest(model=self.model.id, steering=s),
                timeout=self.limits.backend_timeout_s)
        except grpc.aio.AioRpcError as e:
            err = from_rpc_error(e, "steering service")
            # the steering service names the offending field (steering.concepts[0].id) in a trailer
            field = next((v for k, v in (e.trailing_metadata() or ()) if k == PARAM_MD), None)
            if err.code == grpc.StatusCode.NOT_FOUND:
                refs = [c.name if c.WhichOneof("ref") == "name" else f"#{c.concept_id}" for c in s.concepts]
                detail = e.details() or ""
                named = any(r.lower() in detail.lower() for r in refs)
                err.message = f"unknown steering concept: {detail}" + ("" if named else f" (requested: {', '.join(refs)})")
                err.param, err.err_code = field or "steering.concepts", "concept_not_found"
            elif err.code == grpc.StatusCode.INVALID_ARGUMENT:
                err.param = field or "steering"
            raise err from None

    def check_causal(self, req: generate_pb2.GenerateRequest) -> None:
        """A causal model has no concept heads: attribution and steering cannot be served."""
        if req.attribution != common_pb2.ATTRIBUTION_NONE:
            raise invalid(f"model '{self.model.id}' is a causal LM without concepts: attribution is not available",
                          "attribution")
        if req.HasField("steering") and req.steering.concepts:
            raise invalid(f"model '{self.model.id}' is a causal LM without concepts: steering is not available",
                          "steering")

    async def prepare(self, req: generate_pb2.GenerateRequest) -> Prepared:
        self.check_model(req.model)
        if self.model.causal:
            self.check_causal(req)
        prompt = self.tokenize(req)
        options = self.resolve_options(req.decode, req.sampling, len(prompt))
        if req.attribution not in common_pb2.AttributionMode.values():
            raise invalid("attribution must be none, tokens, chunks or all", "attribution")
        top_k = req.attribution_top_k or L.DEFAULT_ATTRIBUTION_TOP_K
        if top_k > L.ATTRIBUTION_TOP_K_MAX:
            raise invalid(f"attribution_top_k must be in [1, {L.ATTRIBUTION_TOP_K_MAX}]", "attribution_top_k")
        steering = await self.resolve_steering(req.steering) if req.HasField("steering") else None
        submit = scheduler_pb2.SubmitRequest(
            request_id=req.request_id or uuid.uuid4().hex, model=self.model.id, prompt_tokens=prompt,
            options=options, attribution=req.attribution, attribution_top_k=top_k, stream_steps=req.stream_steps)
        if steering is not None:
            submit.steering.CopyFrom(steering)
        return Prepared(submit, len(prompt))

    # ---- streams ----------------------------------------------------------------------------
    def _timeout(self, client_remaining: float | None) -> float | None:
        t = self.limits.request_timeout_s
        if client_remaining is not None:
            t = client_remaining if t is None else min(t, client_remaining)
        return t

    def _reattach(self, timeout: float | None, submit: scheduler_pb2.SubmitRequest | None,
                  attach_id: str) -> Reattach:
        return Reattach(self.backends.scheduler, self.backends.scheduler_channel, submit,
                        None if timeout is None else time.monotonic() + timeout, self.limits.reattach_s,
                        attach_id)

    def detach(self, request_id: str, attach_id: str) -> None:
        """Tell the scheduler (in the background) that the client of stream ``attach_id`` left."""
        if self.closing or not request_id:
            return
        task = asyncio.get_running_loop().create_task(self._send_detach(request_id, attach_id))
        self._detaching.add(task)
        task.add_done_callback(self._detaching.discard)

    async def _send_detach(self, request_id: str, attach_id: str) -> None:
        try:
            await self.backends.scheduler.Detach(scheduler_pb2.DetachRequest(request_id=request_id, attach_id=attach_id),
                                                 timeout=self.limits.backend_timeout_s)
        except grpc.aio.AioRpcError as e:   # the scheduler's detach grace cancels it later instead
            log.warning("request %s: Detach failed (%s: %s)", request_id, e.code().name, e.details())

    async def flush_detaches(self, timeout: float) -> None:
        """Wait (bounded) for the Detaches in flight, before the channels close."""
        if self._detaching:
            await asyncio.wait(set(self._detaching), timeout=timeout)

    def open(self, prepared: Prepared, timer: RequestTimer | None = None,
             client_remaining: float | None = None) -> GenerationStream:
        timeout = self._timeout(client_remaining)
        attach_id = uuid.uuid4().hex
        call = self.backends.scheduler.Submit(prepared.submit, timeout=timeout, metadata=attach_metadata(attach_id))
        opened_at = time.perf_counter()
        self.metrics.prompt_tokens.labels(self.model.id).inc(prepared.prompt_tokens)
        return GenerationStream(call, BlockDetokenizer(self.model.tokenizer, prepared.submit.options.stop_ids),
                                timer or self.metrics.request(), prepared.seed, prepared.prompt_tokens,
                                isd=self.model.causal, request_id=prepared.submit.request_id,
                                reattach=self._reattach(timeout, prepared.submit, attach_id), opened_at=opened_at,
                                attach_id=attach_id, on_detach=self.detach)

    def resume(self, req: common_pb2.ResumeRequest, client_remaining: float | None = None) -> GenerationStream:
        if not req.request_id:
            raise invalid("request_id is required", "request_id")
        # Replay from the first block and only prime the detokenizer with the blocks the client
        # already has: a character split across the resume point then decodes as it did in the
        # original stream (a fresh decoder would print U+FFFD for its tail bytes).
        timeout = self._timeout(client_remaining)
        attach_id = uuid.uuid4().hex
        call = self.backends.scheduler.Resume(common_pb2.ResumeRequest(request_id=req.request_id), timeout=timeout,
                                              metadata=attach_metadata(attach_id))
        return GenerationStream(call, BlockDetokenizer(self.model.tokenizer), self.metrics.request(), 0, 0,
                                skip_through=req.after_block if req.HasField("after_block") else None,
                                isd=self.model.causal, request_id=req.request_id,
                                reattach=self._reattach(timeout, None, attach_id),
                                attach_id=attach_id, on_detach=self.detach)

    # ---- unary ------------------------------------------------------------------------------
    async def cancel(self, request_id: str) -> common_pb2.CancelResponse:
        if not request_id:
            raise invalid("request_id is required", "request_id")
        try:
            return await self.backends.scheduler.Cancel(common_pb2.CancelRequest(request_id=request_id),
                                                        timeout=self.limits.backend_timeout_s)
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, "scheduler") from None

    async def search_concepts(self, req: common_pb2.SearchConceptsRequest) -> common_pb2.SearchConceptsResponse:
        self.check_model(req.model)
        if self.model.causal:
            raise invalid(f"model '{self.model.id}' is a causal LM without concepts", "model")
        if not req.query.strip():
            raise invalid("a search query is required", "q")
        if len(req.query) > L.SEARCH_QUERY_MAX_CHARS:
            raise invalid(f"q is {len(req.query)} characters; at most {L.SEARCH_QUERY_MAX_CHARS}", "q")
        if req.limit > L.SEARCH_LIMIT_MAX:
            raise invalid(f"limit must be in [1, {L.SEARCH_LIMIT_MAX}]", "limit")
        fwd = common_pb2.SearchConceptsRequest(query=req.query.strip(), limit=req.limit or L.DEFAULT_SEARCH_LIMIT,
                                               known_only=req.known_only, model=self.model.id)
        try:
            return await self.backends.steering.SearchConcepts(fwd, timeout=self.limits.backend_timeout_s)
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, "steering service") from None

    def _check_catalog(self, model: str = "") -> None:
        self.check_model(model)
        if self.model.causal:
            raise invalid(f"model '{self.model.id}' is a causal LM without concepts", "model")

    async def list_concepts(self, req: steering_pb2.ListConceptsRequest) -> steering_pb2.ListConceptsResponse:
        """One page of the catalog (bounds checked here, before they go into uint32 fields upstream)."""
        self._check_catalog(req.model)
        if req.limit > L.LIST_LIMIT_MAX:
            raise invalid(f"limit must be in [1, {L.LIST_LIMIT_MAX}]", "limit")
        fwd = steering_pb2.ListConceptsRequest()
        fwd.CopyFrom(req)
        fwd.model, fwd.limit = self.model.id, req.limit or L.DEFAULT_LIST_LIMIT
        try:
            return await self.backends.steering.ListConcepts(fwd, timeout=self.limits.backend_timeout_s)
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, "steering service") from None

    async def describe_concept(self, concept_id: int, top_tokens: int) -> steering_pb2.ConceptDetail:
        """A concept and its `top_tokens` most promoted vocabulary tokens; 404 for an unknown id."""
        self._check_catalog()
        if not 0 <= top_tokens <= L.TOP_TOKENS_MAX:
            raise invalid(f"top_tokens must be in [0, {L.TOP_TOKENS_MAX}]", "top_tokens")
        try:
            return await self.backends.steering.DescribeConcept(steering_pb2.DescribeConceptRequest(
                concept_id=concept_id, model=self.model.id, top_tokens=top_tokens),
                timeout=self.limits.backend_timeout_s)
        except grpc.aio.AioRpcError as e:
            err = from_rpc_error(e, "steering service")
            if err.code == grpc.StatusCode.NOT_FOUND:
                err.param, err.err_code = "concept_id", "concept_not_found"
            raise err from None

    def list_models(self) -> generate_pb2.ListModelsResponse:
        return generate_pb2.ListModelsResponse(models=[self.model.info()])


# Scheduler errors a stream is reattached after (unless the request itself ended with them).
REATTACH_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN})
REQUEST_ENDED_MD = "cde-request-ended"   # scheduler_svc.service.REQUEST_ENDED_MD
REATTACH_BACKOFF_S = (0.05, 1.0)         # first and largest pause between attempts
ATTACH_MD = "cde-attach-id"              # scheduler_svc.service.ATTACH_MD: names a stream for Detach


def attach_metadata(attach_id: str) -> tuple[tuple[str, str], ...]:
    return ((ATTACH_MD, attach_id),)


def _request_ended(err: grpc.aio.AioRpcError) -> bool:
    try:
        return any(k == REQUEST_ENDED_MD for k, _ in (err.trailing_metadata() or ()))
    except Exception:  # noqa: BLE001 - metadata of a broken call may be unavailable
        return False


@dataclass
class Reattach:
    """How a `GenerationStream` gets its scheduler call back after the stream broke."""

    scheduler: object                                # SchedulerStub
    channel: grpc.aio.Channel | None                 # its channel: waited on (bounded) before a new call
    submit: scheduler_pb2.SubmitRequest | None      # None: a Resume stream (never re-Submitted)
    deadline: float | None                          # time.monotonic() the request's time runs out
    budget_s: float                                 # retrying without progress gives up after this
    attach_id: str = ""                             # the stream's id, sent again on every new call
    attempts: int = 0
    failing_since: float | None = None

    def progress(self) -> None:
        self.attempts, self.failing_since = 0, None

    def time_left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    async def wait_ready(self) -> bool:
        """Wait (within the budget and the deadline) until the channel is connected."""
        if self.channel is None:
            return True
        start = self.failing_since if self.failing_since is not None else time.monotonic()
        wait = start + self.budget_s - time.monotonic()
        left = self.time_left()
        if left is not None:
            wait = min(wait, left)
        if wait <= 0:
            return False
        try:
            await asyncio.wait_for(self.channel.channel_ready(), wait)
            return True
        except asyncio.TimeoutError:
            return False

    def pause(self) -> float | None:
        """Seconds to wait before the next attempt; None when the budget or deadline is spent."""
        now = time.monotonic()
        if self.failing_since is None:
            self.failing_since = now
        first, most = REATTACH_BACKOFF_S
        delay = min(first * 2 ** self.attempts, most)
        left = self.time_left()
        if now + delay - self.failing_since > self.budget_s or (left is not None and left <= delay):
            return None
        self.attempts += 1
        return delay

    def call(self, request_id: str, accepted: bool, last_block: int | None) -> grpc.aio.UnaryStreamCall:
        left = self.time_left()
        md = attach_metadata(self.attach_id) if self.attach_id else None
        if self.submit is not None and not accepted:   # maybe never created: the same Submit is idempotent
            return self.scheduler.Submit(self.submit, timeout=left, metadata=md)
        req = common_pb2.ResumeRequest(request_id=request_id)
        if last_block is not None:
            req.after_block = last_block
        return self.scheduler.Resume(req, timeout=left, metadata=md)


@dataclass
class GenerationStream:
    """One scheduler call, read as public GenerateResponse events.

    `next()` returns None after Finished. Errors from the scheduler surface as GatewayError at
    the `next()` that hits them; front ends pull the first event before answering so that an
    admission refusal still becomes a proper status (429, 404, ...) and not a broken stream.
    """

    call: grpc.aio.UnaryStreamCall
    detok: BlockDetokenizer
    timer: RequestTimer
    seed: int
    prompt_tokens: int
    done: bool = False
    finish_reason: str | None = None
    skip_through: int | None = None   # Resume: blocks up to this index only prime the detokenizer
    isd: bool = False                 # a causal model's request: report ISD acceptance
    request_id: str = ""
    reattach: Reattach | None = None  # None: a broken scheduler stream is an error at once
    reattached: int = 0               # how many times the scheduler call was replaced
    opened_at: float | None = None    # perf_counter when the scheduler call was opened (cde.trace)
    attach_id: str = ""               # this stream's `cde-attach-id` (its Detach names it)
    on_detach: Callable[[str, str], None] | None = None   # (request id, attach id): the client left
    _accepted: bool = field(default=False)
    _last_block: int | None = field(default=None)   # last block index fed to the detokenizer
    _replayed_through: int | None = field(default=None)   # after a reattach: blocks we already had
    _primed_tokens: int = field(default=0)
    _closed: bool = field(default=False)
    _ended: bool = field(default=False)   # the request's end was seen (Finished, or an error that ended it)
    # usage: characters of this response's text after each of its output tokens (the tokens'
    # bytes through their own UTF-8 decoder, primed like the detokenizer's on a Resume). Only a
    # stop string needs them, so the blocks' tokens wait in _uncounted until tokens_in_text asks
    # (one decode per token was half of a block's translation: ~0.07 ms of 0.14 with cl100k).
    _text_ends: list[int] = field(default_factory=list)
    _chars: codecs.IncrementalDecoder = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))
    _uncounted: list[tuple[list[int], bool]] = field(default_factory=list)   # (tokens, primed) in order
    _response_tokens: int = field(default=0)

    def __post_init__(self) -> None:
        self.timer.metrics.in_flight.labels(self.timer.metrics.model).inc()

    # ---- usage: the tokens this response holds -------------------------------------------
    @property
    def response_tokens(self) -> int:
        """Output tokens this response carries (a Resume's: those after the blocks skipped)."""
        return self._response_tokens

    def tokens_in_text(self, n_chars: int) -> int:
        """Tokens that the first `n_chars` characters of this response's text hold: the shortest
        prefix of its tokens whose text covers them (a token a stop string cuts through counts;
        text-less tokens right after the cut do not). What usage counts after a stop string."""
        if n_chars <= 0:
            return 0
        self._count_text()
        return min(bisect.bisect_left(self._text_ends, n_chars) + 1, len(self._text_ends))

    def _note_tokens(self, tokens: list[int], primed: bool) -> None:
        self._uncounted.append((tokens, primed))
        if not primed:
            self._response_tokens += len(tokens)

    def _count_text(self) -> None:
        for tokens, primed in self._uncounted:
            total = self._text_ends[-1] if self._text_ends else 0
            for t in tokens:
                total += len(self._chars.decode(self.detok.token_text_bytes(t), final=False))
                if not primed:
                    self._text_ends.append(total)
        self._uncounted.clear()

    async def next(self) -> generate_pb2.GenerateResponse | None:
        while not self.done:
            try:
                ev = await self.call.read()
            except grpc.aio.AioRpcError as e:
                ended = _request_ended(e)
                if await self._reattach(e.code() in REATTACH_CODES and not ended,
                                        f"{e.code().name}: {e.details()}"):
                    continue
                self.done = True
                self._ended = self._ended or ended or not self._accepted   # not accepted: nothing to detach from
                raise from_rpc_error(e, "scheduler") from None
            if ev is grpc.aio.EOF:
                if await self._reattach(True, "stream ended before Finished"):
                    continue
                self.done = True
                raise GatewayError(grpc.StatusCode.UNAVAILABLE,
                                   "scheduler ended the stream before the request finished",
                                   err_code="backend_unavailable")
            out = self._translate(ev)
            if out is not None:
                return out
        return None

    async def _reattach(self, retryable: bool, why: str) -> bool:
        """Replace the broken scheduler call (after a pause); False when that is not allowed."""
        r = self.reattach
        if not retryable or r is None or self._closed or not self.request_id:
            return False
        delay = r.pause()
        if delay is None:
            log.warning("request %s: scheduler stream broke (%s); giving up after %d attempts",
                        self.request_id, why, r.attempts)
            return False
        log.info("request %s: scheduler stream broke (%s); reattaching in %.2fs (attempt %d)",
                 self.request_id, why, delay, r.attempts)
        await asyncio.sleep(delay)
        if not await r.wait_ready():
            log.warning("request %s: scheduler unreachable for %.1fs; giving up", self.request_id, r.budget_s)
            return False
        if self._closed:
            return False
        self.call = r.call(self.request_id, self._accepted, self._last_block)
        self._replayed_through = self._last_block
        self.reattached += 1
        return True

    def _translate(self, ev: scheduler_pb2.SchedulerEvent) -> generate_pb2.GenerateResponse | None:
        kind = ev.WhichOneof("event")
        if kind == "accepted":
            if self._accepted:   # a reattached call starts with Accepted again
                return None
            self._accepted = True
            self.request_id = self.request_id or ev.accepted.request_id
            acc = common_pb2.Accepted()
            acc.CopyFrom(ev.accepted)
            acc.prompt_tokens = acc.prompt_tokens or self.prompt_tokens
            self.detok.add_stops(acc.stop_ids)   # a Resume's detokenizer starts without them
            self.seed, self.prompt_tokens = acc.seed, acc.prompt_tokens
            return generate_pb2.GenerateResponse(accepted=acc)
        if kind == "step":
            self.timer.step(len(ev.step.tokens))
            return generate_pb2.GenerateResponse(step=ev.step)
        if kind == "block":
            b = ev.block
            if self._replayed_through is not None and b.block_index <= self._replayed_through:
                return None   # had it before the reattach
            self._last_block = b.block_index
            if self.reattach is not None:
                self.reattach.progress()
            res = self.detok.feed(b.tokens)
            primed = self.skip_through is not None and b.block_index <= self.skip_through
            self._note_tokens(res.tokens, primed)
            if primed:
                self._primed_tokens += len(res.tokens)
                return None
            if self.timer.last_block is None and trace.enabled() and self.opened_at is not None:
                trace.record("gateway", self.request_id, gw_received=trace.wall(self.timer.t0, time.perf_counter),
                             gw_submit=trace.wall(self.opened_at, time.perf_counter), gw_first_read=time.time())
            self.timer.block(len(res.tokens))
            return generate_pb2.GenerateResponse(block=generate_pb2.BlockEvent(
                block_index=b.block_index, start=b.start, tokens=res.tokens, text=res.text,
                token_attributions=b.token_attributions, chunk_attributions=b.chunk_attributions))
        if kind == "finished":
            self.done = self._ended = True
            fin = common_pb2.Finished()
            fin.CopyFrom(ev.finished)
            fin.usage.prompt_tokens = fin.usage.prompt_tokens or self.prompt_tokens
            # usage counts exactly the tokens the response holds (the worker's count may include
            # ids the detokenizer drops), whatever the backend reported
            fin.usage.completion_tokens = self.response_tokens
            self.finish_reason = FINISH_REASON_TEXT.get(fin.reason, "stop")
            self.timer.finished(self.finish_reason, fin.usage, self.isd)
            return generate_pb2.GenerateResponse(finished=fin)
        raise GatewayError(grpc.StatusCode.UNAVAILABLE, f"scheduler sent an unknown event {kind!r}")

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> generate_pb2.GenerateResponse:
        ev = await self.next()
        if ev is None:
            raise StopAsyncIteration
        return ev

    def finish_early(self, reason: str) -> None:
        """The front end ended the request itself (a stop string matched): record it, cancel upstream."""
        if not self.done:
            self.finish_reason = reason
            self.timer.finished(reason)
        self.close()

    def close(self) -> None:
        """Cancel the scheduler call if it is still open (idempotent; safe from finally blocks).
        Closed before the request ended, the client is gone: Detach tells the scheduler so (it
        cancels the request unless another stream is attached)."""
        if self._closed:
            return
        self._closed = True
        self.done = True
        self.timer.metrics.in_flight.labels(self.timer.metrics.model).dec()
        if not self.call.done():
            self.call.cancel()
        if not self._ended and self.on_detach is not None:
            self.on_detach(self.request_id, self.attach_id)

