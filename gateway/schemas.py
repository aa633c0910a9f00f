"""Pydantic models of the REST request bodies (OpenAI fields + our extensions).

Each field declares its bound with cde.limits' constants, so /openapi.json states it and a value
outside it is refused before translation; the bounds a schema cannot know (the model's
inject_layer and tokens_per_step, the server's max_tokens limit, the context) and everything
the gRPC API receives are checked by cde.limits' check functions in gateway.resolve. A value
outside a bound is a *semantic* error (HTTP 400); a value of the wrong type or shape is a
*schema* error (HTTP 422) - see app._validation_status. Top-level unknown fields are ignored
(OpenAI clients send vendor fields freely); our extension objects forbid unknown keys so a typo
such as "strenght" fails loudly instead of being ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cde import limits as L
from cde.limits import (
    AMPLIFY_TARGET,
    DEFAULT_IG_STEPS,
    IG_STEPS_MAX,
    INPUT_TARGETS_MAX,
    ATTRIBUTION_TOP_K_MAX,
    BEST_OF_MAX,
    CONCEPT_NAME_MAX,
    CUTOFF_MAX,
    CUTOFF_MIN,
    DEFAULT_ATTRIBUTION_TOP_K,
    DEFAULT_CUTOFF,
    DEFAULT_MAX_TOKENS,
    DEFAULT_STRIDE,
    DEFAULT_STRENGTH,
    DEFAULT_TOKENS_PER_STEP,
    MAX_CONCEPTS,
    MAX_STOP_IDS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STRIDE,
    MAX_TOKENS_LIMIT,
    N_MAX,
    REPETITION_PENALTY_MAX,
    STEERLING_SAMPLING,
    STRENGTH_MAX,
    SUPPRESS_TARGET,
    TARGET_ABS_MAX,
    TEMPERATURE_MAX,
    TEMPERATURE_MIN,
    THRESHOLD_MAX,
    TOP_LOGPROBS_MAX,
    TOP_P_MAX,
    TOP_P_MIN,
    U32_MAX,
    U64_MAX,
)


_PENALTY_DOC = (f"(0, {REPETITION_PENALTY_MAX:g}]; default {STEERLING_SAMPLING.repetition_penalty:g} "
                "(causal models: must be 1)")


class _Ext(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SteeringConceptIn(_Ext):
    id: Annotated[int, Field(ge=0, le=U32_MAX, description="concept id (GET /v1/concepts)")] | None = None
    name: Annotated[str, Field(min_length=1, max_length=CONCEPT_NAME_MAX,
                               description=f"concept name, at most {CONCEPT_NAME_MAX} characters")] | None = None
    strength: Annotated[float, Field(gt=0.0, le=STRENGTH_MAX, allow_inf_nan=False,
                                     description=(f"(0, {STRENGTH_MAX:g}]: scales the injected magnitude (0.5 half, 2 double); "
                                                  "with several concepts the largest sets the magnitude and the "
                                                  "others weight the direction relative to it"))] = \
        DEFAULT_STRENGTH

    @model_validator(mode="after")
    def _one_ref(self) -> SteeringConceptIn:
        if (self.id is None) == (self.name is None):
            raise ValueError("each steering concept needs exactly one of 'id' or 'name'")
        return self


class SteeringIn(_Ext):
    concepts: Annotated[list[SteeringConceptIn], Field(min_length=1, max_length=MAX_CONCEPTS,
                                                       description=f"1 to {MAX_CONCEPTS} known, steerable concepts")]
    mode: Literal["amplify", "suppress"] = "amplify"
    # The model's layer count is not known to the schema: gateway.resolve checks [1, n_layers].
    inject_layer: Annotated[int, Field(ge=1, le=U32_MAX, description=(
        f"first layer (from 1) that gets the direction, in [1, n_layers]; default {L.INJECT_LAYER_DEFAULT_TEXT}"))] \
        | None = None
    schedule: Literal["default", "fixed", "hard_cutoff"] = "default"
    cutoff: Annotated[int, Field(ge=CUTOFF_MIN, le=CUTOFF_MAX, description=(
        f"hard_cutoff: tokens steered before steering stops, [{CUTOFF_MIN}, {CUTOFF_MAX}], "
        f"default {DEFAULT_CUTOFF}"))] \
        | None = None
    target: Annotated[float, Field(ge=-TARGET_ABS_MAX, le=TARGET_ABS_MAX, allow_inf_nan=False, description=(
        f"[-{TARGET_ABS_MAX:g}, {TARGET_ABS_MAX:g}]; amplify: logit units (default {AMPLIFY_TARGET:g}), "
        f"suppress: raw alpha (default {SUPPRESS_TARGET:g})"))] | None = None

    @model_validator(mode="after")
    def _cutoff_needs_hard_cutoff(self) -> SteeringIn:
        L.check_cutoff_applies(self.cutoff is not None, self.schedule)   # a LimitError is a ValueError
        return self


class DecodeIn(_Ext):
    # The block size is the model's: gateway.resolve checks the upper bound.
    tokens_per_step: Annotated[int, Field(ge=1, le=U32_MAX, description=(
        f"positions committed per denoising step, [1, diffusion block size]; default {DEFAULT_TOKENS_PER_STEP}"))] \
        | None = None
    threshold: Annotated[float, Field(gt=0.0, le=THRESHOLD_MAX, allow_inf_nan=False, description=(
        "commit every position at or above this confidence, (0, 1]"))] | None = None
    stride: Annotated[int, Field(ge=0, le=MAX_STRIDE, description=(
        f"causal models: tokens per forward, [1, {MAX_STRIDE}] (1 = plain autoregressive); "
        f"0 = default {DEFAULT_STRIDE}"))] = 0


class SamplingIn(_Ext):
    use_entropy_sampling: bool | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=REPETITION_PENALTY_MAX, allow_inf_nan=False, description=(
        _PENALTY_DOC))] | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class GenerationFields(BaseModel):
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
    `stop_token_ids`, `response_format` type "regex".
    """

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    response_format: dict[str, Any] | None = Field(None, description=(
        "structured output: {\"type\": \"text\"}, {\"type\": \"json_object\"}, "
        "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}} or "
        "{\"type\": \"regex\", \"regex\": \"...\"}; the output matches it (block diffusion: committed left to right, one "
        "token a step)"))
    # --max-tokens-limit and the context are the server's and the model's: gateway.resolve checks them.
    max_tokens: Annotated[int, Field(ge=1, le=U32_MAX, description=(
        f"[1, --max-tokens-limit (default {MAX_TOKENS_LIMIT})], prompt + max_tokens within the context; "
        f"default {DEFAULT_MAX_TOKENS}"))] | None = None
    temperature: Annotated[float, Field(ge=TEMPERATURE_MIN, le=TEMPERATURE_MAX, allow_inf_nan=False, description=(
        f"[{TEMPERATURE_MIN:g}, {TEMPERATURE_MAX:g}], 0 = greedy; setting it turns entropy sampling off"))] \
        | None = None
    top_p: Annotated[float, Field(ge=TOP_P_MIN, le=TOP_P_MAX, allow_inf_nan=False,
                                  description=f"[{TOP_P_MIN:g}, {TOP_P_MAX:g}]; "
                                              f"default {STEERLING_SAMPLING.top_p:g}")] | None = None
    seed: Annotated[int, Field(ge=0, le=U64_MAX, description="[0, 2^64 - 1]; unset = server-chosen")] | None = None
    stop: Annotated[str, Field(max_length=MAX_STOP_STRING_CHARS)] | \
        Annotated[list[Annotated[str, Field(max_length=MAX_STOP_STRING_CHARS)]],
                  Field(max_length=MAX_STOP_STRINGS)] | None = Field(None, description=(
                      f"at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_STRING_CHARS} characters"))
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=N_MAX, description=(
        f"choices, [1, {N_MAX}]; choice i runs with seed + i (mod 2^64)"))] = 1
    user: str | None = None
    presence_penalty: float | None = Field(None, description="not supported: 0 or unset (use repetition_penalty)")
    frequency_penalty: float | None = Field(None, description="not supported: 0 or unset (use repetition_penalty)")
    logit_bias: dict[str, float] | None = Field(None, description="not supported: empty or unset")
    # extensions
    repetition_penalty: Annotated[float, Field(gt=0.0, le=REPETITION_PENALTY_MAX, allow_inf_nan=False, description=(
        _PENALTY_DOC))] | None = None
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0, le=U32_MAX)]],
                              Field(max_length=MAX_STOP_IDS,
                                    description=f"at most {MAX_STOP_IDS} vocabulary ids")] | None = None
    steering: SteeringIn | None = None
    attribution: Literal["none", "tokens", "chunks", "all"] = "none"
    attribution_top_k: Annotated[int, Field(ge=1, le=ATTRIBUTION_TOP_K_MAX, description=(
        f"concepts per token / chunk, [1, {ATTRIBUTION_TOP_K_MAX}]"))] = DEFAULT_ATTRIBUTION_TOP_K
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


class CompletionRequest(GenerationFields):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)] | \
        Annotated[list[Annotated[int, Field(ge=0, le=U32_MAX)]], Field(min_length=1)] | \
        Annotated[list[Annotated[list[Annotated[int, Field(ge=0, le=U32_MAX)]], Field(min_length=1)]],
                  Field(min_length=1, max_length=1)]
    echo: bool = Field(False, description="return the prompt before the completion (with its logprobs when "
                                          "logprobs is set)")
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1, le=BEST_OF_MAX, description=f"{BEST_OF_MAX} only")] | None = None
    logprobs: Annotated[int, Field(ge=0, le=TOP_LOGPROBS_MAX, description=(
        f"[0, {TOP_LOGPROBS_MAX}]: each token's logprob and this many most likely alternatives; "
        "block-diffusion models: with echo only (see echo_context_tokens)"))] | None = None
    # extension
    echo_context_tokens: Annotated[int, Field(ge=1, le=U32_MAX, description=(
        "block-diffusion models, echo + logprobs: how many leading prompt tokens are the context; the rest "
        "is scored as the public package's lm-eval loglikelihood (a Monte Carlo ELBO, seeded by seed)"))] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.suffix:
            return "suffix", "suffix (insertion) is not supported"
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


class ChatCompletionRequest(GenerationFields):
    messages: Annotated[list[ChatMessageIn], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=U32_MAX, description="as max_tokens (wins over it)")] | \
        None = None
    logprobs: bool | None = Field(None, description="each generated token's logprob (causal models)")
    top_logprobs: Annotated[int, Field(ge=0, le=TOP_LOGPROBS_MAX, description=(
        f"[0, {TOP_LOGPROBS_MAX}] most likely alternatives per token; needs logprobs"))] | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.tools or self.functions:
            return "tools", "tool calling is not supported"
        return super().unsupported()


class InputChunk(BaseModel):
    model_config = ConfigDict(extra="forbid")
    start: Annotated[int, Field(ge=0, le=U32_MAX)]
    end: Annotated[int, Field(ge=0, le=U32_MAX)]


class InputAttributionBody(BaseModel):
    """POST /v1/attributions/inputs: explain generated tokens of a finished request by the prompt
    and earlier tokens (integrated gradients on the diffusion replay)."""

    model_config = ConfigDict(extra="forbid")
    request_id: Annotated[str, Field(min_length=1, max_length=200, description=(
        "the request's id (a response's `id`, with or without its cmpl- / chatcmpl- prefix)"))]
    positions: Annotated[list[Annotated[int, Field(ge=0, le=U32_MAX)]], Field(max_length=INPUT_TARGETS_MAX, description=(
        f"absolute positions of generated tokens (at most {INPUT_TARGETS_MAX})"))] | None = None
    chunk: InputChunk | None = Field(None, description="or every committed token in [start, end)")
    n_steps: Annotated[int, Field(ge=1, le=IG_STEPS_MAX, description=(
        f"integrated-gradients points, [1, {IG_STEPS_MAX}], default {DEFAULT_IG_STEPS}"))] | None = None
    stream: bool = Field(False, description="SSE: progress events, each target as it is done, the summary, [DONE]")


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessageIn], Field(min_length=1)] | None = None
    add_special_tokens: bool = Field(False, description="accepted for vLLM clients; the ids are what a prompt "
                                                        "becomes either way")
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=U32_MAX)]]
