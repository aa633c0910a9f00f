"""REST (OpenAI JSON) <-> public proto.

Requests: an OpenAI body plus our extensions becomes a `generate_pb2.GenerateRequest`; what the
proto cannot carry (stop strings, streaming flags) goes in `RestOptions`.
Responses: `OpenAIFormatter` renders GenerateResponse events as OpenAI completion / chat objects
and chunks, with our per-block data under a `cde` key that OpenAI clients ignore.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from cde.grammar import GrammarError, response_format_fields
from cde.rpc.v1 import common_pb2, generate_pb2
from cde.steerling.tokenizer import Tokenizer
from gateway.detok import token_text
from gateway.errors import invalid, utf8_safe
from gateway.schemas import ChatCompletionRequest, CompletionRequest, GenerationFields

_ATTRIBUTION = {"none": common_pb2.ATTRIBUTION_NONE, "tokens": common_pb2.ATTRIBUTION_TOKENS,
                "chunks": common_pb2.ATTRIBUTION_CHUNKS, "all": common_pb2.ATTRIBUTION_ALL}
_MODE = {"amplify": common_pb2.STEERING_MODE_AMPLIFY, "suppress": common_pb2.STEERING_MODE_SUPPRESS}
_SCHEDULE = {"default": common_pb2.STEERING_SCHEDULE_DEFAULT, "fixed": common_pb2.STEERING_SCHEDULE_FIXED,
             "hard_cutoff": common_pb2.STEERING_SCHEDULE_HARD_CUTOFF}


@dataclass(frozen=True)
class RestOptions:
    chat: bool
    stream: bool
    include_usage: bool
    stop_strings: tuple[str, ...]
    steps: bool


def _common(body: GenerationFields, req: generate_pb2.GenerateRequest, max_tokens: int | None) -> None:
    req.model = utf8_safe(body.model or "")
    try:
        fmt = response_format_fields(body.response_format)
    except GrammarError as e:
        raise invalid(e.message if e.message.startswith(e.field) else f"{e.field} {e.message}", e.field) from None
    if fmt:
        (which, value), = fmt.items()
        setattr(req.response_format, which, utf8_safe(value) if isinstance(value, str) else value)
    d = req.decode
    if max_tokens is not None:
        d.max_new_tokens = max_tokens
    if body.seed is not None:
        d.seed = body.seed
    if body.stop_token_ids:
        d.stop_ids.extend(body.stop_token_ids)
    if body.decode is not None:
        if body.decode.tokens_per_step is not None:
            d.tokens_per_step = body.decode.tokens_per_step
        if body.decode.threshold is not None:
            d.confidence_threshold = body.decode.threshold
        d.isd_stride = body.decode.stride
    s = req.sampling
    if body.temperature is not None:
        s.temperature = body.temperature
    if body.top_p is not None:
        s.top_p = body.top_p
    if body.repetition_penalty is not None:
        s.repetition_penalty = body.repetition_penalty
    if body.sampling is not None:
        if body.sampling.use_entropy_sampling is not None:
            s.use_entropy_sampling = body.sampling.use_entropy_sampling
        if body.sampling.repetition_penalty is not None:
            s.repetition_penalty = body.sampling.repetition_penalty
    if body.steering is not None:
        st = body.steering
        out = req.steering
        for c in st.concepts:
            pc = out.concepts.add(strength=c.strength)
            if c.id is not None:
                pc.concept_id = c.id
            else:
                pc.name = utf8_safe(c.name or "")
        out.mode = _MODE[st.mode]
        out.schedule = _SCHEDULE[st.schedule]
        if st.inject_layer is not None:
            out.inject_layer = st.inject_layer
        if st.cutoff is not None:
            out.cutoff_tokens = st.cutoff
        if st.target is not None:
            out.target = st.target
    req.attribution = _ATTRIBUTION[body.attribution]
    req.attribution_top_k = body.attribution_top_k
    req.stream_steps = body.stream and body.stream_mode == "steps"


def _options(body: GenerationFields, chat: bool) -> RestOptions:
    stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    return RestOptions(chat=chat, stream=body.stream,
                       include_usage=bool(body.stream and body.stream_options and body.stream_options.include_usage),
                       stop_strings=tuple(s for s in stops if s), steps=body.stream_mode == "steps")


def completion_to_proto(body: CompletionRequest) -> tuple[generate_pb2.GenerateRequest, RestOptions]:
    req = generate_pb2.GenerateRequest()
    p = body.prompt
    if isinstance(p, str):
        req.prompt = utf8_safe(p)
    elif isinstance(p[0], str):
        req.prompt = utf8_safe(p[0])
    elif isinstance(p[0], list):   # a batch of one token-id prompt (lm-eval's tokenized requests)
        req.token_ids.ids.extend(p[0])
    else:
        req.token_ids.ids.extend(p)
    _common(body, req, body.max_tokens)
    return req, _options(body, chat=False)


def chat_to_proto(body: ChatCompletionRequest) -> tuple[generate_pb2.GenerateRequest, RestOptions]:
    req = generate_pb2.GenerateRequest()
    for m in body.messages:
        # "developer" is OpenAI's newer name for the system role.
        req.chat.messages.add(role="system" if m.role == "developer" else m.role,
                              content=utf8_safe(m.text()))
    _common(body, req, body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens)
    return req, _options(body, chat=True)


# ---- responses -----------------------------------------------------------------------------
def _f(x: float) -> float:
    return round(float(x), 6)


def _f32(x: float) -> float:
    """A float32 attribution value with the 9 significant digits that round-trip it, so that the
    terms the API lists add up to the token's logit to float32 rounding, not to a decimal cut."""
    return float(f"{float(x):.9g}")


def input_attribution_json(tok: Tokenizer, ev: common_pb2.InputAttributionEvent) -> dict[str, Any]:
    """One input-attribution event as REST sends it (a progress event, a target, the summary)."""
    kind = ev.WhichOneof("event")
    if kind == "progress":
        return {"object": "cde.input_attribution.progress", "done": ev.progress.done, "total": ev.progress.total}
    if kind == "target":
        t = ev.target
        return {"object": "cde.input_attribution.target", "position": t.position, "token": t.token,
                "text": token_text(tok, t.token), "commit_order": t.commit_order,
                "inputs": [{"position": s.position, "token": s.token, "text": token_text(tok, s.token),
                            "score": _f32(s.score), "normalized": _f32(s.normalized)} for s in t.inputs]}
    s = ev.summary
    return {"object": "cde.input_attribution.summary", "targets": s.targets, "n_steps": s.n_steps,
            "prompt": [{"position": x.position, "token": x.token, "text": token_text(tok, x.token),
                        "score": _f32(x.score)} for x in s.prompt]}


def scores_json(top: Any) -> list[dict[str, Any]]:
    return [{"concept_id": c.concept_id, "label": c.label, "score": _f32(c.score), "head": c.head} for c in top]


def other_json(o: common_pb2.OtherConcepts) -> dict[str, float]:
    return {"known": _f32(o.known), "discovered": _f32(o.discovered)}


def token_attr_json(tok: Tokenizer, ta: common_pb2.TokenAttribution) -> dict[str, Any]:
    return {"position": ta.position, "commit_order": ta.commit_order, "token": ta.token, "text": token_text(tok, ta.token),
            "target_logit": _f32(ta.target_logit), "residual": _f32(ta.residual), "top": scores_json(ta.top),
            "other": other_json(ta.other)}


def chunk_attr_json(ca: common_pb2.ChunkAttribution) -> dict[str, Any]:
    return {"start": ca.start, "end": ca.end, "residual_pct": _f32(ca.residual_pct), "top": scores_json(ca.top),
            "other": other_json(ca.other)}


def block_cde_json(tok: Tokenizer, b: generate_pb2.BlockEvent) -> dict[str, Any]:
    return {"block_index": b.block_index, "start": b.start, "tokens": list(b.tokens),
            "token_attributions": [token_attr_json(tok, t) for t in b.token_attributions],
            "chunk_attributions": [chunk_attr_json(c) for c in b.chunk_attributions]}


def usage_json(u: common_pb2.Usage) -> dict[str, Any]:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def usage_cde_json(u: common_pb2.Usage, isd: bool = False) -> dict[str, Any]:
    out = {"steps": u.steps, "forwards": u.forwards, "tokens_per_forward": _f(u.tokens_per_forward)}
    if isd:
        out["isd_acceptance"] = _f(u.isd_acceptance)
    return out


@dataclass
class OpenAIFormatter:
    """Builds the OpenAI-shaped objects for one request (ids, timestamps, object names)."""

    tokenizer: Tokenizer
    model: str
    request_id: str
    chat: bool
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    isd: bool = False   # a causal model's request: usage carries the ISD acceptance

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.request_id

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        obj = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "system_fingerprint": None, "choices": choices}
        if self.include_usage:
            obj["usage"] = None
        obj.update(extra)
        return obj

    def _choice(self, text: str | None, finish_reason: str | None, role: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}

    def accepted_chunk(self, acc: common_pb2.Accepted) -> dict[str, Any]:
        return self._chunk([self._choice("", None, role=True)],
                           cde={"request_id": acc.request_id, "seed": acc.seed, "prompt_tokens": acc.prompt_tokens})

    def block_chunk(self, b: generate_pb2.BlockEvent, text: str) -> dict[str, Any]:
        return self._chunk([self._choice(text, None)], cde=block_cde_json(self.tokenizer, b))

    def text_chunk(self, text: str) -> dict[str, Any]:
        return self._chunk([self._choice(text, None)])

    def step_chunk(self, s: common_pb2.StepEvent) -> dict[str, Any]:
        cde: dict[str, Any] = {"step": s.step, "block_index": s.block_index, "positions": list(s.positions),
                               "tokens": list(s.tokens),
                               # each token's own text, for clients that draw the block as it fills (/ui)
                               "texts": [token_text(self.tokenizer, t) for t in s.tokens]}
        if self.isd:   # one event per forward: what it verified
            cde["drafts_proposed"] = s.drafts_proposed
            cde["drafts_accepted"] = s.drafts_accepted
            if s.HasField("rejected_token"):
                cde["rejected_token"] = s.rejected_token
                cde["rejected_text"] = token_text(self.tokenizer, s.rejected_token)
        return {"id": self.id, "object": "cde.step", "created": self.created, "model": self.model, "choices": [],
                "cde": cde}

    def final_chunk(self, finish_reason: str) -> dict[str, Any]:
        return self._chunk([self._choice(None if self.chat else "", finish_reason)])

    def usage_chunk(self, u: common_pb2.Usage) -> dict[str, Any]:
        obj = self._chunk([], cde=usage_cde_json(u, self.isd))
        obj["usage"] = usage_json(u)
        return obj

    def response(self, text: str, finish_reason: str, usage: common_pb2.Usage, cde: dict[str, Any]) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "system_fingerprint": None, "choices": [choice],
                "usage": usage_json(usage), "cde": {**cde, **usage_cde_json(usage, self.isd)}}
