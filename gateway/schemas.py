"""Pydantic models of the REST request bodies (OpenAI fields + our extensions) and their bounds.

Bounds live here as constants because the gRPC API (which has no pydantic layer) checks the
same ones in gateway.pipeline. A value outside a bound is a *semantic* error (HTTP 400); a value
of the wrong type or shape is a *schema* error (HTTP 422) - see app._validation_status.
Top-level unknown fields are ignored (OpenAI clients send vendor fields freely); our extension
objects forbid unknown keys so a typo such as "strenght" fails loudly instead of being ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# ---- bounds shared with the gRPC API ----------------------------------------------------
MAX_CONCEPTS = 16
STRENGTH_MAX = 10.0          # per-concept weight in the steering direction, (0, 10]
TARGET_ABS_MAX = 100.0       # amplify: logits; suppress: raw alpha
TEMPERATURE_MAX = 2.0
REPETITION_PENALTY_MAX = 10.0
ATTRIBUTION_TOP_K_MAX = 64
DEFAULT_ATTRIBUTION_TOP_K = 8
MAX_STOP_IDS = 16
MAX_STOP_STRINGS = 4
MAX_STOP_STRING_CHARS = 256
CONCEPT_NAME_MAX = 256
SEARCH_LIMIT_MAX = 200
U64_MAX = 2**64 - 1
U32_MAX = 2**32 - 1   # integers that travel as proto uint32


class _Ext(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SteeringConceptIn(_Ext):
    id: Annotated[int, Field(ge=0, le=U32_MAX)] | None = None
    name: Annotated[str, Field(min_length=1, max_length=CONCEPT_NAME_MAX)] | None = None
    strength: Annotated[float, Field(gt=0.0, le=STRENGTH_MAX, allow_inf_nan=False)] = 1.0

    @model_validator(mode="after")
    def _one_ref(self) -> SteeringConceptIn:
        if (self.id is None) == (self.name is None):
            raise ValueError("each steering concept needs exactly one of 'id' or 'name'")
        return self


class SteeringIn(_Ext):
    concepts: Annotated[list[SteeringConceptIn], Field(min_length=1, max_length=MAX_CONCEPTS)]
    mode: Literal["amplify", "suppress"] = "amplify"
    inject_layer: Annotated[int, Field(ge=0, le=U32_MAX)] | None = None
    schedule: Literal["default", "fixed", "hard_cutoff"] = "default"
    cutoff: Annotated[int, Field(ge=1, le=U32_MAX)] | None = None
    target: Annotated[float, Field(ge=-TARGET_ABS_MAX, le=TARGET_ABS_MAX, allow_inf_nan=False)] | None = None

    @model_validator(mode="after")
    def _cutoff_needs_hard_cutoff(self) -> SteeringIn:
        if self.cutoff is not None and self.schedule == "fixed":
            raise ValueError("'cutoff' only applies to schedule 'hard_cutoff'")
        return self


class DecodeIn(_Ext):
    tokens_per_step: Annotated[int, Field(ge=1, le=U32_MAX)] | None = None
    threshold: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    stride: Annotated[int, Field(ge=0, le=U32_MAX)] = 0


class SamplingIn(_Ext):
    use_entropy_sampling: bool | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=REPETITION_PENALTY_MAX, allow_inf_nan=False)] | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class _GenerationFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions.

    OpenAI mapping: `temperature` set => the model's entropy-adaptive temperature is turned off
    and this temperature is used (0 = greedy), unless `sampling.use_entropy_sampling` says
    otherwise; unset fields take the model defaults (entropy sampling, T 1.2, top_p 0.8,
    repetition_penalty 1.1). `stop` strings are matched on the output text (the request is
    cancelled upstream once one matches); `stop_token_ids` end generation inside the engine.
    `max_tokens` defaults to the server's default (128), bounded by --max-tokens-limit and the
    context. `seed` unset => the server picks one and reports it under `cde.seed`.
    Extensions: `steering`, `attribution` (+ `attribution_top_k`), `decode`, `sampling`,
    `stream_mode` ("steps" adds `object: "cde.step"` SSE chunks), `repetition_penalty`,
    `stop_token_ids`.
    """

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1, le=U32_MAX)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=TEMPERATURE_MAX, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = None
    seed: Annotated[int, Field(ge=0, le=U64_MAX)] | None = None
    stop: Annotated[str, Field(max_length=MAX_STOP_STRING_CHARS)] | \
        Annotated[list[Annotated[str, Field(max_length=MAX_STOP_STRING_CHARS)]],
                  Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=1)] = 1
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # extensions
    repetition_penalty: Annotated[float, Field(gt=0.0, le=REPETITION_PENALTY_MAX, allow_inf_nan=False)] | None = None
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0, le=U32_MAX)]],
                              Field(max_length=MAX_STOP_IDS)] | None = None
    steering: SteeringIn | None = None
    attribution: Literal["none", "tokens", "chunks", "all"] = "none"
    attribution_top_k: Annotated[int, Field(ge=1, le=ATTRIBUTION_TOP_K_MAX)] = DEFAULT_ATTRIBUTION_TOP_K
    decode: DecodeIn | None = None
    sampling: SamplingIn | None = None
    stream_mode: Literal["blocks", "steps"] = "blocks"

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) of the first OpenAI feature we accept in the schema but do not do."""
        if self.presence_penalty:
            return "presence_penalty", "presence_penalty is not supported (use repetition_penalty)"
        if self.frequency_penalty:
            return "frequency_penalty", "frequency_penalty is not supported (use repetition_penalty)"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        return None


class CompletionRequest(_GenerationFields):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)] | \
        Annotated[list[Annotated[int, Field(ge=0, le=U32_MAX)]], Field(min_length=1)]
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1, le=1)] | None = None
    logprobs: int | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo is not supported"
        if self.suffix:
            return "suffix", "suffix (insertion) is not supported"
        if self.logprobs is not None:
            return "logprobs", "logprobs are not supported (see the 'attribution' extension)"
        return super().unsupported()


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_GenerationFields):
    messages: Annotated[list[ChatMessageIn], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=U32_MAX)] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.logprobs:
            return "logprobs", "logprobs are not supported (see the 'attribution' extension)"
        if self.tools or self.functions:
            return "tools", "tool calling is not supported"
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            return "response_format", "only response_format {'type': 'text'} is supported"
        return super().unsupported()
