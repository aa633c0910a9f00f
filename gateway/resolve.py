"""A public GenerateRequest -> the scheduler's SubmitRequest: validation and resolution.

REST translates its JSON into the same GenerateRequest the public gRPC API receives, so both
are checked and resolved here, once. `RequestResolver.prepare` tokenizes the prompt and resolves
the options into `ResolvedOptions` (resolved.proto): the seed (drawn here when the client gave
none), max_new_tokens, stop ids, every sampling value and the decoder (block diffusion or ISD),
all final. Steering is checked, its defaults are filled in (`resolved_steering`) and
steering_svc builds the vectors. This is the only place a default is chosen; the scheduler
stores the options and steering_svc and the workers apply them as they are.

Bounds are cde.limits' check functions; a `LimitError` becomes a 400 / INVALID_ARGUMENT naming
the field.
"""

from __future__ import annotations

import contextlib
import secrets
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc

from cde import limits as L
from cde.grammar import GrammarError, compile_format
from cde.model_family import CAUSAL, STEERLING, model_family
from cde.qwen3.chat import ChatTokenizer, load_chat_tokenizer
from cde.qwen3.config import Qwen3Config
from cde.rpc import resolved
from cde.rpc.v1 import common_pb2, generate_pb2, resolved_pb2, scheduler_pb2, steering_pb2
from cde.steerling.config import SteerlingConfig
from cde.steerling.tokenizer import Tokenizer, load_model_tokenizer
from gateway.backends import Backends
from gateway.errors import PARAM_MD, GatewayError, from_rpc_error, invalid


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
    """This gateway's own limits and timeouts (its flags)."""

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


class RequestResolver:
    def __init__(self, model: ModelCard, backends: Backends, limits: Limits) -> None:
        self.model = model
        self.backends = backends
        self.limits = limits

    async def prepare(self, req: generate_pb2.GenerateRequest) -> Prepared:
        self.check_model(req.model)
        if self.model.causal:
            self.check_causal(req)
        prompt = self.tokenize(req)
        options = self.resolve_options(req.decode, req.sampling, len(prompt))
        if req.attribution not in common_pb2.AttributionMode.values():
            raise invalid("attribution must be none, tokens, chunks or all", "attribution")
        top_k = req.attribution_top_k or L.DEFAULT_ATTRIBUTION_TOP_K
        with limit_errors_as_invalid():
            L.check_attribution_top_k(top_k)
        steering = await self.resolve_steering(req.steering) if req.HasField("steering") else None
        submit = scheduler_pb2.SubmitRequest(
            request_id=req.request_id or uuid.uuid4().hex, model=self.model.id, prompt_tokens=prompt,
            options=options, attribution=req.attribution, attribution_top_k=top_k, stream_steps=req.stream_steps)
        if steering is not None:
            submit.steering.CopyFrom(steering)
        grammar = self.grammar(req)
        if grammar is not None:
            submit.grammar = grammar
        return Prepared(submit, len(prompt))

    def grammar(self, req: generate_pb2.GenerateRequest) -> str | None:
        """The request's response_format compiled (400 naming the field when the schema or regex is bad)."""
        which = req.response_format.WhichOneof("format") if req.HasField("response_format") else None
        if which is None:
            return None
        try:
            return compile_format(which, getattr(req.response_format, which))
        except GrammarError as e:
            raise invalid(f"{e.field} {e.message}", e.field) from None

    def check_model(self, name: str) -> None:
        if name and name != self.model.id:
            raise GatewayError(grpc.StatusCode.NOT_FOUND,
                               f"model '{name}' does not exist; this server serves '{self.model.id}'",
                               param="model", err_code="model_not_found")

    def check_causal(self, req: generate_pb2.GenerateRequest) -> None:
        """A causal model has no concept heads: attribution and steering cannot be served."""
        if req.attribution != common_pb2.ATTRIBUTION_NONE:
            raise invalid(f"model '{self.model.id}' is a causal LM without concepts: attribution is not available",
                          "attribution")
        if req.HasField("steering") and req.steering.concepts:
            raise invalid(f"model '{self.model.id}' is a causal LM without concepts: steering is not available",
                          "steering")

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

    # ---- options --------------------------------------------------------------------------
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
        with limit_errors_as_invalid():
            L.check_length(n_prompt, d.max_new_tokens or None, ctx, lim.max_tokens_limit)
            # unset: the default, shrunk to what the context still holds
            max_new = d.max_new_tokens or min(lim.default_max_tokens, lim.max_tokens_limit, ctx - n_prompt)
            threshold = d.confidence_threshold if d.HasField("confidence_threshold") else None
            if self.model.causal:
                if d.tokens_per_step > 1 or threshold is not None:
                    raise invalid("decode.tokens_per_step and decode.threshold apply to block-diffusion models; "
                                  f"this causal model decodes {L.DEFAULT_STRIDE} tokens per forward with "
                                  "decode.stride (1 = plain autoregressive)",
                                  "decode.tokens_per_step" if d.tokens_per_step > 1 else "decode.threshold")
                stride = d.isd_stride or L.DEFAULT_STRIDE
                L.check_stride(stride)
            else:
                tokens_per_step = d.tokens_per_step or L.DEFAULT_TOKENS_PER_STEP
                L.check_tokens_per_step(tokens_per_step, self.model.config.diff_block_size)
                if d.isd_stride:
                    raise invalid("decode.stride (introspective strided decoding) is not supported by this model: "
                                  "Steerling is a block-diffusion model", "decode.stride")
                if threshold is not None:
                    L.check_threshold(threshold)
            L.check_stop_ids(d.stop_ids, self.model.tokenizer.vocab_size)
        # The one place a seed is drawn: the scheduler stores it, so a resumed request draws the same.
        seed = d.seed if d.HasField("seed") else secrets.randbits(63)
        if self.model.causal:
            out = resolved.isd(seed=seed, max_new_tokens=max_new, stride=stride, stop_ids=d.stop_ids)
        else:
            out = resolved.block_diffusion(seed=seed, max_new_tokens=max_new, tokens_per_step=tokens_per_step,
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
            d = L.CAUSAL_SAMPLING
        else:
            d = L.STEERLING_SAMPLING
        entropy = s.use_entropy_sampling if s.HasField("use_entropy_sampling") else (
            False if s.HasField("temperature") else d.use_entropy_sampling)
        out = resolved.sampling(L.SamplingDefaults(
            use_entropy_sampling=entropy,
            temperature=s.temperature if s.HasField("temperature") else d.temperature,
            top_p=s.top_p if s.HasField("top_p") else d.top_p,
            repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else d.repetition_penalty))
        with limit_errors_as_invalid():
            L.check_sampling(out.temperature, out.top_p, out.repetition_penalty)
        return out

    # ---- steering -------------------------------------------------------------------------
    async def resolve_steering(self, s: common_pb2.SteeringRequest) -> common_pb2.PreparedSteering | None:
        """Checked, defaults filled in, built by steering_svc; None when no concept is asked for."""
        if not s.concepts:
            return None
        self.check_steering(s)
        try:
            return await self.backends.steering.BuildSteering(
                steering_pb2.BuildSteeringRequest(model=self.model.id,
                                                  steering=resolved_steering(s, self.model.config.n_layers)),
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

    def check_steering(self, s: common_pb2.SteeringRequest) -> None:
        with limit_errors_as_invalid():
            L.check_concept_count(len(s.concepts))
            for i, c in enumerate(s.concepts):
                L.check_concept(i, concept_ref(c), c.strength or None)   # strength 0: unset
            if s.mode not in common_pb2.SteeringMode.values():
                raise invalid("steering.mode must be amplify or suppress", "steering.mode")
            if s.schedule not in common_pb2.SteeringSchedule.values():
                raise invalid("steering.schedule must be default, fixed or hard_cutoff", "steering.schedule")
            L.check_steering_settings(s.target if s.HasField("target") else None,
                                      s.inject_layer if s.HasField("inject_layer") else None,
                                      s.cutoff_tokens if s.HasField("cutoff_tokens") else None,
                                      self.model.config.n_layers)
            L.check_cutoff_applies(s.HasField("cutoff_tokens"), SCHEDULE_NAMES.get(s.schedule, ""))


SCHEDULE_NAMES = {common_pb2.STEERING_SCHEDULE_DEFAULT: "default", common_pb2.STEERING_SCHEDULE_FIXED: "fixed",
                  common_pb2.STEERING_SCHEDULE_HARD_CUTOFF: "hard_cutoff"}
_SCHEDULES = {name: value for value, name in SCHEDULE_NAMES.items()}


def concept_ref(c: common_pb2.SteeringConcept) -> str | int | None:
    """The concept's name or id, None when it has neither."""
    ref = c.WhichOneof("ref")
    return c.name if ref == "name" else c.concept_id if ref == "concept_id" else None


def resolved_steering(s: common_pb2.SteeringRequest, n_layers: int) -> common_pb2.SteeringRequest:
    """`s` with every unset field set to its mode's preset (cde.limits.steering_preset), so
    steering_svc applies it as it is and caches one entry per meaning."""
    preset = L.steering_preset(n_layers, amplify=s.mode == common_pb2.STEERING_MODE_AMPLIFY)
    out = common_pb2.SteeringRequest()
    out.CopyFrom(s)
    for c in out.concepts:
        c.strength = c.strength or L.DEFAULT_STRENGTH
    if not out.HasField("target"):
        out.target = preset.target
    if not out.HasField("inject_layer"):
        out.inject_layer = preset.inject_layer
    if out.schedule == common_pb2.STEERING_SCHEDULE_DEFAULT:
        out.schedule = _SCHEDULES[preset.schedule]
    if not out.HasField("cutoff_tokens"):
        out.cutoff_tokens = preset.cutoff
    return out


@contextlib.contextmanager
def limit_errors_as_invalid() -> Iterator[None]:
    """A cde.limits check that fails inside becomes the client's 400 / INVALID_ARGUMENT."""
    try:
        yield
    except L.LimitError as e:
        raise invalid(e.message, e.path, e.code) from None
